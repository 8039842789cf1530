"""Quantized candidates of the sample model, and a model with an outlier weight.

The reference is the float32 model; a candidate is the same model quantized. Every site
then differs, so the question is not where the first bug is but which layer hurts most:
``blockdiff diff --rank N`` (optionally ``--baseline-dtype bfloat16``).

    blockdiff diff samples/quant.py:outlier samples/quant.py:outlier_int8_dynamic --rank 5
    blockdiff diff samples/quant.py:outlier samples/quant.py:outlier_int8_dynamic --rank 5 --baseline-dtype bfloat16
"""

from __future__ import annotations

import torch
from torch import nn

from samples import tinylm


def outlier(*, block: int = 2, row: int = 3, column: int = 5, factor: float = 20.0) -> tinylm.TinyLM:
    """The sample model with one weight of block ``block``'s FFN down projection ``factor``
    times the largest: per-tensor int8 spends its range on it, and that layer loses most."""
    model = tinylm.build()
    with torch.no_grad():
        weight = model.blocks[block].ffn.down_proj.weight
        weight[row, column] = weight.abs().max() * factor
    return model


def int8_dynamic(model: nn.Module) -> nn.Module:
    """Dynamic int8 quantization of every ``nn.Linear`` (``torch.ao``): int8 weights, int8
    activations quantized per call."""
    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def outlier_int8_dynamic() -> nn.Module:
    return int8_dynamic(outlier())


def build_int8_dynamic() -> nn.Module:
    return int8_dynamic(tinylm.build())
