"""How the code is shaped, counted the same way at any revision: the figures of issue 54.

    python benchmarks/structure.py                 # the working tree
    python benchmarks/structure.py dbd152d HEAD    # revisions side by side

Counted over the package's Python files (``blockdiff/`` and, where it still lies at the
root, ``hooks/``), by reading their syntax trees (nothing is imported):

- **mode conditionals**: ``if``/``elif``/``while`` tests, conditional expressions and
  comprehension filters whose test reads an execution's option or state by name — one of
  ``MODE_WORDS`` as a variable, an attribute or a keyword's value;
- **kind conditionals**: the same tests reading what kind a side is — one of ``KIND_WORDS``,
  or an ``isinstance`` against a side class or a store class;
- **LiveSide members**: the names ``LiveSide``'s class body defines (methods, properties,
  class attributes) and the ``self.X`` its methods assign, counted once each;
- **undeclared members used outside sides/**: of those, the ones the ``Side`` protocol
  (``sides/__init__.py``'s ``Side`` class) does not declare, read as ``.X`` anywhere outside
  ``sides/`` (distinct names, then attribute reads of an expression named as a side: ``ref``,
  ``cand``, ``side``, ``floor``, ``*_side``, ...), and the ``type: ignore[attr-defined]``
  comments outside ``sides/``;
- **modules over 700 lines** (all lines);
- **functions over 80 lines**, their docstrings not counted;
- ``engine.py``'s lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MODE_WORDS = {
    "decode", "decodes", "backward", "backward_refused", "stream", "save_dumps", "rank", "stateful", "stepper",
    "steppers", "graphs", "uncached_reference", "uncached", "drill_all", "baseline_dtype", "loss",
}
KIND_WORDS = {"live", "lockstep", "kind_of", "ref_kind", "cand_kind", "not_streamed"}
SIDE_CLASSES = {
    "LiveSide", "PrecisionSide", "DumpSide", "OnnxSide", "ShardedSide", "PipelineSide", "RowSide", "OnnxModel",
    "DumpReader", "MemoryStore",
}
SIDE_NAMES = {"ref", "cand", "side", "floor", "reference", "candidate", "row", "batch", "inner", "wrapped", "live"}
ROOT = Path(__file__).resolve().parents[1]


def _files(rev: str | None) -> dict[str, str]:
    """The package's Python sources at ``rev`` (the working tree when ``None``), by path."""
    if rev is None:
        paths = [p for top in ("blockdiff", "hooks") for p in (ROOT / top).rglob("*.py")]
        return {str(p.relative_to(ROOT)): p.read_text() for p in paths}
    listed = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "--", "blockdiff", "hooks"], cwd=ROOT, check=True,
        capture_output=True, text=True,
    ).stdout.split()
    return {
        path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        for path in listed if path.endswith(".py")
    }


def _names(node: ast.AST) -> set[str]:
    """Every variable and attribute name a test expression reads, and the classes its
    ``isinstance`` calls name."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in ("dump", "onnx", "model"):
            found.add("kind_of")  # kind_of(spec) == "dump"
    return found


def _tests(tree: ast.AST) -> list[ast.AST]:
    tests: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
    return tests


def _a_side(node: ast.AST) -> bool:
    """Whether an expression reads as a side by its name (``ref``, ``cand``, ``side``,
    ``self.ref``, ``experiments.floor_side``, ...): ``.module`` of anything else is not
    ``LiveSide.module``."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in SIDE_NAMES or name.endswith("_side")


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = (fn.end_lineno or fn.lineno) - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= (first.end_lineno or first.lineno) - first.lineno + 1
    return lines


def _class_members(tree: ast.AST, name: str) -> set[str]:
    members: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                    for sub in ast.walk(item):
                        for target in getattr(sub, "targets", []) + ([sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []):
                            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                                members.add(target.attr)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def count(rev: str | None) -> dict[str, object]:
    sources = _files(rev)
    trees = {path: ast.parse(text) for path, text in sources.items()}
    mode = kind = 0
    modes_in: set[str] = set()
    for path, tree in trees.items():
        for test in _tests(tree):
            names = _names(test)
            if names & MODE_WORDS:
                mode += 1
                modes_in.add(path)
            if names & KIND_WORDS or ("isinstance" in names and names & SIDE_CLASSES):
                kind += 1
    live = next((t for p, t in trees.items() if p.endswith("sides/live.py")), None)
    members = _class_members(live, "LiveSide") if live is not None else set()
    protocol_tree = next((t for p, t in trees.items() if p.endswith("sides/__init__.py")), None)
    declared = _class_members(protocol_tree, "Side") if protocol_tree is not None else set()
    undeclared = members - declared - {"__init__"}
    used: dict[str, int] = {}
    ignores = 0
    for path, tree in trees.items():
        if "/sides/" in path:
            continue
        ignores += sources[path].count("type: ignore[attr-defined]")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in undeclared and _a_side(node.value):
                used[node.attr] = used.get(node.attr, 0) + 1
    long_functions = [
        f"{path}:{node.name}"
        for path, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 80
    ]
    engine = next((text for p, text in sources.items() if p == "blockdiff/engine.py"), "")
    return {
        "modules": len(sources),
        "mode conditionals": mode,
        "kind conditionals": kind,
        "modules with a mode conditional": len(modes_in),
        "LiveSide members": len(members),
        "undeclared members used outside sides/": f"{len(used)} names, {sum(used.values())} reads",
        "type: ignore[attr-defined] outside sides/": ignores,
        "modules over 700 lines": sorted(f"{p} {t.count(chr(10))}" for p, t in sources.items() if t.count("\n") > 700),
        "functions over 80 lines": len(long_functions),
        "engine.py lines": engine.count("\n"),
    }


def main(argv: list[str]) -> None:
    revs = argv or [None]
    results = [count(rev) for rev in revs]
    width = max(len(k) for k in results[0])
    print(f"{'':{width}}  " + "  |  ".join(rev or "working tree" for rev in revs))
    for key in results[0]:
        print(f"{key:{width}}  " + "  |  ".join(str(r[key]) for r in results))


if __name__ == "__main__":
    main(sys.argv[1:])
