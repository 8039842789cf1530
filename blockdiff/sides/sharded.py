"""Sharded sides: a live model split across the ranks of a launched run (``torchrun``).

:class:`ShardedSide`: every rank holds every block (tensor, sequence, context, expert
parallel), run in lockstep; records hold whole tensors, each experiment hands a module the
reference's activations in the layout it was recorded with and makes its output whole; the
first site whose replicas differ across ranks is blamed (:func:`replica_disagreement`).
:class:`PipelineSide`: ranks hold disjoint blocks (a stage each); sites are gathered to
every rank (:func:`every_rank_sites`), each rank judges the blocks it holds, and the
hand-overs between stages are checked. The collectives themselves are
:mod:`blockdiff.distributed`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Any, Callable

import torch
from torch import nn

from .. import distributed
from ..capture import Recording, record_once
from ..compare import Metrics, metrics
from ..errors import PairingError
from ..hookmap import Layout
from ..inputs import Inputs
from ..pairing import output_position
from ..report import BlockResult, Check, Note, SubpathResult
from ..site import Opaque, Site, map_opaque, map_structure, primary_tensor, replace_primary
from ..store import MemoryStore, SiteStore
from ..tolerance import Threshold
from ..vocab import INPUT_GRADIENT, OUTPUT_GRADIENT, PARAMETER_GRADIENT, REPLICAS, reported_subpath
from . import Frozen, Hidden, Judged, Judging, Side
from .gradients import GradientRunner, Gradients, ReplicaSplit
from .live import LiveSide


class ShardedSide(LiveSide):
    """A live model split across the ranks of a launched run (tensor or expert parallel,
    ``DTensor`` modules or hand-sharded ones), run in lockstep on every rank
    (:mod:`blockdiff.distributed`). Its records hold whole tensors; each module it runs
    for an experiment gets the reference's activations in the layout that module was
    recorded with, and its output is made whole again: a ``DTensor`` gathered, a
    collective's result awaited, a column-parallel module's local shard all-gathered."""

    not_streamed = "a sharded candidate yet: the layouts its modules expect are kept in memory only"

    def __init__(self, name: str, model: nn.Module, layout: Layout, *, label: str | None = None) -> None:
        super().__init__(name, model, layout, label=label, lockstep=True)
        self.meta["ranks"] = distributed.world()
        self._gradients = ShardedGradients(self)

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

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """``judge()``, and the first site whose replicas differ across ranks judged as a
        divergence there (every rank holds it whole and should compute the same bits:
        later collectives would mix the difference into every rank), with a note."""
        stages, blocks = judge()
        store = self.store
        assert store is not None, "a side is localized once recorded"
        sites = [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]
        found = replica_disagreement(sites, dtype=judging.dtype)
        if found is None:
            return stages, blocks
        site, ranks, measured = found
        message = distributed.replicas_message(ranks, measured.rel_l2)
        at = _reference_order(judging.ref, site)
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
        judging.notes.insert(
            0,
            Note("replicas-differ", f"{site.label}: {message}; every rank holds this tensor whole and should "
            "compute the same bits: blamed where the replicas first differ (later collectives mix the difference "
            "into every rank)"),
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

    # Its stages hand activations over point to point, outside autograd: its backward is
    # not the model's.
    backward_refused = "it is pipeline-parallel: its stages hand activations over outside autograd"

    def gradient_runs(self) -> None:
        return None

    def __init__(self, name: str, model: nn.Module, layout: Layout, layouts: list[Layout], *, label: str | None = None) -> None:
        super().__init__(name, model, layout, label=label, lockstep=True)
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

    @property
    def own_layout(self) -> Layout:
        return self.own

    def holds(self, block: int | None, module: str) -> bool:
        """Whether this rank judges block ``block``, or (``block`` None) the stage module
        ``module``."""
        return block in self._blocks if block is not None else module in self._stages

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: str | None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """Run the pipeline once (every rank its stage), recording this rank's sites, then
        put every rank's together into ``store`` (:func:`every_rank_sites`)."""
        own = MemoryStore(store.meta)
        recording = record_once(self.model, self.own, own, inputs, hold=None, progress=progress, lockstep=True)
        for site in every_rank_sites(own.sites()):
            store.add(site)
        self.store = store
        return recording


    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """Each rank judges the blocks and stages it holds, apart from the others (their
        experiments differ); then every rank gets what every rank judged — results, routing
        statistics, notes, non-finite values — and the hand-overs between stages are checked."""
        with distributed.apart():
            stages, blocks = judge()
        found = distributed.every_rank((stages, blocks, judging.moe, judging.notes, judging.nonfinite.found))
        stages = sorted((s for theirs in found for s in theirs[0]), key=lambda s: s.order)  # the reference's order
        blocks = sorted((b for theirs in found for b in theirs[1]), key=lambda b: b.index)
        judging.moe = sorted((m for theirs in found for m in theirs[2]), key=lambda m: m["block"])
        judging.notes = [note for theirs in found for note in theirs[3]]
        for theirs in found:
            judging.nonfinite.merge(theirs[4])
        self._handoff_checks(blocks, judging)
        return stages, blocks

    def _handoff_checks(self, blocks: list[BlockResult], judging: Judging) -> None:
        """Where one stage hands the residual stream to the next (block i on one rank, block
        i + 1 on another), what the next stage's first block received must be what the
        stage before produced: checked (in that block's ``residual``, before its sub-paths)
        wherever the reference hands its block output on unchanged."""
        owner = {index: rank for rank, held in enumerate(self.meta["stages"]) for index in held}
        by_index = {b.index: b for b in blocks}
        ref, dtype = judging.ref, judging.dtype
        for index in sorted(owner):
            after = index + 1
            if after not in owner or owner[after] == owner[index] or after not in by_index:
                continue
            r_out, r_in = _block_site(ref, index).primary_output(), _block_site(ref, after).hidden_input()
            c_prev, c_next = _block_site(self, index), _block_site(self, after)
            c_out, c_in = c_prev.primary_output(), c_next.hidden_input()
            if r_out is None or r_in is None or c_out is None or c_in is None:
                continue
            if r_out.shape != r_in.shape or not torch.equal(r_out, r_in):
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
                judging.tolerance.threshold("residual", dtype, None),
                order=at,
            )
            by_index[after].subpaths.setdefault("residual", SubpathResult("checked", order=at)).checks.insert(0, check)


class ShardedGradients(GradientRunner):
    """A sharded side's backward: its gradients whole on every rank, as its records are;
    each module's backward seeded with this rank's part of the output's gradient."""

    def record_gradients(
        self, inputs: Inputs, loss: Callable[[Any, Inputs], torch.Tensor], *, parameters: bool = True,
        recorded: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> Gradients:
        """The free-running backward on every rank (:meth:`GradientRunner.record_gradients`), its
        gradients whole — a local shard's gathered by the layout its site's tensor had —
        and the first gradient in backward order whose replicas differ across ranks
        (``replicas``): every rank holds each recorded gradient whole and should compute
        the same bits, as in the forward. ``recorded``: as for :meth:`GradientRunner.record_gradients`."""
        # Every parameter's gradient too, for the replicas: a parameter every rank holds
        # whole (a norm's weight) whose gradient is each rank's partial sum is a split.
        layout = self.side.layout
        found = super().record_gradients(inputs, loss, parameters=True, recorded=recorded)
        for key in sorted(found.outputs):  # the same order on every rank: collectives
            path = key[0]
            declared = layout.options(path).shard_output
            found.outputs[key] = distributed.made_whole(found.outputs[key], self.module(path), declared)
        for key in sorted(found.inputs):
            declared = layout.options(key[0]).shard_input
            if declared is not None:
                found.inputs[key] = distributed.declared_whole(found.inputs[key], declared)
        found.replicas = gradient_split(found, replicated=self._replicated_parameters())
        if not parameters:
            found.parameters = {}
        return found

    def _replicated_parameters(self) -> set[str]:
        """The parameters every rank holds the same bits of (a ``DTensor``'s whole value is
        one on every rank): replicas, whose gradients must agree too. A plain parameter
        that differs across ranks is each rank's own shard (hand-sharded weights, experts
        of their own), whose gradient differs as it does."""
        named = [(name, p) for name, p in self.module("").named_parameters() if p.is_floating_point()]
        mine = ["" if distributed.is_distributed(p) else _digest(p.detach()) for _, p in named]
        every = distributed.every_rank(mine)
        return {name for index, (name, _) in enumerate(named) if len({found[index] for found in every}) == 1}

    def _seed(self, path: str, call: Site, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The whole output gradient ``grad`` as this rank's part of the output ``out``: a
        ``DTensor`` of its mesh and placements (a partial output's gradient is every
        rank's whole), or a plain local shard's slice along the dimension its hook map
        declares or its parallelization shows."""
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(out, DTensor):
            placements = tuple(Replicate() if p.is_partial() else p for p in out.placements)
            return distributed.laid_out(super()._seed(path, call, out, grad), out.device_mesh, placements)
        declared = self.side.layout.options(path).shard_output
        dim = distributed.local_output_dim(self.module(path), out) if declared is None else declared
        if dim is None:
            dim = _split_dim(grad, out)
        if dim is not None and grad.dim() == out.dim():
            grad = grad.chunk(distributed.world(), dim=dim)[distributed.rank()]
        return super()._seed(path, call, out, grad)

    def _whole_gradients(
        self, call: Site, inputs: Hidden, params: dict[str, torch.Tensor]
    ) -> tuple[Hidden, dict[str, torch.Tensor]]:
        """Whole on every rank: an activation handed over in a sharded layout gets its
        gradient on each rank's part only (summed over ranks); a ``DTensor`` parameter's
        gradient is gathered."""
        own = call.hidden_inputs()
        inputs = {role: distributed.summed(g) if distributed.sharded_layout(own.get(role)) else g for role, g in inputs.items()}
        return inputs, {name: distributed.whole(g, "cpu") if distributed.is_distributed(g) else g.to("cpu") for name, g in params.items()}


def _split_dim(whole: torch.Tensor, local: torch.Tensor) -> int | None:
    """The one dimension along which ``local`` is a rank's share of ``whole`` (as wide as
    ``whole`` over the world size there, equal elsewhere: a module that returns its local
    heads, say); ``None`` when there is no such dimension, or more than one."""
    if whole.dim() != local.dim():
        return None
    world = distributed.world()
    found = [d for d, (w, n) in enumerate(zip(whole.shape, local.shape)) if w != n]
    return found[0] if len(found) == 1 and whole.shape[found[0]] == local.shape[found[0]] * world else None


def _block_site(side: Side, index: int) -> Site:
    """Block ``index``'s own site (its input and output) in ``side``'s record."""
    assert side.store is not None, "a side is localized once recorded"
    return next(s for s in side.store.block_sites(index) if s.subpath is None)


def _reference_order(reference: Side, site: Site) -> float:
    """Where the reference ran the site paired with ``site`` (checks are placed in the
    reference's order); ``site``'s own order when the reference has none."""
    store = reference.store
    assert store is not None, "a side is localized once recorded"
    sites = store.outside_sites() if site.block is None else store.block_sites(site.block)
    return next((s.order for s in sites if s.key == site.key), site.order)


def merged_layout(layouts: list[Layout]) -> Layout:
    """The layout of a model whose blocks and stages are spread over several layouts (one
    per pipeline stage): every block once, by index; every stage once."""
    first = layouts[0]
    blocks = {block.index: block for layout in layouts for block in layout.blocks}
    outside = list(dict.fromkeys(entry for layout in layouts for entry in layout.outside))
    modules = {path: options for layout in layouts for path, options in layout.modules.items()}
    return Layout(hook_map=first.hook_map, outside=outside, blocks=[blocks[i] for i in sorted(blocks)], modules=modules)


def every_rank_sites(sites: list[Any]) -> list[Any]:
    """The sites every rank recorded (a pipeline: each rank ran some modules), on every
    rank: in rank order, which is the order stages run; numbered again in that order; a
    site two ranks recorded (a context module every stage runs) kept once, from the first.
    This rank keeps its own sites as they are; another rank's arrive without the objects
    its calls held by reference (:class:`~blockdiff.site.Opaque` values), which only that
    rank could replay."""
    def portable(obj: Any) -> Any:  # the markers without the objects they hold
        return map_opaque(obj, lambda marker: Opaque(marker.type_name, None, cache=marker.cache))

    sent = [dataclasses.replace(s, args=portable(s.args), kwargs=portable(s.kwargs), output=portable(s.output)) for s in sites]
    me = distributed.rank()
    found: list[Any] = []
    seen: set[tuple] = set()
    for source, theirs in enumerate(distributed.every_rank(sent)):
        for site in sites if source == me else theirs:
            key = (site.stage, site.block, site.subpath, site.module, site.call)
            if key in seen:
                continue
            seen.add(key)
            found.append(dataclasses.replace(site, order=len(found)))
    return found


def _digest(t: torch.Tensor | None) -> str:
    if t is None:
        return ""
    data = t.detach().contiguous().cpu()
    # The tensor's own bytes, read in place (no copy of the activation).
    return hashlib.blake2b(data.view(torch.uint8).numpy().data if data.numel() else b"", digest_size=16).hexdigest()


def replica_disagreement(sites: list[Any], *, dtype: torch.dtype | None = None) -> tuple[Any, list[int], Metrics] | None:
    """The first of ``sites`` (in the order they ran) whose output is not the same bits on
    every rank: (site, the ranks that differ from rank 0, the worst of their metrics
    against rank 0's). ``None`` when every replica agrees. Collective: every rank passes
    the same sites (its own record of them)."""
    ordered = sorted(sites, key=output_position)
    found = _first_split([s.primary_output() for s in ordered], dtype=dtype)
    return None if found is None else (ordered[found[0]], found[1], found[2])


def gradient_split(
    found: Gradients, *, replicated: set[str] | None = None, dtype: torch.dtype | None = None
) -> ReplicaSplit | None:
    """The first gradient of a free-running backward that is not the same bits on every
    rank, in backward order: the sites last started first; at each, its output's gradient,
    then (at its last call) the gradients of the parameters it is the innermost site of
    (of those in ``replicated``, when given), then its input's. Collective: every rank
    passes its own record of the same run."""
    paths = list(dict.fromkeys(path for path, _ in found.order))
    owned: dict[str, list[str]] = {}
    for name in found.parameters:
        if replicated is not None and name not in replicated:
            continue
        owner = max((p for p in paths if name.startswith(p + ".") or not p), key=len, default=None)
        if owner is not None:
            owned.setdefault(owner, []).append(name)
    order: list[tuple[tuple[str, int], str, torch.Tensor | None]] = []
    for key in reversed(found.order):
        order.append((key, OUTPUT_GRADIENT, found.outputs.get(key)))
        for name in owned.pop(key[0], []):  # the first met in backward order: its last call
            relative = name[len(key[0]) + 1:] if key[0] else name
            order.append((key, PARAMETER_GRADIENT.format(relative), found.parameters[name]))
        order.append((key, INPUT_GRADIENT, found.inputs.get(key)))
    split = _first_split([t for _, _, t in order], dtype=dtype)
    if split is None:
        return None
    index, ranks, measured = split
    return ReplicaSplit(order[index][0], order[index][1], ranks, measured)


def _first_split(tensors: list[torch.Tensor | None], *, dtype: torch.dtype | None) -> tuple[int, list[int], Metrics] | None:
    """The index of the first of ``tensors`` whose bits differ across ranks, the ranks that
    differ from rank 0, and the worst of their metrics against rank 0's; ``None`` when
    every rank holds the same bits in each. One collective for the digests, one for the
    tensor that differs."""
    import torch.distributed as dist

    every = distributed.every_rank([_digest(t) for t in tensors])
    for index, t in enumerate(tensors):
        digests = [found[index] for found in every]
        # A tensor some rank lacks (no gradient reached it there) has no bits to compare:
        # every rank sees the same digests, so every rank skips it alike (no rank waits in
        # a gather the others never enter).
        if len(set(digests)) == 1 or "" in digests:
            continue
        assert t is not None  # its digest is not "" on any rank: this rank holds it
        ranks = [r for r, d in enumerate(digests) if d != digests[0]]
        parts = [torch.empty_like(t) for _ in every]
        dist.all_gather(parts, t.contiguous(), group=distributed.group_for(t))
        return index, ranks, max((metrics(parts[0], parts[r], dtype=dtype) for r in ranks), key=lambda m: m.rel_l2)
    return None


__all__ = ["ShardedSide", "PipelineSide", "every_rank_sites", "gradient_split", "merged_layout", "replica_disagreement"]
