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


class Float8Linear(nn.Module):
    """A Linear with float8 (e4m3) weights and per-output-channel scales, dequantized in
    every call: simulated fp8 weights on any device."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
        self.weight = nn.Parameter((weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype), self.bias)


def fp8_weights(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` but the head replaced by a :class:`Float8Linear`."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and f"{name}.{child_name}".strip(".") != "lm_head":
                setattr(module, child_name, Float8Linear(child))
    return model


def torchao_int8(model: nn.Module, *, dynamic: bool = False) -> nn.Module:
    """torchao int8 weight-only (or int8 dynamic activation, int8 weight) quantization."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig() if dynamic else Int8WeightOnlyConfig())
    return model


def outlier_fp8() -> nn.Module:
    return fp8_weights(outlier())


def outlier_int8_weight_only() -> nn.Module:
    return torchao_int8(outlier())
