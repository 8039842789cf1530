"""Tiny Hugging Face models of several families, and one planted bug per sub-path each.

Families: Gemma2, Gemma3 (text), Phi-3, OLMo2, GPT-2, GPT-NeoX, Falcon, BERT and T5, each
built from a config object (nothing is downloaded) with trained-looking random weights
from a fixed seed, so two calls give the same weights. Needs ``transformers``
(``pip install blockdiff[hf]``).

    blockdiff diff samples/hf_families.py:build_gemma2 --cand-dtype bfloat16
    blockdiff diff samples/hf_families.py:build_gpt_neox samples/hf_families.py:gpt_neox_sequential

:data:`BUGS` maps each family to its planted bugs, one per sub-path it has: the factory
(called with ``family=`` and ``block=``) and the sub-path blockdiff must blame. :func:`inputs` gives the inputs a family
is called with (T5 needs decoder token ids as well).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.weights import trained_looking_

DEFAULT_BLOCK = 1
FAMILIES = ("gemma2", "gemma3", "phi3", "olmo2", "gpt2", "gpt_neox", "falcon", "bert", "t5")

# Gemma's RMSNorm computes x * (1 + w): its weights are drawn around 0, not 1.
OFFSET_NORMS = ("Gemma2RMSNorm", "Gemma3RMSNorm")

_DECODER = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=128,
)


def config(family: str, **overrides):
    """The tiny config of ``family`` (4 blocks, or 2 + 2 for T5; hidden size 64)."""
    import transformers

    gqa = dict(num_key_value_heads=2)
    table: dict[str, Callable[[], object]] = {
        "gemma2": lambda: transformers.Gemma2Config(
            **_DECODER, **gqa, head_dim=16, query_pre_attn_scalar=16, sliding_window=8
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **_DECODER, **gqa, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "phi3": lambda: transformers.Phi3Config(**_DECODER, **gqa, pad_token_id=0),
        "olmo2": lambda: transformers.Olmo2Config(**_DECODER, **gqa, pad_token_id=0),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=128, n_inner=128
        ),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**_DECODER),
        "falcon": lambda: transformers.FalconConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4
        ),
        "bert": lambda: transformers.BertConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=128,
        ),
        "t5": lambda: transformers.T5Config(
            vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
            num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
            decoder_start_token_id=0,
        ),
    }
    if family not in table:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    cfg = table[family]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build(*, family: str = "gemma2", seed: int = 0, **overrides) -> nn.Module:
    """A tiny model of ``family`` with trained-looking weights from ``seed``."""
    import transformers

    cfg = config(family, **overrides)
    if family == "bert":
        model = transformers.BertForMaskedLM(cfg)
    elif family == "t5":
        model = transformers.T5ForConditionalGeneration(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return trained_looking_(model, seed=seed, offset_norms=OFFSET_NORMS).eval()


def inputs(family: str, ids: torch.Tensor):
    """What ``family`` is called with: the token ids, or for T5 a dict with decoder ids
    (the same ids shifted right, as in training)."""
    if family == "t5":
        decoder_ids = torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :-1]], dim=1)
        return dict(input_ids=ids, decoder_input_ids=decoder_ids)
    return ids


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in execution order (T5: encoder blocks, then decoder blocks)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "bert.encoder.layer"):
        try:
            return list(model.get_submodule(path))
        except AttributeError:
            continue
    return [*model.encoder.block, *model.decoder.block]


def _swap_class(module: nn.Module, name: str, forward: Callable) -> None:
    """Give ``module`` (one object, not its class) a replaced ``forward``."""
    module.__class__ = type(name + type(module).__name__, (type(module),), {"forward": forward})


# -- generic bugs ---------------------------------------------------------------------------


class _Swapped(nn.Module):
    """An activation replaced by another (GELU for SiLU or the reverse, GELU for ReLU)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _other_activation(current: Callable) -> nn.Module:
    name = type(current).__name__.lower()
    return _Swapped(F.gelu if ("silu" in name or "relu" in name) else F.silu)


def _layernorm_without_mean(self, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm written as RMSNorm: the mean is not subtracted."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (self.weight.float() * h + self.bias.float()).to(x.dtype)


def _layernorm_bias_dropped(self, x: torch.Tensor) -> torch.Tensor:
    """nn.LayerNorm without its bias."""
    return F.layer_norm(x, self.normalized_shape, self.weight, None, self.eps)


def _rmsnorm_as_layernorm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm (HF Llama style) written as LayerNorm: the mean is subtracted."""
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h - h.mean(-1, keepdim=True)
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return self.weight * h.to(dtype)


def _gemma_norm_without_offset(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm with ``w`` where it should be ``1 + w`` (a classic port bug)."""
    return (self._norm(x.float()) * self.weight.float()).type_as(x)


# -- per-family bugs ------------------------------------------------------------------------


def attention_bug(*, family: str = "gemma2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """A wrong attention: scores scaled by 1/d instead of 1/sqrt(d) (T5: scaled where T5
    does not scale), Phi-3's fused qkv split with key and value swapped, Falcon's fused
    query_key_value split with key and value swapped."""
    model = build(family=family)
    target = blocks(model)[block]
    if family in ("gemma2", "gemma3", "olmo2"):
        target.self_attn.scaling = 1.0 / target.self_attn.head_dim
    elif family == "phi3":
        _swap_class(target.self_attn.qkv_proj, "KVSwapped", _fused_qkv_kv_swapped)
    elif family == "gpt2":
        target.attn.scaling = 1.0 / target.attn.head_dim
    elif family == "gpt_neox":
        target.attention.scaling = 1.0 / target.attention.head_size
    elif family == "falcon":
        attn = target.self_attention
        # Multi-query Falcon (this config) lays its fused projection out as Phi-3 does.
        if not attn.multi_query or attn.new_decoder_architecture:
            raise ValueError("falcon's attention bug is planted in a multi-query config only")
        _swap_class(attn.query_key_value, "KVSwapped", _fused_qkv_kv_swapped)
    elif family == "bert":
        target.attention.self.scaling = 1.0 / target.attention.self.attention_head_size
    elif family == "t5":
        attn = target.layer[0].SelfAttention
        attn.scaling = attn.key_value_proj_dim**-0.5
    else:
        raise ValueError(f"unknown family {family!r}")
    return model


def cross_attention_bug(*, block: int = 3) -> nn.Module:
    """T5 with the cross-attention (EncDecAttention) of decoder ``block`` (a global block
    index: 2 and 3 are the decoder's) scaling its scores, which T5 does not do."""
    model = build(family="t5")
    attn = blocks(model)[block].layer[1].EncDecAttention
    attn.scaling = attn.key_value_proj_dim**-0.5
    return model


def _fused_qkv_kv_swapped(self, x: torch.Tensor) -> torch.Tensor:
    """A fused projection laid out ``[query | key | value]`` (Phi-3's ``qkv_proj``,
    multi-query Falcon's ``query_key_value``) with the key and value slices in the wrong
    order."""
    qkv = F.linear(x, self.weight, self.bias)
    kv = (qkv.shape[-1] - self.in_features) // 2
    q, k, v = qkv.split([self.in_features, kv, kv], dim=-1)
    return torch.cat([q, v, k], dim=-1)


def ffn_bug(*, family: str = "gemma2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """A wrong FFN: the activation swapped (GELU ↔ SiLU, GELU for ReLU); Phi-3's fused
    gate_up split in the wrong order (up taken as the gate)."""
    model = build(family=family)
    target = blocks(model)[block]
    if family in ("gemma2", "gemma3", "olmo2"):
        target.mlp.act_fn = _other_activation(target.mlp.act_fn)
    elif family == "phi3":
        _swap_class(target.mlp, "GateUpSwapped", _phi3_gate_up_swapped)
    elif family in ("gpt2", "gpt_neox", "falcon"):
        target.mlp.act = _other_activation(target.mlp.act)
    elif family == "bert":
        target.intermediate.intermediate_act_fn = _other_activation(target.intermediate.intermediate_act_fn)
    elif family == "t5":
        ff = target.layer[-1].DenseReluDense
        ff.act = _other_activation(ff.act)
    else:
        raise ValueError(f"unknown family {family!r}")
    return model


def _phi3_gate_up_swapped(self, hidden_states: torch.Tensor) -> torch.Tensor:
    up_states = self.gate_up_proj(hidden_states)
    up_states, gate = up_states.chunk(2, dim=-1)  # the bug: halves in the wrong order
    return self.down_proj(up_states * self.activation_fn(gate))


def norm_bug(*, family: str = "gemma2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """A wrong norm: Gemma's (1 + w) applied as w; an RMSNorm written as LayerNorm (Phi-3,
    OLMo2, T5); a LayerNorm written as RMSNorm (GPT-2, GPT-NeoX, Falcon); BERT's
    post-attention LayerNorm without its bias. (BERT's post-LN inputs have a mean near
    zero, so the RMSNorm mistake there is only 2.8x its bfloat16 threshold; the dropped
    bias is 5.5x.)"""
    model = build(family=family)
    target = blocks(model)[block]
    if family in ("gemma2", "gemma3"):
        _swap_class(target.pre_feedforward_layernorm, "NoOffset", _gemma_norm_without_offset)
    elif family == "phi3":
        _swap_class(target.input_layernorm, "LayerNormLike", _rmsnorm_as_layernorm)
    elif family == "olmo2":
        _swap_class(target.post_attention_layernorm, "LayerNormLike", _rmsnorm_as_layernorm)
    elif family == "t5":
        _swap_class(target.layer[-1].layer_norm, "LayerNormLike", _rmsnorm_as_layernorm)
    elif family == "gpt2":
        _swap_class(target.ln_2, "RMSNormLike", _layernorm_without_mean)
    elif family == "gpt_neox":
        _swap_class(target.post_attention_layernorm, "RMSNormLike", _layernorm_without_mean)
    elif family == "falcon":
        _swap_class(target.input_layernorm, "RMSNormLike", _layernorm_without_mean)
    elif family == "bert":
        _swap_class(target.attention.output.LayerNorm, "BiasDropped", _layernorm_bias_dropped)
    else:
        raise ValueError(f"unknown family {family!r}")
    return model


def residual_bug(*, family: str = "gemma2", block: int = DEFAULT_BLOCK) -> nn.Module:
    """A wrong block glue, each family its own: Gemma's post-attention norm applied after
    the residual add; OLMo2 written pre-norm (the norm before attention, as in Llama);
    GPT-NeoX sequential instead of parallel; Falcon's residual dropped; BERT's residual add
    dropped inside its FFN output module; T5's FFN residual add dropped; Phi-3 and GPT-2
    with the attention residual dropped."""
    model = build(family=family)
    target = blocks(model)[block]
    forwards = {
        "gemma2": _gemma_norm_after_add,
        "gemma3": _gemma_norm_after_add,
        "phi3": _phi3_residual_dropped,
        "olmo2": _olmo2_pre_norm,
        "gpt2": _gpt2_residual_dropped,
        "gpt_neox": _neox_sequential,
        "falcon": _falcon_residual_dropped,
    }
    if family in forwards:
        _swap_class(target, "ResidualBug", forwards[family])
    elif family == "bert":
        _swap_class(target.output, "ResidualDropped", _bert_output_residual_dropped)
    elif family == "t5":
        _swap_class(target.layer[-1], "ResidualDropped", _t5_ff_residual_dropped)
    else:
        raise ValueError(f"unknown family {family!r}")
    return model


# The planted blocks pass the cache on in kwargs, under the name their caller gave it:
# `cache` in transformers 5, `past_key_values` before (naming one while the caller passes
# the other warns).


def _gemma_norm_after_add(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                          **kwargs):
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(
        hidden_states=h, position_embeddings=position_embeddings, attention_mask=attention_mask,
        position_ids=position_ids, **kwargs,
    )
    h = self.post_attention_layernorm(residual + h)  # the bug: norm(x + attn) for x + norm(attn)
    residual = h
    h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
    return residual + h


def _phi3_residual_dropped(self, hidden_states, attention_mask=None, position_ids=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    h = self.input_layernorm(hidden_states)
    h, _ = self.self_attn(
        hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
        use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    residual = h  # the bug: `hidden_states + h` is missing
    return residual + self.mlp(self.post_attention_layernorm(h))


def _olmo2_pre_norm(self, hidden_states, attention_mask=None, position_ids=None,
                    use_cache=False, position_embeddings=None, **kwargs):
    # The bug: OLMo2 ported as a Llama (norm before each sub-layer, not after it).
    h, _ = self.self_attn(
        hidden_states=self.post_attention_layernorm(hidden_states), attention_mask=attention_mask,
        position_ids=position_ids, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    hidden_states = hidden_states + h
    return hidden_states + self.mlp(self.post_feedforward_layernorm(hidden_states))


def _gpt2_residual_dropped(self, hidden_states, cache=None, attention_mask=None,
                           encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False, **kwargs):
    # The cache comes second, by position; the attention takes it as `cache` (transformers
    # 5), or as `past_key_values` before.
    name = "cache" if "cache" in inspect.signature(self.attn.forward).parameters else "past_key_values"
    attn_output, _ = self.attn(
        self.ln_1(hidden_states), attention_mask=attention_mask, use_cache=use_cache, **{name: cache}, **kwargs,
    )
    hidden_states = attn_output  # the bug: `+ residual` is missing
    return hidden_states + self.mlp(self.ln_2(hidden_states))


def _neox_sequential(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                     layer_past=None, position_embeddings=None, **kwargs):
    attn_output, _ = self.attention(
        self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
        layer_past=layer_past, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    # The bug: sequential (the MLP reads x + attn) where the config says parallel.
    attn_output = attn_output + hidden_states
    return self.mlp(self.post_attention_layernorm(attn_output)) + attn_output


def falcon_residual(scale: float):
    """A Falcon (parallel) block forward whose residual is multiplied by ``scale`` (the
    bug; 1.0 is the real block), adding the attention output into the MLP output in
    place as FalconDecoderLayer does."""

    def forward(self, hidden_states, *args, **kwargs):
        # Installed with _swap_class: the arguments bound as the real block's forward takes
        # them (older transformers pass ``alibi`` second, 5.25 has none), handed to the
        # attention by name.
        real = inspect.signature(super(type(self), self).forward).bind(hidden_states, *args, **kwargs).arguments
        wanted = inspect.signature(self.self_attention.forward).parameters
        given = {k: v for k, v in real.items() if k in wanted and k not in ("hidden_states", "kwargs")}
        normed = self.input_layernorm(hidden_states)
        attention_output, attn_weights = self.self_attention(normed, **given, **real.get("kwargs", {}))
        mlp_output = self.mlp(normed)
        mlp_output += attention_output
        return mlp_output + scale * hidden_states, attn_weights

    return forward


_falcon_residual_dropped = falcon_residual(0.0)


def _bert_output_residual_dropped(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    hidden_states = self.dropout(self.dense(hidden_states))
    return self.LayerNorm(hidden_states)  # the bug: LayerNorm(h) for LayerNorm(h + input_tensor)


def _t5_ff_residual_dropped(self, hidden_states: torch.Tensor) -> torch.Tensor:
    forwarded = self.DenseReluDense(self.layer_norm(hidden_states))
    return self.dropout(forwarded)  # the bug: `hidden_states +` is missing


# family → {factory: sub-path blamed}. Every family has all four sub-paths.
BUGS: dict[str, tuple[tuple[Callable[..., nn.Module], str], ...]] = {
    family: ((attention_bug, "attention"), (ffn_bug, "ffn"), (norm_bug, "norm"), (residual_bug, "residual"))
    for family in FAMILIES
}


# -- factories for the CLI (each a callable without arguments) -------------------------------


def build_gemma2() -> nn.Module:
    return build(family="gemma2")


def build_gemma3() -> nn.Module:
    return build(family="gemma3")


def build_phi3() -> nn.Module:
    return build(family="phi3")


def build_olmo2() -> nn.Module:
    return build(family="olmo2")


def build_gpt2() -> nn.Module:
    return build(family="gpt2")


def build_gpt_neox() -> nn.Module:
    return build(family="gpt_neox")


def build_falcon() -> nn.Module:
    return build(family="falcon")


def build_t5() -> nn.Module:
    """An encoder-decoder: from the CLI, decoder ids are derived from the token ids."""
    return build(family="t5")


def build_bert() -> nn.Module:
    return build(family="bert")


def build_bart(*, seed: int = 0) -> nn.Module:
    """A tiny BART (bundled map ``bart``: encoder and decoder stacks, fc1 → activation →
    fc2 the ffn)."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return trained_looking_(transformers.BartForConditionalGeneration(config), seed=seed).eval()


def bart_fc2_bias_dropped(*, block: int = 3) -> nn.Module:
    """BART whose layer ``block`` (encoder layers, then decoder layers) computes fc2
    without its bias (a port that built the projection with ``bias=False``)."""
    model = build_bart()
    layer = [*model.model.encoder.layers, *model.model.decoder.layers][block]
    _swap_class(layer.fc2, "BiasDropped", lambda self, x: F.linear(x, self.weight))
    return model


def gpt_neox_sequential() -> nn.Module:
    """GPT-NeoX with block 1 computed sequentially instead of in parallel."""
    return residual_bug(family="gpt_neox")


def gemma2_norm_without_offset() -> nn.Module:
    """Gemma2 with block 1's pre-FFN norm applying w instead of 1 + w."""
    return norm_bug(family="gemma2")
