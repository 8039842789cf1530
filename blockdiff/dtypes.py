"""Dtype names: the one place that turns user text and stored names into torch dtypes and back."""

from __future__ import annotations

import torch

from .errors import InputError

# The attribute that keeps, on a model built from a checkpoint directory, the dtype it was
# saved in (blockdiff.loading sets it; modelinfo.describe reports it beside the dtype it runs in).
CHECKPOINT_DTYPE = "blockdiff_checkpoint_dtype"

# What users may type (CLI, pytest options): canonical names and common short forms.
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    """A dtype a user named (``bf16``, ``float32``, ...).

    Raises:
        InputError: not a dtype blockdiff runs models in.
    """
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InputError(
            f"unknown dtype {name!r}; expected one of float32, float64, float16, bfloat16"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: how reports and dumps name a dtype."""
    return str(dtype).removeprefix("torch.")


def stored_dtype(name: str) -> torch.dtype:
    """The torch dtype a dump or report names (any torch dtype, float8 included); never
    anything else from the torch namespace.

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def precision_label(dtype: torch.dtype, device: torch.device | str) -> str:
    """``bfloat16@cpu``, ``bfloat16@cuda:0``: how stored floors name the precision they were
    measured at. A CUDA device without an index is the current one, as a model placed on
    ``"cuda"`` reports ``cuda:0``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return f"{dtype_name(dtype)}@{device}"
