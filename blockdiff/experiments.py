"""Experiments: one module, or one block with chosen modules frozen, run on the reference's
inputs and judged.

Each experiment asks the candidate side to run (:mod:`blockdiff.sides`) and compares
what comes out with what the reference recorded:

- **module** (attention, ffn, each norm, and the stages outside blocks): the candidate's
  module on its own recorded call with the hidden state replaced by the reference's;
- **residual**: the candidate's whole block on the reference block input with every
  sub-path module's output replaced by the reference's; the block output and the input
  reaching each frozen module are compared;
- **block**: the candidate block on the reference input with nothing frozen (but MoE
  routing, fixed at the reference's);
- **drift**: the free-running candidate against the reference at a site (no run).

Under the calibrated policy, :meth:`Experiments.with_floor` runs the same experiment on
the reference's own code at the candidate's precision (:class:`~blockdiff.sides.live.PrecisionSide`):
the check's noise floor. When the candidate *is* that code (a model against its own cast),
each floor is its check's output, not a second run (:meth:`Experiments.floor_is_check`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, TypeVar

import torch

from .children import ChildPair, pair_children
from .compare import Metrics, metrics, rel_l2, same_bits
from .distributed import everywhere, world
from .dtypes import precision_label
from .errors import PairingError, ShapeMismatchError
from .hookmap import BlockLayout
from .pairing import BlockPair, in_order
from .report import Check
from .sides import Frozen, Side, received_dtype
from .site import Opaque, Site, describe_key, map_opaque, map_structure, primary_tensor
from .tolerance import Tolerance, working_dtype
from .store import SiteStore
from .vocab import BLOCK_TARGET, DRIFT

T = TypeVar("T")
# What a check compared: the reference tensor, the candidate's, and their metrics.
Compared = tuple[torch.Tensor, torch.Tensor, Metrics]


class Experiments:
    """The experiments of one diff between two sides, and how they are judged.

    Args:
        reference, candidate: the sides; the candidate runs the experiments.
        tolerance: the resolved policy (see :meth:`Tolerance.resolved`).
    """

    def __init__(
        self,
        reference: Side,
        candidate: Side,
        tolerance: Tolerance,
        *,
        stored: StoredFloors | None = None,
        precision: tuple[torch.dtype, torch.device] | None = None,
    ) -> None:
        self.ref = reference
        self.cand = candidate
        self.tolerance = tolerance
        dtype, device = precision or (working_dtype(reference.dtype, candidate.dtype), candidate.device)
        self.dtype = dtype
        # The reference's own code at the candidate's precision, when it can run; else the
        # floors a dump stored for that precision, when it has them.
        self.floor_side = reference.in_precision(dtype, device) if tolerance.calibrated else None
        self.stored = stored if tolerance.calibrated and self.floor_side is None else None
        # The reference's whole free run at the candidate's precision: drift floors.
        self.free_run: SiteStore | None = None
        self._free_run_cache: tuple[int | None, dict] = (-1, {})
        # Every floor measured, by key, when a capture stores them (see record_floors()).
        self.measured: dict[str, Any] | None = None
        # Modules carry state from call to call (decode steps: each experiment's own KV
        # cache): an experiment is answered by a recorded call only while its cache has
        # shadowed the side's own at every step (_answered), so that its state sees every step.
        self.stateful = False

    @property
    def calibrated(self) -> bool:
        """Whether checks get noise floors (the calibrated policy, and a live reference or
        floors a dump stored for this precision)."""
        return self.floor_side is not None or self.stored is not None

    def with_floor(self, key: str, measure: Callable[[Side], T]) -> T | None:
        """The floor of the check ``key`` names: ``measure`` run on the reference at the
        candidate's precision, or what a dump stored for it. The calibrated branch of every
        experiment, in one place. ``None`` without floors.

        Keys name a check by kind and site (``module:block 2 ffn``), the same in the run
        that stores floors (:attr:`measured`) and the replay that reads them."""
        if self.stored is not None:
            return self.stored.get(key)
        if self.floor_side is None:
            return None
        value = measure(self.floor_side)
        if self.measured is not None:
            self.measured[key] = value
        return value

    def check(
        self, target: str, what: str, module: str, expected: torch.Tensor, got: torch.Tensor, floor: float | None,
        *, measured: Metrics | None = None,
    ) -> Check:
        """``got`` against ``expected`` (``measured``: their metrics, computed already),
        judged with ``floor``."""
        found = measured or metrics(expected, got, dtype=self.dtype)
        return Check(what, module, found, self.tolerance.threshold(target, self.dtype, floor))

    def floor_l2(self, ref: torch.Tensor, got: torch.Tensor, compared: Compared | None = None) -> float:
        """A floor: ``rel_l2(ref, got)``. When ``got`` is bit for bit the tensor a check
        compared with this very ``ref`` (``compared``: the check's reference, candidate and
        metrics) — the candidate computes what the reference's own code computes at its
        precision, as a model against its own cast does — the check's relative L2 is that
        number already: the same sums of the same elements (``metrics(r, c).rel_l2`` is
        ``rel_l2(r, c)``). Not in a sharded lockstep, where a check's metrics are the
        worst rank's and a floor is each rank's own."""
        if compared is not None and not self.cand.lockstep:
            expected, cand, found = compared
            if expected is ref and (cand is got or cand.stride() == got.stride() and same_bits({"t": cand}, {"t": got})):
                return found.rel_l2
        return rel_l2(ref, got)

    @property
    def floor_runs_candidate(self) -> bool:
        """Whether the floor side runs the candidate's own code: the engine hands the floors
        the candidate's record as their free run exactly when the reference at the
        candidate's precision runs as the candidate
        (:meth:`~blockdiff.sides.live.PrecisionSide.runs_as`: the same classes, settings and
        weights, bit for bit, on the same device under the same layout). Not at decode steps
        (a floor experiment carries a cache of its own) nor in a sharded lockstep (a floor
        is each rank's own)."""
        return (
            self.floor_side is not None
            and self.free_run is not None
            and self.free_run is self.cand.store
            and not self.stateful
            and not self.cand.lockstep
        )

    def floor_is_check(self, r: Site, c: Site, modules: tuple[dict[str, str], dict[str, str]] | None = None) -> bool:
        """Whether the floor experiment of the reference's call ``r`` is the experiment the
        candidate's check ran on ``c``, so that its output is the floor's, with no second run.

        It is when the floor side runs the candidate's own code (:attr:`floor_runs_candidate`:
        the whole candidate is the reference's code at its precision, a model against its
        own cast) on the same module (``modules``: a block's modules, relative, on each
        side): every call the candidate made is the call the floor's own code makes at that
        precision — its other arguments too (rotary tables and masks, computed by the same
        code at the same precision), and a frozen module answers alike on both — so each
        number of the floor is the check's (the design's "its error equals the floor
        exactly"). Replaying the reference's rotary tables cast instead would measure a
        floor for code the candidate does not run (its tables come from an ``inv_freq``
        cast with the model)."""
        return self.floor_runs_candidate and r.module == c.module and (modules is None or modules[0] == modules[1])

    def drift(self, r: Site, c: Site) -> Metrics | None:
        """The free-running candidate's output against the reference's at one site."""
        ref_out, cand_out = r.primary_output(), c.primary_output()
        if ref_out is None or cand_out is None:
            return None
        return metrics(*self.comparable(r, c, ref_out, cand_out), dtype=self.dtype)

    def comparable(self, r: Site, c: Site, ref_out: torch.Tensor, cand_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two outputs of a paired site in one shape (see :func:`comparable`); broadcast
        when either side's hook map says so for its module."""
        broadcast = self.ref.layout.options(r.module).broadcast or self.cand.layout.options(c.module).broadcast
        return comparable(describe_key(c.key), "output", ref_out, cand_out, broadcast=broadcast)

    def drift_check(
        self, r: Site, c: Site, drift: Metrics | None, *, target: str = DRIFT, what: str = DRIFT
    ) -> Check | None:
        """``drift`` (:meth:`drift` of the pair, computed once by the caller) judged: against
        its calibrated floor — the drift of the reference's own free run at the candidate's
        precision (:attr:`free_run`, recorded by the engine), or what a dump stored for it —
        or the fixed threshold of ``target``. An offline comparison judges each site's drift
        this way under its own target (``what``: ``drift (offline)``)."""
        if drift is None:
            return None
        floor = self.with_floor(f"drift:{describe_key(r.key)}", lambda side: self.free_run_floor(r, (c, drift)))
        return Check(what, c.module, drift, self.tolerance.threshold(target, self.dtype, floor), order=r.order)

    def free_run_floor(self, r: Site, drift: tuple[Site, Metrics] | None = None) -> float | None:
        """Drift of the reference's free run at the candidate's precision at site ``r``
        (``drift``: the candidate's site paired with ``r`` and its drift, which answers when
        the free run's output is bit for bit the candidate's, see :meth:`floor_l2`)."""
        own = self._free_run_site(r)
        ref_out, own_out = r.primary_output(), None if own is None else own.primary_output()
        if ref_out is None or own_out is None:
            return None
        expected, got = self.comparable(r, own, ref_out, own_out)
        compared = None
        cand_out = None if drift is None else drift[0].primary_output()
        if drift is not None and cand_out is not None:
            compared = (*self.comparable(r, drift[0], ref_out, cand_out), drift[1])
        return self.floor_l2(expected, got, compared)

    def _free_run_site(self, r: Site) -> Site | None:
        if self.free_run is None:
            return None
        where = r.block
        if self._free_run_cache[0] != where:  # one block's (or the stages') sites at a time
            sites = self.free_run.outside_sites() if where is None else self.free_run.block_sites(where)
            self._free_run_cache = (where, {s.key: s for s in sites})
        return self._free_run_cache[1].get(r.key)

    # -- one module --------------------------------------------------------------------

    def _answered(self, side: Side, key: tuple, call: Site, hidden: dict[str, torch.Tensor] | None) -> bool:
        """Whether an experiment whose inputs are bit for bit those ``side``'s own ``call``
        received is answered by the call's recorded output: always, but at decode steps
        only while the experiment's cache has shadowed the side's own
        (:meth:`~blockdiff.sides.Stepping.shadow`)."""
        stepping = side.stepping()
        return not self.stateful or (stepping is not None and stepping.shadow(key, call, hidden))

    def module_output(self, side: Side, path: str, call: Site, hidden: dict[str, torch.Tensor] | None) -> torch.Tensor:
        out = primary_tensor(side.call_module(path, call, hidden))
        if out is None:
            raise PairingError(f"{call.label}: the module returned no tensor")
        return out

    def floor_output(self, side: Side, call: Site) -> torch.Tensor:
        """The reference's ``call`` replayed on the floor side (its arguments cast to the
        floor's precision). When the free run made that very call — every argument, cast,
        the same bits as the free run's own (the first block's input, in a model whose
        embedding is a lookup) — its recorded output is the answer: the free run measured
        this floor already."""
        own = self._free_run_site(call)
        out = None if own is None else own.primary_output()
        if out is not None and same_call(call, own, side.dtype) and self._answered(side, ("module", call.module), call, None):
            return out
        return self.module_output(side, call.module, call, None)

    def module_check(self, target: str, r: Site, c: Site) -> Check:
        """The candidate's module on the reference's activations, against the reference's output."""
        ref_out = r.primary_output()
        if ref_out is None:
            raise PairingError(f"{r.label}: the reference recorded no output tensor")
        hidden = r.hidden_inputs()
        out = c.primary_output()
        own = c.hidden_inputs()
        same = everywhere(out is not None and same_bits(as_received(hidden, own), own))
        if not same or not self._answered(self.cand, ("module", c.module), c, hidden):
            out = self.module_output(self.cand, c.module, c, hidden)
        ran = out
        expected, out = self.comparable(r, c, ref_out, out)
        key = f"module:{describe_key(r.key)}"
        measured = metrics(expected, out, dtype=self.dtype)

        def measure(side: Side) -> float:
            got = ran if self.floor_is_check(r, c) else self.floor_output(side, r)
            return self.floor_l2(ref_out, got, (expected, out, measured))

        floor = self.with_floor(key, measure)
        check = self.check(target, "output", c.module, expected, out, floor, measured=measured)
        check.order, check.key = r.order, key
        return check

    def children_checks(self, target: str, r: Site, c: Site, check: Check | None = None) -> list[Check]:
        """Drill-down: the module check one level down. Each innermost child the
        reference's module calls (a projection, an activation, an inner norm) is judged as a
        module is — the candidate's child on the reference child's inputs (its other
        arguments its own), against the reference child's output — in the order they ran.
        Children pair by name, else by role, else a fused child against split ones
        (:func:`~blockdiff.children.pair_children`); ``check`` (the module's check) records
        what pairs with nothing and what cannot be judged (``children_not_paired``,
        ``children_not_judged``), which are never counted as checked. Needs both sides live."""
        ref_calls = self.ref.child_calls(r.module, r)
        cand_calls = self.cand.child_calls(c.module, c, r.hidden_inputs())
        pairing = pair_children(
            r.module, ref_calls, c.module, cand_calls, ref_module=_module_of(self.ref), cand_module=_module_of(self.cand)
        )
        checks = [self.child_check(target, r, c, pair) for pair in pairing.pairs]
        if check is not None:
            check.children = checks
            check.children_not_paired = pairing.not_paired
            check.children_not_judged = pairing.not_judged
        return checks

    def child_check(self, target: str, r: Site, c: Site, pair: ChildPair) -> Check:
        """One pair of :meth:`children_checks` judged: the candidate's child (or its
        children, side by side) on the reference child's inputs against the reference's
        child (or its children, side by side). A floor per reference child; the floor of
        several side by side is theirs together (relative L2s over disjoint parts add as
        squares weighted by each part's norm)."""
        label = f"{describe_key(c.key)} {'+'.join(pair.cand_names)}"
        expected = _side_by_side([rc.primary_output() for rc in pair.ref])
        hidden = pair.ref[0].hidden_inputs()
        if len(pair.cand) == 1:
            cc = pair.cand[0]
            out = self.module_output(self.cand, cc.module, cc, hidden)
        else:  # a fused reference child: the candidate's split children on its input
            out = _side_by_side([self.module_output(self.cand, cc.module, cc, hidden) for cc in pair.cand])
        expected, out = comparable(label, "output", expected, out)
        floors = []
        for rc in pair.ref:
            ref_out = rc.primary_output()
            floor = self.with_floor(
                _child_key(r, rc),
                lambda side, rc=rc, ref_out=ref_out: rel_l2(ref_out, self.module_output(side, rc.module, rc, None)),
            )
            floors.append((ref_out, floor))
        module = pair.cand[0].module if len(pair.cand) == 1 else f"{c.module}.{'+'.join(pair.cand_names)}"
        found = self.check(target, pair.what, module, expected, out, _joined_floor(floors))
        found.key = _child_key(r, pair.ref[0]) if len(pair.ref) == 1 else None
        return found

    # -- one block ---------------------------------------------------------------------

    def block_checks(self, pair: BlockPair, *, frozen: bool) -> list[Check]:
        """The residual experiment (``frozen``) or the block-level one (nothing frozen but
        MoE routing, fixed at the reference's so that precision flips stay out of it)."""
        assert pair.ref_layout is not None and pair.cand_layout is not None
        r_block, c_block = pair.ref_block, pair.cand_block
        target = "residual" if frozen else BLOCK_TARGET
        ref_in, ref_out = r_block.hidden_inputs(), r_block.primary_output()
        if "primary" not in ref_in or ref_out is None:
            raise PairingError(f"{r_block.label}: no hidden input or output recorded")
        frozen_c: Frozen = dict(pair.routing())  # (reference site, candidate site): the candidate's run
        if frozen:
            frozen_c.update({(s.subpath, s.ordinal): (s, pair.cand[key]) for key, s in pair.ref.items()})
        own_in = c_block.hidden_inputs()
        if everywhere(
            not frozen_c and c_block.primary_output() is not None and same_bits(as_received(ref_in, own_in), own_in)
        ) and self._answered(self.cand, ("block", c_block.module, frozenset()), c_block, ref_in):
            out, reached = c_block.primary_output(), {}  # the candidate's own call was this call
        else:
            out, reached = self.cand.run_block(c_block.module, c_block, ref_in, relative(pair.cand_layout), frozen_c)
        label = describe_key(c_block.key)
        check_shapes(label, "output", ref_out, out)
        # (what, module, reference tensor, candidate tensor, (sub-path, ordinal) or None)
        compared: list[tuple[str, str, torch.Tensor, torch.Tensor, tuple | None]] = [
            ("block output", c_block.module, ref_out, out, None)
        ]
        if frozen:
            for key, site in in_order(pair.ref):
                expected, at = site.hidden_input(), (site.subpath, site.ordinal)
                if expected is not None and at in reached:
                    module = pair.cand[key].module
                    compared.append((f"input of {module}", module, expected, reached[at], at))

        # The candidate's metrics first: a floor bit for bit the candidate's takes its number.
        results: list[Compared] = []
        for what, _, expected, got, _ in compared:
            got = aligned(label, what, expected, got)
            results.append((expected, got, metrics(expected, got, dtype=self.dtype)))
        by_site = {at: result for (*_, at), result in zip(compared, results)}

        def floors(side: Side) -> dict[str, float]:
            """Each compared tensor's floor, by what it is ("output", "norm#1"): for every
            module of the reference's block, so that floors a dump stores fit any candidate."""
            frozen_f = {key: (r, r) for key, (r, _) in frozen_c.items()}  # the reference's own record
            if self.floor_is_check(r_block, c_block, (relative(pair.ref_layout), relative(pair.cand_layout))):
                f_out, f_reached = out, reached  # the candidate's run was this very run
            elif frozen_f:
                f_out, f_reached = side.run_block(r_block.module, r_block, None, relative(pair.ref_layout), frozen_f)
            else:
                f_out, f_reached = self.floor_output(side, r_block), {}
            values = {"output": self.floor_l2(ref_out, f_out, by_site[None])}
            for site in pair.ref.values() if frozen else ():
                at = (site.subpath, site.ordinal)
                expected, got = site.hidden_input(), f_reached.get(at)
                if expected is not None and got is not None:
                    values[f"{site.subpath}#{site.ordinal}"] = self.floor_l2(expected, got, by_site.get(at))
            return values

        measured = self.with_floor(f"{target}:{describe_key(r_block.key)}", floors) or {}
        return [
            self.check(
                target, what, module, expected, got, measured.get("output" if at is None else f"{at[0]}#{at[1]}"),
                measured=result,
            )
            for (what, module, _, _, at), (expected, got, result) in zip(compared, results)
        ]


def _module_of(side: Side) -> Callable[[str], Any]:
    """A child's module by its path on ``side`` (its role in a pairing), ``None`` where the
    side has no modules to show (a dump, an ONNX graph)."""

    def module(path: str) -> Any:
        try:
            return side.attribute(path)
        except (AttributeError, KeyError, ValueError, IndexError):
            return None

    return module


def _child_key(r: Site, rc: Site) -> str:
    """The floor key of the reference child call ``rc`` of ``r``'s module."""
    return f"child:{describe_key(r.key)}:{rc.module[len(r.module) + 1 :]}#{rc.call}"


def _side_by_side(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The outputs of split children as their fused child writes them: along the last
    dimension, in the order they ran (one tensor: itself)."""
    if any(t is None for t in tensors):
        raise PairingError("a child paired for a drill-down returned no tensor")
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)  # type: ignore[arg-type]


def _joined_floor(parts: list[tuple[torch.Tensor, float | None]]) -> float | None:
    """The relative L2 of tensors side by side from each one's (``(tensor, its relative
    L2)``): the squared errors add, ``sqrt(sum((f_i |t_i|)^2) / sum(|t_i|^2))``; ``None``
    when any part has no floor."""
    if len(parts) == 1:
        return parts[0][1]
    if any(f is None for _, f in parts):
        return None
    norms = [float(t.double().norm()) ** 2 for t, _ in parts]
    total = sum(norms)
    if total == 0:
        return 0.0 if all(f == 0 for _, f in parts) else math.inf
    return math.sqrt(sum(n * f * f for n, (_, f) in zip(norms, parts)) / total)  # type: ignore[operator]


class StoredFloors:
    """Floors a dump stored for one precision (``blockdiff capture --floors``), by check key.

    Attributes:
        label: the precision they were measured at, ``bfloat16@cpu``.
        values: check key → floor (a number, a list of numbers for a block's checks, or a
            router's output at that precision).
    """

    def __init__(self, label: str, values: dict[str, Any]) -> None:
        self.label = label
        self.values = values

    @classmethod
    def of(cls, floors: dict[str, Any] | None, reference: Side, candidate: Side) -> "StoredFloors | None":
        """The floors a dump stored (``floors``, by label) for the precision a diff of
        ``reference`` and ``candidate`` is judged at; ``None`` when it stored none for it."""
        label = precision_label(working_dtype(reference.dtype, candidate.dtype), candidate.device)
        return cls(label, floors[label]["values"]) if floors and label in floors else None

    def get(self, key: str) -> Any:
        return self.values.get(key)


def relative(layout: BlockLayout) -> dict[str, str]:
    """Sub-path module paths (and an MoE router's) relative to the block → sub-path."""
    prefix = layout.path + "."
    found = {path[len(prefix):]: subpath for subpath, paths in layout.subpaths.items() for path in paths}
    if layout.moe is not None:
        found[layout.moe["router"][len(prefix):]] = "router"
    return found


def aligned(label: str, what: str, ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """``cand`` in ``ref``'s shape when they differ only by leading size-1 dimensions
    (a rotary table of [seq, d] against [1, seq, d]); else a :class:`ShapeMismatchError`."""
    if tuple(ref.shape) == tuple(cand.shape):
        return cand
    if _squeeze_leading(ref.shape) == _squeeze_leading(cand.shape):
        return cand.reshape(ref.shape)
    check_shapes(label, what, ref, cand)
    return cand


def comparable(
    label: str, what: str, ref: torch.Tensor, cand: torch.Tensor, *, broadcast: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref`` and ``cand`` in one shape: :func:`aligned`, or with ``broadcast`` (a site
    the hook map declares broadcastable: TransformerLens' positional embedding is
    [B, T, D] where Hugging Face's is [1, T, D]) both broadcast to their common shape.
    Shapes that do not broadcast are a :class:`ShapeMismatchError` either way."""
    if broadcast and tuple(ref.shape) != tuple(cand.shape):
        try:
            shape = torch.broadcast_shapes(ref.shape, cand.shape)
        except RuntimeError:
            check_shapes(label, what, ref, cand)
        return ref.expand(shape), cand.expand(shape)
    return ref, aligned(label, what, ref, cand)


def _squeeze_leading(shape: torch.Size) -> tuple[int, ...]:
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)


def check_shapes(label: str, what: str, ref: torch.Tensor, cand: torch.Tensor) -> None:
    if tuple(ref.shape) != tuple(cand.shape):
        hint = ""
        ranks = world()
        if ranks > 1 and ref.dim() == cand.dim():
            split = [d - ref.dim() for d in range(ref.dim()) if cand.shape[d] * ranks == ref.shape[d]]
            if split and all(ref.shape[d] == cand.shape[d] for d in range(ref.dim()) if d - ref.dim() not in split):
                hint = (
                    f" (a plain local shard of {ranks} ranks along dimension {split[0]}? declare it in the candidate's "
                    f"hook map: shard_input or shard_output = {split[0]}, docs/hook-maps.md)"
                )
        raise ShapeMismatchError(
            f"{label} {what}: candidate has shape {list(cand.shape)}, reference {list(ref.shape)}{hint}",
            site=label,
            reference=tuple(ref.shape),
            candidate=tuple(cand.shape),
        )


def as_received(hidden: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hidden`` as a replay hands it to a call whose own activations are ``own``: each
    floating tensor cast as :func:`~blockdiff.sides.received_dtype` says (see
    :meth:`~blockdiff.sides.live.LiveSide.call_module`). A float32 reference's activations reach
    a bfloat16 candidate's module in bfloat16; where they are then the same bits as the
    candidate's own, the experiment is the candidate's own call."""
    found = {}
    for role, t in hidden.items():
        to = received_dtype(role, own)
        found[role] = t.to(to) if to is not None and t.is_floating_point() and to.is_floating_point else t
    return found


def same_call(call: Site, own: Site, dtype: torch.dtype | None) -> bool:
    """Whether ``call`` replayed with its floating tensors cast to ``dtype`` is the call
    ``own`` recorded: the same structure and plain values, every tensor the same bits, and
    no argument held by reference (an object) that is not the very same object."""
    return same_arguments((call.args, call.kwargs), (own.args, own.kwargs), dtype)


def same_arguments(recorded: Any, own: Any, dtype: torch.dtype | None) -> bool:
    """Whether the recorded structure ``recorded``, its floating tensors cast to ``dtype``,
    is ``own``: :func:`same_call` of any structure (a call's arguments, a module's output)."""
    mine: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    shape_a = map_structure(recorded, lambda t: mine.append(t) or _TENSOR)
    shape_b = map_structure(own, lambda t: theirs.append(t) or _TENSOR)
    if shape_a != shape_b:
        return False
    objects_a: list[Opaque] = []
    objects_b: list[Opaque] = []
    map_opaque(shape_a, lambda o: o.cache or objects_a.append(o))
    map_opaque(shape_b, lambda o: o.cache or objects_b.append(o))
    if any(a.value is None or a.value is not b.value for a, b in zip(objects_a, objects_b)):
        return False
    for a, b in zip(mine, theirs):  # one tensor at a time: most calls differ in the first
        if dtype is not None and a.is_floating_point() and dtype.is_floating_point:
            a = a.to(dtype)
        if not same_bits({"t": a}, {"t": b}):
            return False
    return True


_TENSOR = object()  # where a tensor sits in a call's structure (same_call)


__all__ = ["Experiments", "aligned", "as_received", "check_shapes", "comparable", "relative", "same_arguments", "same_call"]
