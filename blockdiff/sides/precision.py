"""Precision: a model's own code at another precision, and whether two models are that.

:func:`cast_copy` makes the copy a noise floor runs (the reference's code in the
candidate's dtype and device; :class:`~blockdiff.sides.live.PrecisionSide`), and
:func:`twins` says whether a candidate *is* that copy (same classes, settings and
bit-identical weights), so that its own record serves as the floor's free run;
:func:`twin_copy` says so without casting the weights again (the copy it hands back
runs the twin's own).
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
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..compare import CHUNK, same_bits


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
    return _twins(a, b, set())


def _twins(a: nn.Module, b: nn.Module, open_pairs: set[tuple[int, int]]) -> bool:
    """:func:`twins`; ``open_pairs``: the (id, id) of the pairs of modules being compared
    further up. A module held outside the tree may refer back to one of those (its model,
    its parent): that pair is being compared already, so it stands as twins here and the
    comparison that opened it decides."""
    if (id(a), id(b)) in open_pairs:
        return True
    open_pairs.add((id(a), id(b)))
    try:
        return _same_tree(a, b, open_pairs)
    finally:
        open_pairs.discard((id(a), id(b)))


def _same_tree(a: nn.Module, b: nn.Module, open_pairs: set[tuple[int, int]]) -> bool:
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
            elif not _same_value(value, other, open_pairs):
                return False
    return True


_PLAIN = (bool, int, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)


def _same_value(x: Any, y: Any, open_pairs: set[tuple[int, int]]) -> bool:
    if x is y:
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, torch.Tensor):
        return _same_tensor(x, y)
    if isinstance(x, nn.Module):  # held outside ``_modules`` (HF's ``_kernel_funcs``): the same tests
        return _twins(x, y, open_pairs)
    if isinstance(x, float):
        return x == y or (x != x and y != y)
    if isinstance(x, _PLAIN):
        return x == y
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same_value(u, v, open_pairs) for u, v in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(v, y[k], open_pairs) for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return x == y and all(isinstance(v, _PLAIN) for v in x)
    if isinstance(x, functools.partial):  # deep copies make new ones of the same function
        return x.func is y.func and _same_value(x.args, y.args, open_pairs) and _same_value(x.keywords, y.keywords, open_pairs)
    if dataclasses.is_dataclass(x):
        return all(_same_value(getattr(x, f.name), getattr(y, f.name), open_pairs) for f in dataclasses.fields(x))
    if callable(getattr(x, "to_dict", None)) and not isinstance(x, nn.Module):
        try:
            return _same_value(x.to_dict(), y.to_dict(), open_pairs)
        except Exception:
            return False
    return False  # functions compare by identity (deep copies share them), above


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit the same plain dense tensor (dtype, shape, strides, device): the same
    memory viewed the same way is, without reading it."""
    if type(x) not in (torch.Tensor, nn.Parameter) or x.layout != torch.strided or x.is_quantized:
        return False
    if x.stride() != y.stride():
        return False
    if _same_memory(x, y):
        return True
    return same_bits({"t": x.detach()}, {"t": y.detach()})


def _same_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Two views of the same bytes the same way (a tensor and its alias): the same dtype,
    shape, strides and first element's address, on a device with memory."""
    return (
        x.device == y.device and x.device.type != "meta" and x.dtype == y.dtype and x.shape == y.shape
        and x.stride() == y.stride() and x.numel() > 0 and x.data_ptr() != 0 and x.data_ptr() == y.data_ptr()
    )


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
    return _copied(model, memo, dtype, device)


def _copied(model: nn.Module, memo: dict[int, Any], dtype: torch.dtype, device: torch.device) -> nn.Module:
    # Positional .to calls: some models' .to takes no keywords (HookedTransformer).
    return copy.deepcopy(model, memo).to(device).to(dtype)


def twin_copy(
    model: nn.Module, other: nn.Module, dtype: torch.dtype, device: torch.device, made: Callable[[], nn.Module] | None = None
) -> nn.Module | None:
    """The cast copy of ``model`` (:func:`cast_copy`) when it is ``other``'s twin
    (:func:`twins`), else ``None`` — found without casting ``model``'s weights into new
    memory (on a 58M-parameter model, 116 MB of bfloat16 faulted in page by page: most of
    the copy's cost). Each floating tensor the copy would cast is compared with
    ``other``'s tensor of the same name, cast a chunk at a time into one buffer (the same
    conversion as the copy's). Where all agree, the copy is made with ``other``'s
    parameters themselves in their place (no new memory: the copy's own casts would be
    these bits, dtype, shape and strides) and copies of its floating buffers (what a
    forward may write into, a cache, stays the copy's own), and :func:`twins` compares the
    rest as it would the real copy; the copy returned runs ``other``'s weights. Anything
    else (a tensor that differs, tied here and apart there, non-contiguous, a name
    ``other`` lacks) asks the real copy: ``made()`` (default :func:`cast_copy`), which a
    caller that needs the copy anyway keeps."""
    if made is None:
        made = functools.partial(cast_copy, model, dtype, device)

    def if_twins(copied: nn.Module) -> nn.Module | None:
        return copied if twins(copied, other) else None

    classes = [(n, type(m)) for n, m in model.named_modules(remove_duplicate=False)]
    if classes != [(n, type(m)) for n, m in other.named_modules(remove_duplicate=False)]:
        return if_twins(made())  # not twins (the copy's modules are these): no weight compared
    target = torch.empty(0, device=device).device  # "cuda" as the copy's tensors say it: cuda:0
    theirs: dict[tuple[str, str], torch.Tensor] = {("p", n): t for n, t in other.named_parameters(remove_duplicate=False)}
    theirs.update({("b", n): t for n, t in other.named_buffers(remove_duplicate=False)})
    ours: list[tuple[tuple[str, str], torch.Tensor]] = [(("p", n), t) for n, t in model.named_parameters(remove_duplicate=False)]
    ours += [(("b", n), t) for n, t in model.named_buffers(remove_duplicate=False)]
    memo: dict[int, Any] = {}
    source: dict[int, torch.Tensor] = {}  # id of our tensor -> the tensor of other's it stands for
    buffer: torch.Tensor | None = None
    for name, t in ours:
        if type(t) not in (torch.Tensor, nn.Parameter) or not t.is_floating_point():
            continue
        y = theirs.get(name)
        if id(t) in source:
            if source[id(t)] is not y:  # tied here, apart there
                return if_twins(made())
            continue
        if (
            y is None or type(y) is not type(t) or t.layout != torch.strided or not t.is_contiguous()
            or y.layout != torch.strided or y.is_quantized or y.dtype != dtype or y.device != target
            or y.shape != t.shape or y.stride() != t.stride()  # a contiguous cast keeps the strides
        ):
            return if_twins(made())
        if buffer is None:
            buffer = torch.empty(CHUNK, dtype=dtype, device=target)
        if not _cast_equal(t.detach().reshape(-1), y.detach().reshape(-1), buffer):
            return if_twins(made())
        source[id(t)] = y
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(y.detach(), requires_grad=t.requires_grad)
        else:
            memo[id(t)] = y.detach().clone()
    return if_twins(_copied(model, memo, dtype, device))


def _cast_equal(ours: torch.Tensor, theirs: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``ours`` cast to ``theirs``'s dtype is ``theirs`` bit for bit, a chunk of
    ``buffer``'s size at a time (both flat)."""
    with torch.no_grad():
        for start in range(0, ours.numel(), buffer.numel()):
            n = min(buffer.numel(), ours.numel() - start)
            cast = buffer[:n]
            cast.copy_(ours[start : start + n])
            if not same_bits({"t": cast}, {"t": theirs[start : start + n]}):
                return False
    return True


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


__all__ = ["cast_copy", "floor_backward", "twin_copy", "twins"]
