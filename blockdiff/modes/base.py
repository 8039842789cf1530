"""The mode protocol: what the engine asks of an execution.

An *execution* (docs/design.md, "Executions as modes") is one way of running the two sides —
one forward pass, decode steps with a cache, the backward. Each is a class in a file of its
own beside this one, registered in :data:`blockdiff.modes.MODES`; the engine opens the
sides, asks the modes in order which one the options (and the reference) ask for, and runs
it. A mode says which options it refuses before any side is opened (:meth:`Mode.refusal`,
checked for every mode in one place, :func:`blockdiff.modes.refuse`), records its sides and
ends in :func:`~blockdiff.modes.judging.localize`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import OptionsError
from ..report import Report
from ..sides import Side
from .options import Kinds, Options


class Mode(Protocol):
    """One execution."""

    name: str  # how docs and errors name it: "forward", "decode", "backward"

    def asked(self, options: Options, ref: Side, cand: Side) -> bool:
        """Whether ``options`` (or what the opened sides are: a dump of a decode, a
        candidate run in another runtime) ask for this execution."""

    def refusal(self, options: Options, kinds: Kinds) -> OptionsError | None:
        """What this execution refuses of ``options`` on sides of ``kinds``, checked before
        anything is opened; ``None`` when it takes them (or is not asked for)."""

    def alone(self, options: Options) -> Options:
        """``options`` for a run whose candidate is the reference's spec built again (no
        candidate given): what "the model against itself" means for this execution."""

    def run(self, ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
        """Record both sides and localize them into a report. ``inputs`` as the caller gave
        them (the reference makes them concrete: random tokens, a dump's own)."""


__all__ = ["Mode"]
