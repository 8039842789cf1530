"""The README, run as printed: every command of its shell blocks in a real process.

Each recipe of a shell block (its lines up to a blank line) runs in a fresh folder that
holds the repository's ``samples``, one command after another through ``bash``, as a
reader pasting it would run it; the recipes run two at a time and every test reads the
shared results. The exit code a command must end with is the one the README states: an
``exit N`` in the command's own trailing comment, else in the recipe's comment for the
recipe's last command stating none of its own; a command before it (writing a file the
last one reads) must succeed. What a comment quotes in double quotes, its command must
print. The README's Python example runs too, printing what its comments say, and every
output block the README shows must be printed by one of its commands. The links of the
README and of the docs pages it sends readers to must resolve.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")

# What cannot run here, and why. Everything else the README prints runs. A command joined
# with ``&&`` runs without its parts listed here.
NOT_RUN = {
    'pip install "torch==2.13.0" -e .': "installs into the Python running the tests; they test that install",
    'pip install "torch==2.13.0" -e ".[dev]"': "installs into the Python running the tests; they test that install",
    "python -m pytest": "the whole suite, which runs this file: CI runs it as the README prints it",
}
if not torch.cuda.is_available():
    NOT_RUN["blockdiff diff samples/tinylm.py:build --ref-device cpu --cand-device cuda --cand-dtype bfloat16"] = (
        "needs a CUDA GPU"
    )
# Python blocks by the README section they are in.
NOT_RUN_PYTHON = {
    "pytest plugin": "a test file, not a script: tests/test_pytest_plugin.py runs it with pytest as the README prints it",
}
# The docs pages the README sends newcomers to, whose links are checked with the README's.
PAGES = ("docs/cli.md", "docs/performance.md", "docs/pytest-plugin.md", "docs/runtimes.md", "docs/sharded.md")

EXIT = re.compile(r"\bexits? (\d+)\b")


@dataclass
class Command:
    line: int  # in README.md, 1-based
    text: str  # as printed, its trailing comment removed
    comment: str  # its trailing comment
    says: list[str] = field(default_factory=list)  # what its comments quote it printing
    parts: list[str] = field(default_factory=list)  # of an ``a && b`` chain
    expected: int | None = None

    @property
    def runnable(self) -> str:
        """The command without its parts that cannot run here."""
        return " && ".join(p for p in self.parts if p not in NOT_RUN)

    @property
    def id(self) -> str:
        return f"L{self.line}:{self.text[:60]}"


@dataclass
class Recipe:
    section: str
    commands: list[Command]


def _split_comment(line: str) -> tuple[str, str]:
    """``line`` and its trailing comment: a ``#`` after a space, outside quotes."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def _quoted(comment: str) -> list[str]:
    """What a comment quotes a command printing: "text" of a dozen characters or more,
    outside `code`."""
    return re.findall(r'"([^"]{12,})"', re.sub(r"`[^`]*`", "", comment))


def _blocks(language: str) -> list[tuple[str, int, list[str]]]:
    """(section, first line number, lines) of every fenced block in ``language``
    (``""``: blocks with no language, the outputs the README shows)."""
    blocks, section, inside, start, body = [], "", None, 0, []
    for number, line in enumerate(TEXT.splitlines(), start=1):
        if inside is None and line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            if inside is None:
                inside, start, body = line[3:].strip(), number + 1, []
            else:
                if inside == language:
                    blocks.append((section, start, body))
                inside = None
        elif inside is not None:
            body.append(line)
    return blocks


def recipes() -> list[Recipe]:
    """The shell blocks' recipes: commands up to a blank line, with their exit codes."""
    out = []
    for language in ("bash", "sh", "shell"):
        for section, start, body in _blocks(language):
            recipe, stated, quoted, pending = Recipe(section, []), None, [], ""
            for offset, raw in enumerate([*body, ""]):
                if not raw.strip():
                    if recipe.commands:
                        # The recipe's code is its last command's (of those stating none
                        # of their own); the commands before it must succeed.
                        unstated = [c for c in recipe.commands if c.expected is None]
                        if unstated:
                            unstated[-1].expected = stated
                        recipe.commands[-1].says += quoted
                        for command in unstated[:-1]:
                            command.expected = 0
                        out.append(recipe)
                    recipe, stated, quoted = Recipe(section, []), None, []
                    continue
                if raw.rstrip().endswith("\\"):  # continued on the next line
                    pending += raw.rstrip()[:-1] + " "
                    continue
                line, pending = pending + raw, ""
                text, comment = _split_comment(line)
                if not text:  # a comment line: it speaks for the recipe's last command
                    found = EXIT.search(comment)
                    stated = int(found.group(1)) if found else stated
                    quoted += _quoted(comment)
                    continue
                found = EXIT.search(comment)
                recipe.commands.append(
                    Command(
                        line=start + offset, text=" ".join(text.split()), comment=comment,
                        parts=[" ".join(p.split()) for p in text.split(" && ")],
                        expected=int(found.group(1)) if found else None, says=_quoted(comment),
                    )
                )
    return out


RECIPES = recipes()
COMMANDS = [command for recipe in RECIPES for command in recipe.commands]


def _python_first(root: Path) -> str:
    """A folder whose ``python`` is the Python running the tests (CI may have ``python3``
    alone), to put first on PATH, before this Python's own scripts (``blockdiff``). A
    script that runs it, not a link to it: a link in another folder is a virtual
    environment's Python without the environment (it looks for ``pyvenv.cfg`` beside the
    link, then runs the base Python)."""
    folder = root / "bin"
    folder.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        script = folder / name
        if not script.exists():
            script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
            script.chmod(0o755)
    return os.pathsep.join([str(folder), str(Path(sys.executable).parent)])


def _environment(first: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # the width pipes get, 80
    # `blockdiff` and `python` as this Python's: the README's commands, this install.
    env["PATH"] = os.pathsep.join(p for p in (first or str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    env.update(NO_COLOR="1", OMP_NUM_THREADS="1")
    return env


def _folder(root: Path, name: str) -> Path:
    """A fresh folder holding the repository's samples, as a clone's root does."""
    folder = root / name
    folder.mkdir()
    (folder / "samples").symlink_to(ROOT / "samples", target_is_directory=True)
    return folder


def _run(recipe: Recipe, folder: Path) -> dict[int, subprocess.CompletedProcess]:
    done = {}
    env = _environment(_python_first(folder.parent))
    for command in recipe.commands:
        if not command.runnable:
            continue
        done[command.line] = subprocess.run(
            ["bash", "-c", command.runnable], cwd=folder, env=env, capture_output=True, text=True, timeout=300,
        )
    return done


PYTHON = _blocks("python")


def _run_python(start: int, body: list[str], folder: Path) -> dict[int, subprocess.CompletedProcess]:
    done = subprocess.run(
        [sys.executable, "-"], input="\n".join(body), cwd=folder, env=_environment(),
        capture_output=True, text=True, timeout=300,
    )
    return {start: done}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, subprocess.CompletedProcess]:
    """Every run by README line (a Python block's by its first line), two at a time (the
    CI has 2 cores), the recipes of most commands first."""
    root = tmp_path_factory.mktemp("readme")
    _python_first(root)  # made once, before the runs share it
    jobs = [
        (len([c for c in recipe.commands if c.runnable]), lambda folder, recipe=recipe: _run(recipe, folder))
        for recipe in RECIPES
    ] + [
        (1, lambda folder, start=start, body=body: _run_python(start, body, folder))
        for section, start, body in PYTHON if section not in NOT_RUN_PYTHON
    ]
    jobs.sort(key=lambda job: -job[0])
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda item: item[1][1](_folder(root, f"run{item[0]}")), enumerate(jobs)))
    return {line: run for done in runs for line, run in done.items()}


def test_the_readme_has_commands_and_states_each_recipes_exit_code():
    assert len(COMMANDS) >= 10, [c.text for c in COMMANDS]
    unstated = [c.text for c in COMMANDS if c.expected is None]
    assert unstated == [], f"these commands' recipes state no exit code: {unstated}"
    assert {c.expected for c in COMMANDS} >= {0, 1, 2}  # a clean run, a divergence, a usage error
    assert any(c.says for c in COMMANDS)  # and what one of them prints


def test_every_command_that_is_not_run_is_in_the_readme():
    """The exclusions stay short and true: each names a command the README prints."""
    parts = {p for c in COMMANDS for p in c.parts}
    assert set(NOT_RUN) <= parts, set(NOT_RUN) - parts
    assert set(NOT_RUN_PYTHON) <= {section for section, _, _ in PYTHON}


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_readme_command_runs_as_printed(command, results):
    if not command.runnable:
        pytest.skip("; ".join(NOT_RUN[p] for p in command.parts))
    done = results[command.line]
    assert done.returncode == command.expected, (
        f"README line {command.line}: `{command.runnable}` exited {done.returncode}, "
        f"the README says {command.expected}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    printed = " ".join((done.stdout + done.stderr).split())  # as wrapped to the terminal's width
    for said in command.says:  # `# ... "Error: --seq must be at least 1, found 0"`
        assert " ".join(said.split()) in printed, (said, done.stdout[-2000:], done.stderr[-2000:])


def test_every_output_the_readme_shows_is_printed_by_its_command(results):
    """Each output block, line by line (spacing aside) and in order, in one command's stdout."""
    shown = _blocks("")
    assert shown, "the README shows no output"

    def words(line: str) -> str:
        return " ".join(line.split())

    for _, start, body in shown:
        expected = [words(line) for line in body if line.strip()]
        printed = [[words(line) for line in run.stdout.splitlines()] for run in results.values()]

        def contains(lines: list[str]) -> bool:
            it = iter(lines)
            return all(any(line == want for line in it) for want in expected)

        assert any(contains(lines) for lines in printed), f"the output shown at README line {start} is printed by no command"


@pytest.mark.parametrize("section, start, body", PYTHON, ids=[f"L{s}" for _, s, _ in PYTHON])
def test_readme_python_example_runs_and_prints_what_it_says(section, start, body, results):
    if section in NOT_RUN_PYTHON:
        pytest.skip(NOT_RUN_PYTHON[section])
    # `print(...)  # 2 residual`: the comment is what it prints.
    said = [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+)$", "\n".join(body), re.M)]
    done = results[start]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == said


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but ``-`` and ``_``
    dropped, spaces made ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    headings, inside = [], False
    for line in lines:
        if line.startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            headings.append(line.lstrip("#"))
    return {_slug(h) for h in headings}


@pytest.mark.parametrize("page", ["README.md", *PAGES])
def test_links_resolve_to_files_and_headings_that_exist(page):
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local, f"{page} links nowhere"
    broken = []
    for link in local:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(link)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(link)
    assert broken == [], f"{page}: links to nothing: {broken}"


def test_the_readme_stays_short():
    assert len(TEXT.splitlines()) <= 300
