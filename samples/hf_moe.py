"""Tiny Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) and planted MoE bugs.

Built from config objects with trained-looking random weights and a fixed seed; needs
``transformers``. Each bug factory plants one bug in one block's MoE:

- ``not_renormalized``: the top-k weights are not renormalized where the model does;
- ``softmax_after_topk``: softmax over the top-k logits instead of all experts (on
  Qwen2-MoE, which does not renormalize: with renormalization both orders give the same
  weights, so on Mixtral this is no bug at all);
- ``router_low_precision``: the router computed in float8 (a quantization pass that
  forgot to skip it) where the reference keeps the model's precision;
- ``expert_off_by_one``: tokens routed to expert e are computed by expert e+1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.weights import trained_looking_

DEFAULT_BLOCK = 1

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def config(arch: str = "mixtral", **overrides):
    import transformers

    if arch == "mixtral":
        return transformers.MixtralConfig(**{**SIZES, "num_local_experts": 8, "num_experts_per_tok": 2, **overrides})
    if arch == "qwen2_moe":
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
        return transformers.Qwen2MoeConfig(**{**SIZES, **extra, **overrides})
    if arch == "qwen3_moe":
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16, norm_topk_prob=True)
        return transformers.Qwen3MoeConfig(**{**SIZES, **extra, **overrides})
    raise ValueError(f"unknown arch {arch!r}; expected mixtral, qwen2_moe or qwen3_moe")


def build(*, arch: str = "mixtral", seed: int = 0, **overrides) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(arch, **overrides))
    return trained_looking_(model, seed=seed).eval()


def build_switch(*, seed: int = 0, expert_capacity: int = 4) -> nn.Module:
    """A tiny SwitchTransformers (top-1, 4 experts, capacity ``expert_capacity`` tokens per
    expert and sequence); call it with ``dict(input_ids=..., decoder_input_ids=...)``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.SwitchTransformersConfig(
        vocab_size=256, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=expert_capacity, encoder_sparse_step=1, decoder_sparse_step=1,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
    )
    model = transformers.SwitchTransformersForConditionalGeneration(config)
    return trained_looking_(model, seed=seed).eval()


def build_qwen2_moe(*, seed: int = 0) -> nn.Module:
    return build(arch="qwen2_moe", seed=seed)


def build_qwen3_moe(*, seed: int = 0) -> nn.Module:
    return build(arch="qwen3_moe", seed=seed)


def _swap_forward(module: nn.Module, name: str, forward) -> None:
    module.__class__ = type(name + type(module).__name__, (type(module),), {"forward": forward})


def _router_forward(*, renormalize: bool | None, softmax_after: bool = False, fp8: bool = False):
    """A top-k router forward with one thing changed; ``renormalize=None`` keeps the model's."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        if fp8:
            q = torch.float8_e4m3fn
            logits = F.linear(hidden_states.to(q).to(hidden_states.dtype), self.weight.to(q).to(self.weight.dtype))
        else:
            logits = F.linear(hidden_states, self.weight)
        if softmax_after:
            top, indices = torch.topk(logits.float(), self.top_k, dim=-1)
            weights = top.softmax(-1)
        else:
            weights, indices = torch.topk(logits.float().softmax(-1), self.top_k, dim=-1)
        norm = getattr(self, "norm_topk_prob", True) if renormalize is None else renormalize
        if norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices

    return forward


def _experts_off_by_one(self, hidden_states, top_k_index, top_k_weights):
    return type(self).__mro__[1].forward(self, hidden_states, (top_k_index + 1) % self.num_experts, top_k_weights)


def not_renormalized(*, block: int = DEFAULT_BLOCK, arch: str = "mixtral") -> nn.Module:
    model = build(arch=arch)
    _swap_forward(model.model.layers[block].mlp.gate, "NotRenormalized", _router_forward(renormalize=False))
    return model


def softmax_after_topk(*, block: int = DEFAULT_BLOCK, arch: str = "qwen2_moe") -> nn.Module:
    model = build(arch=arch)
    _swap_forward(model.model.layers[block].mlp.gate, "SoftmaxAfterTopk", _router_forward(renormalize=None, softmax_after=True))
    return model


def router_low_precision(*, block: int = DEFAULT_BLOCK, arch: str = "mixtral") -> nn.Module:
    model = build(arch=arch)
    _swap_forward(model.model.layers[block].mlp.gate, "Float8Router", _router_forward(renormalize=None, fp8=True))
    return model


def expert_off_by_one(*, block: int = DEFAULT_BLOCK, arch: str = "mixtral") -> nn.Module:
    model = build(arch=arch)
    _swap_forward(model.model.layers[block].mlp.experts, "OffByOne", _experts_off_by_one)
    return model


# bug → (arch of the reference, part of the ffn blamed)
BUGS: dict[str, tuple[str, str]] = {
    "not_renormalized": ("mixtral", "router"),
    "softmax_after_topk": ("qwen2_moe", "router"),
    "router_low_precision": ("mixtral", "router"),
    "expert_off_by_one": ("mixtral", "experts"),
}
