"""Golden files: a model checked against a dump captured earlier, and the dump (re)written.

Shared by :func:`assert_matches_golden` (the Python API) and the pytest plugin's
``blockdiff_golden`` fixture, which only adds where goldens live, when they are written
(``--blockdiff-update``) and how a failure reads in pytest. A golden check is a replay
(:func:`blockdiff.engine.run` with the golden as the reference): block by block, with
sub-path verdicts. On a divergence the model is captured beside the golden as
``<name>.obtained.h5``, so ``blockdiff diff GOLDEN OBTAINED`` compares them offline.

Importing this module imports neither torch nor h5py; the engine is imported on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .assertion import raise_for_divergence, tolerance_from
from .errors import BlockdiffError

if TYPE_CHECKING:
    from torch import nn

    from .hookmap import HookMap
    from .inputs import Inputs
    from .report import Report
    from .tolerance import Tolerance

__all__ = [
    "assert_matches_golden",
    "obtained_path",
    "inputs_digest",
    "check_inputs_match",
    "precisions",
    "replay",
    "still_holds",
    "write",
]


def _shown(path: Path, relative_to: str | Path | None) -> str:
    if relative_to is not None:
        try:
            return str(Path(path).resolve().relative_to(Path(relative_to).resolve()))
        except ValueError:
            pass
    return str(path)


def obtained_path(golden: str | Path) -> Path:
    """Where a mismatching model's capture goes: ``<name>.obtained.h5`` beside the golden.

    >>> obtained_path("tests/__blockdiff__/test_model.h5").name
    'test_model.obtained.h5'
    """
    golden = Path(golden)
    return golden.with_name(golden.name.removesuffix(".h5") + ".obtained.h5")


def inputs_digest(golden: str | Path) -> str | None:
    """The digest of the inputs a golden dump was captured on."""
    from .dump import DumpReader

    with DumpReader(golden) as dump:
        value = dump.meta.get("inputs_digest")
    return None if value is None else str(value)


def check_inputs_match(golden: str | Path, inputs: Inputs, *, shown: str | None = None, todo: str) -> None:
    """``inputs`` must be the ones ``golden`` was captured on (the one digest rule,
    :func:`~blockdiff.inputs.check_captured_on`); ``shown``: how the message names it.

    Raises:
        InputError: other inputs; the message ends with ``todo``.
    """
    from .inputs import check_captured_on

    check_captured_on(inputs_digest(golden), inputs, what=shown or str(golden), todo=todo)


def replay(
    golden: str | Path, model: nn.Module, *, tolerance: Tolerance, hooks: HookMap | None, fast_path: bool
) -> Report:
    """``model`` replayed against ``golden``."""
    from .engine import Options, run

    return run(Path(golden), model, options=Options(tolerance=tolerance, candidate_hooks=hooks, fast_path=fast_path))


def precisions(floors: Sequence[str], model: nn.Module) -> list[tuple[Any, Any]]:
    """``["bfloat16", "float16@cuda"]`` as (dtype, device) pairs; the device defaults to
    the model's."""
    from .inputs import model_device
    from .loading import parse_precision

    return [parse_precision(str(entry), model_device(model)) for entry in floors]


def _labels(floors: Sequence[str], model: nn.Module) -> set[str]:
    from .dtypes import precision_label

    return {precision_label(dtype, device) for dtype, device in precisions(floors, model)}


def write(
    golden: str | Path,
    model: nn.Module,
    inputs: Inputs,
    *,
    hooks: HookMap | None,
    floors: Sequence[str] = (),
    candidate: nn.Module | None = None,
) -> None:
    """Capture ``model`` on ``inputs`` as the dump ``golden``, with the noise floors of
    ``floors`` (see :func:`precisions`; the device defaults to the ``candidate``'s that will
    be checked against it, else ``model``'s)."""
    from .engine import capture

    capture(model, inputs, golden, hooks=hooks, floors=precisions(floors, candidate if candidate is not None else model))


def still_holds(
    golden: Path,
    model: nn.Module,
    inputs: Inputs,
    *,
    tolerance: Tolerance,
    hooks: HookMap | None,
    fast_path: bool,
    floors: Sequence[str] = (),
) -> bool:
    """Whether an existing ``golden`` still holds for ``model``: captured on the same
    inputs, storing the floors asked for (at ``model``'s device unless they name one), and
    nothing diverges. A missing, damaged or foreign golden does not."""
    if not golden.exists():
        return False
    try:
        from .dump import DumpReader

        with DumpReader(golden) as dump:
            if not _labels(floors, model) <= set(dump.floors()):
                return False
        check_inputs_match(golden, inputs, todo="")
        return not replay(golden, model, tolerance=tolerance, hooks=hooks, fast_path=fast_path).diverged
    except BlockdiffError:
        return False


def assert_matches_golden(
    golden: str | Path,
    model: nn.Module,
    inputs: Inputs,
    *,
    obtained: str | Path | None = None,
    hooks: HookMap | None = None,
    fast_path: bool = False,
    extra_steps: Sequence[str] = (),
    relative_to: str | Path | None = None,
    verify_inputs: bool = True,
    **tolerances: Any,
) -> Report:
    """Assert that ``model`` still matches the golden dump ``golden`` on ``inputs``.

    The model is replayed against the dump (:func:`replay`): block by
    block, with sub-path verdicts, calibrated by the floors the dump stores for the
    model's precision, else judged by fixed thresholds. On a divergence the model is captured to
    ``obtained`` (default ``<name>.obtained.h5`` beside the golden), so
    ``blockdiff diff GOLDEN OBTAINED`` can compare them offline.

    Args:
        golden: an existing dump, captured with :func:`blockdiff.engine.capture`.
        model: the model under test.
        inputs: the inputs the golden was captured on (checked by digest).
        obtained: where to write the model's capture on a mismatch.
        hooks: the model's hook map; found by class name when ``None``.
        fast_path: as for :func:`blockdiff.diff`.
        extra_steps: what else the failure message suggests, after where the capture is.
        relative_to: the message shows paths below this directory relative to it (where
            the person reading it runs commands).
        verify_inputs: check that ``inputs`` are the golden's (by digest); ``False`` when
            the caller has checked already.
        **tolerances: as for :func:`assert_no_divergence`.

    Returns:
        The replay's report, when nothing diverged.

    Raises:
        DivergenceError: the model diverges from the golden; ``.obtained`` is the capture.
        InputError: ``inputs`` are not the inputs the golden was captured on.
        DumpError: the golden is missing or damaged.
    """
    __tracebackhide__ = True
    golden = Path(golden)
    tolerance = tolerance_from(tolerances)
    if verify_inputs:
        check_inputs_match(golden, inputs, todo="capture it again on these inputs")
    report = replay(golden, model, tolerance=tolerance, hooks=hooks, fast_path=fast_path)
    if report.first_divergence is None:
        return report
    obtained = obtained_path(golden) if obtained is None else Path(obtained)
    write(obtained, model, inputs, hooks=hooks)
    shown_golden, shown_obtained = _shown(golden, relative_to), _shown(obtained, relative_to)
    raise_for_divergence(
        report,
        heading=f"blockdiff: the model first diverges from its golden dump {shown_golden} there",
        extra_steps=[
            f"the model's activations are in {shown_obtained}",
            f"compare them offline (drift only): blockdiff diff {shown_golden} {shown_obtained}",
            f"localize again: blockdiff diff {shown_golden} MODEL",
            *extra_steps,
        ],
        golden=golden,
        obtained=obtained,
    )
    return report  # pragma: no cover (raise_for_divergence raised)
