"""TransformerLens ``TransformerBridge`` models around a tiny Hugging Face GPT-2 or Llama,
and one planted bug per sub-path.

TransformerLens 4 removed ``HookedTransformer``: a ``TransformerBridge`` wraps a Hugging Face
model, replacing its modules by TransformerLens components (each holding the Hugging Face
module it wraps) and registering them again under TransformerLens' names (``blocks.1.mlp``
is ``blocks.1._original_component.mlp``). It is built here without the hub, with
``build_bridge_from_module`` around :func:`samples.hf_families.build` ``(family="gpt2")`` or
:func:`samples.hf_llama.build`: the weights are the Hugging Face model's, unprocessed, so
both compute the same logits. The wrapped model is changed in place: :func:`reference`
(:func:`samples.transformer_lens.reference`) builds another one from the same seed. Needs
TransformerLens 4 (or 3.9, which has the bridge beside ``HookedTransformer``).

    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_bridge.py:build
    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_bridge.py:ffn_bug

A bridge runs some modules' Hugging Face code and computes others itself: GPT-2's attention
(q, k and v split out of ``c_attn``) and its LayerNorms are TransformerLens code, so a bug
planted in Hugging Face's ``GPT2Attention`` is not in a bridge around it. Each bug below is in
what the bridge runs. :data:`BUGS` maps each (called with ``family=`` ``"gpt2"`` or
``"llama"`` and ``block=``) to the sub-path blockdiff must blame.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from samples import hf_families, hf_llama
from samples.transformer_lens import DEFAULT_BLOCK, FAMILIES, reference  # the same Hugging Face models


def wrap(hf: nn.Module) -> nn.Module:
    """A ``TransformerBridge`` around ``hf``, built from its class and config (no hub name,
    no download), in eval mode."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    return build_bridge_from_module(hf, type(hf).__name__, hf_config=hf.config).eval()


def build(*, family: str = "gpt2", seed: int = 0) -> nn.Module:
    """A ``TransformerBridge`` computing what :func:`reference` computes, in float32."""
    return wrap(reference(family=family, seed=seed))


def build_llama(*, seed: int = 0) -> nn.Module:
    return build(family="llama", seed=seed)


def attention_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """GPT-2: the bridge's key and value projections (split out of ``c_attn``) swapped in
    block ``block``. Llama: Hugging Face's attention scores scaled by 1/d, not 1/sqrt(d)."""
    if family == "llama":
        return wrap(hf_llama.attention_scale(block=block))
    bridge = build(family=family)
    attn = bridge.blocks[block].attn
    attn._modules["k"], attn._modules["v"] = attn._modules["v"], attn._modules["k"]
    return bridge


def ffn_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Hugging Face's MLP of block ``block`` with SiLU where GPT-2 has GELU (GELU where Llama
    has SiLU)."""
    hf = hf_families.ffn_bug(family="gpt2", block=block) if family == "gpt2" else hf_llama.gelu_for_silu(block=block)
    return wrap(hf)


def norm_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """GPT-2: the bridge's ``ln2`` of block ``block`` takes the LayerNorm for an RMSNorm
    (the mean is not subtracted). Llama: Hugging Face's input RMSNorm written as LayerNorm."""
    if family == "llama":
        return wrap(hf_llama.norm_as_layernorm(block=block))
    bridge = build(family=family)
    norm = bridge.blocks[block].ln2
    norm.__class__ = type("RMSNormLike" + type(norm).__name__, (type(norm),), {"uses_rms_norm": property(lambda self: True)})
    return bridge


def residual_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Hugging Face's block ``block`` drops the residual add around attention."""
    hf = hf_families.residual_bug(family="gpt2", block=block) if family == "gpt2" else hf_llama.residual_dropped(block=block)
    return wrap(hf)


# Planted bug → the sub-path blockdiff must blame.
BUGS: dict[Callable[..., nn.Module], str] = {
    attention_bug: "attention",
    ffn_bug: "ffn",
    norm_bug: "norm",
    residual_bug: "residual",
}
