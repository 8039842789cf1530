"""Planted bugs in tinylm: candidate factories with one bug each, in a chosen block.

Every factory builds the clean sample (same seed, same weights) and plants one bug, so
``blockdiff diff samples/tinylm.py:build samples/bugs.py:gelu_for_silu`` must blame
exactly that block and sub-path. :data:`BUGS` lists each factory with the
(stage, sub-path) blockdiff is expected to blame; the block is the ``block`` argument
(default 1), or ``None`` for the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as samples.bugs (tests) or loaded from its file path (CLI)
    from . import tinylm
except ImportError:  # pragma: no cover
    import tinylm

DEFAULT_BLOCK = 1


class LayerNormLike(tinylm.RMSNorm):
    """RMSNorm written as LayerNorm: the mean is subtracted."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GateUpSwapped(tinylm.SwiGLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)) * self.gate_proj(x))


class MultiplyDropped(tinylm.SwiGLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)))


class ResidualDropped(tinylm.Block):
    """The attention residual add is missing."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def _plant(block: int, where: str, cls: type[nn.Module]) -> tinylm.TinyLM:
    model = tinylm.build()
    target = model.blocks[block] if where == "block" else getattr(model.blocks[block], where)
    target.__class__ = cls
    return model


def norm_as_layernorm(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """RMSNorm written as LayerNorm (mean subtracted) in the block's first norm."""
    return _plant(block, "attn_norm", LayerNormLike)


def gate_up_swapped(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    return _plant(block, "ffn", GateUpSwapped)


def gelu_for_silu(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    model = tinylm.build()
    model.blocks[block].ffn.act = F.gelu
    return model


def multiply_dropped(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """SwiGLU's elementwise multiply by the up projection is missing."""
    return _plant(block, "ffn", MultiplyDropped)


def attention_scale(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Attention scores scaled by 1/d instead of 1/sqrt(d)."""
    model = tinylm.build()
    attn = model.blocks[block].attn
    attn.scale = 1.0 / attn.head_dim
    return model


def causal_mask_dropped(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    model = tinylm.build()
    model.blocks[block].attn.causal = False
    return model


def rope_sign_flipped(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """RoPE rotates the wrong way."""
    model = tinylm.build()
    model.blocks[block].attn.rope_sign = -1.0
    return model


def residual_dropped(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    return _plant(block, "block", ResidualDropped)


def post_norm(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Post-norm instead of pre-norm in one block."""
    model = tinylm.build()
    model.blocks[block].residual = "post"
    return model


def head_untied_transposed() -> tinylm.TinyLM:
    """The vocabulary projection is untied and reads the embedding with a transposed
    layout ([hidden, vocab] memory read as [vocab, hidden])."""
    model = tinylm.build()
    weight = model.embed.weight.detach().t().contiguous().view(model.cfg.vocab_size, model.cfg.hidden)
    model.lm_head = nn.Linear(model.cfg.hidden, model.cfg.vocab_size, bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(weight)
    return model


def outlier_in_down_proj(*, block: int = 2, channel: int = 3, scale: float = 8.0) -> tinylm.TinyLM:
    """One output channel of the block's FFN down projection scaled: the bug lives in a
    child module, which the drill-down names."""
    model = tinylm.build()
    with torch.no_grad():
        model.blocks[block].ffn.down_proj.weight[channel] *= scale
    return model


def nan_in_ffn(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """A down projection with a NaN weight: the candidate produces NaN in that block."""
    model = tinylm.build()
    with torch.no_grad():
        model.blocks[block].ffn.down_proj.weight[0, 0] = float("nan")
    return model


class ScaledBetweenBlocks(tinylm.TinyLM):
    """The model's own loop scales the hidden state after one block: code between blocks,
    which no hook map sub-path owns."""

    scaled_after = DEFAULT_BLOCK

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        cos, sin = self.rotary(x, positions)
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if index == self.scaled_after:
                x = x * 1.5
        return self.lm_head(self.norm(x))


def scaled_between_blocks(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Every block and module is right when run alone; the drift from block ``block + 1``
    on is unexplained by any local check."""
    model = tinylm.build()
    model.__class__ = ScaledBetweenBlocks
    model.scaled_after = block
    return model


class CompiledOnly(tinylm.SwiGLU):
    """Computes something else only inside a compiled graph: a stand-in for a compiler bug
    (the eager module, run alone, is right)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * 1.5 if torch.compiler.is_compiling() else out


def miscompiled(*, block: int = DEFAULT_BLOCK, backend: str = "aot_eager", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model under ``torch.compile`` (in ``dtype``), its block's FFN wrong only in
    the compiled graph. Where an experiment calls the eager module, no local check sees it:
    the drift does, and is reported as unexplained."""
    model = _plant(block, "ffn", CompiledOnly).to(dtype)
    return torch.compile(model, backend=backend)


class NotRenormalized(tinylm.Router):
    """Top-k weights left as softmax probabilities where the model renormalizes them."""

    def forward(self, x):
        logits = self.logits(x)
        weights, indices = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, weights, indices


class SoftmaxAfterTopk(tinylm.Router):
    """Softmax taken over the top-k logits instead of over all experts before top-k."""

    def forward(self, x):
        logits = self.logits(x)
        top, indices = logits.topk(self.top_k, dim=-1)
        return logits, top.softmax(-1), indices


class LowPrecisionRouter(tinylm.Router):
    """The router computed in float8 (e4m3), as a quantization pass that forgot to skip
    it, where the reference keeps it in float32."""

    def logits(self, x):
        fp8 = torch.float8_e4m3fn
        return F.linear(x.to(fp8).float(), self.weight.to(fp8).float())


class ExpertOffByOne(tinylm.MoE):
    """Tokens routed to expert e are computed by expert e+1."""

    def expert_for(self, e):
        return (e + 1) % len(self.experts)


def _plant_moe(block: int, where: str, cls: type[nn.Module], **options) -> tinylm.TinyLM:
    model = tinylm.build_moe(**options)
    ffn = model.blocks[block].ffn
    (ffn if where == "moe" else ffn.router).__class__ = cls
    return model


def moe_not_renormalized(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe``."""
    return _plant_moe(block, "router", NotRenormalized)


def moe_softmax_after_topk(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe_unnormalized`` (with renormalization the two orders
    give the same weights)."""
    return _plant_moe(block, "router", SoftmaxAfterTopk, norm_topk=False)


def moe_router_low_precision(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe``."""
    return _plant_moe(block, "router", LowPrecisionRouter)


def moe_expert_off_by_one(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """Candidate of ``tinylm.build_moe``."""
    return _plant_moe(block, "moe", ExpertOffByOne)


# MoE bug → (reference factory in samples/tinylm.py, part blamed inside the ffn).
MOE_BUGS: dict[str, tuple[str, str]] = {
    "moe_not_renormalized": ("build_moe", "router"),
    "moe_softmax_after_topk": ("build_moe_unnormalized", "router"),
    "moe_router_low_precision": ("build_moe", "router"),
    "moe_expert_off_by_one": ("build_moe", "experts"),
}


# factory name → (stage, sub-path) blockdiff must blame.
BUGS: dict[str, tuple[str, str | None]] = {
    "norm_as_layernorm": ("block", "norm"),
    "gate_up_swapped": ("block", "ffn"),
    "gelu_for_silu": ("block", "ffn"),
    "multiply_dropped": ("block", "ffn"),
    "attention_scale": ("block", "attention"),
    "causal_mask_dropped": ("block", "attention"),
    "rope_sign_flipped": ("block", "attention"),
    "residual_dropped": ("block", "residual"),
    "post_norm": ("block", "residual"),
    "head_untied_transposed": ("head", None),
}
