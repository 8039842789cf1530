"""The teacher-forced mode: a candidate in another runtime (llama.cpp, MLX) localized by
runs with replacement (docs/runtimes.md).

Asked for when the opened candidate ``replaces`` (:class:`~blockdiff.sides.Side`): its
modules cannot be called one at a time, so after the reference is recorded the runtime
runs three times on the reference's inputs — free (drift), replacing every site's value
with the reference's (local errors and the residual), replacing only the block outputs
(each block whole) — and :class:`~blockdiff.sides.replaced.TeacherForced` answers the
localizer's experiments from those runs. The report is the forward's, with a note saying
how the candidate was judged.
"""

from __future__ import annotations

from typing import Any

from ..errors import OptionsError
from ..report import Note, Report
from ..sides import Side
from ..sides.replaced import TeacherForced as Forced
from .forward import with_inputs
from .judging import localize
from .options import Kinds, Options
from .recording import dump_inputs, in_memory, takes


class TeacherForced:
    """One forward of each side, the candidate's repeated with the reference's values
    substituted site by site."""

    name = "teacher-forced"

    def asked(self, options: Options, ref: Side, cand: Side) -> bool:
        return cand.replaces

    def refusal(self, options: Options, kinds: Kinds) -> OptionsError | None:
        return None  # what it refuses depends on the opened candidate: see run

    def alone(self, options: Options) -> Options:
        return options

    def run(self, ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
        if options.stream or options.save_dumps is not None or options.max_memory is not None:
            raise OptionsError(
                ("{max_memory} does not take" if options.max_memory is not None else "{stream} and {save_dumps} do not take")
                + " a candidate run in another runtime ({runtime}): it is judged in memory",
                runtime=cand.meta.get("runtime", "not PyTorch"),
            )
        unrecorded = [side for side in (ref, cand) if side.store is None]  # a dump's record is its own
        if not ref.live:
            return self._judged(ref, cand, dump_inputs(ref, cand, inputs), options, record=unrecorded)
        return with_inputs(ref, inputs, lambda concrete: self._judged(ref, cand, concrete, options, record=unrecorded))

    def _judged(self, ref: Side, cand: Side, inputs: Any, options: Options, *, record: list[Side]) -> Report:
        takes(cand, inputs)
        runtime = cand.meta.get("runtime", "the candidate's runtime")

        def judge(free_run: Any) -> Report:
            assert ref.store is not None
            forced = Forced.judged(cand, inputs, ref.store, runtime)
            report = localize(ref, forced, inputs, options, free_run=free_run)
            report.notes.append(
                Note("teacher-forced", f"teacher-forced: {runtime} cannot run one module at a time, so each local error is "
                "its value in a run of the candidate where every site's value was replaced by the "
                "reference's as it was computed, each block check a run where the block outputs were; "
                "drift is its free run")
            )
            return report

        with ref.running(), cand.running():
            return in_memory(record, inputs, judge, lockstep=False)


__all__ = ["TeacherForced"]
