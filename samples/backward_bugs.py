"""Planted backward bugs: candidates whose forward is right and whose gradients are not.

Each factory builds a clean sample (same seed, same weights) and plants one bug that only
the backward shows, so ``blockdiff diff REF CAND --backward`` must report the forward clean
and blame exactly the planted block, sub-path and gradient:

    blockdiff diff samples/hf_llama.py:build samples/backward_bugs.py:fused_norm_weight_grad --backward

:data:`BUGS` lists each factory with its reference and what must be blamed; :data:`CLEAN`
the candidates that must blame nothing (activation checkpointing done right);
:data:`PAIRING_BUGS` a router that passes no gradient at all (Hugging Face Mixtral) and
weight-gradient bugs in a port whose weights have other names and a fused ``wqkv``
(``samples/fused_port.py``):

    blockdiff diff samples/fused_port.py:reference samples/backward_bugs.py:port_qkv_weight_grad_v_rows_dropped --backward
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:  # imported as samples.backward_bugs (tests) or loaded from its file path (CLI)
    from . import fused_port, hf_llama, hf_moe, tinylm
except ImportError:  # pragma: no cover
    import fused_port
    import hf_llama
    import hf_moe
    import tinylm

DEFAULT_BLOCK = 1


# -- a fused RMSNorm whose weight gradient is wrong (Hugging Face Llama) ----------------------


class FusedNormWrongWeightGrad(torch.autograd.Function):
    """An RMSNorm "kernel": the forward is the module's own code (the same bits); the
    backward's input gradient is right, its weight gradient reduces ``grad × x`` — the raw
    input — where it should reduce ``grad × x / rms(x)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: nn.Module, original: Callable) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.module, ctx.original = module, original
        return original(module, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.original(ctx.module, leaf), (leaf,), grad)
        weight = ctx.module.weight
        grad_weight = (grad.float() * x.float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None, None


def _fused_norm(module: nn.Module) -> None:
    original = type(module).forward

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return FusedNormWrongWeightGrad.apply(hidden_states, self.weight, self, original)

    module.__class__ = type("Fused" + type(module).__name__, (type(module),), {"forward": forward})


def fused_norm_weight_grad(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Hugging Face Llama, block ``block``'s post-attention RMSNorm as the fused function."""
    model = hf_llama.build()
    _fused_norm(model.model.layers[block].post_attention_layernorm)
    return model


# -- a SwiGLU function whose backward swaps the gate and up terms (Hugging Face Llama) -------


class SwiGLUGateUpSwapped(torch.autograd.Function):
    """``silu(gate) × up`` as one function: the forward as the model computes it, the
    backward with the gate's and the up projection's gradients handed back in each other's
    place."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        gate, up = ctx.saved_tensors
        g, a, b = grad.float(), gate.float(), up.float()
        sigmoid = torch.sigmoid(a)
        grad_gate = g * b * sigmoid * (1 + a * (1 - sigmoid))
        grad_up = g * a * sigmoid
        return grad_up.to(gate.dtype), grad_gate.to(up.dtype)  # the bug: swapped


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(SwiGLUGateUpSwapped.apply(self.gate_proj(x), self.up_proj(x)))


def swiglu_backward_swapped(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Hugging Face Llama, block ``block``'s MLP through the fused SwiGLU function."""
    model = hf_llama.build()
    mlp = model.model.layers[block].mlp
    mlp.__class__ = type("Fused" + type(mlp).__name__, (type(mlp),), {"forward": _swiglu_forward})
    return model


# -- an activation module whose backward is wrong: the drill-down names it (Hugging Face Llama)


class SiLUWithoutSigmoidTerm(torch.autograd.Function):
    """SiLU whose backward returns ``sigmoid(x)`` alone, dropping the ``x σ'(x)`` term."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.silu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return (grad.float() * torch.sigmoid(x.float())).to(grad.dtype)


class FusedSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SiLUWithoutSigmoidTerm.apply(x)


def silu_backward_wrong(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Hugging Face Llama, block ``block``'s MLP activation module (``act_fn``) replaced by
    a SiLU "kernel" with a wrong backward: blamed on the ffn, the drill-down names
    ``act_fn``."""
    model = hf_llama.build()
    model.model.layers[block].mlp.act_fn = FusedSiLU()
    return model


# -- the block's glue cuts the residual stream's gradient (tinylm) ----------------------------


class ResidualDetached(tinylm.Block):
    """``x.detach() + attn(norm(x))``: the forward adds the same numbers, the backward loses
    the residual path of the attention's add."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x.detach() + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def residual_detached(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    model = tinylm.build()
    model.blocks[block].__class__ = ResidualDetached
    return model


# -- activation checkpointing (tinylm) -------------------------------------------------------


class Checkpointed(tinylm.Block):
    """The block run under ``torch.utils.checkpoint`` (non-reentrant): its activations are
    recomputed in the backward, under :meth:`recomputing`'s context."""

    def recomputing(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        body = functools.partial(tinylm.Block.forward, self)
        return checkpoint(
            body, x, cos, sin, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), self.recomputing())
        )


class RecomputedWithOtherScale(Checkpointed):
    """The recomputation runs with a setting the forward did not have: attention scores
    scaled by 1/d instead of 1/sqrt(d) (a recompute context that switches the attention to
    a kernel with its own scale). The same tensors are saved, of the same shapes and dtypes,
    so the checkpoint's own check passes; their values, and so the gradients, are wrong."""

    @contextlib.contextmanager
    def recomputing(self):
        scale = self.attn.scale
        self.attn.scale = 1.0 / self.attn.head_dim
        try:
            yield
        finally:
            self.attn.scale = scale


def checkpointed(*, blocks: tuple[int, ...] = (0, 1, 2, 3)) -> tinylm.TinyLM:
    """Clean: every block in ``blocks`` checkpointed, recomputed as it ran."""
    model = tinylm.build()
    for index in blocks:
        model.blocks[index].__class__ = Checkpointed
    return model


def checkpoint_recomputed_differently(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Every block checkpointed; block ``block``'s recomputed with another attention scale."""
    model = checkpointed()
    model.blocks[block].__class__ = RecomputedWithOtherScale
    return model


# -- an MoE whose routing weights pass no gradient to the router (tinylm) --------------------


class RouterDetached(tinylm.MoE):
    """The routing weights ``detach()``ed before they scale the experts' outputs: the same
    forward, no gradient for the router."""

    def routing_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return weights.detach()  # the bug


def moe_router_detached(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe``."""
    model = tinylm.build_moe()
    model.blocks[block].ffn.__class__ = RouterDetached
    return model


class LogitsWeightGradHalved(torch.autograd.Function):
    """A router's logits ``x Wᵀ`` as one function: the forward as the router computes it,
    the weight gradient halved (a mean over two where a sum belongs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        return grad @ weight, 0.5 * (grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class RouterWeightGradHalved(tinylm.Router):
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return LogitsWeightGradHalved.apply(x.float(), self.weight.float())


def moe_router_weight_grad_halved(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe``: block ``block``'s router computes its logits
    through a function whose weight gradient is halved. The router's own backward is
    wrong, the experts' is right: the router part is blamed, not the experts."""
    model = tinylm.build_moe()
    model.blocks[block].ffn.router.__class__ = RouterWeightGradHalved
    return model


# -- a Hugging Face MoE router whose decision is detached (Hugging Face Mixtral) --------------


def _detached_router(gate: nn.Module) -> None:
    """``gate`` (this one router) returning its logits, routing weights and expert indices
    ``detach()``ed: the same values, outside autograd."""
    base = type(gate)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return tuple(t.detach() for t in base.forward(self, *args, **kwargs))

    gate.__class__ = type("Detached" + base.__name__, (base,), {"forward": forward})


def hf_moe_router_detached(*, block: int = DEFAULT_BLOCK, arch: str = "mixtral") -> nn.Module:
    """Candidate of ``hf_moe.build``: block ``block``'s router (``mlp.gate``) returns its
    logits, routing weights and expert indices ``detach()``ed — a port that treats the
    routing decision as index bookkeeping outside autograd. The same forward; no gradient
    reaches the router's weight or, through it, its input."""
    model = hf_moe.build(arch=arch)
    _detached_router(model.model.layers[block].mlp.gate)  # the bug
    return model


def hf_moe_routers_detached(*, arch: str = "mixtral") -> nn.Module:
    """``hf_moe.build`` with every block's router detached as in
    :func:`hf_moe_router_detached`: routers that pass no gradient on both sides when it is
    diffed against itself (nothing may be blamed)."""
    model = hf_moe.build(arch=arch)
    for layer in model.model.layers:
        _detached_router(layer.mlp.gate)
    return model


# -- a port's projections with hand-written backwards (samples/fused_port.py) ----------------


class LinearWeightGrad(torch.autograd.Function):
    """``x Wᵀ`` as a hand-written projection kernel: the forward is ``F.linear`` (the same
    bits as ``nn.Linear``), the backward autograd's own for the input gradient and the
    weight gradient, then the weight gradient passed through ``wrong(grad_weight, x)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, wrong: Callable) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.wrong = wrong
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaves = x.detach().requires_grad_(), weight.detach().requires_grad_()
            grad_x, grad_weight = torch.autograd.grad(F.linear(*leaves), leaves, grad)
        return grad_x, ctx.wrong(grad_weight, x), None


def _kernel(linear: nn.Linear, name: str, wrong: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """``linear`` (this one module) computed by :class:`LinearWeightGrad` with ``wrong``."""
    assert linear.bias is None

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return LinearWeightGrad.apply(x, self.weight, wrong)

    linear.__class__ = type(name + type(linear).__name__, (type(linear),), {"forward": forward})


def port_down_weight_grad_averaged(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Candidate of ``fused_port.reference``: the Meta-style port (``fused_port.port``:
    fused ``wqkv``, ``w1, w3, w2``), block ``block``'s down projection ``w2`` a kernel
    whose weight gradient is averaged over the batch (divided by the batch size) where it
    should be summed. Forward, input gradient and every other gradient right."""
    model = fused_port.port()
    _kernel(model.model.layers[block].feed_forward.w2, "BatchAveraged", lambda g, x: g / x.shape[0])  # the bug
    return model


def port_qkv_weight_grad_v_rows_dropped(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Candidate of ``fused_port.reference``: the port's fused ``wqkv`` in block ``block``
    a kernel whose backward writes the weight gradient of the q and k rows only (its grid
    sized for ``n_heads + n_kv_heads`` heads, not ``n_heads + 2 n_kv_heads``): the v rows'
    gradient stays zero. Forward, input gradient and every other gradient right."""
    model = fused_port.port()
    attention = model.model.layers[block].attention
    rows = (attention.n_heads + attention.n_kv_heads) * attention.head_dim

    def wrong(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[rows:] = 0  # the bug
        return g

    _kernel(attention.wqkv, "VRowsDropped", wrong)
    return model


# factory → (reference spec, block, sub-path, what the first backward divergence compared).
BUGS: dict[str, tuple[str, int, str, str]] = {
    "fused_norm_weight_grad": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "norm", "parameter gradient: weight"),
    "swiglu_backward_swapped": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "ffn", "parameter gradient: up_proj.weight"),
    "residual_detached": ("samples/tinylm.py:build", DEFAULT_BLOCK, "residual", "input gradient"),
    # The modules alone and the glue with the reference's modules are right: the block's
    # recomputation is what differs.
    "checkpoint_recomputed_differently": ("samples/tinylm.py:build", DEFAULT_BLOCK, "unattributed", "input gradient"),
    "moe_router_detached": ("samples/tinylm.py:build_moe", DEFAULT_BLOCK, "ffn", "parameter gradient: router.weight"),
}

# Gradients the backward once refused or passed, each blamed exactly by
# tests/test_backward_ports.py in float32 and bfloat16: factory → (reference spec, block,
# sub-path, {candidate dtype: what the first backward divergence compared}).
PAIRING_BUGS: dict[str, tuple[str, int, str, dict[str, str]]] = {
    # A router that passes no gradient at all: its weight's gradient and its input's are
    # zero. In float32 every zero gradient is 1e4 times the fixed threshold, and the MoE's
    # check of the router's weight comes first; in bfloat16 the router's own input gradient
    # has the smallest floor of them.
    "hf_moe_router_detached": (
        "samples/hf_moe.py:build", DEFAULT_BLOCK, "ffn",
        {"float32": "parameter gradient: gate.weight", "bfloat16": "router: input gradient"},
    ),
    # A port's weights of other names, paired as the forward pairs them (by role, order and
    # shape; a fused child's weight against its split counterparts side by side).
    "port_down_weight_grad_averaged": (
        "samples/fused_port.py:reference", DEFAULT_BLOCK, "ffn",
        dict.fromkeys(("float32", "bfloat16"), "parameter gradient: w2.weight (as down_proj.weight)"),
    ),
    "port_qkv_weight_grad_v_rows_dropped": (
        "samples/fused_port.py:reference", DEFAULT_BLOCK, "attention",
        dict.fromkeys(("float32", "bfloat16"), "parameter gradient: wqkv.weight (as q_proj.weight+k_proj.weight+v_proj.weight)"),
    ),
}

# factory → reference spec: nothing may be blamed.
CLEAN: dict[str, str] = {"checkpointed": "samples/tinylm.py:build"}
