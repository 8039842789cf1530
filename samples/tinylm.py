"""tinylm: a small, readable decoder-only language model in plain torch.

Token embedding → blocks (RMSNorm, causal self-attention with RoPE and grouped-query
heads, SwiGLU feed-forward) → final RMSNorm → vocabulary projection tied to the embedding.
Blocks are pre-norm by default; ``residual="post"`` gives post-norm blocks and
``residual="parallel"`` GPT-NeoX-style parallel blocks. ``experts=N`` replaces the
feed-forward of every block by a mixture of experts (a float32 top-k router and N SwiGLU
experts, optionally with an expert capacity that drops tokens first-come by position).

``build()`` is the factory blockdiff loads (``samples/tinylm.py:build``): a fixed seed and
weights that look trained, so a second call returns the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.weights import trained_looking_


@dataclass
class Config:
    vocab_size: int = 256
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 172
    blocks: int = 4
    eps: float = 1e-6
    rope_theta: float = 10000.0
    residual: str = "pre"  # "pre", "post" or "parallel"
    experts: int = 0  # 0: dense SwiGLU; N: mixture of N experts
    top_k: int = 2
    norm_topk: bool = True  # renormalize the top-k routing weights to sum to 1
    capacity_factor: float | None = None  # None: dropless
    expert_intermediate: int = 96

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """Model-level rotary embedding: (cos, sin) for the positions, shared by all blocks."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.scale = cfg.head_dim ** -0.5
        self.causal = True
        self.rope_sign = 1.0

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + self.rope_sign * rotate_half(x) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        probs = scores.float().softmax(-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config, intermediate: int | None = None) -> None:
        super().__init__()
        intermediate = intermediate or cfg.intermediate
        self.gate_proj = nn.Linear(cfg.hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, cfg.hidden, bias=False)
        self.act = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k router computed in float32 whatever the model's dtype.

    Returns ``(logits [T, E], weights [T, k], indices [T, k])`` like Hugging Face's MoE
    routers: softmax over all experts, then top-k, then (``norm_topk``) renormalized.
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.hidden))
        self.top_k = cfg.top_k
        self.norm_topk = cfg.norm_topk

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        weights, indices = logits.softmax(-1).topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, indices


class MoE(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = nn.ModuleList(SwiGLU(cfg, cfg.expert_intermediate) for _ in range(cfg.experts))
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / len(self.experts))

    def keep(self, indices: torch.Tensor) -> torch.Tensor:
        """[T, k] bool: assignments within capacity, first come by position (token by
        token, a token's slots in order)."""
        capacity = self.capacity(indices.shape[0])
        if capacity is None:
            return torch.ones_like(indices, dtype=torch.bool)
        onehot = F.one_hot(indices.reshape(-1), len(self.experts))
        position = (onehot.cumsum(0) * onehot).sum(-1).view_as(indices)
        return position <= capacity

    def expert_for(self, e: int) -> int:
        return e

    def routing_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The router's top-k weights as they scale the experts' outputs."""
        return weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, indices = self.router(flat)
        weights = self.routing_weights(weights)
        keep = self.keep(indices)
        out = torch.zeros_like(flat)
        for e in range(len(self.experts)):
            token, slot = torch.where((indices == e) & keep)
            if token.numel():
                y = self.experts[self.expert_for(e)](flat[token]) * weights[token, slot, None].to(flat.dtype)
                out.index_add_(0, token, y)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.ffn = MoE(cfg) if cfg.experts else SwiGLU(cfg)
        self.residual = cfg.residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.residual == "parallel":
            return x + self.attn(self.attn_norm(x), cos, sin) + self.ffn(self.ffn_norm(x))
        if self.residual == "post":
            x = self.attn_norm(x + self.attn(x, cos, sin))
            return self.ffn_norm(x + self.ffn(x))
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.rotary = Rotary(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        cos, sin = self.rotary(x, positions)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def build(*, seed: int = 0, **options) -> TinyLM:
    """The sample model with trained-looking weights from ``seed``.

    Args:
        seed: weight seed; the same seed gives the same weights.
        **options: :class:`Config` fields, e.g. ``blocks=8`` or ``residual="parallel"``.
    """
    return trained_looking_(TinyLM(Config(**options)), seed=seed).eval()


def build_parallel(*, seed: int = 0) -> TinyLM:
    """GPT-NeoX-style parallel residual variant."""
    return build(seed=seed, residual="parallel")


def build_post_norm(*, seed: int = 0) -> TinyLM:
    """Post-norm (original Transformer) variant."""
    return build(seed=seed, residual="post")


def build_moe(*, seed: int = 0, **options) -> TinyLM:
    """Mixture-of-experts variant: 8 experts, top-2, renormalized weights, dropless."""
    return build(seed=seed, **{"experts": 8, "top_k": 2, **options})


def build_moe_unnormalized(*, seed: int = 0) -> TinyLM:
    """MoE variant whose top-k weights are not renormalized (Qwen2-MoE style)."""
    return build_moe(seed=seed, norm_topk=False)


def build_moe_capacity(*, seed: int = 0) -> TinyLM:
    """MoE variant with an expert capacity (factor 1.0) that drops tokens by position."""
    return build_moe(seed=seed, capacity_factor=1.0)


def build_adds_into_ffn(*, seed: int = 0, block: int = 1) -> TinyLM:
    """The reference model computing the same outputs, but block ``block`` adds its residual
    into its FFN's output tensor in place — after the FFN's hook has recorded that tensor
    (HF Falcon adds into its MLP's output): what an asynchronous copy of the recorded
    tensor must not see."""
    model = build(seed=seed)
    layer = model.blocks[block]

    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + layer.attn(layer.attn_norm(x), cos, sin)
        out = layer.ffn(layer.ffn_norm(x))
        out += x
        return out

    layer.forward = forward
    return model
