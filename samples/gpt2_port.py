"""GPT-2 written the way a from-scratch codebase writes it, loading Hugging Face weights
through its own weight-copy loop.

:class:`GPT` is a nanoGPT-style GPT-2: ``nn.Linear`` projections (``c_attn``, ``c_proj``,
``c_fc``), learned positions, tanh-approximated GELU, a tied head. Hugging Face keeps
GPT-2's projections as ``Conv1D`` (weights ``[in, out]``), so :func:`load_hf` copies them
transposed, as such ports do. :func:`port` is the clean port of
:func:`samples.hf_families.build` ``(family="gpt2")``; :func:`attn_proj_not_transposed`
forgets the transpose for the one square projection (block 1's ``attn.c_proj``), which no
shape check catches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as samples.gpt2_port (tests) or loaded from its file path (CLI)
    from . import hf_families
except ImportError:  # pragma: no cover
    import hf_families

BLOCK = 1
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, inner)
        self.c_proj = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, positions: int, dim: int, heads: int, layers: int, inner: int, eps: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.h = nn.ModuleList(Block(dim, heads, inner, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def load_hf(hf_model: nn.Module, *, skip_transpose: tuple[str, ...] = ()) -> GPT:
    """A :class:`GPT` holding ``hf_model``'s weights: every name copied, the Conv1D
    weights transposed (but those named in ``skip_transpose``: a planted mistake)."""
    cfg = hf_model.config
    model = GPT(cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.n_inner or 4 * cfg.n_embd,
                cfg.layer_norm_epsilon)
    source = {name.removeprefix("transformer."): t for name, t in hf_model.state_dict().items()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight":
                continue  # tied to wte
            tensor = source[name]
            if name.split(".", 2)[-1] in TRANSPOSED and name not in skip_transpose:
                tensor = tensor.T
            param.copy_(tensor)
    return model.eval()


def reference(*, seed: int = 0) -> nn.Module:
    """HF ``GPT2LMHeadModel`` (samples/hf_families.py's tiny config)."""
    return hf_families.build(family="gpt2", seed=seed)


def port(*, seed: int = 0) -> GPT:
    """:func:`reference`'s weights in the from-scratch GPT."""
    return load_hf(reference(seed=seed))


def attn_proj_not_transposed() -> GPT:
    """The port whose loop forgets to transpose block 1's square attention projection."""
    return load_hf(reference(), skip_transpose=(f"h.{BLOCK}.attn.c_proj.weight",))
