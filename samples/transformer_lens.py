"""TransformerLens ``HookedTransformer`` models with the weights of a tiny Hugging Face
GPT-2, and one planted bug per sub-path.

The Hugging Face model is :func:`samples.hf_families.build` (``family="gpt2"``: built from
a config, trained-looking weights from a fixed seed, nothing downloaded). Its state dict
goes through TransformerLens' own conversion (``convert_gpt2_weights``) into a
``HookedTransformer`` loaded without any of TransformerLens' weight processing (no
folded LayerNorms, no centred weights or unembedding, no folded value biases), so that
both compute the same logits. Needs ``transformer-lens<4`` (``pip install blockdiff[dev]``).

    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_lens.py:build
    blockdiff diff samples/hf_families.py:build_gpt2 samples/transformer_lens.py:ffn_bug

:data:`BUGS` maps each planted bug to the sub-path blockdiff must blame (block
:data:`DEFAULT_BLOCK`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from samples import hf_families

DEFAULT_BLOCK = 1


def reference(*, seed: int = 0) -> nn.Module:
    """The Hugging Face GPT-2 whose weights :func:`build` converts."""
    return hf_families.build(family="gpt2", seed=seed)


def build(*, seed: int = 0) -> nn.Module:
    """A ``HookedTransformer`` computing what :func:`reference` computes, in float32."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hf = reference(seed=seed)
    c = hf.config
    # What TransformerLens' loader derives from a GPT-2 config (convert_hf_model_config),
    # without a hub name to look the config up by.
    cfg = HookedTransformerConfig(
        d_model=c.n_embd,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=c.n_inner or 4 * c.n_embd,
        n_layers=c.n_layer,
        n_ctx=c.n_positions,
        eps=c.layer_norm_epsilon,
        d_vocab=c.vocab_size,
        act_fn=c.activation_function,
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
        device="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "use TransformerBridge" (TL 3.x)
        model = HookedTransformer(cfg, move_to_device=False)
    model.load_and_process_state_dict(
        convert_gpt2_weights(hf, cfg),
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval()


def _swap_forward(module: nn.Module, forward: Callable) -> None:
    """Give ``module`` (one object, not its class) a replaced ``forward``."""
    module.__class__ = type("Buggy" + type(module).__name__, (type(module),), {"forward": forward})


def attention_bug(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s attention scores divided by 2·sqrt(d_head) instead of sqrt(d_head)."""
    model = build()
    model.blocks[block].attn.attn_scale = model.blocks[block].attn.attn_scale * 2
    return model


def ffn_bug(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s MLP with SiLU where GPT-2 has GELU."""
    model = build()
    model.blocks[block].mlp.act_fn = F.silu
    return model


def _layernorm_without_mean(self, x: torch.Tensor) -> torch.Tensor:
    """TransformerLens' LayerNorm written as RMSNorm: the mean is not subtracted."""
    scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
    return x / scale * self.w + self.b


def norm_bug(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block``'s ``ln1`` (all three of its calls) without mean subtraction."""
    model = build()
    _swap_forward(model.blocks[block].ln1, _layernorm_without_mean)
    return model


def _attention_residual_dropped(self, resid_pre: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A GPT-2 block whose attention output replaces the residual stream instead of
    adding to it."""
    x = self.ln1(resid_pre)
    resid_mid = self.attn(query_input=x, key_input=x, value_input=x)
    return resid_mid + self.mlp(self.ln2(resid_mid))


def residual_bug(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Block ``block`` drops the residual add around attention."""
    model = build()
    _swap_forward(model.blocks[block], _attention_residual_dropped)
    return model


# Planted bug → the sub-path blockdiff must blame.
BUGS: dict[Callable[..., nn.Module], str] = {
    attention_bug: "attention",
    ffn_bug: "ffn",
    norm_bug: "norm",
    residual_bug: "residual",
}
