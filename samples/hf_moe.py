"""Tiny Hugging Face MoE models and planted MoE bugs.

:func:`build` gives Mixtral, Qwen2-MoE and Qwen3-MoE (4 blocks); :func:`build_family`
every other MoE family transformers ships, tiny (3 or 4 blocks, 4 or 8 experts):
:data:`FAMILIES`. Its bugs, :func:`router_bug` and :func:`experts_bug`, work on any of
them, in block :data:`FAMILY_BLOCK` (an MoE block in every family).

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


# -- every MoE family ---------------------------------------------------------------------

# Family → (config builder, model class). Sizes: hidden 64, 3 blocks (Jamba 4), 8 experts
# (Llama 4 and NLLB-MoE 4), top-2 (Llama 4 top-1); DeepSeek and GLM-4-MoE have a dense
# first block, Jamba MoE in blocks 1 and 3 (Mamba layers in 0 and 2).
_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)
_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
FAMILY_BLOCK = 1


def _family_configs():
    import transformers as t

    def dbrx():
        cfg = t.DbrxConfig(
            d_model=64, n_heads=4, n_layers=3, max_seq_len=128, vocab_size=256,
            attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=96, moe_num_experts=8, moe_top_k=2),
        )
        cfg.attn_config.rope_theta = 10000.0  # transformers 5.24 reads it there but does not set it
        return cfg

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=48)
    return {
        "qwen3_next": lambda: t.Qwen3NextConfig(
            **_TINY, **moe, head_dim=16, num_experts=8, shared_expert_intermediate_size=96,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
        "deepseek_v2": lambda: t.DeepseekV2Config(
            **{**_TINY, **_MLA}, **moe, n_routed_experts=8, n_shared_experts=1, q_lora_rank=None,
            first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        ),
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**_TINY, **_MLA}, **moe, n_routed_experts=8, n_shared_experts=1, q_lora_rank=32,
            first_k_dense_replace=1, n_group=4, topk_group=2,
        ),
        "gpt_oss": lambda: t.GptOssConfig(
            **_TINY, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        "llama4": lambda: t.Llama4TextConfig(
            **_TINY, head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
            attention_chunk_size=16, no_rope_layer_interval=2,
        ),
        "olmoe": lambda: t.OlmoeConfig(**_TINY, num_experts=8, num_experts_per_tok=2, eos_token_id=None),
        "glm4_moe": lambda: t.Glm4MoeConfig(
            **_TINY, **moe, head_dim=16, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
            n_group=2, topk_group=1,
        ),
        "granitemoe": lambda: t.GraniteMoeConfig(**_TINY, num_local_experts=8, num_experts_per_tok=2),
        "dbrx": dbrx,
        "phimoe": lambda: t.PhimoeConfig(**_TINY, num_local_experts=8, num_experts_per_tok=2),
        "jamba": lambda: t.JambaConfig(
            **{**_TINY, "num_hidden_layers": 4}, num_experts=8, num_experts_per_tok=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=8,
        ),
        "nllb_moe": lambda: t.NllbMoeConfig(
            vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=96,
            decoder_ffn_dim=96, encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4,
            expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=128,
        ),
    }


FAMILIES = (
    "qwen3_next", "deepseek_v2", "deepseek_v3", "gpt_oss", "llama4", "olmoe", "glm4_moe", "granitemoe",
    "dbrx", "phimoe", "jamba", "nllb_moe",
)
SEQ2SEQ = ("nllb_moe",)


def build_family(family: str, *, seed: int = 0) -> nn.Module:
    """A tiny ``family`` model (:data:`FAMILIES`) with trained-looking weights from ``seed``;
    DeepSeek-V3's expert-score correction bias (a buffer) is drawn too, so that it changes
    which experts are chosen."""
    import transformers

    configs = _family_configs()
    if family not in configs:
        raise ValueError(f"unknown MoE family {family!r}; expected one of {', '.join(FAMILIES)}")
    cfg = configs[family]()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSeq2SeqLM if family in SEQ2SEQ else transformers.AutoModelForCausalLM
    model = trained_looking_(auto.from_config(cfg), seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
    return model


def family_inputs(family: str, ids: torch.Tensor):
    """What ``family`` is called with: the token ids, or for NLLB-MoE a dict with decoder
    ids (the ids shifted right)."""
    if family in SEQ2SEQ:
        return dict(input_ids=ids, decoder_input_ids=torch.cat([torch.full_like(ids[:, :1], 2), ids[:, :-1]], 1))
    return ids


def moe_module(model: nn.Module, block: int = FAMILY_BLOCK) -> nn.Module:
    """Block ``block``'s MoE module (the router's parent), in execution order (NLLB-MoE:
    encoder blocks, then decoder blocks)."""
    from blockdiff import autodetect

    layout = autodetect.resolve(model).blocks[block]
    if layout.moe is None:
        raise ValueError(f"block {block} of {type(model).__name__} is not an MoE block")
    return model.get_submodule(layout.moe["router"].rpartition(".")[0])


def _router_of(moe: nn.Module) -> nn.Module:
    return next(m for name, m in moe.named_children() if name in ("gate", "router"))


def _wrap_output(module: nn.Module, name: str, change) -> None:
    base = type(module)
    _swap_forward(module, name, lambda self, *a, **k: change(base.forward(self, *a, **k)))


def _router_bug_output(out):
    """A router whose weights are wrong: ``topk`` — each chosen expert's weight divided
    by k (a mean where the model sums; PhiMoE weighs each chosen expert 1, so reordering
    would not show); ``dense`` — every chosen expert weighted 1/k
    (Llama 4's sigmoid or NLLB's renormalized probabilities dropped); ``logits`` — the
    logits halved (a temperature applied twice)."""
    if isinstance(out, torch.Tensor):
        return out * 0.5
    if len(out) == 3 and not out[2].is_floating_point():
        logits, weights, indices = out
        return logits, weights / indices.shape[-1], indices
    *rest, weights, logits = out
    chosen = (weights != 0).to(weights.dtype)
    return (*rest, chosen / chosen.sum(-1, keepdim=True), logits)


def router_bug(*, family: str = "deepseek_v3", block: int = FAMILY_BLOCK) -> nn.Module:
    model = build_family(family)
    _wrap_output(_router_of(moe_module(model, block)), "Misrouted", _router_bug_output)
    return model


def experts_bug(*, family: str = "deepseek_v3", block: int = FAMILY_BLOCK) -> nn.Module:
    """The experts' output off by a scaling factor (a ``routed_scaling_factor`` applied
    twice): every token routed to an expert gets 1.25 times its contribution."""
    model = build_family(family)
    _wrap_output(moe_module(model, block).experts, "Rescaled", lambda out: out * 1.25)
    return model


def correction_bias_dropped(*, family: str = "deepseek_v3", block: int = FAMILY_BLOCK) -> nn.Module:
    """DeepSeek-V3 / GLM-4-MoE with the router's expert-score correction bias left at zero
    (a buffer a checkpoint conversion did not carry): logits and weights of the tokens
    whose experts agree are unchanged, other tokens pick other experts."""
    model = build_family(family)
    _router_of(moe_module(model, block)).e_score_correction_bias.zero_()
    return model


# bug → (families it applies to, part of the ffn blamed)
FAMILY_BUGS: dict[str, tuple[tuple[str, ...], str]] = {
    "router_bug": (FAMILIES, "router"),
    "experts_bug": (FAMILIES, "experts"),
    "correction_bias_dropped": (("deepseek_v3", "glm4_moe"), "router"),
}


# Factories for the command line (``blockdiff arch samples/hf_moe.py:build_deepseek_v3``).
def build_qwen3_next() -> nn.Module:
    return build_family("qwen3_next")


def build_deepseek_v2() -> nn.Module:
    return build_family("deepseek_v2")


def build_deepseek_v3() -> nn.Module:
    return build_family("deepseek_v3")


def build_gpt_oss() -> nn.Module:
    return build_family("gpt_oss")


def build_llama4() -> nn.Module:
    return build_family("llama4")


def build_olmoe() -> nn.Module:
    return build_family("olmoe")


def build_glm4_moe() -> nn.Module:
    return build_family("glm4_moe")


def build_granitemoe() -> nn.Module:
    return build_family("granitemoe")


def build_dbrx() -> nn.Module:
    return build_family("dbrx")


def build_phimoe() -> nn.Module:
    return build_family("phimoe")


def build_jamba() -> nn.Module:
    return build_family("jamba")


def build_nllb_moe() -> nn.Module:
    return build_family("nllb_moe")


def deepseek_v3_correction_bias_dropped() -> nn.Module:
    return correction_bias_dropped(family="deepseek_v3")
