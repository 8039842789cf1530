"""The forward mode: one forward pass of each side, localized (``blockdiff diff``).

What the sides can do picks the way it records them:

=============  =============  ==================================================================
reference      candidate      how
=============  =============  ==================================================================
live           live           both recorded (in memory, or streamed into dumps), every
                              experiment run, calibrated floors
dump           live           replay: the candidate runs on the dump's inputs
dump           dump           offline comparison: drift at every site
=============  =============  ==================================================================

:func:`live` is also the backward's recording (:mod:`blockdiff.modes.backward` hands it
the recorder that keeps the forward's graph).
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from .. import distributed
from ..capture import Recording
from ..dump import DumpReader
from ..errors import DumpError, InputError, OptionsError
from ..experiments import StoredFloors
from ..inputs import Inputs, check_inputs, digest
from ..report import Note, Report
from ..sides import Side
from ..tolerance import Tolerance
from .judging import localize
from .options import Kinds, Options
from .recording import dump_inputs, in_memory, stream, takes

# How a live run judges what it recorded: ``judge(free_run)``, where ``free_run(side)``
# records the reference at the candidate's precision (drift floors).
Judge = Callable[[Callable[[Side], Any]], Report]


class Forward:
    """One forward pass (the default execution)."""

    name = "forward"

    def asked(self, options: Options, ref: Side, cand: Side) -> bool:
        return True

    def refusal(self, options: Options, kinds: Kinds) -> OptionsError | None:
        return None

    def alone(self, options: Options) -> Options:
        return options

    def run(self, ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
        if not ref.live:
            return replayed(ref, cand, inputs, options) if cand.live else offline(ref, cand, options)
        return with_inputs(ref, inputs, lambda concrete: live(ref, cand, concrete, options))


def with_inputs(ref: Side, inputs: Any, run: Callable[[Inputs], Report]) -> Report:
    """``run`` on the concrete inputs the live reference makes of ``inputs`` (random token
    ids within its vocabulary, a token file's), the report saying what it made up."""
    concrete, made = ref.inputs(inputs)
    report = run(concrete)
    if made is not None:
        report.notes.insert(0, Note("inputs", f"inputs: {made}"))
    return report


def live(
    ref: Side, cand: Side, inputs: Inputs, options: Options, *, judge: Judge | None = None,
    record: Callable[..., Recording] | None = None,
) -> Report:
    """Both sides live: record each (in memory, or streamed into dumps) and localize.
    ``judge`` and ``record``: a mode's own (the backward's); the forward's localization and
    ``side.record`` when not given."""
    takes(cand, check_inputs(inputs))
    refused = next((side.not_streamed for side in (ref, cand) if side.not_streamed), None)
    on_disk = options.save_dumps is not None or options.stream or options.max_memory is not None
    if refused and on_disk:
        raise OptionsError(
            ("{max_memory} does not take" if options.max_memory is not None else "{stream} and {save_dumps} do not take")
            + " {refused}; diff in memory, or capture the reference alone (blockdiff capture) and replay against it",
            refused=refused,
        )
    lockstep = ref.lockstep or cand.lockstep
    judge = judge or (lambda free_run: localize(ref, cand, inputs, options, free_run=free_run))
    with ExitStack() as stack:
        stack.enter_context(ref.running())
        stack.enter_context(cand.running())
        if not on_disk:
            return in_memory([ref, cand], inputs, judge, lockstep=lockstep, record=record)
        if options.save_dumps is not None and distributed.rank() == 0:
            folder = Path(options.save_dumps)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DumpError(f"cannot create {folder}: {exc.strerror or exc}", path=str(folder)) from None
        for side in (ref, cand):
            path = folder / f"{side.name}.h5"
            stream(side, inputs, path, release=True)
            # The dumps were just written by this process: no need to probe them.
            side.store = stack.enter_context(DumpReader(path, probe=False))

        def streamed_free_run(side: Side) -> DumpReader:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
            stream(side, inputs, scratch / "free-run.h5", release=True)
            return stack.enter_context(DumpReader(scratch / "free-run.h5", probe=False))

        return judge(streamed_free_run)


def replayed(ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
    """A reference dump and a live candidate: the candidate runs on the dump's inputs."""
    stored = dump_inputs(ref, cand, inputs)
    with cand.running():
        report = in_memory(
            [cand], stored, lambda free_run: localize(ref, cand, stored, options, free_run=free_run), lockstep=cand.lockstep
        )
    report.notes.insert(0, Note("replay", f"replay: the reference is the dump {ref.meta['dump']}"))
    changed = _version_changes(ref.versions, cand.versions)
    if changed:
        report.notes.insert(1, Note("versions-differ", f"the dump was captured under other package versions ({changed}): code may have moved between modules"))
    return report


def _version_changes(stored: Any, current: dict[str, str]) -> str:
    """``transformers 4.57.0 → 5.23.0, ...`` for the packages both record with different versions."""
    if not isinstance(stored, dict):
        return ""
    return ", ".join(f"{name} {stored[name]} → {version}" for name, version in current.items() if name in stored and stored[name] != version)


def offline(ref: Side, cand: Side, options: Options) -> Report:
    """Two dumps: drift at every site, against the reference's stored drift floors for the
    candidate's precision, else fixed thresholds."""
    ref_inputs, cand_inputs = ref.inputs(None)[0], cand.inputs(None)[0]
    if ref_inputs is not None and cand_inputs is not None and digest(ref_inputs) != digest(cand_inputs):
        raise InputError(
            f"the dumps were captured on different inputs ({ref.meta['dump']}: {digest(ref_inputs)}, "
            f"{cand.meta['dump']}: {digest(cand_inputs)}); capture both on the same token ids"
        )
    assert ref.store is not None  # a dump side holds its store from the start
    floors = ref.store.floors()
    stored = StoredFloors.of(floors, ref, cand) is not None
    tolerance = options.tolerance or Tolerance()
    if tolerance.policy is None:  # the user's choice stands; blockdiff's follows the floors
        tolerance = replace(tolerance, policy="calibrated" if stored else "fixed")
    report = localize(ref, cand, ref_inputs, replace(options, tolerance=tolerance, fast_path=False, capacity_factors=()))
    basis = "its stored drift floors" if stored else "fixed thresholds"
    report.notes.append(
        Note("offline-drift", "offline comparison of two dumps: only drift could be computed, judged against "
        f"{basis}; local errors (which sub-path is wrong rather than where the error shows) "
        f"need a live candidate: blockdiff diff {ref.meta['dump']} CANDIDATE_MODEL")
    )
    return report


__all__ = ["Forward", "Judge", "live", "offline", "replayed", "with_inputs"]
