"""A port whose conversion script has a mistake: HF Llama weights copied into tinylm wrong.

:func:`samples.port.port` copies :func:`samples.port.reference`'s weights into tinylm
through a safetensors file; each factory here does the same with one mistake in the
conversion, the kind a hand-written weight-copy loop makes, in block 1 (or the rotary
table):

- :func:`norm_from_the_other_norm`: the ffn norm's weight taken from the attention norm;
- :func:`gate_up_swapped`: ``w1``/``w3`` (gate and up projections) swapped;
- :func:`square_projection_not_transposed`: the attention's output projection copied
  transposed (a square matrix: no shape error warns);
- :func:`query_rows_permuted`: the query projection's rows permuted by the q/k head
  interleave of a rotary conversion, applied where it is not wanted;
- :func:`rotary_base_wrong`: the rotary table built with base 50000 instead of 10000.

blockdiff blames each on its block and sub-path (the ``context`` stage for the rotary
table) and names the weight and what it is instead (docs/cli.md, "Ports and converted
weights").
"""

from __future__ import annotations

import torch
from torch import nn

try:  # imported as samples.converted_port (tests) or loaded from its file path (CLI)
    from . import port, tinylm
except ImportError:  # pragma: no cover
    import port
    import tinylm

BLOCK = 1


def _converted(change) -> tinylm.TinyLM:
    """The port, then ``change(model, reference)`` applied to its copied weights."""
    reference = port.reference()
    model = port.port_llama(reference)
    with torch.no_grad():
        change(model, reference)
    return model


def norm_from_the_other_norm() -> tinylm.TinyLM:
    def change(model: nn.Module, reference: nn.Module) -> None:
        model.blocks[BLOCK].ffn_norm.weight.copy_(reference.model.layers[BLOCK].input_layernorm.weight)

    return _converted(change)


def gate_up_swapped() -> tinylm.TinyLM:
    def change(model: nn.Module, reference: nn.Module) -> None:
        mlp = reference.model.layers[BLOCK].mlp
        model.blocks[BLOCK].ffn.gate_proj.weight.copy_(mlp.up_proj.weight)
        model.blocks[BLOCK].ffn.up_proj.weight.copy_(mlp.gate_proj.weight)

    return _converted(change)


def square_projection_not_transposed() -> tinylm.TinyLM:
    def change(model: nn.Module, reference: nn.Module) -> None:
        model.blocks[BLOCK].attn.o_proj.weight.copy_(reference.model.layers[BLOCK].self_attn.o_proj.weight.T)

    return _converted(change)


def interleave(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The q/k row permutation of a rotary conversion (Meta's interleaved pairs to HF's
    halves): per head, rows ``0, d/2, 1, d/2 + 1, ...``."""
    dim = weight.shape[0] // heads
    return weight.view(heads, 2, dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def query_rows_permuted() -> tinylm.TinyLM:
    def change(model: nn.Module, reference: nn.Module) -> None:
        q = reference.model.layers[BLOCK].self_attn.q_proj.weight
        model.blocks[BLOCK].attn.q_proj.weight.copy_(interleave(q, reference.config.num_attention_heads))

    return _converted(change)


def rotary_base_wrong() -> tinylm.TinyLM:
    reference = port.reference()
    cfg = port.tinylm_config(reference.config)
    model = port.port_llama(reference)
    wrong = tinylm.Rotary(tinylm.Config(**{**cfg.__dict__, "rope_theta": 50000.0}))
    model.rotary = wrong
    return model
