"""Assertions: a diff as a test verdict.

The test-suite front door to the engine (the pytest plugin's fixtures call it, and so do
the golden checks of :mod:`blockdiff.golden`): run the engine, and when a divergence is
found raise :class:`DivergenceError`, an ``AssertionError`` whose message
is the report for people in a fixed order: the first divergence (block, sub-path,
module, metric against threshold) on the first line, so pytest's short summary shows it;
then the rendered report (heatmap and table of local errors); then what to do next.

Tolerances are keyword arguments: ``policy="fixed"|"calibrated"`` and one fixed
relative-L2 threshold per sub-path or stage (``ffn=0.05``), as
``Tolerance(policy=..., overrides=...)``; unknown names are rejected.

Importing this module imports neither torch nor h5py (the pytest plugin imports it in
every session); the engine is imported on first use.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from torch import nn

    from .hookmap import HookMap
    from .inputs import Inputs
    from .report import Divergence, Report
    from .tolerance import Tolerance

__all__ = [
    "DivergenceError",
    "assert_batch_invariant",
    "assert_no_divergence",
    "raise_for_divergence",
    "tolerance_from",
    "failure_message",
    "default_next_steps",
    "render_text",
]

POLICY = "policy"


class DivergenceError(AssertionError):
    """A diff or a golden replay found a divergence.

    Attributes:
        report: the :class:`~blockdiff.report.Report` (``report.write_json(path)`` keeps
            every metric).
        golden: the golden dump replayed, for a golden check; else ``None``.
        obtained: where the model's own capture was written, for a golden check.
    """

    def __init__(
        self,
        message: str,
        *,
        report: Report,
        golden: Path | None = None,
        obtained: Path | None = None,
    ) -> None:
        super().__init__(message)
        self.report = report
        self.golden = golden
        self.obtained = obtained

    def __reduce__(self) -> tuple:
        # The keyword-only data would be lost by BaseException's pickling (multiprocessing).
        return (_rebuild_divergence_error, (str(self), self.report, self.golden, self.obtained))


def _rebuild_divergence_error(
    message: str, report: Report, golden: Path | None, obtained: Path | None
) -> DivergenceError:
    return DivergenceError(message, report=report, golden=golden, obtained=obtained)


# Shown as blockdiff.DivergenceError in tracebacks and pytest's summary, where it is exported.
DivergenceError.__module__ = "blockdiff"


def tolerance_from(settings: Mapping[str, Any]) -> Tolerance:
    """The :class:`~blockdiff.tolerance.Tolerance` of tolerance keyword arguments.

    Args:
        settings: ``policy`` (``"fixed"``, ``"calibrated"`` or ``None`` for blockdiff's
            choice) and fixed relative-L2 thresholds by sub-path or stage name
            (``attention``, ``ffn``, ``norm``, ``residual``, ``block``, ``embed``,
            ``context``, ``final_norm``, ``head``). A ``None`` value means "not set".

    Raises:
        TypeError: a name that is neither ``policy`` nor a sub-path or stage, or a
            threshold that is not a number.
        InputError: an unknown policy, or a threshold that is not positive.

    >>> tolerance_from({"policy": "fixed", "ffn": 0.05}).overrides
    {'ffn': 0.05}
    """
    from .tolerance import Tolerance
    from .vocab import TARGETS

    unknown = [name for name in settings if name != POLICY and name not in TARGETS]
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise TypeError(
            f"unknown tolerance {names}: expected policy= or a sub-path or stage name "
            f"({', '.join(TARGETS)})"
        )
    overrides: dict[str, float] = {}
    for name, value in settings.items():
        if name == POLICY or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"tolerance {name}= must be a number, found {value!r}")
        overrides[name] = float(value)
    return Tolerance(policy=settings.get(POLICY), overrides=overrides)


def render_text(report: Report) -> str:
    """The terminal report as plain text, 120 columns wide, without colour codes and
    without the CLI's closing advice (`--json PATH`, ...): a test failure gives its own."""
    from rich.console import Console

    from .render import render

    out = io.StringIO()
    # force_terminal=False: FORCE_COLOR in the environment must not put escape codes
    # into an exception message.
    render(report, Console(file=out, no_color=True, width=120, force_terminal=False, highlight=False), advice=None)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip().splitlines()).rstrip()


def _target(first: Divergence) -> str:
    """The tolerance name that judges the first divergence (``ffn``, ``head``, ...)."""
    if first.stage != "block":
        return first.stage
    return "block" if first.subpath == "unattributed" else str(first.subpath)


def loosen_hint(first: Divergence) -> str | None:
    """How to raise the threshold that judged ``first``; ``None`` for non-finite values,
    which no threshold tolerates."""
    nonfinite_ref, nonfinite_cand = first.check.nonfinite
    if nonfinite_ref != nonfinite_cand:
        return None
    target = _target(first)
    return (
        f"if it is precision and not a bug, set that threshold: {target}=VALUE "
        f"(measured {first.check.measured:.3g}) as a keyword argument or in "
        f"@pytest.mark.blockdiff({target}=VALUE)"
    )


def failure_message(report: Report, *, heading: str, next_steps: Sequence[str] = ()) -> str:
    """The message of a :class:`DivergenceError`.

    Args:
        report: a report with a divergence.
        heading: what was compared, the line after the first divergence.
        next_steps: what to do next, one item a line, after the rendered report.
    """
    first = report.first_divergence
    assert first is not None, "failure_message needs a report with a divergence"
    # The headline first: pytest's short summary shows the message's first line.
    lines = [first.headline(), heading, "", render_text(report)]
    if next_steps:
        lines += ["", "what to do next:", *(f"  - {step}" for step in next_steps)]
    return "\n".join(lines)


def assert_no_divergence(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    *,
    reference_hooks: HookMap | None = None,
    candidate_hooks: HookMap | None = None,
    fast_path: bool = False,
    labels: tuple[str | None, str | None] = (None, None),
    decode: int = 0,
    caches: tuple[str, str] = ("dynamic", "dynamic"),
    backward: bool = False,
    loss: Any = None,
    **tolerances: Any,
) -> Report:
    """Assert that ``candidate`` does not diverge from ``reference`` on ``inputs``.

    Args:
        reference: the trusted model.
        candidate: the model under test (a separate object).
        inputs: token ids, a tuple of positional arguments or a dict of keyword arguments.
        reference_hooks, candidate_hooks, fast_path, labels: as for :func:`blockdiff.diff`.
        decode, caches: decode steps after the prompt ``inputs`` (token ids), each side with
            its own cache, every step judged (``docs/decode.md``); 0: one forward pass.
        backward, loss: also run forward and backward on both sides and judge the gradients
            (``docs/backward.md``); ``loss`` a callable ``loss(output, inputs)`` or a
            ``"module:function"`` spec, default next-token cross-entropy on the input ids.
        **tolerances: ``policy="fixed"|"calibrated"`` and fixed relative-L2 thresholds
            per sub-path or stage, e.g. ``ffn=0.05`` (see :func:`tolerance_from`).

    Returns:
        The report, when nothing diverged.

    Raises:
        DivergenceError: something diverged; the message is the readable report and
            ``.report`` the report itself.
        TypeError: an unknown tolerance name.

    >>> assert_no_divergence(tinylm.build(), tinylm.build().to(torch.bfloat16), ids)  # doctest: +SKIP
    >>> assert_no_divergence(tinylm.build(), bugs.gelu_for_silu(block=2), ids)        # doctest: +SKIP
    Traceback (most recent call last):
    DivergenceError: block 2 ffn (blocks.2.ffn): rel_l2 0.178 > threshold 0.0001 (1779.3x)
    """
    __tracebackhide__ = True
    from .engine import Options, run

    options = Options(
        tolerance=tolerance_from(tolerances),
        reference_hooks=reference_hooks,
        candidate_hooks=candidate_hooks,
        fast_path=fast_path,
        labels=labels,
        decode=decode,
        caches=caches,
        backward=backward,
        loss=loss,
    )
    report = run(reference, candidate, inputs, options=options)
    raise_for_divergence(
        report,
        heading="blockdiff: the candidate first diverges from the reference there",
        extra_steps=["keep every metric: the error's .report.write_json(PATH)"],
    )
    if report.backward is not None and report.backward.diverged:  # --backward: the forward is clean
        first = report.backward.first_divergence
        assert first is not None
        raise DivergenceError(
            "\n".join([
                report.verdict(),
                "blockdiff: the forward agrees; the candidate's gradients first diverge from the reference's there "
                "(judged from the head to the embedding)",
                "",
                render_text(report.backward),
                "",
                "what to do next:",
                f"  - read the backward of {first.module}: its gradients are measured on the reference's own "
                "inputs and output gradient, so the cause is inside it, not upstream",
                "  - keep every metric: the error's .report.write_json(PATH) (its \"backward\")",
            ]),
            report=report,
        )
    return report


def raise_for_divergence(
    report: Report,
    *,
    heading: str,
    extra_steps: Sequence[str] = (),
    golden: Path | None = None,
    obtained: Path | None = None,
) -> None:
    """Raise :class:`DivergenceError` when ``report`` holds a divergence.

    The message suggests reading the divergent module and, when the divergence is a
    finite error, the threshold to raise if it is precision; then ``extra_steps``.
    """
    __tracebackhide__ = True
    first = report.first_divergence
    if first is None:
        return
    raise DivergenceError(
        failure_message(report, heading=heading, next_steps=[*default_next_steps(report), *extra_steps]),
        report=report,
        golden=golden,
        obtained=obtained,
    )


def default_next_steps(report: Report) -> list[str]:
    """Read the divergent module; raise its threshold if the divergence is precision."""
    first = report.first_divergence
    assert first is not None
    steps = [
        f"read {first.module}: its local error is measured on the reference's own inputs, "
        "so the cause is inside it, not upstream"
    ]
    hint = loosen_hint(first)
    if hint is not None:
        steps.append(hint)
    return steps


def assert_batch_invariant(model: Any, tokens: Any = None, **options: Any) -> Report:
    """:func:`~blockdiff.modes.invariance.invariance` as a test verdict: the report when no
    row differs, else a :class:`DivergenceError` naming the first operation and its rows.

    >>> assert_batch_invariant("samples/tinylm.py:build", batch=4)   # doctest: +SKIP
    """
    __tracebackhide__ = True
    from .modes.invariance import invariance

    report = invariance(model, tokens, **options)
    raise_for_divergence(report, heading="a row's output depends on its batch")
    return report
