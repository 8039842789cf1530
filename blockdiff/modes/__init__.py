"""Executions as modes: one file per way of running the two sides, behind one protocol.

=================  ===========================================================================
``base.py``        :class:`~blockdiff.modes.base.Mode`: what the engine asks of an execution
``options.py``     :class:`~blockdiff.modes.options.Options`, every execution's keywords, and
                   the rules of every run
``recording.py``   each side's run into a store, in memory or streamed; the retry loop
``judging.py``     two recorded sides localized into a report (the one path every mode ends in)
``forward.py``     one forward pass: live, replayed against a dump, or two dumps offline
``decode.py``      decode steps with a cache, each step localized; decode dumps
``backward.py``    the forward, then its gradients localized from the head to the embedding
``teacher.py``     a candidate in another runtime (llama.cpp, MLX): runs with the reference's
                   values substituted site by site
``invariance.py``  each row of a batch alone against itself inside the batch
=================  ===========================================================================

The engine (:mod:`blockdiff.engine`) opens the sides and runs the mode :func:`chosen`
returns; :func:`refuse` checks every mode's rules on the options, in one place, before
anything is opened. A new execution is a file here and one entry in :data:`MODES`
(docs/architecture.md, "Adding an execution"). Invariance runs one model, not two sides,
and is reached by its own entry point (``blockdiff invariance``).
"""

from __future__ import annotations

from ..sides import Side
from .backward import Backward
from .base import Mode
from .decode import Decode
from .forward import Forward
from .options import Kinds, Options, common_refusal
from .teacher import TeacherForced
from .options import refuse as _refuse

# The executions, in the order they are asked whether the options are theirs: the first
# that says yes runs (the forward always does).
MODES: tuple[Mode, ...] = (Backward(), Decode(), TeacherForced(), Forward())


def refuse(options: Options, kinds: Kinds) -> None:
    """Raise :class:`~blockdiff.errors.OptionsError` for ``options`` that a run on sides of
    ``kinds`` cannot take: the rules of every run, then each mode's."""
    _refuse(options, kinds, [common_refusal, *(mode.refusal for mode in MODES)])


def chosen(options: Options, ref: Side, cand: Side) -> Mode:
    """The execution ``options`` ask for (or the opened sides: a dump of a decode, a
    candidate in another runtime)."""
    return next(mode for mode in MODES if mode.asked(options, ref, cand))


def alone(options: Options) -> Options:
    """``options`` for a run whose candidate is the reference's spec built again."""
    for mode in MODES:
        options = mode.alone(options)
    return options


__all__ = ["MODES", "Mode", "Options", "alone", "chosen", "refuse"]
