"""Precision: a model's own code at another precision, and whether two models are that.

:func:`cast_copy` makes the copy a noise floor runs (the reference's code in the
candidate's dtype and device; :class:`~blockdiff.sides.live.PrecisionSide`), and
:func:`twins` says whether a candidate *is* that copy (same classes, settings and
bit-identical weights), so that its own record serves as the floor's free run.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from typing import Any

import torch
from torch import nn

from ..compare import same_bits


# A module's own state that is not its settings: compared apart (tensors, submodules) or
# left out (hooks that do not run in a forward).
_TREE = ("_parameters", "_buffers", "_modules")
_FORWARD_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def twins(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models compute the same thing on the same inputs: the same module tree
    of the same classes, no forward hooks, every parameter and buffer bit for bit the same
    (dtype, shape, strides, device), and every other attribute of every module equal —
    numbers, strings, dtypes, tensors, containers of them, dataclasses and configurations
    (``to_dict``), the same functions (and partials of them). Anything it cannot compare (another object, a bound method, a
    tensor subclass) makes them not twins."""
    mods_a, mods_b = list(a.named_modules(remove_duplicate=False)), list(b.named_modules(remove_duplicate=False))
    if [n for n, _ in mods_a] != [n for n, _ in mods_b]:
        return False
    for (_, x), (_, y) in zip(mods_a, mods_b):
        if type(x) is not type(y):
            return False
        own_x, own_y = vars(x), vars(y)
        if own_x.keys() != own_y.keys():
            return False
        for key, value in own_x.items():
            other = own_y[key]
            if key in _FORWARD_HOOKS:
                if value or other:
                    return False
            elif key == "_modules":
                continue  # walked above
            elif key.endswith("hooks") and key.startswith("_"):
                continue  # state-dict and backward hooks: not part of a forward
            elif not _same_value(value, other):
                return False
    return True


_PLAIN = (bool, int, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _same_value(x: Any, y: Any) -> bool:
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return _same_tensor(x, y)
    if isinstance(x, float):
        return x == y or (x != x and y != y)
    if isinstance(x, _PLAIN):
        return x == y
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same_value(u, v) for u, v in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(v, y[k]) for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return x == y and all(isinstance(v, _PLAIN) for v in x)
    if isinstance(x, functools.partial):  # deep copies make new ones of the same function
        return x.func is y.func and _same_value(x.args, y.args) and _same_value(x.keywords, y.keywords)
    if dataclasses.is_dataclass(x):
        return all(_same_value(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x))
    if callable(getattr(x, "to_dict", None)) and not isinstance(x, nn.Module):
        try:
            return _same_value(x.to_dict(), y.to_dict())
        except Exception:
            return False
    return False  # functions compare by identity (deep copies share them), above


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit the same plain dense tensor (dtype, shape, strides, device)."""
    if type(x) not in (torch.Tensor, nn.Parameter) or x.layout != torch.strided or x.is_quantized:
        return False
    return x.stride() == y.stride() and same_bits({"t": x.detach()}, {"t": y.detach()})


def cast_copy(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` on ``device`` with its floating parameters and buffers in
    ``dtype``, as ``copy.deepcopy(model).to(device).to(dtype)`` makes it, but with each
    tensor cast once on its way into the copy instead of copied, moved and cast (tied
    weights stay tied). Tensors of other kinds (subclasses, quantized) are copied and
    converted by ``.to`` as before."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo or type(t) not in (torch.Tensor, nn.Parameter) or not t.is_floating_point():
            continue
        cast = t.detach().to(device=device, dtype=dtype, copy=True)
        memo[id(t)] = nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cast
    # Positional .to calls: some models' .to takes no keywords (HookedTransformer).
    return copy.deepcopy(model, memo).to(device).to(dtype)


__all__ = ["cast_copy", "twins"]
