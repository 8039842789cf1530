"""The backward mode (``--backward``): the forward diff, then the gradients of the same run
localized from the head to the embedding (:mod:`blockdiff.backward` holds its experiments;
docs/backward.md).

Each live side is recorded once, its forward kept with the graph its backward
differentiates (:class:`~blockdiff.backward.Recorder`); the forward's localization runs as
in :mod:`~blockdiff.modes.forward`, and :func:`~blockdiff.backward.judge` adds the
backward's verdict to its report.
"""

from __future__ import annotations

from typing import Any

from .. import backward
from ..errors import OptionsError
from ..report import Report
from ..sides import Side
from .forward import live, with_inputs
from .judging import localize
from .options import Kinds, Options


class Backward:
    """The forward diff and its backward, in memory."""

    name = "backward"

    def asked(self, options: Options, ref: Side, cand: Side) -> bool:
        return options.backward

    def refusal(self, options: Options, kinds: Kinds) -> OptionsError | None:
        if not options.backward:
            if options.loss is not None:
                return OptionsError("{loss} sets the loss of {backward}; give {backward} too")
            return None
        if "dump" in kinds or options.decode:
            return OptionsError("{backward} runs both models live, one forward pass: not with a dump, nor with {decode}")
        if options.save_dumps is not None or options.stream or options.rank:
            return OptionsError("{backward} runs in memory: not with {stream}, {save_dumps} or {rank}")
        if options.max_memory is not None:
            return OptionsError(
                "{backward} keeps every block's weights and activations for the gradients: not with {max_memory}; "
                "diff the backward with the models in memory"
            )
        return None

    def alone(self, options: Options) -> Options:
        return options

    def run(self, ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
        backward.refuse_backward(ref, cand)
        recorder = backward.Recorder(ref, options.loss)

        def judged(concrete: Any) -> Report:
            return live(
                ref, cand, concrete, options, record=recorder.record,
                judge=lambda free_run: backward.judge(
                    ref, cand, concrete, localize(ref, cand, concrete, options, free_run=free_run),
                    tolerance=options.tolerance, loss=options.loss, recorded=recorder,
                ),
            )

        return with_inputs(ref, inputs, judged)


__all__ = ["Backward"]
