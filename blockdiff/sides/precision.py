"""Precision: a model's own code at another precision, and whether two models are that.

:func:`cast_copy` makes the copy a noise floor runs (the reference's code in the
candidate's dtype and device; :class:`~blockdiff.sides.live.PrecisionSide`), and
:func:`twins` says whether a candidate *is* that copy (same classes, settings and
bit-identical weights), so that its own record serves as the floor's free run.
:func:`floor_backward` is the context a floor's backward runs in: on a CPU without
matrix units for its dtype, a ``Linear``'s input gradient computed with the weight laid
out for PyTorch's vectorized kernel (the same product, fifteen times faster there).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

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
    (``to_dict``), the same functions (and partials of them), modules held outside the
    tree (compared as twins too). Anything it cannot compare (another object, a bound method, a
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
    if isinstance(x, nn.Module):  # held outside ``_modules`` (HF's ``_kernel_funcs``): the same tests
        return twins(x, y)
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


class _InputGradient(torch.autograd.Function):
    """``y`` (a ``Linear``'s output computed from ``x`` detached) passed through, with the
    gradient of ``x`` added: ``g @ weight``, the weight's transpose made contiguous first.

    PyTorch's CPU matmul in bfloat16 and float16, where oneDNN has no kernel for the
    dtype (no AVX-512), runs ``g @ weight`` with both operands row-major (what autograd
    does for ``F.linear``'s input gradient) in a scalar loop: 185-2900 ms for the shapes
    of a 26M Llama's backward, against 22-125 ms with the weight column-major — the same
    product, accumulated in float32 and rounded once (99.8-100 % of the elements equal
    bit for bit, the rest one rounding apart). The weight's and bias's gradients stay
    autograd's own (``y``'s graph)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        (weight,) = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[1]:
            gx = g.reshape(-1, g.shape[-1]).mm(weight.t().contiguous().t()).reshape(ctx.shape)
        return g, gx, None


class _FloorLinear(TorchFunctionMode):
    """``F.linear`` on a CPU weight of one of ``dtypes`` whose input requires grad: its
    input gradient by :class:`_InputGradient`. Every other call as it is."""

    def __init__(self, dtypes: frozenset[torch.dtype]) -> None:
        super().__init__()
        self.dtypes = dtypes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            x, weight = args[0], args[1]
            if (
                type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.requires_grad
                and torch.is_grad_enabled() and weight.dtype in self.dtypes and weight.device.type == "cpu"
                and weight.dim() == 2 and x.dim() >= 1
            ):
                y = func(x.detach(), *args[1:], **kwargs)
                return _InputGradient.apply(y, x, weight.detach())
        return func(*args, **kwargs)


@functools.cache
def _scalar_matmul_dtypes() -> frozenset[torch.dtype]:
    """The reduced dtypes whose CPU matmul has no oneDNN kernel on this machine."""
    mkldnn = torch.ops.mkldnn
    slow = set()
    if not mkldnn._is_mkldnn_bf16_supported():
        slow.add(torch.bfloat16)
    if not mkldnn._is_mkldnn_fp16_supported():
        slow.add(torch.float16)
    return frozenset(slow)


@contextlib.contextmanager
def floor_backward(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """The context a floor side's code runs in with autograd on: on a CPU whose matmul
    in ``dtype`` is PyTorch's scalar loop, each ``F.linear`` computes its input gradient
    with the weight column-major (:class:`_InputGradient`); elsewhere nothing changes.
    Only blockdiff's own copy runs in it, never a side's code: the floor measures what
    the reference's code loses at ``dtype``, and the product is the same."""
    if device.type != "cpu" or dtype not in _scalar_matmul_dtypes():
        yield
        return
    with _FloorLinear(frozenset({dtype})):
        yield


__all__ = ["cast_copy", "floor_backward", "twins"]
