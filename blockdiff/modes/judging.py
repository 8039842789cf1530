"""Judging: two recorded sides localized into a report — the one path every mode ends in.

:func:`localize` builds the :class:`~blockdiff.localize.Localizer` (tolerance resolved for
the two precisions, floors live or stored, the drift floors' free run), runs it stage by
stage and block by block inside the candidate's own completion
(:meth:`~blockdiff.sides.Side.localized`), and writes what the verdict needs said: the
ranking, unexplained drift, which floors judged, the conversion diagnosis.
:func:`measure_floors` is the same experiments run as a model against itself at one
precision (stored floors, ranking baselines).
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Callable, Iterator

import torch

from .. import conversion
from .._version import __version__
from ..dtypes import precision_label
from ..dump import DumpReader
from ..dump.memory import release_freed_memory
from ..errors import run_model_code
from ..experiments import StoredFloors
from ..inputs import Inputs, digest
from ..localize import Localizer, NonfiniteScan, States
from ..report import Note, Report
from ..sides import Side
from ..site import describe_key
from ..tolerance import Tolerance, working_dtype
from ..vocab import DRIFT
from .options import Options, OptionsError
from .recording import counted, record_in_memory

def localize(
    ref: Side, cand: Side, inputs: Inputs | None, options: Options, *, free_run: Callable[[Side], Any] | None = None,
    stateful: bool = False, states: States | None = None, no_floors: str | None = None,
) -> Report:
    """Localize two recorded sides into a report.

    Args:
        free_run: ``free_run(side)`` records the reference at the candidate's precision
            for drift floors, into a store it returns (in memory when not given). Floors a
            reference dump stored serve where it has them.
        stateful: the experiments carry state from call to call (decode steps' caches).
        states: the mode's checks of what each block keeps from call to call, scheduled
            by the localizer after the block's sub-path checks (:data:`~blockdiff.localize.States`).
        no_floors: why a reference dump stores no floors for this run, where the mode
            knows better than "capture it with --floors".
    """
    tolerance = (options.tolerance or Tolerance()).resolved(same_dtype=ref.dtype == cand.dtype, same_device=ref.device == cand.device)
    assert ref.store is not None, "localize needs both sides recorded"
    floors = None if ref.live else ref.store.floors()
    localizer = Localizer(
        ref, cand, tolerance, fast_path=options.fast_path, capacity_factors=options.capacity_factors,
        stored=StoredFloors.of(floors, ref, cand), drill_all=options.rank, states=states,
    )
    localizer.experiments.stateful = stateful
    floor = localizer.experiments.floor_side
    if floor is not None and cand.live and inputs is not None:
        # Drift floors: the reference's own free run at the candidate's precision. When the
        # candidate is that very code (a model against its own cast: the same classes,
        # settings and weights at that precision), its own record is the free run.
        if cand.store is not None and floor.runs_as(cand):
            localizer.experiments.free_run = cand.store
        else:
            record = free_run or (lambda side: record_in_memory(side, inputs))
            localizer.experiments.free_run = record(floor)

    def judge() -> tuple[list, list]:
        stages = run_model_code("candidate", lambda: list(localizer.stages()))
        blocks = run_model_code("candidate", lambda: counted(_block_by_block(localizer), "localize", len(cand.layout.blocks)))
        return stages, blocks

    with torch.inference_mode():
        # The candidate's kind completes what was judged (a pipeline's ranks share theirs).
        stages, blocks = cand.localized(localizer, judge)
    report = Report(
        reference=dict(ref.meta),
        candidate=dict(cand.meta),
        inputs=describe_inputs(inputs),
        tolerance=tolerance.to_dict(localizer.experiments.dtype),
        stages=stages,
        blocks=blocks,
        moe=localizer.moe,
        created=now(),
        version=__version__,
    )
    _nonfinite_notes(report, localizer.nonfinite)
    report.notes.extend(localizer.notes)
    if options.rank:
        _ranked(report, ref, cand, inputs, options)
    _unexplained_drift_note(report)
    _floors_note(report, localizer, tolerance, floors, no_floors)
    if report.diverged:  # a converted weight that explains a divergence is named (blockdiff.conversion)
        conversion.diagnose(ref, cand, report)
    return report


def _ranked(report: Report, ref: Side, cand: Side, inputs: Inputs | None, options: Options) -> None:
    """Every check ranked by its error over its threshold, or over the reference's own
    floor at ``options.baseline_dtype``."""
    baseline = None
    if options.baseline_dtype is not None:
        if not ref.live:
            raise OptionsError("a baseline precision ({baseline_dtype}) needs a live reference, not a dump")
        with torch.inference_mode():
            baseline = run_model_code(
                "reference", measure_floors, ref, ref.store, inputs, options.baseline_dtype, cand.device, drill_all=True
            )
        report.tolerance["baseline"] = precision_label(options.baseline_dtype, cand.device)
    report.ranking = report.rank(baseline)


def _unexplained_drift_note(report: Report) -> None:
    first = report.first_divergence
    if first is None or first.subpath != DRIFT:
        return
    basis = (
        "calibrated against the reference's own free run at the candidate's precision"
        if first.check.threshold.basis == "calibrated"
        else f"{first.check.threshold.basis} threshold"
    )
    report.notes.append(
        Note("unexplained-drift", f"unexplained drift: the free-running candidate drifts past its tolerance ({basis}) at "
        f"{first.where.removesuffix(' unexplained drift')} ({first.module}) while every local check "
        "before it passes: the candidate runs something its modules "
        "do not compute when called alone (a compiled graph, a fused kernel, code the hook map does "
        "not see: `blockdiff arch MODEL`), or precision accumulates more than in the reference's own "
        "code (compare precisions with --tolerance calibrated; accept it with --tol drift=VALUE)")
    )


def _floors_note(report: Report, localizer: Localizer, tolerance: Tolerance, floors: Any, no_floors: str | None) -> None:
    """Which floors judged: stored ones, or none where calibration was asked for."""
    experiments = localizer.experiments
    label = precision_label(working_dtype(localizer.ref.dtype, localizer.cand.dtype), localizer.cand.device)
    if experiments.stored is not None:
        report.tolerance["floors"] = f"stored {label}"
        report.notes.append(Note("stored-floors", f"calibrated (stored floors): the dump's noise floors measured at {label}"))
    elif tolerance.calibrated and not experiments.calibrated:
        if floors:
            why = f"it stores floors for {', '.join(floors)}, not for the candidate's {label}"
        else:
            why = no_floors or f"it stores none: capture it with --floors {label}"
        report.notes.append(
            Note("fixed-thresholds", "calibrated tolerance needs the live reference modules or floors stored in the dump "
            f"({why}): fixed thresholds were used")
        )
        report.tolerance["policy"] = "fixed"


def measure_floors(
    side: Side, store: Any, inputs: Inputs, dtype: torch.dtype, device: torch.device, *, drill_all: bool = False
) -> dict[str, Any]:
    """Every check's noise floor at one precision, by check key: the experiments of a
    calibrated diff of the model against itself (``side``, recorded into ``store``),
    keeping what each floor measured (``drill_all``: every module's children's too)."""
    side.store = store
    localizer = Localizer(side, side, Tolerance("calibrated"), precision=(dtype, device), drill_all=drill_all)
    experiments = localizer.experiments
    experiments.measured = {}
    assert experiments.floor_side is not None
    experiments.free_run = record_in_memory(experiments.floor_side, inputs)
    with torch.inference_mode():
        list(localizer.stages())
        list(localizer.blocks())
        # Drift floors of every site, for offline comparisons (a diff judges block outputs').
        for site in [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]:
            experiments.with_floor(f"drift:{describe_key(site.key)}", lambda side: experiments.free_run_floor(site))  # called at once
    return experiments.measured


def _block_by_block(localizer: Localizer) -> Iterator:
    """The localizer's blocks. Read from dumps: what the stages left (the logits) handed
    back to the system first, and each block's records dropped from the dumps once it is
    judged (:meth:`DumpReader.forget`): a streamed diff holds one block's, not every
    block's."""
    stores = (localizer.ref.store, localizer.cand.store, localizer.experiments.free_run)
    dumps = {id(store): store for store in stores if isinstance(store, DumpReader)}
    if dumps:
        release_freed_memory()
    for result in localizer.blocks():
        yield result
        for dump in dumps.values():
            dump.forget(result.index)


def _nonfinite_notes(report: Report, scan: NonfiniteScan) -> None:
    found = scan.result()
    report.first_nonfinite = found.get("candidate")
    report.reference_nonfinite = found.get("reference")
    if report.reference_nonfinite is not None:
        nf = report.reference_nonfinite
        report.notes.append(
            Note("reference-nonfinite", f"the reference itself holds {nf['nonfinite_ref']} NaN/Inf values from {nf['site']} "
            f"({nf['module']}) on: check the inputs and the reference; comparisons there use the "
            "finite elements")
        )


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def describe_inputs(inputs: Inputs | None) -> dict[str, Any]:
    if inputs is None:
        return {"kind": None, "shape": None, "digest": None}
    if isinstance(inputs, torch.Tensor):
        kind, shape = "token_ids", list(inputs.shape)
    else:
        kind, shape = ("args" if isinstance(inputs, tuple) else "kwargs"), None
    return {"kind": kind, "shape": shape, "digest": digest(inputs)}


__all__ = ["describe_inputs", "localize", "measure_floors", "now"]
