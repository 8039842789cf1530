"""Sides: what the engine asks of an implementation, whatever kind it is.

A *side* (docs/design.md, "Sides") is the reference or the candidate. The engine asks four
things of it, and nothing else:

- its **sites**: what one run of the whole model recorded (:attr:`Side.store`);
- **run one module** (or a child of it) on a recorded call with chosen activations
  replaced (:meth:`Side.call_module`);
- **run block i** on a recorded call with chosen modules frozen, answering with recorded
  outputs instead of computing (:meth:`Side.run_block`);
- its **device, dtype and layout**.

The kinds here:

- :class:`LiveSide`: an ``nn.Module`` as it runs: eager, or under ``torch.compile`` (its
  experiments then run compiled code, see :meth:`LiveSide.runnable`);
- :class:`PrecisionSide`: a live side's modules copied into another dtype and device,
  which is how a noise floor is measured (the reference's own code at the candidate's
  precision);
- :class:`DumpSide`: a dump written by ``blockdiff capture``; it has sites and runs
  nothing (:attr:`Side.live` is false).

A new kind of candidate (sharded, another runtime) is a new class with these members;
the localizer (:mod:`blockdiff.localize`) never branches on kinds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
from torch import nn

from . import distributed
from .capture import Recording, record_once
from .dtypes import dtype_name, stored_dtype
from .compare import metrics
from .errors import PairingError
from .hookmap import Layout, layout_from_dict
from .inputs import Inputs, model_device, model_dtype
from .site import (
    SiteKey,
    Site,
    describe_key,
    for_replay,
    hidden_location,
    iter_tensors,
    map_structure,
    primary_tensor,
    replace_primary,
    recorded_copy,
    replayed_copy,
    snapshot,
    with_hidden,
)
from .store import MemoryStore, SiteStore
from .report import BlockResult, Check, StageResult, SubpathResult
from .tolerance import Threshold
from .vocab import REPLICAS, reported_subpath

if TYPE_CHECKING:  # the localizer drives sides: imported for annotations only
    from .localize import Localizer

# Activations by role ("primary", "encoder_hidden_states", "arg3", ...), as Site.hidden_inputs.
Hidden = dict[str, torch.Tensor]
# What a localization judged: its stage results and block results, in order.
Judged = tuple[list[StageResult], list[BlockResult]]
# Modules frozen in a block run, by (sub-path, ordinal): (site whose output answers, site
# whose output gives the structure and dtypes: the running side's own record).
Frozen = dict[tuple[str, int], tuple[Site, Site]]


class Side(Protocol):
    """What the engine needs of one side of a diff."""

    name: str  # "reference" or "candidate"
    layout: Layout
    store: SiteStore
    meta: dict[str, Any]  # how the report describes it: model, class, device, dtype, hook_map

    @property
    def live(self) -> bool:
        """Whether it can run experiments (a dump cannot)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        """The output of module ``path`` called with ``call``'s arguments, its
        activations replaced by ``hidden`` (cast to the call's own dtypes)."""

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """Block ``path`` run on ``call`` with ``hidden``; the modules of ``frozen`` answer
        with recorded outputs. Returns the block's output and the hidden input that reached
        each module of ``modules`` (block-relative path → sub-path), by (sub-path, ordinal)."""

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        """Module ``path`` run on ``call`` with ``hidden``, the calls of its innermost
        children recorded (drill-down)."""

    def record(self, inputs: Any, store: SiteStore, *, hold: str | None, progress: Callable[[int, int], None] | None = None) -> Any:
        """Run the whole model once, recording every site into ``store``."""

    def attribute(self, path: str) -> Any:
        """An attribute of the model (``model.layers.0.mlp.capacity``); ``None`` when absent."""

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "Side | None":
        """This side's code run in ``dtype`` on ``device`` (noise floors); ``None`` when it
        cannot run."""

    def runs_as(self, other: "Side") -> bool:
        """Whether ``other`` computes what this side does, so that its record is this
        side's run (a floor side and a candidate that is the reference's own cast)."""

    def holds(self, block: int | None, module: str) -> bool:
        """Whether this process judges block ``block``, or (``block`` None) the stage module
        ``module``, with this side as the candidate: a pipeline stage only the ones its rank
        holds; every other side all of them."""

    def localized(self, localizer: "Localizer", judge: Callable[[], Judged]) -> Judged:
        """The stage and block results of a localization with this side as the candidate:
        ``judge()`` (the localizer's run), completed as this kind of side needs — what
        other ranks judged (a pipeline stage), the replica check (a sharded model). Most
        sides return ``judge()``."""


def describe(model: nn.Module, layout: Layout, label: str | None) -> dict[str, Any]:
    """How a report names a live model (with ``quantization`` where it can be seen)."""
    found = {
        "model": label or type(model).__name__,
        "class": type(model).__name__,
        "device": str(model_device(model)),
        "dtype": dtype_name(model_dtype(model)),
        "hook_map": layout.hook_map.name,
    }
    quantized = quantization(model)
    if quantized:
        found["quantization"] = quantized
    return found


def quantization(model: nn.Module) -> str | None:
    """What quantization a model shows, in words (``"Int8Tensor weights in 28 modules"``):
    quantized module classes (``torch.ao``), weights held as tensor subclasses (torchao)
    or in 8-bit floating or integer dtypes; ``None`` when it shows none."""
    seen: dict[str, int] = {}
    for module in model.modules():
        where = type(module).__module__
        if ".quantized." in where and next(module.children(), None) is None or ".quantized.dynamic." in where:
            kind = f"torch.ao {'dynamic ' if '.dynamic.' in where else ''}quantized {type(module).__name__}"
            if kind.endswith("LinearPackedParams"):
                continue  # the packed weights of a quantized Linear, counted with it
            seen[kind] = seen.get(kind, 0) + 1
            continue
        for param in module.parameters(recurse=False):
            if distributed.is_distributed(param):
                continue  # sharded, not quantized: ShardedSide says how many ranks
            if type(param) not in (torch.Tensor, nn.Parameter):
                kind = f"{type(param).__name__} weights"
            elif param.dtype.itemsize == 1:
                kind = f"{dtype_name(param.dtype)} weights"
            else:
                continue
            seen[kind] = seen.get(kind, 0) + 1
    if not seen:
        return None
    return ", ".join(f"{kind} in {count} module{'s' if count > 1 else ''}" for kind, count in sorted(seen.items()))


def versions(model: nn.Module) -> dict[str, str]:
    """The versions of torch, of transformers when it is loaded, and of every installed
    package that defines a module class of ``model``: what a dump records, so that a replay
    under other versions (code moved between a module and its caller) can say so."""
    roots = {type(m).__module__.split(".")[0] for m in model.modules()}
    if "transformers" in sys.modules:
        roots.add("transformers")
    return {"torch": torch.__version__, **_versions(frozenset(roots - {"torch", "builtins", "__main__"}))}


@functools.lru_cache(maxsize=64)
def _versions(roots: frozenset[str]) -> dict[str, str]:
    """Installed versions of the distributions providing these top-level modules, read
    once per set (each read opens the distribution's metadata)."""
    import importlib.metadata

    found = {}
    distributions = _distributions()
    for root in sorted(roots):
        for name in distributions.get(root, []):
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it, read once: reading
    every distribution's file list took ~170 ms, as long as a forward of a 58M model."""
    import importlib.metadata

    try:
        return importlib.metadata.packages_distributions()
    except Exception:  # a broken environment: record what is certain
        return {}


class SideDefaults:
    """The protocol's members most sides answer alike: no model attributes, no other
    precision, no twin, every block judged here, a localization as the localizer runs it."""

    def attribute(self, path: str) -> Any:
        return None

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "Side | None":
        return None

    def runs_as(self, other: "Side") -> bool:
        return False

    def holds(self, block: int | None, module: str) -> bool:
        return True

    def localized(self, localizer: "Localizer", judge: Callable[[], Judged]) -> Judged:
        return judge()


def received_dtype(role: str, own: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype a replayed call's activation in ``role`` is handed over in: ``cast`` (a
    side running at another precision), else the dtype of the call's own tensor in that
    role (``own``), else unchanged (``None``)."""
    return cast or (own[role].dtype if role in own else None)


class LiveSide(SideDefaults):
    """An ``nn.Module`` (eager or compiled) with its layout; :meth:`record` fills its store."""

    live = True
    # Why the side cannot be recorded into a dump for a streamed diff, or None when it can.
    not_streamed: str | None = None

    def __init__(self, name: str, model: nn.Module, layout: Layout, *, label: str | None = None) -> None:
        self.name = name
        self.model = model
        self.layout = layout
        self.meta = describe(model, layout, label)
        self.store: SiteStore | None = None  # set by record()
        self._compiled: dict[str, Callable] = {}  # runnable(): modules compiled like their model

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model)

    # Replayed floating arguments are cast to this dtype; None keeps each its own.
    cast: torch.dtype | None = None

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: str | None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """Run the whole model once, recording every site into ``store`` (see
        :func:`~blockdiff.capture.record_once` for ``hold``)."""
        self.store = store
        return record_once(self.model, self.layout, store, inputs, hold=hold, progress=progress)  # type: ignore[arg-type]

    def module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable:
        """What runs module ``path`` (``module``, when the caller holds it already) the way
        the side's own forward runs it: the module itself, or — inside a model or module
        under ``torch.compile`` — the module compiled with that compile's own backend and
        options, so that an experiment judges the generated code, not the eager module it
        was generated from. Compiled once per module, on first use."""
        module = self.module(path) if module is None else module
        if compile_context(module) is not None:
            return module  # compiled itself (`layers[i] = torch.compile(layer)`, `layer.compile()`)
        context = None
        parts = path.split(".") if path else []
        for depth in range(len(parts)):  # every ancestor; the innermost compiled one counts
            context = compile_context(self.model.get_submodule(".".join(parts[:depth]))) or context
        if context is None:
            return module
        compiled = self._compiled.get(path)
        if compiled is None:
            compiled = self._compiled[path] = context(module)
        return compiled

    def attribute(self, path: str) -> Any:
        owner, _, attr = path.rpartition(".")
        return getattr(self.model.get_submodule(owner), attr, None)

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "PrecisionSide":
        return PrecisionSide(self, dtype, device)


    def _replay(self, call: Site, hidden: Hidden | None) -> tuple[tuple, dict]:
        """``call``'s arguments on this side's device (floating ones cast to :attr:`cast`),
        its activations replaced by ``hidden`` in the call's own dtypes."""
        device = self.device
        args, kwargs, fresh = call.args, call.kwargs, set()
        if hidden:
            own = call.hidden_inputs()
            hidden = {
                role: replayed_copy(t, device, received_dtype(role, own, self.cast), layout=own.get(role))
                for role, t in hidden.items()
            }
            # Replaced before the rest is copied: each tensor of the call is copied (and cast) once.
            args, kwargs = with_hidden(args, kwargs, hidden, call.activations)
            fresh = {id(t) for t in hidden.values()}
        return (
            for_replay(args, device=device, dtype=self.cast, keep=fresh),
            for_replay(kwargs, device=device, dtype=self.cast, keep=fresh),
        )

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        args, kwargs = self._replay(call, hidden)
        return self.runnable(path)(*args, **kwargs)

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None, *, depth: int = 2) -> list[Site]:
        """Module ``path`` run on ``call`` (its activations replaced by ``hidden``), with
        every call of its innermost children (up to ``depth`` levels down) recorded: one site
        per call, in the order they started, under the parent's stage, block and sub-path.
        The hooks are added for this one run and removed in ``finally``."""
        module = self.module(path)
        leaves = {rel: child for rel, child in module.named_modules() if rel and rel.count(".") < depth}
        found: list[Site] = []
        open_: dict[str, list[Site]] = {}
        calls: dict[str, int] = {}
        handles = []

        def pre(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict) -> None:
                site = Site(call.stage, call.block, call.subpath, f"{path}.{rel}", calls.get(rel, 0), len(found),
                            snapshot(args), snapshot(kwargs), order=len(found))
                calls[rel] = site.call + 1
                found.append(site)
                open_.setdefault(rel, []).append(site)
                return None

            return hook

        def post(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                open_[rel].pop().output = snapshot(output)
                return None

            return hook

        try:
            for rel, child in leaves.items():
                handles.append(child.register_forward_pre_hook(pre(rel), with_kwargs=True))
                handles.append(child.register_forward_hook(post(rel), with_kwargs=True))
            args, kwargs = self._replay(call, hidden)
            self.runnable(path, module)(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        # The innermost modules that ran: a module whose own children ran is theirs to judge
        # (a quantized Linear keeps its weights in a child that is never called: it stays).
        ran = {site.module for site in found}
        innermost = [s for s in found if not any(other.startswith(s.module + ".") for other in ran)]
        for ordinal, site in enumerate(innermost):
            site.ordinal = site.order = ordinal
        return innermost

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """For this one call, every module of ``modules`` gets a pre-hook (what reached it)
        and, when something is frozen, its ``forward`` wrapped on the instance; both are
        undone in ``finally`` (an instance ``forward`` the module already had is put back).

        A frozen module answers with the first site's primary tensor in the structure and
        dtypes of the second (the running side's own recorded output); a router answers
        with the whole recorded routing decision.
        """
        block = self.module(path)
        device, cast = self.device, self.cast
        reached: dict[tuple[str, int], torch.Tensor] = {}
        counters: dict[str, int] = {}
        seen: dict[str, int] = {}  # calls of each module so far
        current: dict[str, tuple[str, int] | None] = {}
        handles = []
        patched: list[tuple[nn.Module, Any]] = []
        missing = object()

        def pre(rel: str, subpath: str) -> Callable:
            options = self.layout.options(f"{path}.{rel}")

            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                call = seen[rel] = seen.get(rel, -1) + 1
                if not options.selects(call):  # not a site (the map's `calls`): it computes
                    current[rel] = None
                    return None
                ordinal = counters.get(subpath, 0)
                counters[subpath] = ordinal + 1
                current[rel] = (subpath, ordinal)
                loc = hidden_location(args, kwargs, options.activations)
                if loc is not None:
                    tensor = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
                    if options.shard_input is not None and distributed.in_lockstep():
                        reached[(subpath, ordinal)] = distributed.declared_whole(tensor, options.shard_input)
                    else:
                        reached[(subpath, ordinal)] = recorded_copy(tensor)
                return None

            return hook

        def frozen_forward(rel: str, original: Callable) -> Callable:
            def forward(*args: Any, **kwargs: Any) -> Any:
                key = current.get(rel)
                if frozen is None or key not in frozen:
                    return original(*args, **kwargs)
                recorded, template = frozen[key]
                own = for_replay(template.output, device=device, dtype=cast)
                if key[0] == "router":
                    return _replace_all(own, recorded.output, device)
                like = primary_tensor(template.output)
                dtype = cast or (like.dtype if like is not None else None)
                return replace_primary(own, replayed_copy(recorded.primary_output(), device, dtype, layout=like))

            return forward

        try:
            named = dict(block.named_modules())
            for rel, subpath in modules.items():
                module = named[rel]
                handles.append(module.register_forward_pre_hook(pre(rel, subpath), with_kwargs=True))
                if frozen:
                    patched.append((module, module.__dict__.get("forward", missing)))
                    module.forward = frozen_forward(rel, module.forward)
            args, kwargs = self._replay(call, hidden)
            out = primary_tensor(self.runnable(path, block)(*args, **kwargs))
        finally:
            for handle in handles:
                handle.remove()
            for module, previous in reversed(patched):
                if previous is missing:
                    del module.forward
                else:
                    module.forward = previous
        if out is None:
            raise PairingError(f"{call.label}: the block returned no tensor")
        return out, reached


class PrecisionSide(LiveSide):
    """A live side's code in another dtype and device: the modules it runs are one copy of
    the side's model, cast (the user's model is never changed), and every recorded floating
    argument is cast too. The noise floor of a check is this side's error.

    The copy is made on first use and kept while the side lives: the free run and every
    floor experiment run it, so each weight is cast once (a copy per experiment cast the
    whole model twice over). It costs the model's weights at this precision in memory, as
    long as the diff runs."""

    def __init__(self, side: LiveSide, dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.layout, self.meta, self.store = side.name, side.layout, side.meta, side.store
        self.model = side.model
        self.cast = dtype
        self._device = device
        self._copy: nn.Module | None = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        assert self.cast is not None
        return self.cast

    def module(self, path: str) -> nn.Module:
        if self._copy is None:
            assert self.cast is not None
            self._copy = cast_copy(self.model, self.cast, self._device)
        return self._copy.get_submodule(path)

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable:
        return self.module(path) if module is None else module  # a copy, run eagerly

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: str | None = None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """The whole model's free run at this precision (the drift floors); ``hold`` as for
        :func:`~blockdiff.capture.record_once`. The experiments run the same modules again:
        a store that holds their own tensors (``"kept"``) must be checked after them
        (``Recording.changed()``), as :func:`~blockdiff.engine._in_memory` does, since a
        module that reuses its output buffer would change what the free run holds."""
        self.store = store
        return record_once(self.module(""), self.layout, store, inputs, hold=hold, progress=progress)  # type: ignore[arg-type]

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "PrecisionSide":
        return PrecisionSide(self, dtype, device)

    def runs_as(self, other: Side) -> bool:
        """Whether ``other`` is this side's code at this precision: a live side on this
        device whose model is the copy's twin (:func:`twins`) under the same layout. Its own
        record then is this side's free run (same inputs, same computation)."""
        model = getattr(other, "model", None)
        return (
            isinstance(model, nn.Module)
            and type(other) is LiveSide
            and other.device == self.device
            and other.layout.to_dict() == self.layout.to_dict()
            and twins(self.module(""), model)
        )


class ShardedSide(LiveSide):
    """A live model split across the ranks of a launched run (tensor or expert parallel,
    ``DTensor`` modules or hand-sharded ones), run in lockstep on every rank
    (:mod:`blockdiff.distributed`). Its records hold whole tensors; each module it runs
    for an experiment gets the reference's activations in the layout that module was
    recorded with, and its output is made whole again: a ``DTensor`` gathered, a
    collective's result awaited, a column-parallel module's local shard all-gathered."""

    not_streamed = "a sharded candidate yet: the layouts its modules expect are kept in memory only"

    def __init__(self, name: str, model: nn.Module, layout: Layout, *, label: str | None = None) -> None:
        super().__init__(name, model, layout, label=label)
        self.meta["ranks"] = distributed.world()

    def _whole(self, path: str, out: Any) -> Any:
        """``out`` of module ``path`` made whole: its primary tensor a local shard gathered
        (:func:`~blockdiff.distributed.made_whole`), every distributed tensor whole."""
        primary = primary_tensor(out)
        if primary is None:
            return out
        made = map_structure(out, lambda t: distributed.whole(t) if distributed.is_distributed(t) else t)
        whole = distributed.made_whole(primary, self.module(path), self.layout.options(path).shard_output)
        return replace_primary(made, whole)

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        return self._whole(path, super().call_module(path, call, hidden))

    def localized(self, localizer: "Localizer", judge: Callable[[], Judged]) -> Judged:
        """``judge()``, and the first site whose replicas differ across ranks judged as a
        divergence there (every rank holds it whole and should compute the same bits:
        later collectives would mix the difference into every rank), with a note."""
        stages, blocks = judge()
        store = self.store
        sites = [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]
        found = distributed.replica_disagreement(sites, dtype=localizer.experiments.dtype)
        if found is None:
            return stages, blocks
        site, ranks, measured = found
        names = ", ".join(str(r) for r in ranks)
        message = (
            f"replicas disagree: rank{'s' if len(ranks) > 1 else ''} {names} "
            f"differ{'' if len(ranks) > 1 else 's'} from rank 0 (rel_l2 {measured.rel_l2:.3g})"
        )
        at = _reference_order(localizer.ref, site)
        check = Check(REPLICAS, site.module, measured, Threshold(0.0, "fixed"), details={"ranks": ranks, "message": message}, order=at)
        if site.block is None:
            stage = next(s for s in stages if s.stage == site.stage)
            if stage.local is None or not stage.local.diverged:
                stage.local = check
        else:
            block = next(b for b in blocks if site.module == b.module or site.module.startswith(b.module + "."))
            result = block.subpaths.setdefault(reported_subpath(site.subpath), SubpathResult("checked", order=at))
            result.checks.insert(0, check)
            result.status = "checked"
        localizer.notes.insert(
            0,
            f"{describe_key(site.key)} ({site.module}): {message}; every rank holds this tensor whole and should "
            "compute the same bits: blamed where the replicas first differ (later collectives mix the difference "
            "into every rank)",
        )
        return stages, blocks

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        out, reached = super().run_block(path, call, hidden, modules, frozen)
        return self._whole(path, out), reached


class PipelineSide(LiveSide):
    """A model split into pipeline stages, one per rank of a launched run: each rank holds
    some of the blocks (a ``ModuleDict`` keyed by their global index) and stages, and runs
    only those. Its record is every rank's sites put together, on every rank; its layout,
    every rank's. An experiment on a block or stage runs on the rank that holds it
    (:meth:`holds`), each rank apart from the others.

    Args:
        layouts: every rank's own layout, in rank order (``layout`` is this rank's).
    """

    def __init__(self, name: str, model: nn.Module, layout: Layout, layouts: list[Layout], *, label: str | None = None) -> None:
        super().__init__(name, model, layout, label=label)
        self.own = layout
        self.layout = merged_layout(layouts)
        self.meta["ranks"] = len(layouts)
        self.meta["stages"] = [[block.index for block in theirs.blocks] for theirs in layouts]
        me = distributed.rank()
        self._blocks = {block.index for block in layout.blocks}
        # A stage module several ranks hold (a rotary embedding every stage runs) is judged
        # on the first.
        first: dict[str, int] = {}
        for rank, theirs in enumerate(layouts):
            for _, path in theirs.outside:
                first.setdefault(path, rank)
        self._stages = {path for path, rank in first.items() if rank == me}

    def holds(self, block: int | None, module: str) -> bool:
        """Whether this rank judges block ``block``, or (``block`` None) the stage module
        ``module``."""
        return block in self._blocks if block is not None else module in self._stages

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: str | None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """Run the pipeline once (every rank its stage), recording this rank's sites, then
        put every rank's together into ``store`` (:func:`~blockdiff.distributed.every_rank_sites`)."""
        own = MemoryStore(store.meta)
        recording = record_once(self.model, self.own, own, inputs, hold=None, progress=progress)  # type: ignore[arg-type]
        for site in distributed.every_rank_sites(own.sites()):
            store.add(site)
        self.store = store
        return recording


    def localized(self, localizer: "Localizer", judge: Callable[[], Judged]) -> Judged:
        """Each rank judges the blocks and stages it holds, apart from the others (their
        experiments differ); then every rank gets what every rank judged — results, routing
        statistics, notes, non-finite values — and the hand-overs between stages are checked."""
        with distributed.apart():
            stages, blocks = judge()
        found = distributed.every_rank((stages, blocks, localizer.moe, localizer.notes, localizer.nonfinite.found))
        stages = sorted((s for theirs in found for s in theirs[0]), key=lambda s: s.order)  # the reference's order
        blocks = sorted((b for theirs in found for b in theirs[1]), key=lambda b: b.index)
        localizer.moe = sorted((m for theirs in found for m in theirs[2]), key=lambda m: m["block"])
        localizer.notes = [note for theirs in found for note in theirs[3]]
        for theirs in found:
            localizer.nonfinite.merge(theirs[4])
        self._handoff_checks(blocks, localizer)
        return stages, blocks

    def _handoff_checks(self, blocks: list[BlockResult], localizer: "Localizer") -> None:
        """Where one stage hands the residual stream to the next (block i on one rank, block
        i + 1 on another), what the next stage's first block received must be what the
        stage before produced: checked (in that block's ``residual``, before its sub-paths)
        wherever the reference hands its block output on unchanged."""
        owner = {index: rank for rank, held in enumerate(self.meta["stages"]) for index in held}
        by_index = {b.index: b for b in blocks}
        ref, dtype = localizer.ref, localizer.experiments.dtype
        for index in sorted(owner):
            after = index + 1
            if after not in owner or owner[after] == owner[index] or after not in by_index:
                continue
            r_out, r_in = _block_site(ref, index).primary_output(), _block_site(ref, after).hidden_input()
            c_prev, c_next = _block_site(self, index), _block_site(self, after)
            c_out, c_in = c_prev.primary_output(), c_next.hidden_input()
            if any(t is None for t in (r_out, r_in, c_out, c_in)) or r_out.shape != r_in.shape or not torch.equal(r_out, r_in):
                continue
            if c_out.shape != c_in.shape:
                raise PairingError(
                    f"block {after} received a tensor of shape {list(c_in.shape)} from the stage before, "
                    f"which produced {list(c_out.shape)}"
                )
            at = _block_site(ref, after).order  # placed in the reference's order, as every check is
            check = Check(
                f"input handed over from block {index} (rank {owner[index]} to rank {owner[after]})",
                c_next.module,
                metrics(c_out, c_in, dtype=dtype),
                localizer.tolerance.threshold("residual", dtype, None),
                order=at,
            )
            by_index[after].subpaths.setdefault("residual", SubpathResult("checked", order=at)).checks.insert(0, check)


def _block_site(side: Side, index: int) -> Site:
    """Block ``index``'s own site (its input and output) in ``side``'s record."""
    return next(s for s in side.store.block_sites(index) if s.subpath is None)


def _reference_order(reference: Side, site: Site) -> float:
    """Where the reference ran the site paired with ``site`` (checks are placed in the
    reference's order); ``site``'s own order when the reference has none."""
    sites = reference.store.outside_sites() if site.block is None else reference.store.block_sites(site.block)
    return next((s.order for s in sites if s.key == site.key), site.order)


def merged_layout(layouts: list[Layout]) -> Layout:
    """The layout of a model whose blocks and stages are spread over several layouts (one
    per pipeline stage): every block once, by index; every stage once."""
    first = layouts[0]
    blocks = {block.index: block for layout in layouts for block in layout.blocks}
    outside = list(dict.fromkeys(entry for layout in layouts for entry in layout.outside))
    modules = {path: options for layout in layouts for path, options in layout.modules.items()}
    return Layout(hook_map=first.hook_map, outside=outside, blocks=[blocks[i] for i in sorted(blocks)], modules=modules)


class DumpSide(SideDefaults):
    """A dump written by ``blockdiff capture`` (or ``--save-dumps``): the sites one run
    recorded, with the layout, device and dtype it ran with. It runs nothing."""

    live = False

    def __init__(self, name: str, dump: Any, *, label: str | None = None) -> None:
        meta = dump.meta
        self.name = name
        self.store = dump
        self.layout = layout_from_dict(meta.get("layout") or {})
        self.meta = {
            "model": label or str(dump.path),
            "class": meta.get("class"),
            "device": meta.get("device"),
            "dtype": meta.get("dtype"),
            "hook_map": meta.get("hook_map"),
            "dump": str(dump.path),
            "captured_model": meta.get("model"),
        }
        self._dtype = stored_dtype(str(meta.get("dtype", "float32")))
        self._device = torch.device(str(meta.get("device", "cpu")))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _cannot(self, what: str) -> PairingError:
        return PairingError(f"the {self.name} is a dump ({self.meta['dump']}): it cannot {what}; give a live model")

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        raise self._cannot(f"run {path}")

    def run_block(self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None) -> Any:
        raise self._cannot(f"run {path}")

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        raise self._cannot(f"run {path}")

    def record(self, inputs: Any, store: SiteStore, *, hold: str | None, progress: Any = None) -> Any:
        raise self._cannot("run the model")



# A module's own state that is not its settings: compared apart (tensors, submodules) or
# left out (hooks that do not run in a forward).
_TREE = ("_parameters", "_buffers", "_modules")
_FORWARD_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def twins(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models compute the same thing on the same inputs: the same module tree
    of the same classes, no forward hooks, every parameter and buffer bit for bit the same
    (dtype, shape, strides, device), and every other attribute of every module equal —
    numbers, strings, dtypes, tensors, containers of them, dataclasses and configurations
    (``to_dict``), the same functions (and partials of them). Anything it cannot compare (another object, a bound method, a
    tensor subclass) makes them not twins."""
    mods_a, mods_b = list(a.named_modules(remove_duplicate=False)), list(b.named_modules(remove_duplicate=False))
    if [n for n, _ in mods_a] != [n for n, _ in mods_b]:
        return False
    for (_, x), (_, y) in zip(mods_a, mods_b):
        if type(x) is not type(y):
            return False
        own_x, own_y = vars(x), vars(y)
        if own_x.keys() != own_y.keys():
            return False
        for key, value in own_x.items():
            other = own_y[key]
            if key in _FORWARD_HOOKS:
                if value or other:
                    return False
            elif key == "_modules":
                continue  # walked above
            elif key.endswith("hooks") and key.startswith("_"):
                continue  # state-dict and backward hooks: not part of a forward
            elif not _same_value(value, other):
                return False
    return True


_PLAIN = (bool, int, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _same_value(x: Any, y: Any) -> bool:
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return _same_tensor(x, y)
    if isinstance(x, float):
        return x == y or (x != x and y != y)
    if isinstance(x, _PLAIN):
        return x == y
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same_value(u, v) for u, v in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(v, y[k]) for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return x == y and all(isinstance(v, _PLAIN) for v in x)
    if isinstance(x, functools.partial):  # deep copies make new ones of the same function
        return x.func is y.func and _same_value(x.args, y.args) and _same_value(x.keywords, y.keywords)
    if dataclasses.is_dataclass(x):
        return all(_same_value(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x))
    if callable(getattr(x, "to_dict", None)) and not isinstance(x, nn.Module):
        try:
            return _same_value(x.to_dict(), y.to_dict())
        except Exception:
            return False
    return False  # functions compare by identity (deep copies share them), above


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit the same plain dense tensor (dtype, shape, strides, device)."""
    from .experiments import same_bits  # experiments builds on sides

    if type(x) not in (torch.Tensor, nn.Parameter) or x.layout != torch.strided or x.is_quantized:
        return False
    return x.stride() == y.stride() and same_bits({"t": x.detach()}, {"t": y.detach()})


def cast_copy(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` on ``device`` with its floating parameters and buffers in
    ``dtype``, as ``copy.deepcopy(model).to(device).to(dtype)`` makes it, but with each
    tensor cast once on its way into the copy instead of copied, moved and cast (tied
    weights stay tied). Tensors of other kinds (subclasses, quantized) are copied and
    converted by ``.to`` as before."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo or type(t) not in (torch.Tensor, nn.Parameter) or not t.is_floating_point():
            continue
        cast = t.detach().to(device=device, dtype=dtype, copy=True)
        memo[id(t)] = nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cast
    # Positional .to calls: some models' .to takes no keywords (HookedTransformer).
    return copy.deepcopy(model, memo).to(device).to(dtype)


@contextlib.contextmanager
def compiled_code_limits(*models: nn.Module) -> Iterator[None]:
    """Compiled code that runs what blockdiff adds, room for the recompiles that causes, and
    no silent fallback to eager code.

    - By default dynamo does not guard on module hooks: a model compiled and run before
      blockdiff hooked it would keep running its old graph, without the hooks, and record
      nothing. Within a run, hooks are guarded; and when one of ``models`` holds compiled
      code, dynamo's caches are reset first (``torch.compiler.reset()``: other compiled
      functions of the process compile again on their next call).
    - Each experiment on a compiled module calls it with hooks or frozen modules of its
      own: a recompile per experiment. Past dynamo's recompile limit (8 per code object,
      shared by every block of a model) it would quietly run the eager code, and the
      experiment would judge code the candidate does not run. Within a run the limits are
      raised, and hitting one raises instead of falling back.
    """
    if not any(compile_context(module) is not None for model in models for module in model.modules()):
        yield  # no compiled code: nothing to guard (and dynamo is not imported)
        return
    from torch._dynamo import config

    torch.compiler.reset()
    # The names since torch 2.7, and before it.
    names = [("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")]
    limit, accumulated = (next(n for n in pair if hasattr(config, n)) for pair in names)
    settings = {limit: max(getattr(config, limit), 4096), accumulated: max(getattr(config, accumulated), 65536)}
    fail = next((n for n in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit") if hasattr(config, n)), None)
    if fail is not None:
        settings[fail] = True
    if hasattr(config, "skip_nnmodule_hook_guards"):
        settings["skip_nnmodule_hook_guards"] = False
    with config.patch(**settings):
        yield


def compile_context(module: nn.Module) -> Any:
    """The ``torch.compile`` context (backend and options) ``module`` runs under when it is
    compiled itself — an ``OptimizedModule``, or compiled in place with
    ``module.compile()`` — else ``None``."""
    if "torch._dynamo" not in sys.modules:
        return None  # nothing was ever compiled in this process
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    if isinstance(module, OptimizedModule):
        return module.dynamo_ctx
    compiled = module.__dict__.get("_compiled_call_impl")
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def _replace_all(output: Any, recorded: Any, device: torch.device) -> Any:
    """``recorded`` in place of ``output``, each floating tensor cast to the dtype of the
    tensor it replaces (a router's whole decision: logits, weights, indices)."""
    own = list(iter_tensors(output))
    position = iter(range(len(own) + 1))

    def cast(t: torch.Tensor) -> torch.Tensor:
        i = next(position)
        return replayed_copy(t, device, own[i].dtype if i < len(own) else None)

    return for_replay(map_structure(recorded, cast), device=device)


__all__ = ["Side", "LiveSide", "PrecisionSide", "ShardedSide", "PipelineSide", "DumpSide", "Hidden", "Frozen", "SiteKey", "describe"]
