"""Engine: the whole diff — capture both sides, localize block by block, build the report.

:func:`diff` is the library's entry point; the CLI and the pytest plugin only prepare its
arguments.
"""

from __future__ import annotations

import datetime as _dt
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from . import __version__
from .capture import record
from .errors import BlockdiffError, InputError, ModelRunError
from .hookmap import HookMap, Layout, resolve
from .inputs import Inputs, check_inputs, check_vocab, digest, model_device, model_dtype
from .localize import Localizer, Side, first_nonfinite
from .report import Report
from .store import MemoryStore
from .tolerance import Tolerance


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the body and restore every module's flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def vocab_size(model: nn.Module, layout: Layout) -> int | None:
    """The vocabulary of the model's embedding, if it is an ``nn.Embedding``."""
    for stage, path in layout.outside:
        if stage == "embed":
            module = model.get_submodule(path)
            if isinstance(module, nn.Embedding):
                return module.num_embeddings
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def describe_side(model: nn.Module, layout: Layout, label: str | None) -> dict[str, Any]:
    return {
        "model": label or type(model).__name__,
        "class": type(model).__name__,
        "device": str(model_device(model)),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
        "hook_map": layout.hook_map.name,
    }


def diff(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    *,
    tolerance: Tolerance | None = None,
    reference_hooks: HookMap | None = None,
    candidate_hooks: HookMap | None = None,
    fast_path: bool = False,
    capacity_factors: tuple[float, ...] = (1.0, 1.25),
    labels: tuple[str | None, str | None] = (None, None),
) -> Report:
    """Find where ``candidate`` first diverges from ``reference`` on ``inputs``.

    Both models run as they are (device, dtype); neither is changed: hooks are removed
    and training flags restored on every path.

    Args:
        reference: the trusted model.
        candidate: the model under test (another object, possibly another codebase).
        inputs: token ids, a tuple of positional arguments or a dict of keyword arguments;
            moved to each model's device.
        tolerance: how local errors are judged; calibrated when dtypes or devices differ.
        reference_hooks, candidate_hooks: hook maps; found by class name when ``None``.
        fast_path: skip a block's sub-path experiments when the block as a whole is within
            tolerance.
        capacity_factors: counterfactual capacity factors for the routing statistics of
            dropless MoE blocks.
        labels: how the report names the two models (e.g. their specs).

    Returns:
        The :class:`~blockdiff.report.Report`; ``report.first_divergence`` is ``None``
        when nothing diverged.

    >>> report = diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids)   # doctest: +SKIP
    >>> (report.first_divergence.block, report.first_divergence.subpath)  # doctest: +SKIP
    (2, 'ffn')
    """
    if reference is candidate:
        raise InputError("reference and candidate are the same object; pass two separate models")
    check_inputs(inputs)
    ref_layout = resolve(reference, reference_hooks)
    cand_layout = resolve(candidate, candidate_hooks)
    if len(ref_layout.blocks) != len(cand_layout.blocks):
        raise InputError(
            f"the reference has {len(ref_layout.blocks)} blocks and the candidate "
            f"{len(cand_layout.blocks)}; blockdiff compares models with the same number of blocks"
        )
    if isinstance(inputs, torch.Tensor):
        check_vocab(inputs, vocab_size(reference, ref_layout), side="reference")
        check_vocab(inputs, vocab_size(candidate, cand_layout), side="candidate")
    tolerance = (tolerance or Tolerance()).resolved(
        same_dtype=model_dtype(reference) == model_dtype(candidate),
        same_device=model_device(reference) == model_device(candidate),
    )
    with ExitStack() as stack:
        stack.enter_context(eval_mode(reference))
        stack.enter_context(eval_mode(candidate))
        ref_store, cand_store = MemoryStore(), MemoryStore()
        _run("reference", record, reference, ref_layout, ref_store, inputs)
        _run("candidate", record, candidate, cand_layout, cand_store, inputs)
        ref_side = Side("reference", reference, ref_layout, ref_store)
        cand_side = Side("candidate", candidate, cand_layout, cand_store)
        localizer = Localizer(ref_side, cand_side, tolerance, fast_path=fast_path, capacity_factors=capacity_factors)
        with torch.inference_mode():
            stages = _run("candidate", lambda: list(localizer.stages()))
            blocks = _run("candidate", lambda: list(localizer.blocks()))
        report = Report(
            reference=describe_side(reference, ref_layout, labels[0]),
            candidate=describe_side(candidate, cand_layout, labels[1]),
            inputs=describe_inputs(inputs),
            tolerance=tolerance.to_dict(localizer.dtype),
            stages=stages,
            blocks=blocks,
            moe=localizer.moe,
            first_nonfinite=first_nonfinite(ref_store, cand_store),
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            version=__version__,
        )
    if not localizer.calibrate and tolerance.calibrated:
        report.notes.append("calibrated tolerance asked for but no live reference: fixed thresholds used")
    return report


def _run(side: str, fn, *args):
    """Call ``fn``; an exception raised by model code becomes a :class:`ModelRunError`."""
    try:
        return fn(*args)
    except BlockdiffError:
        raise
    except Exception as exc:
        raise ModelRunError(f"the {side} model raised {type(exc).__name__}: {exc}", side=side) from exc


def describe_inputs(inputs: Inputs) -> dict[str, Any]:
    if isinstance(inputs, torch.Tensor):
        kind, shape = "token_ids", list(inputs.shape)
    else:
        kind, shape = ("args" if isinstance(inputs, tuple) else "kwargs"), None
    return {"kind": kind, "shape": shape, "digest": digest(inputs)}
