"""Sides: what the engine asks of an implementation, whatever kind it is.

A *side* (docs/design.md, "Sides") is the reference or the candidate. This module is the
protocol and nothing else; each kind is a file beside it, and :func:`~blockdiff.sides.factory.open_side`
is the one place a spec (a model, a factory, a model spec, a Hugging Face directory, an
``.h5`` dump, an ``.onnx`` graph, a model split over launched ranks) becomes one:

========================  =================================================================
``live.py``               :class:`LiveSide`: an ``nn.Module`` as it runs (eager; compiled
                          code judged as compiled, ``compiled.py``); :class:`PrecisionSide`:
                          its code at another precision (noise floors; ``precision.py``)
``sharded.py``            ``ShardedSide`` (every rank every block), ``PipelineSide`` (a stage
                          per rank)
``dump.py``               ``DumpSide``: a dump's sites; runs nothing
``onnx.py``               ``OnnxSide``: an ONNX Runtime graph, experiments as sub-graphs
========================  =================================================================

The localizer (:mod:`blockdiff.localize`) and the experiments never branch on the kind.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Protocol

import torch
from torch import nn

from ..capture import Hold, Recording
from ..hookmap import Layout
from ..inputs import Inputs
from ..report import BlockResult, StageResult
from ..site import Site
from ..store import SiteStore

# Activations by role ("primary", "encoder_hidden_states", "arg3", ...), as Site.hidden_inputs.
Hidden = dict[str, torch.Tensor]
# What a localization judged: its stage results and block results, in order.
Judged = tuple[list[StageResult], list[BlockResult]]
# Modules frozen in a block run, by (sub-path, ordinal): (site whose output answers, site
# whose output gives the structure and dtypes: the running side's own record).
Frozen = dict[tuple[str, int], tuple[Site, Site]]


class Judging(Protocol):
    """What a side sees of the localization it completes (:meth:`Side.localized`): the
    localizer, as far as a kind of side needs it."""

    ref: "Side"
    notes: list[str]  # the report's notes, in order
    moe: list[dict[str, Any]]  # routing statistics per MoE block
    nonfinite: Any  # the NaN/Inf scan (found(), merge())
    tolerance: Any  # the Tolerance (threshold(subpath, dtype, floor))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype comparisons are judged in."""


class Side(Protocol):
    """What the engine needs of one side of a diff: who it is, its sites, the experiments
    it runs, and how it completes a localization.

    Who: ``name``, ``meta``, ``layout``, ``device``, ``dtype``, ``lockstep``, ``versions``.
    Sites: ``store``, filled by ``record`` on the ``inputs`` it takes. Experiments: ``call_module``, ``run_block``, ``child_calls``,
    ``attribute`` — a side that cannot run (``live`` false) is judged on drift only;
    ``decodes``: it runs decode steps with caches of its own (``stepping()``, a live
    PyTorch model's, docs/decode.md); ``backward_refused``: why it cannot run a backward
    (``None``: ``gradient_runs()``, docs/backward.md).
    Precision: ``in_precision`` (the noise floor's side), ``runs_as``. Running: ``running``
    (the context its runs need), ``not_streamed``. Completing: ``holds``, ``localized``.
    """

    name: str  # "reference" or "candidate"
    layout: Layout
    store: SiteStore | None  # its record: None until ``record`` (or the engine) fills it
    meta: dict[str, Any]  # how the report describes it: model, class, device, dtype, hook_map

    # What it is, read only (a kind answers with a class attribute, a narrower one where
    # it has one answer: a pipeline's ``backward_refused`` is a ``str``).
    @property
    def live(self) -> bool:
        """Whether it can run experiments (a dump cannot)."""

    @property
    def decodes(self) -> bool:
        """Whether it runs decode steps, each experiment with a cache of its own."""

    @property
    def replaces(self) -> bool:
        """Whether it runs in a runtime whose modules blockdiff cannot call one at a time,
        and is judged by one run with every site's value replaced by the reference's
        (teacher-forced: ``replaced``, :mod:`blockdiff.modes.teacher`)."""

    @property
    def drills(self) -> bool:
        """Whether its modules' children can be run apart (the drill-down)."""

    @property
    def backward_refused(self) -> str | None:
        """Why it cannot run a backward (--backward), or ``None``."""

    @property
    def lockstep(self) -> bool:
        """Whether it runs on every rank of a launched run, in lockstep."""

    @property
    def not_streamed(self) -> str | None:
        """Why it cannot be recorded into a dump (--stream), or ``None``."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def versions(self) -> dict[str, str]:
        """The package versions its code comes from (what a dump records)."""

    def inputs(self, given: Any) -> tuple[Any, str | None]:
        """The concrete inputs this side runs on for the inputs a user gave (a tensor, a
        file, :class:`~blockdiff.inputs.RandomTokens`; a dump: its own), and a note when
        blockdiff made up part of them. Raises ``InputError`` for inputs it cannot take."""

    def running(self) -> ContextManager[Any]:
        """The context every run of this side needs (eval mode, compiled-code limits), entered
        once around a diff; restored after."""

    def record(self, inputs: Any, store: SiteStore, *, hold: Hold | None, progress: Callable[[int, int], None] | None = None) -> Any:
        """Run the whole model once, recording every site into ``store``; ``hold``: what the
        store gets of the model's own tensors (``None``: copies; :func:`~blockdiff.capture.record_once`)."""

    def replaced_runs(self, inputs: Any, reference: SiteStore) -> tuple[SiteStore, SiteStore]:
        """A side that ``replaces``: its runs on ``inputs`` with the values of ``reference``
        substituted — at every site, and at the block outputs only — each recorded as it
        computed them (:mod:`blockdiff.sides.replaced`)."""

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        """The output of module ``path`` called with ``call``'s arguments, its
        activations replaced by ``hidden`` (cast to the call's own dtypes)."""

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """Block ``path`` run on ``call`` with ``hidden``; the modules of ``frozen`` answer
        with recorded outputs. Returns the block's output and the hidden input that reached
        each module of ``modules`` (block-relative path → sub-path), by (sub-path, ordinal)."""

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        """Module ``path`` run on ``call`` with ``hidden``, the calls of its innermost
        children recorded (drill-down)."""

    def attribute(self, path: str) -> Any:
        """An attribute of the model (``model.layers.0.mlp.capacity``); ``None`` when absent."""

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "Side | None":
        """This side's code run in ``dtype`` on ``device`` (noise floors); ``None`` when it
        cannot run."""

    def runs_as(self, other: "Side") -> bool:
        """Whether ``other`` computes what this side does, so that its record is this
        side's run (a floor side and a candidate that is the reference's own cast)."""

    def holds(self, block: int | None, module: str) -> bool:
        """Whether this process judges block ``block``, or (``block`` None) the stage module
        ``module``, with this side as the candidate: a pipeline stage only the ones its rank
        holds; every other side all of them."""

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """The stage and block results of a localization with this side as the candidate:
        ``judge()`` (the localizer's run), completed as this kind of side needs — what
        other ranks judged (a pipeline stage), the replica check (a sharded model), a note
        on what recording changed (an ONNX graph). Most sides return ``judge()``."""

    # The roles a side holds beyond the forward experiments; ``None``: it has none.
    def stepping(self) -> Stepping | None:
        """Its decode steps (``decodes``): each experiment's cache, carried from step to step."""

    def gradient_runs(self) -> GradientRuns | None:
        """Its backward (``backward_refused`` is ``None``): its model's free-running backward
        and a module's."""


class SideDefaults:
    """The protocol's members most sides answer alike: runs alone, can be streamed, needs no
    context, no model attributes, no other precision, no twin, every block judged here, a
    localization as the localizer runs it."""

    lockstep = False
    decodes = False
    replaces = False
    drills = True
    backward_refused: str | None = "it is not a live PyTorch model"
    not_streamed: str | None = None
    @property
    def versions(self) -> dict[str, str]:
        return {}

    def inputs(self, given: Any) -> tuple[Any, str | None]:
        return given, None

    def running(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def attribute(self, path: str) -> Any:
        return None

    def replaced_runs(self, inputs: Any, reference: SiteStore) -> tuple[SiteStore, SiteStore]:
        raise NotImplementedError(f"the {getattr(self, 'name', 'side')} does not run with replaced values")

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "Side | None":
        return None

    def runs_as(self, other: "Side") -> bool:
        return False

    def holds(self, block: int | None, module: str) -> bool:
        return True

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        return judge()

    def stepping(self) -> Stepping | None:
        return None

    def gradient_runs(self) -> GradientRuns | None:
        return None


# -- the roles a side may hold beyond the forward experiments (a live PyTorch model's:
# sides/stepping.py, sides/gradients.py), as the code outside sides/ reaches them


class Stepping(Protocol):
    """A side's decode steps (``Side.stepping()``, docs/decode.md): the stepper its model
    runs with, and each experiment's cache — a *stream*, one per kind of experiment and
    module — carried from step to step."""

    stepper: Any  # how its model runs a step and makes a cache (blockdiff.decoding); None outside a decode

    @property
    def model(self) -> nn.Module:
        """The model its steps run."""

    def start(self, stepper: Any) -> None:
        """Decode steps start with ``stepper`` (``None``: none do): every stream anew."""

    def begin_step(self) -> None:
        """A decode step starts."""

    def shadow(self, key: tuple, call: Site, hidden: Hidden | None = None) -> bool:
        """Whether experiment ``key`` on the side's own ``call`` may be answered by the
        call's recorded output at this step (its stream not made yet)."""

    def made_stream(self, key: tuple) -> Any:
        """The stream of experiment ``key`` if made, ``None`` while it shadows the side's run."""

    def keeps_cache(self, path: str, call: Site) -> bool:
        """Whether module ``path``'s ``call`` reads and writes a cache."""

    def remember(self, path: str, call: Site, hidden: Hidden | None) -> None:
        """Module ``path`` ran on ``call`` at this step: what a later step's drill-down replays."""


# Forward replacements for one run of a module, by path below it: make(original) → forward.
Replaced = dict[str, Callable[[Callable], Callable]]
# A module's innermost child calls, each with the gradient of its hidden input and of its output.
ChildGradients = list[tuple[Site, torch.Tensor | None, torch.Tensor | None]]


class GradientRuns(Protocol):
    """A side's backward (``Side.gradient_runs()``, docs/backward.md): its model's
    free-running backward (a :class:`~blockdiff.sides.gradients.Gradients`), a module's
    backward on given activations, and the graphs its forward diff's experiments keep for it."""

    @property
    def cast(self) -> torch.dtype | None:
        """The dtype its replayed floating arguments are cast to (a floor side's), or ``None``."""

    def module(self, path: str) -> nn.Module:
        """The module at ``path`` it runs."""

    def record_with_gradients(
        self, inputs: Inputs, store: SiteStore, loss: Callable[[Any, Inputs], torch.Tensor], *,
        hold: Hold | None, progress: Callable[[int, int], None] | None = None, parameters: bool = True,
    ) -> tuple[Recording, Any]:
        """The side's record and its free-running backward in one run (``None``: recorded alone)."""

    def record_gradients(
        self, inputs: Inputs, loss: Callable[[Any, Inputs], torch.Tensor], *, parameters: bool = True,
        recorded: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> Any:
        """The whole model's free-running backward on ``inputs``."""

    def backward_module(
        self, path: str, call: Site, hidden: Hidden, grad: torch.Tensor, *,
        replaced: Replaced | None = None, parameters: bool = True,
    ) -> tuple[Hidden, dict[str, torch.Tensor]]:
        """Module ``path``'s backward at ``call`` from ``grad``: its activations' and
        parameters' gradients."""

    def backward_child_calls(self, path: str, call: Site, hidden: Hidden | None) -> list[Site]:
        """Module ``path``'s child calls, as a backward's pairing of children compares them."""

    def child_gradients(self, path: str, call: Site, hidden: Hidden, grad: torch.Tensor) -> ChildGradients:
        """Module ``path``'s backward, each innermost child's call and gradients recorded."""

    def keep_graphs(self) -> None:
        """From here, its module experiments keep their graphs (the forward diff of a backward)."""

    def close_graphs(self) -> None:
        """The forward diff is over: its module runs from here are the backward's own."""

    def drop_graphs(self) -> None:
        """What the backward did not take is let go."""


def received_dtype(role: str, own: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype a replayed call's activation in ``role`` is handed over in: ``cast`` (a
    side running at another precision), else the dtype of the call's own tensor in that
    role (``own``), else unchanged (``None``)."""
    return cast or (own[role].dtype if role in own else None)


__all__ = [
    "Side", "SideDefaults", "Judging", "Judged", "Hidden", "Frozen", "received_dtype",
    "Stepping", "GradientRuns", "Replaced", "ChildGradients",
]
