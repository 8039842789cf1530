"""Hook maps: where a model keeps its embedding, its blocks and each block's sub-paths.

A hook map is data (TOML, bundled in ``hooks/`` or given by the user with ``--hooks``).
:func:`apply_map` applies one to a model and checks every module it names exists, giving
a :class:`Layout`: the concrete module paths, per block, of each sub-path. Capture and
localization work from the layout only. The format is documented in ``docs/hook-maps.md``.
:func:`~blockdiff.autodetect.resolve` finds the map of a model (the bundled one its class
matches, else a guess: :mod:`.autodetect`).

>>> layout = resolve(model)                                  # doctest: +SKIP
>>> layout.blocks[0].subpaths["attention"]                   # doctest: +SKIP
['model.layers.0.self_attn']

A map may also say, per module it names (``[modules."PATH"]``), which keyword arguments
carry activations, which of the module's calls are sites, and whether its output is
compared after broadcasting: :class:`ModuleOptions`.
"""

from __future__ import annotations

import functools

import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from .errors import HookMapError
from .vocab import MODULE_SUBPATHS, OUTSIDE_STAGES, ROUTER_FORMATS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# ``HookMap.source`` of a map guessed by :func:`~blockdiff.autodetect.detect`;
# ``blockdiff arch`` prints it.
AUTO_DETECTED = "auto-detected"


# ``calls`` of a module: every call is a site (the default), or only the first.
EACH_CALL = "each"
FIRST_CALL = "first"


@dataclass(frozen=True)
class ModuleOptions:
    """``[modules."PATH"]`` of a hook map: how one module it names is recorded and compared.

    Attributes:
        activations: keyword arguments that carry activations besides the built-in names
            (:data:`~blockdiff.site.HIDDEN_KWARGS`): the first one passed is the hidden
            state. TransformerLens attention takes ``query_input``, ``key_input``,
            ``value_input``. ``()`` (``activations = []``): the module takes no
            activation and always runs on its own arguments (TransformerLens'
            ``pos_embed`` reads only the number of tokens from its input); ``None``: the
            map names none, the built-in rules apply.
        calls: which calls of the module are sites: ``"each"`` (every call, its own
            ordinal), ``"first"``, or a call index (0-based, counted per forward). The
            other calls are not recorded and take no ordinal: TransformerLens calls
            ``ln1`` three times per block (for q, k and v), Hugging Face GPT-2 ``ln_1`` once.
        broadcast: the output is compared with the other side's after broadcasting
            (``[B, T, D]`` against ``[1, T, D]``) instead of refused as a shape mismatch.
        shard_output, shard_input: in a sharded run, the module returns (takes as its
            hidden state) a plain local shard split along this dimension across the ranks,
            in rank order: a hand-written tensor-parallel layer. Recorded whole (gathered),
            and a replay hands the module this rank's part of the reference's tensor.
            (``DTensor`` modules need no declaration.)
    """

    activations: tuple[str, ...] | None = None
    calls: str | int = EACH_CALL
    broadcast: bool = False
    shard_output: int | None = None
    shard_input: int | None = None

    def selects(self, call: int) -> bool:
        """Whether call number ``call`` (0-based) of the module is a site."""
        if self.calls == EACH_CALL:
            return True
        return call == (0 if self.calls == FIRST_CALL else self.calls)

    def to_dict(self) -> dict[str, Any]:
        activations = None if self.activations is None else list(self.activations)
        return {
            "activations": activations,
            "calls": self.calls,
            "broadcast": self.broadcast,
            "shard_output": self.shard_output,
            "shard_input": self.shard_input,
        }


DEFAULT_OPTIONS = ModuleOptions()
MODULE_KEYS = ("activations", "calls", "broadcast", "shard_output", "shard_input")
MAP_KEYS = ("name", "description", "match", "prefix", "optional", "outside", "blocks", "modules")


@dataclass(frozen=True)
class HookMap:
    """A hook map as written in TOML, not yet applied to a model."""

    name: str
    source: str
    match: tuple[str, ...]
    outside: dict[str, tuple[str, ...]]
    optional: tuple[str, ...]
    blocks: tuple[str, ...]
    subpaths: dict[str, tuple[str, ...]]
    prefix: str = ""
    description: str = ""
    # [blocks.moe]: router paths (relative to a block; the first that exists is the
    # router), router output format, an optional capacity attribute path relative to
    # the MoE module (the router's parent): an int, or a callable taking the token count,
    # and (format "logits") the MoE module's attribute holding the experts per token.
    moe: dict[str, Any] = field(default_factory=dict)
    # [modules."PATH"]: options of modules the map names, by the path as written
    # (relative to a block for sub-path modules).
    modules: dict[str, ModuleOptions] = field(default_factory=dict)


@dataclass
class BlockLayout:
    """One block: its path, its index and the module paths of each sub-path."""

    index: int
    path: str
    stack: str
    subpaths: dict[str, list[str]] = field(default_factory=dict)
    # Modules with parameters that no sub-path covers: their errors would pass for glue.
    unmapped: list[str] = field(default_factory=list)
    # MoE blocks: {"router": full path, "format": a router format, "capacity": full attr
    # path, "top_k": experts per token as read from the model (format "logits")}.
    moe: dict[str, str] | None = None


@dataclass
class Layout:
    """A hook map resolved against one model: concrete module paths for every site."""

    hook_map: HookMap
    outside: list[tuple[str, str]]
    blocks: list[BlockLayout]
    # Options of the modules the map gave any (``[modules]``), by full module path.
    modules: dict[str, ModuleOptions] = field(default_factory=dict)

    def options(self, path: str) -> ModuleOptions:
        """The :class:`ModuleOptions` of the module at ``path`` (the defaults when none)."""
        return self.modules.get(path, DEFAULT_OPTIONS)

    def site_of(self) -> dict[str, tuple[str, int | None, str | None]]:
        """Module path → (stage, block, subpath) for every module that is a site."""
        sites: dict[str, tuple[str, int | None, str | None]] = {}
        for stage, path in self.outside:
            sites[path] = (stage, None, None)
        for block in self.blocks:
            sites[block.path] = ("block", block.index, None)
            for subpath, paths in block.subpaths.items():
                for path in paths:
                    sites[path] = ("block", block.index, subpath)
            if block.moe is not None:
                sites[block.moe["router"]] = ("block", block.index, "router")
        return sites

    def to_dict(self) -> dict[str, Any]:
        return {
            "hook_map": self.hook_map.name,
            "source": self.hook_map.source,
            "outside": [{"stage": s, "module": p} for s, p in self.outside],
            "blocks": [
                {"index": b.index, "module": b.path, "stack": b.stack, "subpaths": b.subpaths, "unmapped": b.unmapped, "moe": b.moe}
                for b in self.blocks
            ],
            **({"modules": {p: o.to_dict() for p, o in self.modules.items()}} if self.modules else {}),
        }


def parse(text: str, *, source: str) -> HookMap:
    """Parse and validate a hook map written in TOML.

    Raises:
        HookMapError: malformed TOML, a missing or mistyped key, an unknown sub-path.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HookMapError(f"hook map {source}: not valid TOML ({exc})", source=source) from None

    def strings(value: Any, key: str) -> tuple[str, ...]:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise HookMapError(
            f"hook map {source}: {key} must be a string or a list of strings, "
            f"found {type(value).__name__}",
            source=source,
        )

    unknown = sorted(set(data) - set(MAP_KEYS))
    if unknown:
        raise HookMapError(
            f"hook map {source}: unknown key {unknown[0]!r}; expected {', '.join(MAP_KEYS)}", source=source
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise HookMapError(f"hook map {source}: missing 'name' (a string)", source=source)
    blocks = data.get("blocks")
    if not isinstance(blocks, dict) or "path" not in blocks:
        raise HookMapError(
            f"hook map {source}: missing [blocks] table with 'path' (the block list)", source=source
        )
    unknown = sorted(set(blocks) - {"path", "subpaths", "moe"})
    if unknown:
        raise HookMapError(
            f"hook map {source}: unknown key {unknown[0]!r} in [blocks]; expected path, subpaths, moe", source=source
        )

    def table(value: Any, key: str, allowed: tuple[str, ...], what: str, hint: str = "") -> dict:
        if not isinstance(value, dict):
            raise HookMapError(f"hook map {source}: [{key}] must be a table", source=source)
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise HookMapError(
                f"hook map {source}: unknown {what} {unknown[0]!r} in [{key}]; "
                f"expected {', '.join(allowed)}{hint}",
                source=source,
            )
        return value

    raw_subpaths = table(
        blocks.get("subpaths", {}), "blocks.subpaths", MODULE_SUBPATHS, "sub-path", " (residual owns no module)"
    )
    raw_outside = table(data.get("outside", {}), "outside", OUTSIDE_STAGES, "stage")
    optional = strings(data.get("optional", []), "optional")
    prefix = data.get("prefix", "")
    if not isinstance(prefix, str):
        raise HookMapError(f"hook map {source}: 'prefix' must be a string", source=source)
    return HookMap(
        name=name,
        source=source,
        match=strings(data.get("match", []), "match"),
        outside={k: strings(v, f"outside.{k}") for k, v in raw_outside.items()},
        optional=optional,
        blocks=strings(blocks["path"], "blocks.path"),
        subpaths={k: strings(v, f"blocks.subpaths.{k}") for k, v in raw_subpaths.items()},
        prefix=prefix,
        description=str(data.get("description", "")),
        moe=_parse_moe(blocks.get("moe", {}), source),
        modules=_parse_modules(data.get("modules", {}), source, raw_outside, raw_subpaths, strings),
    )


def _parse_modules(raw: Any, source: str, outside: dict, subpaths: dict, strings: Any) -> dict[str, ModuleOptions]:
    """``[modules."PATH"]`` tables: options of modules named in [outside] or
    [blocks.subpaths], by the path as written there."""
    if not isinstance(raw, dict):
        raise HookMapError(f"hook map {source}: [modules] must be a table of module paths", source=source)
    named = {p for v in [*outside.values(), *subpaths.values()] for p in ([v] if isinstance(v, str) else v)}
    found: dict[str, ModuleOptions] = {}
    for path, options in raw.items():
        where = f'[modules."{path}"]'
        if path not in named:
            raise HookMapError(
                f"hook map {source}: {where} names a module the map does not name in [outside] "
                "or [blocks.subpaths] (paths are written as there)",
                source=source,
            )
        if not isinstance(options, dict):
            raise HookMapError(f"hook map {source}: {where} must be a table", source=source)
        unknown = sorted(set(options) - set(MODULE_KEYS))
        if unknown:
            raise HookMapError(
                f"hook map {source}: unknown key {unknown[0]!r} in {where}; expected {', '.join(MODULE_KEYS)}",
                source=source,
            )
        calls = options.get("calls", EACH_CALL)
        if not (calls in (EACH_CALL, FIRST_CALL) or (type(calls) is int and calls >= 0)):
            raise HookMapError(
                f"hook map {source}: {where} calls must be \"each\", \"first\" or a call index (0, 1, ...), "
                f"found {calls!r}",
                source=source,
            )
        broadcast = options.get("broadcast", False)
        if not isinstance(broadcast, bool):
            raise HookMapError(f"hook map {source}: {where} broadcast must be true or false, found {broadcast!r}", source=source)
        shards = {key: options.get(key) for key in ("shard_output", "shard_input")}
        for key, dim in shards.items():
            if dim is not None and type(dim) is not int:
                raise HookMapError(f"hook map {source}: {where} {key} must be a dimension (-1, 2, ...), found {dim!r}", source=source)
        found[path] = ModuleOptions(
            activations=None if "activations" not in options else strings(options["activations"], f"{where} activations"),
            calls=calls,
            broadcast=broadcast,
            **shards,
        )
    return found


def _parse_moe(raw: Any, source: str) -> dict[str, str]:

    if not isinstance(raw, dict):
        raise HookMapError(f"hook map {source}: [blocks.moe] must be a table", source=source)
    if not raw:
        return {}
    unknown = sorted(set(raw) - {"router", "format", "capacity", "top_k"})
    routers = raw.get("router")
    if isinstance(routers, str):
        routers = [routers]
    if unknown or not (isinstance(routers, list) and routers and all(isinstance(r, str) for r in routers)):
        raise HookMapError(
            f"hook map {source}: [blocks.moe] takes router (a path or a list of paths), format, capacity and top_k"
            + (f"; found {unknown[0]!r}" if unknown else "; router is missing"),
            source=source,
        )
    fmt = raw.get("format", "topk")
    if fmt not in ROUTER_FORMATS:
        raise HookMapError(
            f"hook map {source}: [blocks.moe] format {fmt!r} is unknown; expected {', '.join(ROUTER_FORMATS)}",
            source=source,
        )
    out: dict[str, Any] = {"router": list(routers), "format": fmt}
    if "capacity" in raw:
        out["capacity"] = str(raw["capacity"])
    if "top_k" in raw:
        out["top_k"] = str(raw["top_k"])
    elif fmt == "logits":
        raise HookMapError(
            f"hook map {source}: [blocks.moe] format 'logits' needs top_k, the MoE module's attribute "
            "holding the experts per token (e.g. \"top_k\")",
            source=source,
        )
    return out


def load(path: str | Path) -> HookMap:
    """Read a user's hook map file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HookMapError(f"hook map {path}: no such file", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HookMapError(f"hook map {path}: cannot read ({exc})", source=str(path)) from None
    return parse(text, source=str(path))


def bundled() -> list[HookMap]:
    """The hook maps shipped with blockdiff (``hooks/*.toml``), sorted by name."""
    return list(_bundled())


@functools.lru_cache(maxsize=1)
def _bundled() -> tuple[HookMap, ...]:
    """Read and parsed once per process (every resolve asks; parsing them all took a few
    milliseconds); a HookMap is frozen."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "hooks").is_dir():
        # A source checkout reads its own maps, even where an editable install of another
        # checkout maps blockdiff.hooks elsewhere.
        folder: Any = checkout / "hooks"
    else:
        folder = resources.files("blockdiff.hooks")
    maps = []
    for entry in folder.iterdir():
        if entry.name.endswith(".toml"):
            maps.append(parse(entry.read_text(encoding="utf-8"), source=f"hooks/{entry.name}"))
    return tuple(sorted(maps, key=lambda m: m.name))


def find(model: nn.Module) -> HookMap:
    """The bundled hook map whose ``match`` names the model's class.

    Raises:
        HookMapError: no bundled map matches.
    """
    cls = type(uncompiled(model)).__name__
    for hook_map in bundled():
        if cls in hook_map.match:
            return hook_map
    raise HookMapError(
        f"no hook map matches model class {cls}; write one and pass it with --hooks FILE.toml "
        "(format: docs/hook-maps.md)"
    )


def apply_map(model: nn.Module, hook_map: HookMap) -> Layout:
    """Apply a hook map to ``model``: every module it names must exist. (With no map,
    :func:`~blockdiff.autodetect.resolve` finds one, or guesses it.)

    Raises:
        HookMapError: a named module does not exist, or the block list is not a list.
    """
    modules = dict(model.named_modules())
    # Maps name modules as written, without torch.compile's wrappers: a path is looked up
    # with every `_orig_mod` step taken out, and stands for the outermost module there
    # (`layers.0` for a compiled layer, whose own modules are `layers.0._orig_mod.*`).
    # A module registered twice is found by either path and stands under its name in
    # named_modules(): TransformerLens 4's bridge registers Hugging Face GPT-2's `ln_1` as
    # `blocks.0._original_component.ln_1` and again as `blocks.0.ln1`.
    named = {id(module): path for path, module in modules.items()}
    actual: dict[str, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        actual.setdefault(without_compile(path), named[id(module)])

    def lookup(path: str) -> str | None:
        found = actual.get(without_compile(path))
        if found is None and hook_map.prefix and path.startswith(hook_map.prefix):
            found = actual.get(without_compile(path[len(hook_map.prefix):]))
        return found

    def missing(what: str, path: str) -> HookMapError:
        return HookMapError(
            f"hook map {hook_map.name} ({hook_map.source}): {what} {path!r} does not exist "
            f"in {type(model).__name__}",
            source=hook_map.source,
        )

    outside: list[tuple[str, str]] = []
    options: dict[str, ModuleOptions] = {}
    for stage in OUTSIDE_STAGES:
        for path in hook_map.outside.get(stage, ()):
            found = lookup(path)
            if found is None:
                if stage in hook_map.optional or path in hook_map.optional:
                    continue
                raise missing(f"{stage} module", path)
            outside.append((stage, found))
            if path in hook_map.modules:
                options[found] = hook_map.modules[path]

    blocks: list[BlockLayout] = []
    for stack_path in hook_map.blocks:
        found = lookup(stack_path)
        if found is None:
            raise missing("block list", stack_path)
        stack = modules[found]
        # A ModuleDict keyed by block index: a pipeline stage's share of the blocks.
        keyed = isinstance(stack, nn.ModuleDict) and all(name.isdigit() for name in stack.keys())
        if not (keyed or isinstance(stack, (nn.ModuleList, nn.Sequential))):
            raise HookMapError(
                f"hook map {hook_map.name}: block list {found!r} is a {type(stack).__name__}, "
                "expected a ModuleList, a Sequential or a ModuleDict keyed by block index",
                source=hook_map.source,
            )
        first = len(blocks)
        for name, _ in stack.named_children():
            block_path = f"{found}.{name}" if found else name
            clean_block = without_compile(block_path)
            index = first + int(name) if keyed else len(blocks)
            layout = BlockLayout(index=index, path=block_path, stack=found)
            for subpath in MODULE_SUBPATHS:
                paths = []
                for rel in hook_map.subpaths.get(subpath, ()):
                    full = actual.get(without_compile(f"{clean_block}.{rel}"))
                    if full is None:
                        if rel in hook_map.optional:
                            continue  # absent in this block (an encoder block has no cross-attention)
                        raise missing(f"{subpath} module", f"{block_path}.{rel}")
                    paths.append(full)
                    if rel in hook_map.modules:
                        options[full] = hook_map.modules[rel]
                if paths:
                    layout.subpaths[subpath] = paths
            layout.unmapped = _unmapped(modules, block_path, layout.subpaths)
            routers = [actual.get(without_compile(f"{clean_block}.{r}")) for r in hook_map.moe.get("router", [])]
            router = next((r for r in routers if r is not None), None)
            if router is not None:  # blocks without a router are dense
                layout.moe = {"router": router, "format": hook_map.moe["format"]}
                if "capacity" in hook_map.moe:
                    layout.moe["capacity"] = f"{router.rpartition('.')[0]}.{hook_map.moe['capacity']}"
                if "top_k" in hook_map.moe:
                    layout.moe["top_k"] = str(_experts_per_token(modules, router, hook_map))
            blocks.append(layout)
    if not blocks:
        raise HookMapError(f"hook map {hook_map.name}: the block list is empty", source=hook_map.source)
    return Layout(hook_map=hook_map, outside=outside, blocks=blocks, modules=options)


def _experts_per_token(modules: dict[str, nn.Module], router: str, hook_map: HookMap) -> int:
    """The experts per token of a ``logits`` router, read from the MoE module (the
    router's parent) where ``top_k`` names it: stored in the layout, so a dump has it."""
    owner = modules[router.rpartition(".")[0]]
    value = getattr(owner, hook_map.moe["top_k"], None)
    if type(value) is not int or value < 1:
        raise HookMapError(
            f"hook map {hook_map.name}: [blocks.moe] top_k {hook_map.moe['top_k']!r} of {type(owner).__name__} "
            f"is {value!r}, expected a positive int",
            source=hook_map.source,
        )
    return value


COMPILED = "_orig_mod"  # where torch.compile's OptimizedModule keeps the module it wraps


def without_compile(path: str) -> str:
    """``path`` with torch.compile's wrapper steps taken out: ``layers.0._orig_mod.mlp``
    → ``layers.0.mlp``; ``_orig_mod.embed`` → ``embed``."""
    return ".".join(part for part in path.split(".") if part != COMPILED)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper holds (``model`` itself when it is none)."""
    inner = getattr(model, COMPILED, None)
    return inner if isinstance(inner, nn.Module) else model


def _unmapped(modules: dict[str, nn.Module], block_path: str, subpaths: dict[str, list[str]]) -> list[str]:
    """Modules inside a block that hold parameters but belong to no sub-path."""
    covered = [p for paths in subpaths.values() for p in paths]
    found = []
    for path, module in modules.items():
        if not path.startswith(block_path + "."):
            continue
        if any(path == c or path.startswith(c + ".") for c in covered):
            continue
        if next(module.parameters(recurse=False), None) is not None:
            found.append(path)
    return found


def layout_from_dict(data: dict[str, Any]) -> Layout:
    """Rebuild a :class:`Layout` from :meth:`Layout.to_dict` (as stored in a dump's meta),
    for a side that has no live model."""
    try:
        hook_map = HookMap(
            name=str(data["hook_map"]),
            source=str(data.get("source", "dump")),
            match=(),
            outside={},
            optional=(),
            blocks=(),
            subpaths={},
        )
        blocks = [
            BlockLayout(
                index=int(b["index"]),
                path=str(b["module"]),
                stack=str(b.get("stack", "")),
                subpaths={k: [str(p) for p in v] for k, v in b["subpaths"].items()},
                unmapped=[str(p) for p in b.get("unmapped", [])],
                moe=None if b.get("moe") is None else {k: str(v) for k, v in b["moe"].items()},
            )
            for b in data["blocks"]
        ]
        outside = [(str(o["stage"]), str(o["module"])) for o in data["outside"]]
        modules = {
            str(path): ModuleOptions(
                activations=None if o.get("activations") is None else tuple(str(a) for a in o["activations"]),
                calls=o.get("calls", EACH_CALL),
                broadcast=bool(o.get("broadcast", False)),
                shard_output=o.get("shard_output"),
                shard_input=o.get("shard_input"),
            )
            for path, o in data.get("modules", {}).items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise HookMapError(f"stored layout is malformed ({type(exc).__name__}: {exc})") from None
    return Layout(hook_map=hook_map, outside=outside, blocks=blocks, modules=modules)

