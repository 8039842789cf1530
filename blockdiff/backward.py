"""Backward: localize the first divergent gradient, by the same freeze-three/swap-one rule.

After the forward diff (``--backward``), both sides run forward and backward once on the
same inputs and the same loss (next-token cross-entropy on the input ids unless a
``--loss`` is given), in eval mode (dropout off), every floating parameter requiring grad
(:meth:`~blockdiff.sides.gradients.GradientRunner.record_gradients`). Each site's output gradient,
its input gradient (the share that flows back through that call alone) and every
parameter's gradient are recorded. Then, per site, in backward execution order (head to
embedding; a block's modules last to first, then its residual):

- **module** (attention, ffn, each norm, and the stages): the candidate's module run on the
  reference's input and backward from the **reference's** output gradient; its input
  gradient and each of its parameter gradients against the reference's, paired as the
  forward pairs weights and children (:mod:`~blockdiff.backward_pairing`: a port's ``wqkv``
  as ``q_proj+k_proj+v_proj``), what pairs with nothing named; a module that passes no
  gradient at all gets zeros, judged;
- **residual**: the candidate's block on the reference's input with every sub-path module
  replaced by the reference's own module (forward and backward), backward from the
  reference's block-output gradient; the block's input gradient against the reference's;
- **block**: the candidate's block alone on the same (an ``unattributed`` divergence when no
  sub-path explains it: recomputation that differs, a module the hook map misses);
- **MoE parts**: an MoE ffn's router alone, and its experts with the reference's router in
  place (forward and backward), judged apart;
- **gradient drift**: the free-running candidate's input gradient against the reference's.

Noise floors are the same experiments on the reference's own code at the candidate's
precision (``side.in_precision``); drift floors its own free-running backward. The verdict
is a report of its own (``Report.backward``) whose first divergence is the first in
backward order. What the forward blames is not blamed again: the backward checks of a
sub-path the forward blames say so (``explained_by``), and gradient drift, which a wrong
forward causes everywhere, is not judged after a forward divergence. docs/backward.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from . import distributed
from .backward_pairing import GradientPairing, answered_by, frozen_routing, held, probed, side_by_side, summed
from .capture import Hold, Recording
from .children import ChildPair
from .compare import Metrics, metrics, rel_l2
from .errors import InputError, run_model_code
from .experiments import aligned, same_call
from .inputs import Inputs
from .loss import Loss, resolve_loss
from .localize import Localizer
from .pairing import BlockPair
from .report import BlockResult, Check, Note, Report, StageResult, SubpathResult
from .sides import GradientRuns, Replaced, Side
from .sides.gradients import Gradients, ReplicaSplit
from .sides.precision import twins
from .site import Site, describe_key, with_hidden
from .tolerance import Threshold, Tolerance, working_dtype
from .vocab import DRIFT, INPUT_GRADIENT, PARAMETER_GRADIENT, REPLICAS, SUBPATHS, UNATTRIBUTED, reported_subpath

GRADIENT_DRIFT = "gradient drift"
EXPERTS_GRADIENT = "experts (routing frozen at the reference's): input gradient"


def gradient_runs(side: Side) -> GradientRuns:
    """``side``'s backward (``Side.gradient_runs``).

    Raises:
        InputError: the one refusal of a side that cannot run a backward (a dump, an ONNX
            graph, a pipeline: ``Side.backward_refused``), naming why.
    """
    found = side.gradient_runs() if side.backward_refused is None else None
    if found is None:
        raise InputError(
            f"the {side.name} cannot run a backward: {side.backward_refused or 'it runs no gradients'} "
            "(--backward needs live PyTorch models on both sides, in one process or tensor-parallel)"
        )
    return found


def refuse_backward(*sides: Side) -> None:
    """Raises :class:`InputError` for a side that cannot run a backward
    (:func:`gradient_runs`), before anything runs."""
    for side in sides:
        gradient_runs(side)


class Recorder:
    """The forward records of a backward diff, each with its side's free-running backward:
    a live model run eagerly in one process is recorded by its gradient runner's
    ``record_with_gradients``, one run for the forward diff's record and the backward's
    gradients (the reference with its parameters' gradients, the candidate and the floor
    side without), kept in :attr:`gradients` by side; the candidate's and the floor side's
    module experiments in the forward diff keep their graphs for the backward's
    (:class:`~blockdiff.sides.gradients.Graphs`).
    Any other side records as it would (its gradients are recorded apart by :func:`judge`).
    The loss is resolved before anything runs.

    >>> recorder = Recorder(ref, None)                                  # doctest: +SKIP
    >>> recorder.record(ref, ids, MemoryStore(), hold="kept", progress=None)  # doctest: +SKIP
    """

    def __init__(self, ref: Side, loss: str | Loss | None) -> None:
        self.ref = ref
        self.loss, self.named = resolve_loss(loss)
        self.gradients: dict[int, Gradients] = {}
        self.kept: list[GradientRuns] = []  # the sides whose module experiments keep their graphs

    def record(self, side: Side, inputs: Inputs, store: Any, *, hold: Hold | None, progress: Any) -> Recording:
        runs = gradient_runs(side)
        recording, found = runs.record_with_gradients(
            inputs, store, self.loss, hold=hold, progress=progress, parameters=side is self.ref
        )
        if found is None:  # recorded alone (a compiled model, a side split across ranks)
            return recording
        self.gradients[id(side)] = found
        if side is not self.ref:  # the candidate and the floor side: their experiments' graphs kept
            runs.keep_graphs()
            self.kept.append(runs)
        return recording


def judge(
    ref: Side, cand: Side, inputs: Inputs, forward: Report, *, tolerance: Tolerance | None, loss: str | Loss | None,
    recorded: Recorder | None = None,
) -> Report:
    """The backward of two live sides localized: ``forward`` (their forward report) with its
    :attr:`~blockdiff.report.Report.backward` set and a note on what ran.

    Raises:
        InputError: a side that cannot run its backward (a dump, an ONNX graph).
    """
    refuse_backward(ref, cand)
    run, named = (recorded.loss, recorded.named) if recorded is not None else resolve_loss(loss)
    resolved = (tolerance or Tolerance()).resolved(same_dtype=ref.dtype == cand.dtype, same_device=ref.device == cand.device)
    kept = [] if recorded is None else recorded.kept
    for runs in kept:  # the forward diff is over: a module run from here is the backward's own
        runs.close_graphs()
    try:
        experiments = GradientChecks(ref, cand, inputs, resolved, run, recorded={} if recorded is None else recorded.gradients)
        back = experiments.report(forward, named)
    finally:
        for runs in kept:  # what the backward did not take
            runs.drop_graphs()
    forward.backward = back
    forward.notes.append(back.notes[0])
    return forward


class GradientChecks:
    """The backward experiments of one diff, and how they are judged: the gradients'
    direction of the one walk (:class:`~blockdiff.localize.Localizer`; its ``stage`` and
    ``block`` are :class:`~blockdiff.localize.Direction`'s), the localizer built by
    :meth:`report`.

    Args:
        ref, cand: the two sides, recorded (their forward stores hold the calls replayed).
        inputs, loss: what both sides run forward and backward on.
        tolerance: the resolved policy; a calibrated one measures every floor on the
            reference's own code at the candidate's precision.
    """

    def __init__(
        self, ref: Side, cand: Side, inputs: Inputs, tolerance: Tolerance, loss: Loss, *, recorded: dict[int, Gradients] | None = None
    ) -> None:
        self.ref, self.cand, self.tolerance = ref, cand, tolerance
        self.dtype = working_dtype(ref.dtype, cand.dtype)
        self.judged = True  # whether gradient drift is judged (not after a forward divergence: report)
        self.notes: list[str] = []
        floor = ref.in_precision(self.dtype, cand.device) if tolerance.calibrated else None
        recorded = recorded or {}  # the free-running backwards run with the forward's records (Recorder)
        self.ref_runs, self.cand_runs = gradient_runs(ref), gradient_runs(cand)
        self.pairing = GradientPairing(ref, cand, self.ref_runs, self.cand_runs)

        def gradients(side: Side, name: str, *, parameters: bool) -> Gradients:
            if id(side) in recorded:
                return recorded[id(side)]
            return run_model_code(name, gradient_runs(side).record_gradients, inputs, loss, parameters=parameters)

        self.ref_g = gradients(ref, "reference", parameters=True)
        self.cand_g = gradients(cand, "candidate", parameters=False)
        # The floor side: the reference's code at the candidate's precision. When the
        # candidate is that very code (the reference's own cast: same classes, settings and
        # weights), its free run is the floor's (the same inputs, the same computation).
        self.floor = floor
        self.twin = floor is not None and floor.runs_as(cand)
        self.floor_g = None
        if floor is not None:
            self.floor_g = self.cand_g if self.twin else gradients(floor, "reference", parameters=False)
        self._twins: dict[tuple[str, str], bool] = {}
        # A block's residual floor found by its whole-block floor run (residual_probe).
        self._residual_floors: dict[tuple[str, int], Any] = {}
        self._exclusive = self._exclusive_parameters()

    def _exclusive_parameters(self) -> dict[int, str]:
        """The reference's parameters that one site's one call alone uses (id → name): their
        whole gradient is that call's. Another (a tied embedding and head, a module called
        twice) gets its expected gradient from the reference's own module's backward."""
        model = self.ref_runs.module("")
        names = {id(p): name for name, p in model.named_parameters()}
        owners: dict[int, list[str]] = {}
        layout = self.ref.layout
        paths = [path for _, path in layout.outside] + [p for b in layout.blocks for ps in b.subpaths.values() for p in ps]
        for path in dict.fromkeys(paths):
            for p in model.get_submodule(path).parameters():
                owners.setdefault(id(p), []).append(path)
        calls = self.ref_g.calls
        return {
            pid: names[pid] for pid, found in owners.items()
            if len(found) == 1 and calls.get(found[0], 0) <= 1 and pid in names
        }

    # -- judging -------------------------------------------------------------------------

    def check(
        self, target: str, what: str, module: str, expected: torch.Tensor, got: torch.Tensor, floor: torch.Tensor | None
    ) -> Check:
        """``got`` against ``expected``, judged with the floor ``floor`` holds (the same
        gradient from the reference's code at the candidate's precision; ``got`` itself when
        the candidate is that code)."""
        got = aligned(module, what, expected, got)
        measured = metrics(expected, got, dtype=self.dtype)
        value = None
        if floor is not None:
            value = measured.rel_l2 if floor is got else rel_l2(expected, aligned(module, what, expected, floor))
        return Check(what, module, measured, self.tolerance.threshold(target, self.dtype, value))

    def _floor_run(self, r: Site, c: Site, got: Any, measure: Callable[[Side], Any]) -> Any:
        """What the floor side gives for the experiment on the reference's call ``r`` whose
        candidate run on ``c`` gave ``got``: ``measure(floor side)``, or ``got`` itself when
        that run is the floor's (:meth:`same_experiment`); ``None`` without floors."""
        if self.floor is None:
            return None
        return got if self.same_experiment(r, c) else measure(self.floor)

    def same_experiment(self, r: Site, c: Site) -> bool:
        """Whether the floor's experiment on ``r`` is the candidate's on ``c``: ``c``'s module
        is the floor's module's twin (same classes, settings and weights at the candidate's
        precision: :func:`~blockdiff.sides.precision.twins`) and ``c``'s call, its
        activations set aside (both get the reference's), is ``r``'s cast to that precision,
        bit for bit. Then each number of the floor is the candidate's.

        When the whole candidate is the floor's twin (:attr:`twin`: the reference's own
        code at its precision), every call it made is the call the floor's own run makes —
        its non-hidden arguments too (rotary tables, masks: the same code computing them at
        the same precision) — so every experiment on it is the floor's (the design's "its
        error equals the floor exactly")."""
        assert self.floor is not None
        if self.twin:
            return True
        key = (r.module, c.module)
        if key not in self._twins:
            self._twins[key] = twins(gradient_runs(self.floor).module(r.module), self.cand_runs.module(c.module))
        if not self._twins[key]:
            return False
        dtype = self.floor.dtype
        hidden = {role: t.to(dtype) if t.is_floating_point() else t for role, t in r.hidden_inputs().items()}
        args, kwargs = with_hidden(c.args, c.kwargs, hidden, c.activations)
        return same_call(r, replace(c, args=args, kwargs=kwargs), dtype)

    # -- one module ----------------------------------------------------------------------

    def module_checks(self, target: str, r: Site, c: Site) -> list[Check]:
        """The candidate's module backward from the reference's output gradient, on the
        reference's input: its input gradient and each parameter gradient judged (no check
        for a module no gradient reaches). Parameters pair as the forward pairs them
        (:meth:`GradientPairing.parameters <blockdiff.backward_pairing.GradientPairing.parameters>`);
        those that pair with nothing are named on the module's
        first check (``details["parameters_not_paired"]``) and in a note, never dropped
        silently. A module that passes no gradient at all where the reference's does (its
        output depends on none of its inputs and weights: a ``detach()``) gets zeros, judged
        as any gradient is, and a note."""
        grad = self.ref_g.outputs.get((r.module, r.call))
        if grad is None:
            return []
        hidden = r.hidden_inputs()
        got = self.cand_runs.backward_module(c.module, c, hidden, grad)
        floor = self._floor_run(r, c, got, lambda side: gradient_runs(side).backward_module(r.module, r, hidden, grad))
        got_in, got_params = got
        floor_in, floor_params = floor if floor is not None else ({}, {})
        checks = []
        expected_in = self.ref_g.inputs.get((r.module, r.call))
        if expected_in is not None and "primary" in got_in:
            checks.append(self.check(target, INPUT_GRADIENT, c.module, expected_in, got_in["primary"], floor_in.get("primary")))
        expected = self.expected_parameters(r, hidden, grad)
        pairs, not_paired = self.pairing.parameters(r, c, hidden, expected, got_params)
        ref_module, cand_module = self.ref_runs.module(r.module), self.cand_runs.module(c.module)
        for pair in pairs:
            want = side_by_side([held(ref_module, name, expected[name]) for name in pair.ref], pair.dim)
            mine = side_by_side([held(cand_module, name, got_params[name]) for name in pair.cand], pair.dim)
            if floor is got:  # the floor's run was the candidate's: its number is the floor
                own = mine
            elif all(name in floor_params for name in pair.ref):
                own = side_by_side([held(ref_module, name, floor_params[name]) for name in pair.ref], pair.dim)
            else:
                own = None
            checks.append(self.check(target, PARAMETER_GRADIENT.format(pair.name), c.module, want, mine, own))
        where = f"backward: {describe_key(c.key._replace(subpath=reported_subpath(c.subpath)))} ({c.module})"
        if any(not_paired.values()):
            if checks:
                checks[0].details = {**(checks[0].details or {}), "parameters_not_paired": not_paired}
            self.notes.append(
                Note("gradients-not-paired", f"{where}: parameter gradients that pair with nothing on the other side (by name, by role, order "
                "and shape, or through the module's children), not judged: "
                + "; ".join(f"{side} {', '.join(names)}" for side, names in not_paired.items() if names))
            )
        reached = [t for t in [expected_in, *expected.values()] if t is not None]
        if any(bool(t.any()) for t in reached) and not any(bool(t.any()) for t in [*got_in.values(), *got_params.values()]):
            self.notes.append(
                Note("no-gradient", f"{where}: the candidate's module passes no gradient — every gradient of its input and weights is "
                "zero — where the reference's passes one: what it returns depends on none of them (a detach() or a "
                "no-grad region in its code)")
            )
        worst = max(checks, key=lambda k: (k.diverged, k.ratio), default=None)
        try:
            if worst is not None and worst.diverged:
                self.pairing.drill_down(r, c, hidden, grad, worst, lambda pair, found: self.child_check(target, c, pair, found))
        finally:
            self.pairing.forget()
        return checks

    def child_check(
        self, target: str, c: Site, pair: ChildPair, gradients: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> Check | str:
        """One pair of the drill-down (:meth:`~blockdiff.backward_pairing.GradientPairing.drill_down`)
        judged as a module's backward is, or why it cannot be: the candidate's child (or
        children) on the reference child's input, backward from the reference child's output
        gradient (several: side by side along the last dimension, as their outputs are), on
        the input gradient (several children reading one input: the sum of theirs)."""
        hidden = pair.ref[0].hidden_inputs()
        expected_parts = [gradients.get(id(s), (None, None))[0] for s in pair.ref]
        out_grads = [gradients.get(id(s), (None, None))[1] for s in pair.ref]
        if "primary" not in hidden:
            return "its call has no floating input"
        if all(g is None for g in out_grads) or all(e is None for e in expected_parts):
            return "no gradient reaches it"
        if len(pair.ref) == 1 and len(pair.cand) == 1:
            (rc,), (cc,), expected_in, out_grad = pair.ref, pair.cand, expected_parts[0], out_grads[0]
            if expected_in is None or out_grad is None:
                return "no gradient reaches it"
            got = self.cand_runs.backward_module(cc.module, cc, hidden, out_grad, parameters=False)[0]
            floor = self._floor_run(
                rc, cc, got, lambda side: gradient_runs(side).backward_module(rc.module, rc, hidden, out_grad, parameters=False)[0]
            )
            if "primary" not in got:
                return "its input gradient is not recorded"
            return self.check(
                target, pair.what, cc.module, expected_in, got["primary"], None if floor is None else floor.get("primary")
            )
        # A fused child against split ones: what flows back into their shared input.
        outputs = {id(s): s.primary_output() for s in (*pair.ref, *pair.cand)}
        if any(out is None for out in outputs.values()):
            return "a call returned no tensor"
        expected = summed([e for e in expected_parts if e is not None])
        whole = side_by_side(
            [g if g is not None else torch.zeros_like(outputs[id(s)]) for s, g in zip(pair.ref, out_grads)], -1  # type: ignore[arg-type]
        )

        def backward(side: Side, sites: list[Site]) -> torch.Tensor | None:
            """The input gradient of ``side``'s children ``sites`` on the reference's input,
            backward from the reference's output gradient (split as their outputs are)."""
            widths = [outputs[id(s)].shape[-1] for s in sites]  # type: ignore[union-attr]
            parts = whole.split(widths, dim=-1) if len(sites) > 1 else [whole]
            runs = gradient_runs(side)
            found = [runs.backward_module(s.module, s, hidden, g, parameters=False)[0].get("primary") for s, g in zip(sites, parts)]
            grads = [f for f in found if f is not None]
            return summed(grads) if len(grads) == len(found) else None

        got_in = backward(self.cand, pair.cand)
        if got_in is None:
            return "its input gradient is not recorded"
        floor_in = None if self.floor is None else got_in if self.twin else backward(self.floor, pair.ref)
        module = pair.cand[0].module if len(pair.cand) == 1 else f"{c.module}.{'+'.join(pair.cand_names)}"
        return self.check(target, pair.what, module, expected, got_in, floor_in)

    def moe_checks(self, r: Site, c: Site, router_r: Site, router_c: Site) -> list[Check]:
        """An MoE ffn's router and experts judged apart: the candidate's router alone,
        backward from the reference router's output gradient on its input (``router: …``);
        the candidate's MoE with its router replaced by the reference's (forward and
        backward), backward from the reference's ffn output gradient, on its input gradient
        (``experts …``: the experts and the MoE's own code, routing fixed at the reference's)."""
        checks = self.module_checks("ffn", router_r, router_c)
        for check in checks:
            check.what = f"router: {check.what}"
        grad = self.ref_g.outputs.get((r.module, r.call))
        expected = self.ref_g.inputs.get((r.module, r.call))
        if grad is None or expected is None:
            return checks
        hidden = r.hidden_inputs()
        replaced = self.by_reference(self.cand, c.module, [(router_r, router_c)])
        got = self.cand_runs.backward_module(c.module, c, hidden, grad, replaced=replaced, parameters=False)[0]

        def measure(side: Side) -> Any:
            own = self.by_reference(side, r.module, [(router_r, router_r)])
            return gradient_runs(side).backward_module(r.module, r, hidden, grad, replaced=own, parameters=False)[0]

        floor = self._floor_run(r, c, got, measure)
        if "primary" in got:
            checks.append(self.check(
                "ffn", EXPERTS_GRADIENT, c.module, expected, got["primary"], None if floor is None else floor.get("primary")
            ))
        return checks

    def expected_parameters(self, r: Site, hidden: dict[str, torch.Tensor], grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """The reference's gradient of each floating parameter of ``r``'s module, by name
        relative to it: from its whole backward where that call alone uses the parameter,
        else from its own module's backward at that call."""
        module = self.ref_runs.module(r.module)
        own = [(name, p) for name, p in module.named_parameters() if p.is_floating_point()]
        if all(id(p) in self._exclusive for _, p in own):
            return {name: self.ref_g.parameters[self._exclusive[id(p)]] for name, p in own}
        return self.ref_runs.backward_module(r.module, r, hidden, grad)[1]

    # -- one block -----------------------------------------------------------------------

    def block_check(self, pair: BlockPair, *, residual: bool) -> Check | None:
        """The candidate's block backward from the reference's block-output gradient, on the
        reference's block input: with every sub-path module replaced by the reference's own
        (``residual``: its glue judged), or alone (the whole block); its input gradient
        judged."""
        rb, cb = pair.ref_block, pair.cand_block
        grad = self.ref_g.outputs.get((rb.module, rb.call))
        expected = self.ref_g.inputs.get((rb.module, rb.call))
        if grad is None or expected is None:
            return None
        hidden = rb.hidden_inputs()
        routers = [] if residual else list(pair.routing().values())
        if routers:
            # The whole block with every MoE router frozen at the reference's decision, as
            # the forward's whole-block experiment runs: a precision flip of a near-tie token
            # is no block error (the router is judged alone). Its expected gradient is the
            # reference block's own backward, routing frozen alike.
            own_routing = self.routing_frozen(self.ref, rb.module, [(r, r) for r, _ in routers])
            expected = self.ref_runs.backward_module(rb.module, rb, hidden, grad, replaced=own_routing, parameters=False)[0].get("primary")
            if expected is None:
                return None
        if residual:
            replaced = self.by_reference(self.cand, cb.module, [(s, pair.cand[k]) for k, s in pair.ref.items()])
        else:
            replaced = self.routing_frozen(self.cand, cb.module, routers) or None
        got = self.cand_runs.backward_module(cb.module, cb, hidden, grad, replaced=replaced, parameters=False)[0]

        key = (rb.module, rb.call)

        def measure(side: Side) -> Any:
            shares: dict[tuple[str, int], bool] | None = None
            if residual:
                if key in self._residual_floors:  # the whole block's floor run was this run
                    return self._residual_floors.pop(key)
                own = self.by_reference(side, rb.module, [(s, s) for s in pair.ref.values()])
            elif routers:
                own = self.routing_frozen(side, rb.module, [(r, r) for r, _ in routers])
            else:
                shares = {}
                own = self.residual_probe(side, rb.module, list(pair.ref.values()), shares)
            found = gradient_runs(side).backward_module(rb.module, rb, hidden, grad, replaced=own, parameters=False)[0]
            if shares is not None and len(shares) == len(pair.ref) and all(shares.values()):
                self._residual_floors[key] = found
            return found

        floor = self._floor_run(rb, cb, got, measure)
        if "primary" not in got:
            return None
        target = "residual" if residual else "block"
        return self.check(target, INPUT_GRADIENT, cb.module, expected, got["primary"], None if floor is None else floor["primary"])

    def by_reference(self, side: Side, block: str, sites: list[tuple[Site, Site]]) -> Replaced:
        """For a backward of ``side``'s block ``block``: each of its sub-path modules
        answering with the reference's own module (forward and backward) run on what reached
        it, with the reference's other arguments of that call. ``sites``: (reference site,
        ``side``'s site of that call, whose output gives the structure and dtypes).

        Under the calibrated policy the reference's module runs at the candidate's precision
        (the floor side's copy), in the candidate's residual experiment and in its floor
        alike: the modules' own rounding is then the same in both, and what differs is the
        glue's, which is what the residual judges."""
        ref = self.floor if self.floor is not None else self.ref
        return answered_by(ref, side, gradient_runs(side).cast, block, sites)

    def residual_probe(
        self, side: Side, block: str, sites: list[Site], shares: dict[tuple[str, int], bool]
    ) -> Replaced:
        """For the floor's whole-block backward of ``side``'s block ``block``: each sub-path
        module's call (``sites``, the reference's) runs its own code, and ``shares`` says, by
        (module, call), whether that call is the one the residual experiment's floor makes in
        its place (:meth:`by_reference`: this very module on what reached it, with the
        reference's other arguments cast): the same arguments bit for bit, and an output
        holding its primary tensor alone, of the recorded output's dtype and shape. When
        every call is, that run is the residual's floor too (the same computation forward
        and backward) and it is not run again."""
        return probed(side, gradient_runs(side).cast, block, sites, shares)

    def routing_frozen(self, side: Side, block: str, routers: list[tuple[Site, Site]]) -> Replaced:
        """For a backward of ``side``'s block ``block``: each router answering with the
        reference's recorded decision (:func:`~blockdiff.backward_pairing.frozen_routing`)."""
        return frozen_routing(side, gradient_runs(side).cast, block, routers)

    def drift(self, r: Site, c: Site, *, judged: bool) -> tuple[Metrics | None, Check | None]:
        """The free-running candidate's input gradient at a site against the reference's
        (its output gradient for a site that takes none: the embedding), and, when
        ``judged``, that drift against the reference's own free run at the candidate's
        precision (or the fixed drift threshold)."""
        which = "inputs" if (r.module, r.call) in self.ref_g.inputs else "outputs"
        expected = getattr(self.ref_g, which).get((r.module, r.call))
        got = getattr(self.cand_g, which).get((c.module, c.call))
        if expected is None or got is None:
            return None, None
        got = aligned(c.module, GRADIENT_DRIFT, expected, got)
        measured = metrics(expected, got, dtype=self.dtype)
        if not judged:
            return measured, None
        floor = None
        if self.floor_g is not None:
            own = getattr(self.floor_g, which).get((c.module, c.call) if self.twin else (r.module, r.call))
            floor = None if own is None else (measured.rel_l2 if self.twin else rel_l2(expected, aligned(c.module, GRADIENT_DRIFT, expected, own)))
        return measured, Check(GRADIENT_DRIFT, c.module, measured, self.tolerance.threshold(DRIFT, self.dtype, floor))

    # -- the report ----------------------------------------------------------------------

    def report(self, forward: Report, loss: str) -> Report:
        """The backward report: every stage and block with its backward checks, in backward
        execution order (:attr:`~blockdiff.report.StageResult.order` and the rest count from
        the head), what the forward blames marked as explained by it."""
        ref, cand = self.ref, self.cand
        first = forward.first_divergence
        judged = first is None  # a wrong forward makes every gradient downstream differ
        notes: list[str] = [Note(
            "backward", f"backward: both sides ran forward and backward on the same inputs, loss: {loss}, in eval mode (dropout "
            "off), every floating parameter requiring grad; gradients are judged from the head to the embedding "
            f"(reference loss {self.ref_g.loss:.6g}, candidate {self.cand_g.loss:.6g})"
        )]
        if not judged:
            notes.append(
                Note("backward-after-forward", f"backward: the forward diverges first ({first.where}): gradient drift is not judged (a wrong forward "
                "makes every gradient downstream differ), and the backward checks of what the forward blames are "
                "reported as explained by it")
            )
        # The one walk (localize.Localizer) over every stage and block by where it ran in the
        # forward, each judged in the gradients' direction; numbered after in backward order.
        self.judged = judged
        localizer = Localizer(ref, cand, self.tolerance, direction=lambda _: self)
        stages, blocks = list(localizer.stages()), list(localizer.blocks())
        notes.extend(localizer.notes)
        _backward_order(stages, blocks)
        if self.cand_g.replicas is not None:  # a side split across ranks (sides.sharded.gradient_split)
            notes.append(self.replicas_check(self.cand_g.replicas, stages, blocks))
        back = Report(
            reference=dict(forward.reference), candidate=dict(forward.candidate),
            inputs={**forward.inputs, "loss": loss}, tolerance=dict(forward.tolerance),
            stages=[s for s in stages if s.local is not None or s.drift is not None], blocks=blocks,
            notes=notes + self.notes, created=forward.created, version=forward.version,
        )
        _explained(back, forward)
        for divergence in back.divergences:
            if divergence.subpath == UNATTRIBUTED:
                back.notes.append(
                    Note("backward-unattributed", f"{divergence.where}: the block's backward differs while each sub-path module alone, and its glue "
                    "with the reference's own modules, are right: what runs differs when the block runs whole — a "
                    "recomputation that differs from the forward (activation checkpointing), or a module the hook "
                    "map misses (`blockdiff arch`)")
                )
        return back

    def replicas_check(self, split: ReplicaSplit, stages: list[StageResult], blocks: list[BlockResult]) -> str:
        """The first gradient whose replicas differ across the candidate's ranks, judged as
        a divergence where it is (threshold 0: every rank holds it whole and should compute
        the same bits), first among its sub-path's checks; the note that says so."""
        path, call = split.key
        store = self.cand.store
        site = next(
            (s for s in [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]
             if s.module == path and s.call == call),
            None,
        )
        gradient = split.which
        message = distributed.replicas_message(split.ranks, split.measured.rel_l2, of=gradient)
        note = Note(
            "replicas-differ", f"backward: {describe_key(site.key) if site else path} ({path}): {message}; every rank holds this gradient "
            "whole and should compute the same bits: blamed where the replicas first differ in backward order (the "
            "missing or extra collective is in that module's backward)"
        )
        check = Check(REPLICAS, path, split.measured, Threshold(0.0, "fixed"), details={"ranks": split.ranks, "message": message, "gradient": gradient})
        stage = next((s for s in stages if s.module == path), None) if site is not None and site.block is None else None
        if stage is not None:
            check.order = stage.order
            if stage.local is None or not stage.local.diverged:
                stage.local = check
        elif site is not None and site.block is not None:
            block = next(b for b in blocks if b.index == site.block and (path == b.module or path.startswith(b.module + ".")))
            result = block.subpaths.setdefault(reported_subpath(site.subpath), SubpathResult("checked", order=block.order))
            check.order = min((c.order for c in result.checks if c.order is not None), default=result.order)
            # The module's own experiment on that gradient, drilled down, names the child
            # whose backward lacks (or repeats) the collective: shown with this check.
            own = next((c for c in result.checks if c.what == gradient and c.module == path and c.children), None)
            if own is not None:
                check.children, check.children_not_paired, check.children_not_judged = (
                    own.children, own.children_not_paired, own.children_not_judged
                )
            result.checks.insert(0, check)
            result.status = "checked"
        return note

    def stage(self, r: Site, c: Site, pairs: list[tuple[Site, Site]]) -> StageResult:
        """A stage outside the blocks (embedding, final norm, head): its module's backward
        checks, the worst as its ``local`` (every one under ``details``), and its drift;
        numbered by its forward order until :func:`_backward_order` renumbers it."""
        checks = self.module_checks(r.stage, r, c)
        drift, drift_check = self.drift(r, c, judged=self.judged)
        worst = max(checks, key=lambda k: (k.diverged, k.ratio), default=None)
        if worst is not None and len(checks) > 1:
            worst.details = {**(worst.details or {}), "checks": [k.to_dict() for k in checks]}
        return StageResult(r.stage, c.module, worst, drift, order=r.order, drift_check=drift_check)

    def block(self, pair: BlockPair) -> BlockResult:
        """One block: each sub-path module's backward checks (an MoE ffn's router and
        experts apart too), the residual, the whole block and the drift of its input
        gradient."""
        subpaths: dict[str, SubpathResult] = {}
        # Backward order inside the block: its modules last to first (checks numbered below).
        for r, c in sorted(pair.sites(), key=lambda rc: -rc[0].order):
            result = subpaths.setdefault(r.subpath or "", SubpathResult("checked"))
            router = pair.router_of(r)
            for check in self.module_checks(r.subpath or "", r, c) + ([] if router is None else self.moe_checks(r, c, *router)):
                check.order = r.order
                result.checks.append(check)
        residual = SubpathResult("checked")
        whole = None
        if pair.ref_layout is not None and pair.cand_layout is not None:
            whole = self.block_check(pair, residual=False)  # first: its floor run may be the residual's
            found = self.block_check(pair, residual=True)
            residual.checks = [found] if found is not None else []
        subpaths["residual"] = residual
        drift, drift_check = self.drift(pair.ref_block, pair.cand_block, judged=self.judged)
        layout = pair.cand_layout
        return BlockResult(
            index=pair.index, module=pair.cand_block.module, stack=layout.stack if layout else "",
            subpaths={name: subpaths[name] for name in SUBPATHS if name in subpaths}, block=whole, drift=drift,
            order=pair.ref_block.order, unmapped=list(layout.unmapped) if layout else [], drift_check=drift_check,
        )


def _backward_order(stages: list[StageResult], blocks: list[BlockResult]) -> None:
    """Number every stage, block, sub-path and check in backward execution order: the
    reverse of the forward's (each holds its forward order; the head first), inside a block
    its modules last to first and its residual (the block input's gradient) after them."""
    items: list[tuple[float, StageResult | BlockResult]] = [(s.order, s) for s in stages]
    items += [(b.order, b) for b in blocks]
    position = 0.0
    for _, item in sorted(items, key=lambda pair: -pair[0]):
        position += 1
        item.order = position
        if isinstance(item, StageResult):
            if item.local is not None:
                item.local.order = position
            continue
        # Module checks carry their site's forward order: the latest-started runs first.
        forward_orders = sorted({c.order for r in item.subpaths.values() for c in r.checks if c.order is not None}, reverse=True)
        at = {order: position + rank + 1 for rank, order in enumerate(forward_orders)}
        for name, result in item.subpaths.items():
            if name == "residual":
                continue
            for check in result.checks:
                check.order = at.get(check.order, position)
            result.order = min((c.order for c in result.checks if c.order is not None), default=position + 0.5)
        residual = item.subpaths.get("residual")
        position += len(forward_orders) + 1
        if residual is not None:
            residual.order = position
            for check in residual.checks:
                check.order = position


def _explained(back: Report, forward: Report) -> None:
    """Mark the backward checks of what the forward blames as explained by it: the module
    computes something else, so its backward differs too; blamed once, on the forward."""
    for divergence in forward.divergences:
        if divergence.subpath == DRIFT:
            continue
        label = f"forward {divergence.where}"
        if divergence.stage != "block":
            for stage in back.stages:
                if stage.stage == divergence.stage and stage.module == divergence.module:
                    stage.explained_by = label
            continue
        block = next((b for b in back.blocks if b.index == divergence.block and b.stack == divergence.stack), None)
        if block is None:
            continue
        if divergence.subpath == UNATTRIBUTED:
            block.explained_by = label
            name = "residual"
        else:
            name = divergence.subpath or ""
        if name in block.subpaths:
            block.subpaths[name].explained_by = label


__all__ = ["GradientChecks", "Recorder", "gradient_runs", "judge", "refuse_backward"]
