"""Model information: how a report and a dump name a live model — its class, device,
dtype and hook map, the quantization it shows, and the package versions that define it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

from . import distributed
from .dtypes import CHECKPOINT_DTYPE, dtype_name
from .hookmap import Layout
from .inputs import model_device, model_dtype


def describe(model: nn.Module, layout: Layout, label: str | None) -> dict[str, Any]:
    """How a report names a live model (with ``quantization`` where it can be seen, and
    ``checkpoint_dtype`` for a model built from a checkpoint directory that names its dtype)."""
    found = {
        "model": label or type(model).__name__,
        "class": type(model).__name__,
        "device": str(model_device(model)),
        "dtype": dtype_name(model_dtype(model)),
        "hook_map": layout.hook_map.name,
    }
    quantized = quantization(model)
    if quantized:
        found["quantization"] = quantized
    saved = getattr(model, CHECKPOINT_DTYPE, None)
    if isinstance(saved, str):
        found["checkpoint_dtype"] = saved
    return found


def quantization(model: nn.Module) -> str | None:
    """What quantization a model shows, in words (``"Int8Tensor weights in 28 modules"``):
    quantized module classes (``torch.ao``), weights held as tensor subclasses (torchao)
    or in 8-bit floating or integer dtypes; ``None`` when it shows none."""
    seen: dict[str, int] = {}
    for module in model.modules():
        where = type(module).__module__
        if ".quantized." in where and next(module.children(), None) is None or ".quantized.dynamic." in where:
            kind = f"torch.ao {'dynamic ' if '.dynamic.' in where else ''}quantized {type(module).__name__}"
            if kind.endswith("LinearPackedParams"):
                continue  # the packed weights of a quantized Linear, counted with it
            seen[kind] = seen.get(kind, 0) + 1
            continue
        for param in module.parameters(recurse=False):
            if distributed.is_distributed(param):
                continue  # sharded, not quantized: ShardedSide says how many ranks
            if type(param) not in (torch.Tensor, nn.Parameter):
                kind = f"{type(param).__name__} weights"
            elif param.dtype.itemsize == 1:
                kind = f"{dtype_name(param.dtype)} weights"
            else:
                continue
            seen[kind] = seen.get(kind, 0) + 1
    if not seen:
        return None
    return ", ".join(f"{kind} in {count} module{'s' if count > 1 else ''}" for kind, count in sorted(seen.items()))


def versions(model: nn.Module) -> dict[str, str]:
    """The versions of torch, of transformers when it is loaded, and of every installed
    package that defines a module class of ``model``: what a dump records, so that a replay
    under other versions (code moved between a module and its caller) can say so."""
    roots = {type(m).__module__.split(".")[0] for m in model.modules()}
    if "transformers" in sys.modules:
        roots.add("transformers")
    return {"torch": torch.__version__, **_versions(frozenset(roots - {"torch", "builtins", "__main__"}))}


@functools.lru_cache(maxsize=64)
def _versions(roots: frozenset[str]) -> dict[str, str]:
    """Installed versions of the distributions providing these top-level modules, read
    once per set (each read opens the distribution's metadata)."""
    import importlib.metadata

    found = {}
    distributions = _distributions()
    for root in sorted(roots):
        for name in distributions.get(root, []):
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions providing it, read once: reading
    every distribution's file list took ~170 ms, as long as a forward of a 58M model."""
    import importlib.metadata

    try:
        return importlib.metadata.packages_distributions()
    except Exception:  # a broken environment: record what is certain
        return {}


__all__ = ["describe", "quantization", "versions"]
