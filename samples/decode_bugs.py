"""Bugs that only a KV cache shows: tiny Hugging Face Llamas whose cached path is wrong
while a full forward without a cache is right (``blockdiff diff ... --decode N``).

Each factory builds ``samples.hf_llama.build()`` (same weights) and changes one thing on
the cached path of one block (``DEFAULT_BLOCK`` unless named otherwise):

    blockdiff diff samples/hf_llama.py:build samples/decode_bugs.py:cache_one_slot_early --decode 4
    blockdiff diff samples/hf_llama.py:build samples/decode_bugs.py:rotary_not_offset --decode 4
    blockdiff diff samples/decode_bugs.py:sliding samples/decode_bugs.py:window_one_too_many --decode 6 --seq 4
    blockdiff diff samples/hf_llama.py:build_qwen3 samples/decode_bugs.py:keys_cached_before_knorm --decode 2
    blockdiff diff samples/decode_bugs.py:scale_wrong_when_decoding --decode 6
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from samples import hf_llama

DEFAULT_BLOCK = 1


def _cache_of(kwargs: dict) -> tuple[str | None, Any]:
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None, None


class _Updating:
    """A cache seen through ``update``: the layer's writes go through ``write``."""

    def __init__(self, cache: Any, write: Any) -> None:
        self._cache, self._write = cache, write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        return self._write(self._cache, key_states, value_states, layer_idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def _on_cached_path(model: nn.Module, block: int, write: Any) -> nn.Module:
    """``model`` with block ``block``'s attention handing its cache writes to ``write``
    at decode steps (one new token)."""
    attn = model.model.layers[block].self_attn
    original = attn.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        name, cache = _cache_of(kwargs)
        if name is not None and hidden is not None and hidden.shape[1] == 1:
            kwargs[name] = _Updating(cache, write)
        return original(*args, **kwargs)

    attn.forward = forward
    return model


def cache_one_slot_early(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """At decode steps the new token's keys and values overwrite the last position the
    cache holds (the last prompt position at step 1) instead of being appended."""

    def write(cache: Any, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        layer = cache.layers[layer_idx]
        n = cache.get_seq_length(layer_idx)
        if hasattr(layer, "cumulative_length"):  # a static layer: one slot early
            layer.keys[:, :, n - 1 : n] = k
            layer.values[:, :, n - 1 : n] = v
            return layer.keys, layer.values
        layer.keys = torch.cat([layer.keys[:, :, :-1], k], dim=2)
        layer.values = torch.cat([layer.values[:, :, :-1], v], dim=2)
        return layer.keys, layer.values

    return _on_cached_path(hf_llama.build(), block, write)


def kv_heads_reversed_when_cached(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """At decode steps the attention reads the cached keys and values with their KV heads
    in reverse order (GQA heads grouped wrongly on the cached path only); the cache itself
    holds the right ones."""

    def write(cache: Any, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys, values = cache.update(k, v, layer_idx, *args, **kwargs)
        return keys.flip(1), values.flip(1)

    return _on_cached_path(hf_llama.build(), block, write)


def rotary_not_offset() -> nn.Module:
    """At decode steps the new token is rotated as position 0: the model's rotary table is
    computed without the cache's offset (``model.rotary_emb``, the context stage)."""
    model = hf_llama.build()
    rotary = model.model.rotary_emb
    original = rotary.forward

    @functools.wraps(original)
    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if position_ids.shape[-1] == 1:
            position_ids = torch.zeros_like(position_ids)
        return original(x, position_ids, *args, **kwargs)

    rotary.forward = forward
    return model


def static_slots_unmasked(*, block: int = 0) -> nn.Module:
    """At decode steps block ``block``'s attention drops its mask, so a static cache's
    unfilled slots (zeros) are attended to. Decode it with ``--cand-cache static``."""
    model = hf_llama.build()
    attn = model.model.layers[block].self_attn
    original = attn.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is not None and hidden.shape[1] == 1:
            kwargs["attention_mask"] = None
        return original(*args, **kwargs)

    attn.forward = forward
    return model


def scale_wrong_when_decoding(*, block: int = 2) -> nn.Module:
    """At decode steps (one new token) block ``block``'s attention scales its scores by
    ``1/head_dim`` instead of ``1/sqrt(head_dim)``; a forward over the whole sequence is
    right. Found with no candidate (the model against its own uncached forward):
    ``blockdiff diff samples/decode_bugs.py:scale_wrong_when_decoding --decode 6``. Eager
    attention: its matrix products take the keys' positions from the call they are given."""
    model = hf_llama.build(attn_implementation="eager")
    attn = model.model.layers[block].self_attn
    original, right = attn.forward, attn.scaling

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        attn.scaling = right * right if hidden is not None and hidden.shape[1] == 1 else right
        try:
            return original(*args, **kwargs)
        finally:
            attn.scaling = right

    attn.forward = forward
    return model


# -- sliding windows: a Mistral whose attention sees the last WINDOW positions ----------

WINDOW = 6


def sliding() -> nn.Module:
    """The reference: a tiny Mistral with a sliding window of ``WINDOW`` positions."""
    return hf_llama.build(arch="mistral", sliding_window=WINDOW)


def window_one_too_many() -> nn.Module:
    """The same weights, its window one position too wide: it differs from the first step
    whose sequence is longer than ``WINDOW``."""
    return hf_llama.build(arch="mistral", sliding_window=WINDOW + 1)


def window_one_too_few() -> nn.Module:
    """The same weights, its window one position too narrow."""
    return hf_llama.build(arch="mistral", sliding_window=WINDOW - 1)


def keys_cached_before_knorm(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """A Qwen3 (k-norm on the keys) whose block ``block`` caches its keys *before* the
    k-norm (rotated, not normalised), while the current tokens attend with the normalised
    ones: from the prompt on, the cache holds other keys than the model computes, and every
    later step attends to them. The reference is ``samples/hf_llama.py:build_qwen3``."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    model = hf_llama.build_qwen3()
    attn = model.model.layers[block].self_attn
    original, k_norm = attn.forward, attn.k_norm.forward
    seen: dict[str, torch.Tensor] = {}

    def normed(x: torch.Tensor) -> torch.Tensor:
        seen["raw"] = x  # [batch, tokens, kv_heads, head_dim], before the norm
        return k_norm(x)

    attn.k_norm.forward = normed

    def write(cache: Any, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        cos, sin = seen["rotary"]
        _, raw = apply_rotary_pos_emb(k, seen["raw"].transpose(1, 2), cos, sin)
        keys, values = cache.update(raw, v, layer_idx, *args, **kwargs)
        return torch.cat([keys[:, :, : -k.shape[2]], k], dim=2), values  # the current tokens: normalised

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        seen["rotary"] = kwargs.get("position_embeddings")
        name, cache = _cache_of(kwargs)
        if name is not None:
            kwargs[name] = _Updating(cache, write)
        return original(*args, **kwargs)

    attn.forward = forward
    return model
