"""Tiny Hugging Face Llama-family models (Llama, Mistral, Qwen2, Qwen3) and planted bugs.

Built from config objects with trained-looking random weights and a fixed seed: nothing is
downloaded. Needs ``transformers`` (``pip install blockdiff[hf]``).

    blockdiff diff samples/hf_llama.py:build --cand-dtype bfloat16
    blockdiff diff samples/hf_llama.py:build samples/hf_llama.py:gelu_for_silu
"""

from __future__ import annotations

import torch
from torch import nn

from blockdiff.weights import trained_looking_

DEFAULT_BLOCK = 1

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def config(arch: str = "llama", **overrides):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(classes)}")
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    return classes[arch](**{**SIZES, **extra, **overrides})


def build(*, arch: str = "llama", seed: int = 0, **overrides) -> nn.Module:
    """A tiny ``{Llama,Mistral,Qwen2,Qwen3}ForCausalLM`` with trained-looking weights."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(arch, **overrides))
    return trained_looking_(model, seed=seed).eval()


def build_flex(*, seed: int = 0) -> nn.Module:
    """The same Llama with flex attention (its mask is a ``BlockMask`` object)."""
    return build(seed=seed, attn_implementation="flex_attention")


def build_qwen3(*, seed: int = 0) -> nn.Module:
    return build(arch="qwen3", seed=seed)


def build_mistral(*, seed: int = 0) -> nn.Module:
    return build(arch="mistral", seed=seed)


def build_qwen2(*, seed: int = 0) -> nn.Module:
    return build(arch="qwen2", seed=seed)


def _swap_class(module: nn.Module, name: str, forward) -> None:
    module.__class__ = type(name + type(module).__name__, (type(module),), {"forward": forward})


def _layernorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _residual_dropped_forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                              position_embeddings=None, **kwargs):
    # The cache goes on in kwargs under the name the caller gave it: `cache` in transformers
    # 5, `past_key_values` before (naming one while the caller passes the other warns).
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(
        hidden_states=h,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    # The bug: `h = hidden_states + h` is missing.
    residual = h
    h = self.mlp(self.post_attention_layernorm(h))
    return residual + h


def gelu_for_silu(*, block: int = DEFAULT_BLOCK, arch: str = "llama") -> nn.Module:
    model = build(arch=arch)
    model.model.layers[block].mlp.act_fn = nn.GELU()
    return model


def residual_dropped(*, block: int = DEFAULT_BLOCK, arch: str = "llama") -> nn.Module:
    model = build(arch=arch)
    _swap_class(model.model.layers[block], "ResidualDropped", _residual_dropped_forward)
    return model


def norm_as_layernorm(*, block: int = DEFAULT_BLOCK, arch: str = "llama") -> nn.Module:
    """RMSNorm written as LayerNorm in the block's input norm."""
    model = build(arch=arch)
    _swap_class(model.model.layers[block].input_layernorm, "LayerNormLike", _layernorm_forward)
    return model


def attention_scale(*, block: int = DEFAULT_BLOCK, arch: str = "llama") -> nn.Module:
    """Attention scores scaled by 1/d instead of 1/sqrt(d)."""
    model = build(arch=arch)
    attn = model.model.layers[block].self_attn
    attn.scaling = 1.0 / attn.head_dim
    return model


# factory name → (stage, sub-path) blockdiff must blame.
BUGS: dict[str, tuple[str, str]] = {
    "gelu_for_silu": ("block", "ffn"),
    "residual_dropped": ("block", "residual"),
    "norm_as_layernorm": ("block", "norm"),
    "attention_scale": ("block", "attention"),
}
