"""Planted backward bugs: candidates whose forward is right and whose gradients are not.

Each factory builds a clean sample (same seed, same weights) and plants one bug that only
the backward shows, so ``blockdiff diff REF CAND --backward`` must report the forward clean
and blame exactly the planted block, sub-path and gradient:

    blockdiff diff samples/hf_llama.py:build samples/backward_bugs.py:fused_norm_weight_grad --backward

:data:`BUGS` lists each factory with its reference and what must be blamed; :data:`CLEAN`
the candidates that must blame nothing (activation checkpointing done right).
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
    from . import hf_llama, tinylm
except ImportError:  # pragma: no cover
    import hf_llama
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

# factory → reference spec: nothing may be blamed.
CLEAN: dict[str, str] = {"checkpointed": "samples/tinylm.py:build"}
