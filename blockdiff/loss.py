"""The loss a backward diff differentiates (``--backward``, docs/backward.md).

Both sides run forward and backward on the same inputs and the same scalar loss: by
default the next-token cross-entropy of the logits on the input ids
(:func:`next_token_loss`); ``--loss`` names another, ``path/to/file.py:function`` or
``package.module:function`` (:func:`load_loss`), a callable ``function(output, inputs)``.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import InputError
from .inputs import Inputs

# A loss as blockdiff calls it: the model's output and the inputs it ran on → a scalar.
Loss = Callable[[Any, Inputs], torch.Tensor]

DEFAULT_LOSS = "next-token cross-entropy on the input ids"


def next_token_loss(output: Any, inputs: Inputs) -> torch.Tensor:
    """The default loss: mean cross-entropy of the logits at each position against the next
    input token (``logits[:, :-1]`` against ``ids[:, 1:]``), in float32.

    Raises:
        InputError: the output holds no ``[batch, tokens, vocab]`` logits, or the inputs no
            token ids: give a loss (``--loss module:function``).
    """
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    ids = inputs if isinstance(inputs, torch.Tensor) else None
    if isinstance(inputs, dict):
        ids = inputs.get("input_ids")
    elif isinstance(inputs, tuple) and inputs and isinstance(inputs[0], torch.Tensor):
        ids = inputs[0]
    if (
        not isinstance(logits, torch.Tensor) or ids is None or ids.is_floating_point()
        or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape) or ids.shape[1] < 2
    ):
        found = list(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise InputError(
            f"--backward's default loss ({DEFAULT_LOSS}) needs token ids [batch, tokens >= 2] and logits "
            f"[batch, tokens, vocab]; found logits {found}: give a loss with --loss module:function"
        )
    if int(ids.max()) >= logits.shape[-1]:
        raise InputError(
            f"--backward's default loss ({DEFAULT_LOSS}): the output's last dimension ({logits.shape[-1]}) is not a "
            f"vocabulary holding the input ids (up to {int(ids.max())}): give a loss with --loss module:function"
        )
    ids = ids.to(logits.device)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def load_loss(spec: str) -> Loss:
    """The loss a ``--loss`` spec names: ``path/to/file.py:function`` or
    ``package.module:function``, a callable ``function(output, inputs)`` returning a scalar.

    Raises:
        InputError: a malformed spec, or a file, module or function that is not there.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise InputError(f"--loss {spec!r}: expected path/to/file.py:function or package.module:function")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target)
            if not path.is_file():
                raise InputError(f"--loss {spec!r}: no such file {target}")
            found = importlib.util.spec_from_file_location(f"blockdiff_loss_{path.stem}", path)
            assert found is not None and found.loader is not None
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"--loss {spec!r}: cannot load {target} ({type(exc).__name__}: {exc})") from None
    loss = getattr(module, name, None)
    if not callable(loss):
        raise InputError(f"--loss {spec!r}: {target} has no function {name!r}")
    return loss


def resolve_loss(loss: str | Loss | None) -> tuple[Loss, str]:
    """The loss to run and how the report names it."""
    if loss is None:
        return next_token_loss, DEFAULT_LOSS
    if isinstance(loss, str):
        return load_loss(loss), loss
    return loss, getattr(loss, "__name__", type(loss).__name__)


__all__ = ["DEFAULT_LOSS", "Loss", "load_loss", "next_token_loss", "resolve_loss"]
