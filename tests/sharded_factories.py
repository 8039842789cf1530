"""Factories for the sharded CLI tests: a model whose factory fails on one rank only."""

from __future__ import annotations

import torch.distributed as dist

from samples import sharded


def fails_on_rank_one():
    """The tensor-parallel sample Llama, but rank 1's factory raises."""
    model = sharded.llama_tp()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 could not load its shard")
    return model
