"""Planted bugs that make a row's output depend on the rest of its batch.

For ``blockdiff invariance MODEL`` (docs/invariance.md): each factory is a model that is
right for a row alone and wrong for the same row inside a batch.

- :func:`norm_over_batch`: a norm whose statistics are taken over the batch and the hidden
  size (block 1's ``ffn_norm``);
- :func:`matmul_split_by_rows`: a projection that splits its reduction into chunks whose
  number depends on how many rows it is given (block 1's ``ffn.down_proj``): the same sum in
  another order, which the drill-down names;
- :func:`ignores_padding_mask`: a Hugging Face Llama whose layers get no padding mask — right
  for an unpadded batch, wrong for a row padded on the left (block 0 attention);
- :func:`moe_capacity`: a mixture of experts whose expert capacity (block 0's) is shared by
  every token of the batch, so which tokens are dropped depends on the other rows (block 0
  ffn, the capacity named in a note).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # imported as samples.invariance_bugs (tests) or loaded from its file path (CLI)
    from . import hf_llama, tinylm
except ImportError:  # pragma: no cover
    import hf_llama
    import tinylm

DEFAULT_BLOCK = 1


class BatchNorm(tinylm.RMSNorm):
    """RMSNorm whose mean square is taken over the batch as well as the hidden size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=(0, -1), keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RowSplitLinear(nn.Linear):
    """A bias-free Linear that sums its reduction in two halves when given more than one
    row (a kernel choosing its split by the problem's size), in one piece for one row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return F.linear(x, self.weight)
        half = x.shape[-1] // 2
        return F.linear(x[..., :half], self.weight[:, :half]) + F.linear(x[..., half:], self.weight[:, half:])


def norm_over_batch(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """tinylm whose ``block``'s ffn norm takes its statistics over the batch too."""
    model = tinylm.build()
    old = model.blocks[block].ffn_norm
    norm = BatchNorm(old.weight.shape[0], old.eps)
    norm.load_state_dict(old.state_dict())
    model.blocks[block].ffn_norm = norm
    return model


def matmul_split_by_rows(*, block: int = DEFAULT_BLOCK) -> tinylm.TinyLM:
    """tinylm whose ``block``'s down projection splits its reduction by the number of rows."""
    model = tinylm.build()
    old = model.blocks[block].ffn.down_proj
    split = RowSplitLinear(old.in_features, old.out_features, bias=False)
    split.load_state_dict(old.state_dict())
    model.blocks[block].ffn.down_proj = split
    return model


def ignores_padding_mask() -> nn.Module:
    """A Hugging Face Llama whose decoder layers are handed no padding mask: each attends
    causally over every position, pads included (a stack that builds its causal mask and
    forgets the padding)."""
    model = hf_llama.build()

    def causal_only(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "attention_mask": None}

    for layer in model.model.layers:
        layer.register_forward_pre_hook(causal_only, with_kwargs=True)
    return model


def moe_capacity(*, block: int = 0) -> tinylm.TinyLM:
    """tinylm's mixture of experts, dropless but in ``block``, whose experts have a capacity
    (factor 1) over all the batch's tokens."""
    model = tinylm.build_moe_capacity()
    for index, each in enumerate(model.blocks):
        if index != block:
            each.ffn.capacity_factor = None
    return model
