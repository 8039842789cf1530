"""Model inputs: token ids, positional-argument tuples or keyword dicts, and how to call a
model with them.

Everywhere in the Python API, ``inputs`` may be a tensor (token ids), a tuple of
positional arguments or a dict of keyword arguments. The CLI makes token ids from
``--batch/--seq/--seed`` or reads them from ``--tokens FILE`` (.json list of lists, or
.safetensors holding ``input_ids``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import InputError
from .site import iter_tensors, map_structure

Inputs = Any  # torch.Tensor | tuple | dict



@dataclass(frozen=True)
class RandomTokens:
    """Random token ids within the reference's vocabulary (the CLI's ``--batch/--seq/--seed``)."""

    batch: int = 2
    seq: int = 16
    seed: int = 0


@dataclass(frozen=True)
class InputsFile:
    """Named model inputs from a file (the CLI's ``--inputs``): see :func:`load_inputs`."""

    path: str | Path


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes: its first parameter's (or buffer's) device. Parameters on
    the ``meta`` device (offloaded by accelerate, loaded in at each call) do not count."""
    for tensors in (model.parameters(), model.buffers()):
        for tensor in tensors:
            if tensor.device.type != "meta":
                return tensor.device
    return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def check_inputs(inputs: Inputs) -> Inputs:
    """Validate the shape of ``inputs`` (tensor, tuple or dict) and return it.

    Raises:
        InputError: another type, or inputs holding no elements.
    """
    if not isinstance(inputs, (torch.Tensor, tuple, dict)):
        raise InputError(
            f"inputs must be a tensor of token ids, a tuple of positional arguments or a dict "
            f"of keyword arguments, found {type(inputs).__name__}"
        )
    tensors = list(iter_tensors(inputs))
    if not tensors:
        raise InputError("inputs hold no tensor")
    if any(t.numel() == 0 for t in tensors):
        shapes = ", ".join(str(list(t.shape)) for t in tensors)
        raise InputError(f"inputs are empty (shapes {shapes}); give at least one token")
    return inputs


def run_model(model: nn.Module, inputs: Inputs) -> Any:
    """Call ``model`` on ``inputs`` moved to its device.

    Models whose forward takes ``use_cache`` (Hugging Face) are called with
    ``use_cache=False`` unless the inputs say otherwise: a cache object would make
    recorded calls unreplayable.
    """
    run_on = getattr(inputs, "run_on", None)
    if callable(run_on):  # one decode step, with the cache it carries (blockdiff.decoding)
        return run_on(model)
    device = model_device(model)
    moved = map_structure(inputs, lambda t: t.to(device))
    if isinstance(moved, dict):
        args, kwargs = (), dict(moved)
    elif isinstance(moved, tuple):
        args, kwargs = moved, {}
    else:
        args, kwargs = (moved,), {}
    if "use_cache" not in kwargs and accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    return model(*args, **kwargs)


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes a parameter ``name`` (``False`` where it cannot tell)."""
    forward = model.forward
    function = getattr(forward, "__func__", forward)  # a bound method is made anew at each read
    try:
        names = _PARAMETERS.get(function)
    except TypeError:  # not weak-referenceable: read each time
        names = None
    if names is None:
        try:
            names = frozenset(inspect.signature(forward).parameters)
        except (TypeError, ValueError):
            return False
        try:
            _PARAMETERS[function] = names
        except TypeError:
            pass
    return name in names


# Each forward function's parameter names: reading a signature cost a capture of a small
# model half a microsecond a site (benchmarks/per_site.py). Weak: a forward made for one
# model (an instance's own) goes with it.
_PARAMETERS: "weakref.WeakKeyDictionary[Any, frozenset[str]]" = weakref.WeakKeyDictionary()


def random_tokens(*, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Token ids uniform in ``[0, vocab)`` from ``seed``."""
    if batch < 1:
        raise InputError(f"--batch must be at least 1, found {batch}")
    if seq < 1:
        raise InputError(f"--seq must be at least 1, found {seq}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _regular_file(path: str | Path, what: str) -> Path:
    """``path``, when it is a regular file; else an :class:`InputError` saying what it is."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path}: no such file")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file (a device, pipe or socket)"
        raise InputError(f"{what} {path}: {kind}; expected a .json or .safetensors file")
    return path


def load_tokens(path: str | Path) -> torch.Tensor:
    """Token ids from a .json file (list of lists of ints) or a .safetensors file holding
    ``input_ids``.

    Raises:
        InputError: missing file, not a regular file, other format, wrong dtype or shape.
    """
    path = _regular_file(path, "token file")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"token file {path}: not valid JSON ({exc})") from None
        if not (
            isinstance(data, list)
            and data
            and all(isinstance(row, list) for row in data)
            and all(isinstance(v, int) and not isinstance(v, bool) for row in data for v in row)
        ):
            raise InputError(f"token file {path}: expected a non-empty list of lists of integers")
        if len({len(row) for row in data}) != 1:
            raise InputError(f"token file {path}: rows have different lengths")
        ids = torch.tensor(data, dtype=torch.long)
    elif path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(f"token file {path}: not a readable safetensors file ({exc})") from None
        if "input_ids" not in tensors:
            raise InputError(
                f"token file {path}: expected a tensor named 'input_ids', found {sorted(tensors)}"
            )
        ids = tensors["input_ids"]
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
            raise InputError(f"token file {path}: input_ids must be integers, found {ids.dtype}")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise InputError(
                f"token file {path}: input_ids must be [batch, seq], found shape {list(ids.shape)}"
            )
        ids = ids.long()
    else:
        raise InputError(f"token file {path}: expected a .json or .safetensors file")
    if ids.numel() == 0:
        raise InputError(f"token file {path}: holds no tokens")
    return ids


def load_inputs(path: str | Path) -> dict[str, torch.Tensor]:
    """Named model inputs, passed as keyword arguments: every tensor of a ``.safetensors``
    file, or a ``.json`` object mapping names to nested lists (integers become int64,
    numbers with a fraction float32, booleans bool).

    >>> load_inputs("batch.json")  # {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 0]]}  # doctest: +SKIP

    Raises:
        InputError: missing file, not a regular file, other format, or nothing in it.
    """
    path = _regular_file(path, "inputs file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            found = dict(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(f"inputs file {path}: not a readable safetensors file ({exc})") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"inputs file {path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InputError(f"inputs file {path}: expected an object of named arrays, e.g. {{\"input_ids\": [[1, 2]]}}")
        found = {}
        for name, value in data.items():
            try:
                found[name] = torch.tensor(value)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InputError(f"inputs file {path}: {name!r} is not a rectangular array of numbers ({exc})") from None
            if found[name].dtype == torch.float64:
                found[name] = found[name].float()
    else:
        raise InputError(f"inputs file {path}: expected a .json or .safetensors file")
    if not found or any(t.numel() == 0 for t in found.values()):
        raise InputError(f"inputs file {path}: holds no inputs (or an empty one)")
    return found


def complete_inputs(model: nn.Module, inputs: Inputs) -> tuple[Inputs, str | None]:
    """Token ids completed into what ``model`` needs, and a note saying how; other inputs
    as they are.

    An encoder-decoder (``config.is_encoder_decoder``) given only token ids gets
    ``decoder_input_ids`` derived as the model itself derives them from labels: the ids
    shifted right after ``decoder_start_token_id``.
    """
    config = getattr(model, "config", None)
    if not isinstance(inputs, torch.Tensor) or not getattr(config, "is_encoder_decoder", False):
        return inputs, None
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None) or 0
    decoder = torch.cat([torch.full_like(inputs[:, :1], int(start)), inputs[:, :-1]], dim=1)
    note = (
        f"decoder_input_ids derived from the input ids shifted right after decoder_start_token_id "
        f"{int(start)}, as the model does from labels"
    )
    return {"input_ids": inputs, "decoder_input_ids": decoder}, note


def pixel_input(model: nn.Module) -> tuple[str, tuple[int, ...]] | None:
    """``("pixel_values", (channels, size, size))`` for a vision encoder that takes pixels
    and no token ids (ViT, a CLIP or SigLIP vision tower), from its configuration."""
    if accepts(model, "input_ids") or not accepts(model, "pixel_values"):
        return None
    config = getattr(model, "config", None)
    config = getattr(config, "vision_config", None) or config
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", 3)
    if not isinstance(size, int):
        return None
    return "pixel_values", (int(channels), size, size)


def random_pixels(shape: tuple[int, ...], *, batch: int, seed: int) -> torch.Tensor:
    """Pixel values ~ N(0, 1) (already normalized, as an image processor returns them)."""
    if batch < 1:
        raise InputError(f"--batch must be at least 1, found {batch}")
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))


def check_vocab(ids: torch.Tensor, vocab: int | None, *, side: str) -> None:
    """Token ids must lie in ``[0, vocab)`` of the side's embedding."""
    if vocab is None or ids.is_floating_point():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise InputError(
            f"token ids out of range for the {side}'s vocabulary of {vocab}: found ids from "
            f"{low} to {high}"
        )


def digest(inputs: Inputs) -> str:
    """A short content digest of the inputs (sha256 over dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for t in iter_tensors(inputs):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def check_captured_on(stored: str | None, inputs: Inputs, *, what: str, todo: str) -> None:
    """The one input-digest rule: ``inputs`` must be the ones ``what`` (a dump, a golden)
    was captured on, whose digest is ``stored`` (``None``: it recorded none, nothing to
    check).

    Raises:
        InputError: ``{what} was captured on other inputs (digest …) than these (digest …);
            {todo}``.
    """
    given = digest(check_inputs(inputs))
    if stored is not None and stored != given:
        raise InputError(f"{what} was captured on other inputs (digest {stored}) than these (digest {given}); {todo}")
