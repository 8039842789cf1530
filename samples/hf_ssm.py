"""Tiny Hugging Face models whose token mixer is no attention, and a planted bug in it.

Mamba and Mamba2 (selective state spaces), LFM2 (short convolutions in blocks 0 and 2,
attention in block 1), and from :mod:`samples.hf_moe` Jamba (Mamba layers in blocks 0
and 2) and Qwen3-Next (gated delta-net linear attention in blocks 0 and 2): every one maps
its token mixer to the ``attention`` sub-path (the token-mixing sub-path). Built from
config objects with trained-looking weights from a fixed seed; needs ``transformers``.

    blockdiff diff samples/hf_ssm.py:build_mamba samples/hf_ssm.py:mamba_conv_reversed

:data:`MIXER_BLOCK` names, per family, a block whose token mixer is no attention.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from blockdiff.weights import trained_looking_
from samples import hf_moe

FAMILIES = ("mamba", "mamba2", "lfm2", "jamba", "qwen3_next")
MIXER_BLOCK = {"mamba": 1, "mamba2": 1, "lfm2": 2, "jamba": 2, "qwen3_next": 2}


def config(family: str):
    import transformers as t

    if family == "mamba":
        return t.MambaConfig(
            vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=3, intermediate_size=128,
            time_step_rank=8, use_mambapy=False,
        )
    if family == "mamba2":
        return t.Mamba2Config(
            vocab_size=256, hidden_size=64, num_heads=8, head_dim=16, state_size=8, n_groups=1,
            num_hidden_layers=3, chunk_size=16,
        )
    if family == "lfm2":
        return t.Lfm2Config(
            vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, layer_types=["conv", "full_attention", "conv"],
        )
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def build(family: str = "mamba", *, seed: int = 0) -> nn.Module:
    """A tiny ``family`` model (:data:`FAMILIES`) with trained-looking weights from ``seed``."""
    import transformers

    if family in hf_moe.FAMILIES:
        return hf_moe.build_family(family, seed=seed)
    cfg = config(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return trained_looking_(transformers.AutoModelForCausalLM.from_config(cfg), seed=seed).eval()


def token_mixer(model: nn.Module, block: int) -> nn.Module:
    """Block ``block``'s token mixer, as blockdiff maps it (the ``attention`` sub-path)."""
    from blockdiff import autodetect

    return model.get_submodule(autodetect.resolve(model).blocks[block].subpaths["attention"][0])


def conv_reversed(family: str = "mamba", *, block: int | None = None) -> nn.Module:
    """The token mixer's causal convolution with its taps reversed (a kernel ported as a
    convolution where the model cross-correlates): each position mixes its neighbours with
    the wrong weights."""
    model = build(family)
    mixer = token_mixer(model, MIXER_BLOCK[family] if block is None else block)
    conv = next(m for m in mixer.modules() if isinstance(m, nn.Conv1d))
    with torch.no_grad():
        conv.weight.copy_(conv.weight.flip(-1))
    return model


def build_mamba() -> nn.Module:
    return build("mamba")


def mamba_conv_reversed() -> nn.Module:
    return conv_reversed("mamba")


# How much the planted decay bug scales A (the state's decay rate, ``A = -exp(A_log)``).
DECAY_SCALE = 0.5


class _DecayWrongWhenDecoding:
    """A selective state-space mixer whose state decays at the wrong rate on the cached
    single-token path only: ``A`` (read through ``A_log``, as every Hugging Face Mamba
    mixer's scan reads it) scaled by :data:`DECAY_SCALE` while a step of one token runs with
    a cache; the prompt (prefill) is right."""

    @property
    def A_log(self) -> torch.Tensor:
        own = self._parameters["A_log"]
        return own + math.log(DECAY_SCALE) if self.__dict__.get("_decoding") else own

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        self.__dict__["_decoding"] = cache is not None and hidden_states.shape[1] == 1
        try:
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)  # type: ignore[misc]
        finally:
            self.__dict__["_decoding"] = False


def decay_wrong_when_decoding(family: str = "mamba", *, block: int | None = None) -> nn.Module:
    """Block ``block``'s (default :data:`MIXER_BLOCK`) Mamba mixer updates its ssm state with
    the wrong decay at decode steps only (:class:`_DecayWrongWhenDecoding`): a forward pass
    and the prompt's step see nothing wrong."""
    model = build(family)
    mixer = token_mixer(model, MIXER_BLOCK[family] if block is None else block)
    mixer.__class__ = type("DecayWrong" + type(mixer).__name__, (_DecayWrongWhenDecoding, type(mixer)), {})
    return model


def mamba_decay_wrong_when_decoding() -> nn.Module:
    return decay_wrong_when_decoding("mamba")


def mamba2_decay_wrong_when_decoding() -> nn.Module:
    return decay_wrong_when_decoding("mamba2")


def build_mamba2() -> nn.Module:
    return build("mamba2")
