"""Random weights that look trained, for test models built from configs.

Default initialisations (std 0.02, norm weights of exactly 1, biases of 0) make attention
nearly uniform and hide norm-weight and attention bugs (docs/design.md, "Testing with random
weights"). :func:`trained_looking_` draws, from a fixed seed: projections ~ N(0, 1/fan_in)
(stacked MoE expert weights ``[E, .., ..]`` per expert), embeddings ~ N(0, 1), norm weights ~ 1 ± 0.2 (or ± 0.2 around 0 for norms that add 1 to
their weight), biases ~ U(-0.1, 0.1).
"""

from __future__ import annotations

import torch
from torch import nn


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name


@torch.no_grad()
def trained_looking_(model: nn.Module, *, seed: int = 0, offset_norms: tuple[str, ...] = ()) -> nn.Module:
    """Re-draw every parameter of ``model`` in place so that it looks trained.

    Args:
        model: the model to re-initialise (changed in place and returned).
        seed: the seed; the same seed and model give the same weights.
        offset_norms: class names of norms computing ``x * (1 + w)`` (Gemma): their
            weights are drawn around 0 instead of 1.

    >>> model = trained_looking_(nn.Linear(4, 4), seed=0)
    """
    gen = torch.Generator().manual_seed(seed)

    def draw(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low

    done: set[int] = set()
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in done:  # tied weights are drawn once
                continue
            done.add(id(param))
            if isinstance(module, nn.Embedding) or "embed" in pname:
                value = draw(param.shape, 1.0)
            elif _is_norm(module) and param.dim() == 1:
                if pname == "bias":
                    value = uniform(param.shape, -0.1, 0.1)
                elif type(module).__name__ in offset_norms:
                    value = uniform(param.shape, -0.2, 0.2)
                else:
                    value = uniform(param.shape, 0.8, 1.2)
            elif param.dim() == 1:
                value = uniform(param.shape, -0.1, 0.1)
            else:
                # nn.Linear stores [out, in]; HF's Conv1D stores [in, out]; MoE experts stack
                # one matrix per expert, [E, out, in] or [E, in, out]: the geometric mean of
                # the two is near either fan-in.
                if type(module).__name__ == "Conv1D":
                    fan_in = param.shape[0]
                elif param.dim() == 3 and "expert" in type(module).__name__.lower():
                    fan_in = (param.shape[1] * param.shape[2]) ** 0.5
                else:
                    fan_in = param[0].numel()
                value = draw(param.shape, fan_in ** -0.5)
            param.copy_(value.to(param.dtype))
    return model
