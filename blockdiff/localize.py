"""Localize: the order of the experiments of one diff, and nothing else.

One walk (:class:`Localizer`) over the sites of two recorded sides (docs/design.md, "The
localization procedure"; sides in :mod:`blockdiff.sides`): the stages outside blocks, then
block by block. What is judged at each pair of sites is a *direction*'s: the outputs'
(:class:`Outputs`, the forward — and each decode step, whose cache checks it schedules as
:data:`States`) or the gradients' (:class:`blockdiff.backward.Gradients`). Per block the
outputs' judge, in execution order, the block-level experiment, each sub-path module (an
MoE ffn as router and experts, :func:`~blockdiff.moe.moe_checks`), the block's state, the
residual, the MoE routing statistics, and drift (judged too: drift no local check explains
is a divergence, see :meth:`~blockdiff.report.Report.unexplained_drift`).
Pairing is :mod:`blockdiff.pairing`'s, the experiments :mod:`blockdiff.experiments`'.

With a candidate that cannot run (a dump), every site is judged on its drift alone: the
first divergence is where the error first *shows*, which may be downstream of where it
starts; replay against a live candidate tells them apart.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch

from .experiments import Experiments, StoredFloors
from .moe import moe_checks, moe_statistics, routing_shapes_differ
from .pairing import BlockPair, check_block_counts, check_paired, in_order, output_position, pair_block, pair_outside
from .report import BlockResult, Check, Note, StageResult, SubpathResult
from .sides import Side
from .compare import Metrics, metrics
from .site import NotReplayable, Site, SiteKey, describe_key
from .dump.memory import release_freed_memory
from .store import MemoryStore
from .tolerance import Tolerance
from .vocab import EXPERTS, NOT_JUDGED, OFFLINE_DRIFT, reported_subpath

T = TypeVar("T")


class Direction(Protocol):
    """What one direction judges at each pair of sites the localizer walks to: a site's
    output (:class:`Outputs`, the forward) or its gradient (the backward's
    :class:`~blockdiff.backward.Gradients`). ``stage`` gets every pair outside the blocks
    too (a check may read the next stage's input); ``dtype`` is what comparisons are judged in."""

    @property
    def dtype(self) -> torch.dtype: ...

    def stage(self, r: Site, c: Site, pairs: list[tuple[Site, Site]]) -> StageResult: ...

    def block(self, pair: BlockPair) -> BlockResult: ...


# A mode's checks of what a block keeps from call to call (decode: its cache), run by
# the localizer right after the block's sub-path checks, with its experiments: checks by
# sub-path, put first in that sub-path's results (a wrong cache write is what the
# module's output then shows).
States = Callable[[Experiments, BlockPair], dict[str, list[Check]]]


class Localizer:
    """The one walk of a diff: the stages outside the blocks, then block by block, each pair
    of sites paired once (:mod:`blockdiff.pairing`), only what this process judges
    (``Side.holds``), a streamed block's memory handed back once judged; what is judged at
    each pair is the direction's (:class:`Outputs` unless one is given). Build it, then
    iterate :meth:`stages` / :meth:`blocks`.

    Args:
        reference, candidate: the two sides, recorded. A candidate that is not live (a
            dump) gets drift-only checks; a live reference gives calibrated floors.
        tolerance: the judging policy, already resolved (see :meth:`Tolerance.resolved`).
        direction: what each pair is judged by, built from this localizer
            (``direction(localizer)``); the outputs' (:class:`Outputs`) when not given,
            with ``checks`` (its keywords).
    """

    def __init__(
        self,
        reference: Side,
        candidate: Side,
        tolerance: Tolerance,
        *,
        direction: Callable[[Localizer], Direction] | None = None,
        **checks: Any,
    ) -> None:
        self.ref = reference
        self.cand = candidate
        self.tolerance = tolerance
        self.moe: list[dict[str, Any]] = []  # routing statistics, one entry per MoE block
        self.nonfinite = NonfiniteScan()
        self.notes: list[str] = []  # what could not be judged, and why
        self.direction: Direction = direction(self) if direction is not None else Outputs(self, **checks)

    @property
    def experiments(self) -> Experiments:
        """The forward's experiments (the outputs' direction)."""
        assert isinstance(self.direction, Outputs), "only the outputs' direction runs the forward's experiments"
        return self.direction.experiments

    @property
    def dtype(self) -> torch.dtype:
        """The dtype comparisons are judged in (what a side completing the localization
        compares in: :class:`~blockdiff.sides.Judging`)."""
        return self.direction.dtype

    def _here(self, block: int | None, module: str = "") -> bool:
        """Whether this process judges the block or stage (``Side.holds``)."""
        return self.cand.holds(block, module)

    def stages(self) -> Iterator[StageResult]:
        """The results of the sites outside blocks (embed, context, final norm, head)."""
        pairs = pair_outside(self.ref.store, self.cand.store, self.ref.layout, self.cand.layout, self.notes)
        for r, c in pairs:
            if self._here(None, c.module):
                yield self.direction.stage(r, c, pairs)

    def blocks(self) -> Iterator[BlockResult]:
        """One :class:`BlockResult` per block, in order; reads one block's sites at a time."""
        ref_blocks = self.ref.store.block_indices()
        check_block_counts(len(ref_blocks), len(self.cand.store.block_indices()))
        streamed = not (isinstance(self.ref.store, MemoryStore) and isinstance(self.cand.store, MemoryStore))
        for index in ref_blocks:
            if not self._here(index):
                continue
            yield self.block(index)
            if streamed:
                release_freed_memory()

    def block(self, index: int) -> BlockResult:
        return self.direction.block(pair_block(self.ref.store, self.cand.store, index, self.ref.layout, self.cand.layout))


class Outputs:
    """The forward's direction: each stage's and block's outputs judged — per block, in
    execution order, the block-level experiment, each sub-path module (an MoE ffn as router
    and experts, :func:`~blockdiff.moe.moe_checks`), what the block keeps from call to call
    (``states``: a decode step's cache), the residual, the MoE routing statistics, and
    drift. The experiments are :mod:`blockdiff.experiments`'.

    Args:
        fast_path: skip a block's sub-path experiments when the block-level local error is
            within tolerance (they are reported as ``not_needed``).
        capacity_factors: the counterfactual capacity factors of dropless MoE statistics.
        stored: floors a dump stored for the candidate's precision (a replay).
        precision: the (dtype, device) floors are measured at, when not the candidate's.
        drill_all: drill down into every module check, not only divergent ones (ranking).
        states: a mode's checks of what a block keeps from call to call (:data:`States`).
    """

    def __init__(
        self,
        localizer: Localizer,
        *,
        fast_path: bool = False,
        capacity_factors: tuple[float, ...] = (1.0, 1.25),
        stored: StoredFloors | None = None,
        precision: tuple[torch.dtype, torch.device] | None = None,
        drill_all: bool = False,
        states: States | None = None,
    ) -> None:
        self.localizer = localizer
        self.ref, self.cand = localizer.ref, localizer.cand
        self.experiments = Experiments(self.ref, self.cand, localizer.tolerance, stored=stored, precision=precision)
        self.drill_all = drill_all
        self.fast_path = fast_path
        self.capacity_factors = tuple(capacity_factors)
        self.states = states

    @property
    def dtype(self) -> torch.dtype:
        return self.experiments.dtype

    def _judged(self, where: str, experiment: Callable[[], T]) -> T | None:
        """``experiment()``, or ``None`` (and a note) when a call it replays holds an
        argument that cannot be replayed faithfully: such a check is not judged, never
        blamed on a wrong argument."""
        try:
            return experiment()
        except NotReplayable as exc:
            self.localizer.notes.append(Note("not-judged", f"{where}: not judged: {exc} ({exc.advice})"))
            return None

    def stage(self, r: Site, c: Site, pairs: list[tuple[Site, Site]]) -> StageResult:
        """A stage's local error and drift."""
        self.localizer.nonfinite.see(r, c)
        drift = self.experiments.drift(r, c)
        if self.cand.live:
            check = self._judged(r.stage, lambda: self.experiments.module_check(r.stage, r, c))
            judged = self.experiments.drift_check(r, c, drift)
        else:  # the drift check is the stage's only check
            check, judged = self.experiments.drift_check(r, c, drift, target=r.stage, what=OFFLINE_DRIFT), None
        result = StageResult(r.stage, c.module, check, drift, order=r.order, drift_check=judged)
        if self.cand.live and check is not None and check.diverged:
            result.boundary_move = self._boundary_move(r, check, pairs)
        return result

    def _boundary_move(self, r: Site, check: Check, pairs: list[tuple[Site, Site]]) -> dict[str, Any] | None:
        """Whether a stage's diverging output is code moved across its module boundary: the
        tensor reaching the next stage agrees on both sides (a Gemma embedding scale applied
        inside the embedding on one side, after it on the other). Judged with the stage's
        own threshold; only where the next stage's input is recorded (embed → the first
        block, final norm → the head)."""
        if r.stage == "embed" and self.ref.store.block_indices():
            first = self.ref.store.block_indices()[0]
            key = SiteKey.of_block(first)
            ref_next = next((s for s in self.ref.store.block_sites(first) if s.key == key), None)
            cand_next = next((s for s in self.cand.store.block_sites(first) if s.key == key), None)
            reaches = f"block {first} input"
        elif r.stage == "final_norm":
            heads = [(a, b) for a, b in pairs if a.stage == "head"]
            ref_next, cand_next = heads[0] if heads else (None, None)
            reaches = "head input"
        else:
            return None
        if ref_next is None or cand_next is None:
            return None
        expected, got = ref_next.hidden_input(), cand_next.hidden_input()
        if expected is None or got is None or expected.shape != got.shape:
            return None
        agreement = metrics(expected, got, dtype=self.experiments.dtype)
        if agreement.nonfinite_cand or not agreement.rel_l2 <= check.threshold.value:
            return None
        self.localizer.notes.append(
            Note("boundary-move", f"{r.stage} ({r.module}): the output differs (rel_l2 {check.measured:.3g}) but what reaches the "
            f"{reaches} agrees (rel_l2 {agreement.rel_l2:.3g}): code moved across the module boundary "
            "(the same computation done inside the module on one side and after it on the other); not blamed")
        )
        return {"reaches": reaches, "rel_l2": agreement.rel_l2}

    def block(self, pair: BlockPair) -> BlockResult:
        """One block's results: its checks in execution order (the class's docstring)."""
        index = pair.index
        for r, c in [(pair.ref_block, pair.cand_block), *pair.sites(), *self._routers(pair)]:
            self.localizer.nonfinite.see(r, c)
        if not self.cand.live:
            return self._drift_only(pair)
        exp = self.experiments
        if pair.moe:
            pair.routing_differs = routing_shapes_differ(exp, pair)
        block_check = None
        where = f"block {index}"
        if pair.cand_layout is not None:
            found = self._judged(f"{where} (whole block)", lambda: exp.block_checks(pair, frozen=False))
            block_check = found[0] if found else None
        # The whole-block experiment runs with routing frozen, so it cannot clear a router:
        # MoE blocks always get their sub-path experiments.
        skip = self.fast_path and not pair.moe and block_check is not None and not block_check.diverged
        status = "not_needed" if skip else "checked"
        subpaths: dict[str, SubpathResult] = {}
        for r, c in pair.sites():
            result = subpaths.setdefault(r.subpath, SubpathResult(status, order=r.order))
            if skip:
                continue
            if pair.router_of(r) is not None:
                checks = self._judged(f"{where} {r.subpath} ({c.module})", lambda: moe_checks(exp, pair, r, c))
            else:
                found = self._judged(f"{where} {r.subpath} ({c.module})", lambda: exp.module_check(r.subpath, r, c))
                if found is not None and (found.diverged or self.drill_all) and self.ref.live and self.cand.drills:
                    self._judged(  # sets found.children and what was not checked
                        f"{where} {r.subpath} ({c.module}) children", lambda: exp.children_checks(r.subpath, r, c, found)
                    )
                checks = None if found is None else [found]
            if checks is None:
                result.status = NOT_JUDGED
            else:
                result.checks.extend(checks)
        if self.states is not None:
            for name, found_states in self.states(self.experiments, pair).items():
                result = subpaths.setdefault(name, SubpathResult("checked", order=pair.last_order()))
                order = min((c.order for c in result.checks if c.order is not None), default=result.order)
                for check in found_states:
                    check.order = order
                result.checks[:0] = found_states
                result.status = "checked"
        residual = SubpathResult(status, order=pair.last_order() + 0.5)
        if not skip and pair.cand_layout is not None and pair.ref_layout is not None:
            checks = self._judged(f"{where} residual", lambda: exp.block_checks(pair, frozen=True))
            if checks is None:
                residual.status = NOT_JUDGED
            else:
                residual.checks = checks
        if pair.moe and not pair.routing_differs:
            self.localizer.moe.append(moe_statistics(exp, pair, subpaths.get("ffn"), self.capacity_factors))
        subpaths["residual"] = residual
        layout = pair.cand_layout
        budget = None if skip else self.budget(pair, subpaths)
        drift = exp.drift(pair.ref_block, pair.cand_block)
        return BlockResult(
            index=index,
            module=pair.cand_block.module,
            stack=layout.stack if layout else "",
            subpaths=subpaths,
            block=block_check,
            drift=drift,
            order=pair.ref_block.order,
            unmapped=list(layout.unmapped) if layout else [],
            drift_check=exp.drift_check(pair.ref_block, pair.cand_block, drift),
            budget=budget,
        )

    def budget(self, pair: BlockPair, subpaths: dict[str, SubpathResult]) -> dict[str, dict[str, float]] | None:
        """Where the block output's error comes from, to first order.

        Each sub-path adds the absolute error of its local check, ‖c − r‖ = local × ‖its
        reference output‖ (the residual: its block-output check); the error carried in is
        the block input's, ‖c − r‖ of the free-running inputs, which the residual stream
        passes on. Errors that small add up to first order, so each source's share of
        their sum says which hurts the next block most. Exact when one source differs and the
        block is linear in it (tests/test_ranking.py); an upper-bound split otherwise.
        """
        r_block, c_block = pair.ref_block, pair.cand_block
        x_ref, x_cand = r_block.hidden_input(), c_block.hidden_input()
        if x_ref is None or x_cand is None or x_ref.shape != x_cand.shape:
            return None
        def added(found: Metrics | None) -> float:
            return 0.0 if found is None else found.error_l2

        errors = {"incoming": added(metrics(x_ref, x_cand, dtype=self.experiments.dtype))}
        for r, _ in pair.sites():
            result = subpaths.get(r.subpath)
            if result is None:
                continue
            by_key = {c.key: c for c in result.checks}
            # A module's own check; an MoE ffn's, its experts' (routing frozen at the reference's).
            check = by_key.get(f"module:{describe_key(r.key)}") or next((c for c in result.checks if c.what == EXPERTS), None)
            errors[r.subpath] = errors.get(r.subpath, 0.0) + added(check and check.metrics)
        residual = subpaths.get("residual")
        block_output = next((c for c in residual.checks if c.what == "block output"), None) if residual else None
        errors["residual"] = added(block_output and block_output.metrics)
        whole = sum(errors.values())
        return {name: {"error": value, "share": value / whole if whole > 0 else 0.0} for name, value in errors.items()}

    @staticmethod
    def _routers(pair: BlockPair) -> list[tuple[Site, Site]]:
        return [(r, pair.cand_routers[k]) for k, r in pair.ref_routers.items() if k in pair.cand_routers]

    def _drift_only(self, pair: BlockPair) -> BlockResult:
        """Every site of the block judged on its drift (a router's under ``ffn``)."""
        exp = self.experiments
        check_paired(pair.ref_routers, pair.cand_routers)
        cand = {**pair.cand, **pair.cand_routers}
        subpaths: dict[str, SubpathResult] = {}
        for key, r in in_order({**pair.ref, **pair.ref_routers}):
            name = reported_subpath(r.subpath)
            result = subpaths.setdefault(name, SubpathResult("drift_only", order=r.order))
            found = exp.drift_check(r, cand[key], exp.drift(r, cand[key]), target=name, what=OFFLINE_DRIFT)
            if found is not None:
                result.checks.append(found)
        r_block, c_block = pair.ref_block, pair.cand_block
        drift = exp.drift(r_block, c_block)
        return BlockResult(
            pair.index,
            c_block.module,
            "",
            subpaths,
            exp.drift_check(r_block, c_block, drift, target="block", what=OFFLINE_DRIFT),
            drift,
            order=r_block.order,
        )




# Dtypes with float32's range or more: summed in their own dtype (see _nonfinite).
_OWN_RANGE_SUMS = (torch.bfloat16, torch.float32, torch.float64)


def _nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf ``t`` holds; one sum when there are none. Any finite sum proves
    every element finite (a NaN or Inf makes every sum it enters non-finite), so the sum
    runs in the tensor's own dtype where that has float32's range (bfloat16: summed with
    ``dtype=float32``, a converted copy of the whole tensor was made first, 15 ms on
    bfloat16 logits), else in float32 (float16, 8-bit floats); a sum that overflows only
    costs the count that follows."""
    if not t.is_floating_point():
        return 0
    if bool(torch.isfinite(t.sum(dtype=None if t.dtype in _OWN_RANGE_SUMS else torch.float32))):
        return 0
    return int((~torch.isfinite(t)).sum())


class NonfiniteScan:
    """Where NaN/Inf first appear, found while localization reads each pair of sites (no
    second pass over the activations).

    ``result()["candidate"]``: the first site, in the order outputs are produced, whose
    free-running candidate output holds non-finite values that the reference's does not;
    ``result()["reference"]``: the first whose reference output already holds some (the
    inputs or the trusted model are broken; comparisons there use the finite elements).
    """

    def __init__(self) -> None:
        self._found: dict[str, tuple[tuple, dict[str, Any]]] = {}

    def see(self, r: Site, c: Site) -> None:
        ro, co = r.primary_output(), c.primary_output()
        if ro is None or co is None:
            return
        bad_r, bad_c = _nonfinite(ro), _nonfinite(co)
        if not bad_r and bad_c == bad_r:
            return
        where = {"site": describe_key(c.key), "module": c.module, "nonfinite_cand": bad_c, "nonfinite_ref": bad_r}
        position = output_position(r)
        if bad_r:
            self._keep("reference", position, {**where, "module": r.module})
        if bad_c != bad_r:
            self._keep("candidate", position, where)

    def _keep(self, role: str, position: tuple, where: dict[str, Any]) -> None:
        if role not in self._found or position < self._found[role][0]:
            self._found[role] = (position, where)

    def result(self) -> dict[str, dict[str, Any]]:
        return {role: where for role, (_, where) in self._found.items()}

    @property
    def found(self) -> dict[str, tuple[tuple, dict[str, Any]]]:
        """Each role's first site and its position: what :meth:`merge` takes (the scan of
        another pipeline stage)."""
        return dict(self._found)

    def merge(self, found: dict[str, tuple[tuple, dict[str, Any]]]) -> None:
        for role, (position, where) in found.items():
            self._keep(role, position, where)


__all__ = ["Direction", "Localizer", "NonfiniteScan", "Outputs", "States"]
