"""A model that keeps its KV cache in its own modules, the way many ports serve.

:class:`CachedLM` is :mod:`samples.tinylm`'s decoder written as ports for serving often
are (gpt-fast, torchtune, llama.cpp-style Python ports): each attention holds a
:class:`KVCache` child whose ``k_cache``/``v_cache`` buffers ``[batch, kv_heads, slots,
head_dim]`` are written in place at ``input_pos``; the rotary angles are computed inside
the attention from those positions (no rotary module); the forward is
``model(input_ids, input_pos=None)`` — without ``input_pos``, an uncached forward of the
whole sequence.

blockdiff decodes it through its step adapter, :class:`Steps` (``blockdiff_stepper``):
``new_cache`` empties the buffers, ``run`` feeds the next positions, and
``cache_buffers`` names the buffers that hold keys and values, so that every experiment
writes into a cache of its own instead of the model's (docs/decode.md).

Factories: :func:`port` (Hugging Face Llama weights, :func:`samples.port.reference`, copied
through the port's conversion), and planted bugs on its cached path only:
:func:`write_one_slot_early` and :func:`rotary_not_offset`; :func:`slots_first` keeps its
caches ``[batch, slots, kv_heads, head_dim]`` and says so in its adapter's ``kv_layout``.

    blockdiff diff samples/port.py:reference samples/cached_lm.py:port --decode 8
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

try:  # imported as samples.cached_lm (tests) or loaded from its file path (CLI)
    from . import port as _port
    from . import tinylm
except ImportError:  # pragma: no cover
    import port as _port
    import tinylm

DEFAULT_BLOCK = 1
SLOTS = 256  # positions each cache holds


class KVCache(nn.Module):
    """Keys and values of one attention, ``[batch, kv_heads, slots, head_dim]`` — or, with
    ``slots_first``, ``[batch, slots, kv_heads, head_dim]`` as Meta's reference Llama code
    keeps them — written at the positions given; allocated for the batch on the first
    write after :meth:`reset`."""

    def __init__(self, kv_heads: int, head_dim: int, slots: int = SLOTS, *, slots_first: bool = False) -> None:
        super().__init__()
        self.slots_first = slots_first
        self.shape = (slots, kv_heads, head_dim) if slots_first else (kv_heads, slots, head_dim)
        self.register_buffer("k_cache", torch.zeros(0, *self.shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(0, *self.shape), persistent=False)
        self.offset = 0  # planted bug: where a single new token is written, relative to its position

    def reset(self) -> None:
        self.k_cache = self.k_cache.new_zeros(0, *self.shape)
        self.v_cache = self.v_cache.new_zeros(0, *self.shape)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_cache.shape[0] != k.shape[0] or self.k_cache.dtype != k.dtype:
            self.k_cache = k.new_zeros(k.shape[0], *self.shape)
            self.v_cache = v.new_zeros(v.shape[0], *self.shape)
        where = input_pos + self.offset if input_pos.numel() == 1 else input_pos
        if self.slots_first:
            self.k_cache[:, where] = k.transpose(1, 2)
            self.v_cache[:, where] = v.transpose(1, 2)
            return self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        self.k_cache[:, :, where] = k
        self.v_cache[:, :, where] = v
        return self.k_cache, self.v_cache


class Attention(tinylm.Attention):
    """tinylm's attention with its rotary angles computed from ``input_pos`` and a cache
    of its own; without ``input_pos`` it is tinylm's uncached attention."""

    def __init__(self, cfg: tinylm.Config) -> None:
        super().__init__(cfg)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.kv_cache = KVCache(cfg.kv_heads, cfg.head_dim)
        self.decode_positions_from_zero = False  # planted bug: the new token rotated as position 0

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        b, s, _ = x.shape
        if input_pos is None:
            cos, sin = self.angles(torch.arange(s, device=x.device), x.dtype)
            return super().forward(x, cos, sin)
        rotated = input_pos - input_pos if self.decode_positions_from_zero and s == 1 else input_pos
        cos, sin = self.angles(rotated, x.dtype)
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        k, v = self.kv_cache.update(input_pos, k, v)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        slots = torch.arange(k.shape[2], device=x.device)
        scores = scores.masked_fill(slots[None, :] > input_pos[:, None], float("-inf"))
        probs = scores.float().softmax(-1).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, s, -1))


class Block(tinylm.Block):
    def __init__(self, cfg: tinylm.Config) -> None:
        super().__init__(cfg)
        self.attn = Attention(cfg)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        x = x + self.attn(self.attn_norm(x), input_pos)
        return x + self.ffn(self.ffn_norm(x))


class CachedLM(nn.Module):
    """Embedding → blocks with their own KV caches → final norm → tied head."""

    def __init__(self, cfg: tinylm.Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = tinylm.RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        self.blockdiff_stepper = Steps()

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, input_pos)
        return self.lm_head(self.norm(x))


@dataclass
class Position:
    """Where the next token goes: the handle :class:`Steps` decodes with."""

    next: int = 0


class Steps:
    """blockdiff's step adapter for :class:`CachedLM` (docs/decode.md)."""

    # The buffers that hold the cache, keys first: blockdiff gives each experiment its own.
    cache_buffers = ("k_cache", "v_cache")
    # How they are laid out (blockdiff reads them as [batch, kv_heads, positions, head_dim]).
    kv_layout = ("batch", "kv_heads", "positions", "head_dim")

    def new_cache(self, model: nn.Module) -> Position:
        for module in model.modules():
            if isinstance(module, KVCache):
                module.reset()
        return Position()

    def run(self, model: nn.Module, ids: torch.Tensor, cache: Position) -> torch.Tensor:
        positions = torch.arange(cache.next, cache.next + ids.shape[1], device=ids.device)
        cache.next += ids.shape[1]
        return model(ids, input_pos=positions)


def port_of(reference: nn.Module, model: CachedLM | None = None) -> CachedLM:
    """``model`` (a new one when ``None``) with ``reference``'s weights, through the port's
    conversion (:func:`samples.port.port_llama`)."""
    model = model if model is not None else CachedLM(_port.tinylm_config(reference.config))
    return _port.port_llama(reference, into=model)  # type: ignore[arg-type]


def port(*, seed: int = 0) -> CachedLM:
    """:func:`samples.port.reference`'s weights in a model with its own cache."""
    return port_of(_port.reference(seed=seed))


class SlotsFirst(Steps):
    """The adapter of a model whose caches are ``[batch, slots, kv_heads, head_dim]``."""

    kv_layout = ("batch", "positions", "kv_heads", "head_dim")


def slots_first(model: CachedLM | None = None) -> CachedLM:
    """The port with its caches laid out as Meta's reference Llama code lays them out,
    ``[batch, slots, kv_heads, head_dim]``, and an adapter that says so."""
    model = model if model is not None else port()
    for block in model.blocks:
        cache = block.attn.kv_cache
        block.attn.kv_cache = KVCache(*cache.shape[::2], cache.shape[1], slots_first=True)
        block.attn.kv_cache.offset = cache.offset
    model.blockdiff_stepper = SlotsFirst()
    return model


def slots_first_one_slot_early() -> CachedLM:
    """:func:`write_one_slot_early` with its caches laid out slots first."""
    return slots_first(write_one_slot_early())


def write_one_slot_early(*, block: int = DEFAULT_BLOCK) -> CachedLM:
    """The port whose ``block`` writes each decoded token one slot early (over the
    position before it)."""
    model = port()
    model.blocks[block].attn.kv_cache.offset = -1
    return model


def rotary_not_offset(*, block: int = DEFAULT_BLOCK) -> CachedLM:
    """The port whose ``block`` rotates each decoded token as position 0 (its prompt is right)."""
    model = port()
    model.blocks[block].attn.decode_positions_from_zero = True
    return model
