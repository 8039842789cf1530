"""The one place a spec becomes a side.

A spec is what a user hands blockdiff for one side: an ``nn.Module``; a factory (a callable
returning one, or an :class:`~blockdiff.sides.onnx.OnnxModel`); a model spec string
(``file.py:factory``, ``package.module:factory``, a Hugging Face directory or
``config.json``), built on the device and in the dtype asked for; an HDF5 dump (``.h5``);
an ONNX graph (``.onnx``, a candidate only). Inside a launched run (``torchrun``) a
candidate model is a :class:`~blockdiff.sides.sharded.ShardedSide` when every rank holds
every block, a :class:`~blockdiff.sides.sharded.PipelineSide` when the ranks hold disjoint
ones. The CLI, :func:`blockdiff.engine.run`, the pytest plugin and golden files all come
through :func:`open_side`; :func:`kind_of` tells a spec's kind without opening it (what the
engine's choice of mode needs first).

A new kind of side is a file in this package and one branch here.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import distributed
from ..autodetect import resolve
from ..errors import InputError, run_model_code
from ..hookmap import HookMap, layout_from_dict
from ..diskweights import ATTRIBUTE, attach, disk_weights
from ..inputs import model_dtype
from ..loading import ACCEPTED, WEIGHT_SUFFIXES, build_model, checkpoint_dtype, reads_from_disk, unread
from . import Side, dump, gguf, mlx, onnx
from .live import LiveSide
from .sharded import PipelineSide, ShardedSide

# The kinds a spec other than a PyTorch model can be, asked in order: each module says
# whether it ``claims`` a spec (before anything is built, and what a factory returned) and
# gives its side (``opened``). A new kind of side is its file and one entry here.
KINDS = (dump, onnx, gguf, mlx)


def kind_of(spec: Any) -> str:
    """``"dump"``, ``"onnx"`` (a kind's ``NAME``) or ``"model"`` (a module, a factory or a
    model spec string), read off the spec without opening or building anything."""
    return next((kind.NAME for kind in KINDS if kind.claims(spec)), "model")


def open_side(
    role: str,
    spec: Any,
    *,
    opened: ExitStack,
    hooks: HookMap | None = None,
    label: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    like: Side | None = None,
    from_disk: bool = False,
) -> Side:
    """The side ``spec`` stands for, in ``role``.

    Args:
        opened: where what the side holds open (a dump's file) is closed.
        hooks: the hook map; found by the model's class name when ``None``.
        label: how the report names it.
        device, dtype: where a model spec string is built (default: CPU; a checkpoint
            directory's own dtype, else float32).
        like: the reference, for a candidate whose anatomy is the reference's (an ONNX
            graph's sites are found under the reference's layout).
        from_disk: a model built without weights reads them from its checkpoint a block
            at a time (a Hugging Face directory; a model naming its checkpoint:
            :func:`~blockdiff.loading.reads_from_disk`), in ``dtype`` on ``device``.

    Raises:
        InputError: a spec of no kind, an ONNX graph as the reference, a factory that
            returns something else, ranks holding overlapping blocks.
    """
    if isinstance(spec, (str, Path)) and kind_of(spec) == "model":
        text = str(spec)
        if ":" not in text and not Path(text).is_dir() and Path(text).suffix.lower() not in (".json", *WEIGHT_SUFFIXES):
            raise InputError(
                f"{text}: not a dump (.h5) or an ONNX graph (.onnx); as a model spec, expected {ACCEPTED}"
            )
        built = build_model(
            text, device=torch.device(device or "cpu"), dtype=dtype or checkpoint_dtype(text) or torch.float32,
            like=getattr(like, "model", None), from_disk=from_disk,
        )
        spec = _built(f"model spec {text!r}: the factory", built)
    elif callable(spec) and not isinstance(spec, nn.Module) and kind_of(spec) == "model":
        spec = _built(f"the {role} factory", run_model_code(role, spec))
    if isinstance(spec, nn.Module) and reads_from_disk(spec) and disk_weights(spec) is None:
        if not from_disk:
            raise unread(f"the {role}", spec)
        spec = attach(spec, getattr(spec, ATTRIBUTE), dtype=dtype or model_dtype(spec), device=torch.device(device or "cpu"))
    for kind in KINDS:
        if kind.claims(spec):
            return kind.opened(role, spec, opened=opened, like=like, label=label)
    if not isinstance(spec, nn.Module):
        raise InputError(f"the {role} is a {type(spec).__name__}: give a model, a factory, a model spec or a dump")
    return _live(role, spec, hooks, label)


def _built(what: str, model: Any) -> Any:
    """What a factory returned, when it is something blockdiff runs."""
    if not isinstance(model, nn.Module) and kind_of(model) == "model":
        raise InputError(
            f"{what} returned a {type(model).__name__}, expected a torch nn.Module "
            "(or, for a candidate, a blockdiff.onnxside.OnnxModel)"
        )
    return model


def _live(role: str, model: nn.Module, hooks: HookMap | None, label: str | None) -> LiveSide:
    """A live model's side: on its own, or — a candidate inside a launched run — split over
    the ranks as their layouts say. Every rank of a launched run runs in lockstep."""
    layout = resolve(model, hooks)
    lockstep = distributed.in_lockstep()
    if not lockstep or role == "reference":  # a reference: one device's model on every rank
        return LiveSide(role, model, layout, label=label, lockstep=lockstep)
    layouts = [layout_from_dict(found) for found in distributed.every_rank(layout.to_dict())]
    held = [{block.index for block in theirs.blocks} for theirs in layouts]
    if all(blocks == held[0] for blocks in held):
        return ShardedSide(role, model, layout, label=label)  # tensor, sequence, expert parallel
    if all(not (a & b) for i, a in enumerate(held) for b in held[i + 1 :]):
        return PipelineSide(role, model, layout, layouts, label=label)  # one stage per rank
    raise InputError(
        f"the {role}'s ranks hold overlapping sets of blocks ({held}): a pipeline stage per rank, or "
        "every block on every rank (tensor or expert parallel), is what blockdiff localizes"
    )


__all__ = ["open_side", "kind_of", "KINDS"]
