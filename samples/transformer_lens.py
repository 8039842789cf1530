"""TransformerLens ``HookedTransformer`` models with the weights of a tiny Hugging Face
GPT-2 or Llama, and one planted bug per sub-path.

The Hugging Face model is :func:`samples.hf_families.build` (``family="gpt2"``) or
:func:`samples.hf_llama.build`: built from a config, trained-looking weights from a fixed
seed, nothing downloaded. Its state dict goes through TransformerLens' own conversion
(``convert_gpt2_weights``, ``convert_llama_weights``) into a ``HookedTransformer`` loaded
without any of TransformerLens' weight processing (no folded norms, no centred weights or
unembedding, no folded value biases), so that both compute the same logits. Needs
TransformerLens 3 (``pip install "transformer-lens<4"``; the ``dev`` extra installs 4, which
removed ``HookedTransformer``: :mod:`samples.transformer_bridge` is its counterpart).

    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_lens.py:build
    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_lens.py:ffn_bug

:data:`BUGS` maps each planted bug (called with ``family=`` ``"gpt2"`` or ``"llama"``
and ``block=``) to the sub-path blockdiff must blame. Hugging Face Llama computes its
rotary tables in a model-level module (a ``context`` site), TransformerLens inside each
attention: compare the two with :func:`llama_reference_map` for the Hugging Face side.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from samples import hf_families, hf_llama

DEFAULT_BLOCK = 1
FAMILIES = ("gpt2", "llama")


def reference(*, family: str = "gpt2", seed: int = 0) -> nn.Module:
    """The Hugging Face model whose weights :func:`build` converts."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return hf_families.build(family="gpt2", seed=seed) if family == "gpt2" else hf_llama.build(seed=seed)


def reference_llama(*, seed: int = 0) -> nn.Module:
    return reference(family="llama", seed=seed)


def llama_reference_map():
    """The bundled ``llama`` map without its ``context`` stage: TransformerLens has no
    model-level rotary module to pair Hugging Face's ``model.rotary_emb`` with (each
    attention applies its own rotary tables, which stay each side's own)."""
    from dataclasses import replace

    from blockdiff.hookmap import find

    bundled = find(reference_llama())
    return replace(bundled, outside={k: v for k, v in bundled.outside.items() if k != "context"})


def _config(hf: nn.Module):
    """What TransformerLens' loader derives from a Hugging Face config
    (``convert_hf_model_config``), without a hub name to look the config up by."""
    from transformer_lens import HookedTransformerConfig

    c = hf.config
    common = dict(default_prepend_bos=False, device="cpu", n_layers=c.num_hidden_layers, d_vocab=c.vocab_size)
    if c.model_type == "gpt2":
        return HookedTransformerConfig(
            **common,
            d_model=c.n_embd,
            d_head=c.n_embd // c.n_head,
            n_heads=c.n_head,
            d_mlp=c.n_inner or 4 * c.n_embd,
            n_ctx=c.n_positions,
            eps=c.layer_norm_epsilon,
            act_fn=c.activation_function,
            normalization_type="LN",
            original_architecture="GPT2LMHeadModel",
        )
    head_dim = c.hidden_size // c.num_attention_heads
    return HookedTransformerConfig(
        **common,
        d_model=c.hidden_size,
        d_head=head_dim,
        n_heads=c.num_attention_heads,
        n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
        d_mlp=c.intermediate_size,
        n_ctx=c.max_position_embeddings,
        eps=c.rms_norm_eps,
        act_fn=c.hidden_act,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=head_dim,
        rotary_base=c.rope_parameters["rope_theta"],
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
    )


def build(*, family: str = "gpt2", seed: int = 0) -> nn.Module:
    """A ``HookedTransformer`` computing what :func:`reference` computes, in float32."""
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights

    hf = reference(family=family, seed=seed)
    cfg = _config(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "use TransformerBridge" (TL 3.x)
        model = HookedTransformer(cfg, move_to_device=False)
    convert = convert_gpt2_weights if family == "gpt2" else convert_llama_weights
    model.load_and_process_state_dict(
        convert(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval()


def _swap_forward(module: nn.Module, forward: Callable) -> None:
    """Give ``module`` (one object, not its class) a replaced ``forward``."""
    module.__class__ = type("Buggy" + type(module).__name__, (type(module),), {"forward": forward})


def build_llama(*, seed: int = 0) -> nn.Module:
    return build(family="llama", seed=seed)


def attention_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s attention scores divided by 2·sqrt(d_head) instead of sqrt(d_head)."""
    model = build(family=family)
    model.blocks[block].attn.attn_scale = model.blocks[block].attn.attn_scale * 2
    return model


def ffn_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s MLP with SiLU where GPT-2 has GELU (GELU where Llama has SiLU)."""
    model = build(family=family)
    model.blocks[block].mlp.act_fn = F.silu if family == "gpt2" else F.gelu
    return model


def _layernorm_without_mean(self, x: torch.Tensor) -> torch.Tensor:
    """TransformerLens' LayerNorm written as RMSNorm: the mean is not subtracted."""
    scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
    return x / scale * self.w + self.b


def _rmsnorm_with_mean(self, x: torch.Tensor) -> torch.Tensor:
    """TransformerLens' RMSNorm written as LayerNorm: the mean is subtracted."""
    x = x - x.mean(-1, keepdim=True)
    return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * self.w


def norm_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s ``ln1`` (all three of its calls) with the other norm's centring."""
    model = build(family=family)
    _swap_forward(model.blocks[block].ln1, _layernorm_without_mean if family == "gpt2" else _rmsnorm_with_mean)
    return model


def _attention_residual_dropped(self, resid_pre: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A pre-norm block whose attention output replaces the residual stream instead of
    adding to it."""
    x = self.ln1(resid_pre)
    resid_mid = self.attn(query_input=x, key_input=x, value_input=x)
    return resid_mid + self.mlp(self.ln2(resid_mid))


def residual_bug(*, family: str = "gpt2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block`` drops the residual add around attention."""
    model = build(family=family)
    _swap_forward(model.blocks[block], _attention_residual_dropped)
    return model


# Planted bug → the sub-path blockdiff must blame.
BUGS: dict[Callable[..., nn.Module], str] = {
    attention_bug: "attention",
    ffn_bug: "ffn",
    norm_bug: "norm",
    residual_bug: "residual",
}
