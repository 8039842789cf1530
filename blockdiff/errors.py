"""Errors blockdiff raises.

The library raises; only the CLI catches :class:`BlockdiffError`, prints one line and
exits 2. Every subclass carries its data as attributes so callers can act on it.

Hierarchy::

    BlockdiffError
    ├── ModelSpecError        a model spec cannot be loaded (file, factory, return type)
    ├── HookMapError          a hook map is malformed or names modules that do not exist
    ├── InputError            bad token ids, shapes, dtype or device names, empty inputs
    │   └── OptionsError          options that do not go together (named as parameters)
    ├── ModelRunError         a model raised while blockdiff ran it
    ├── PairingError          reference and candidate sites cannot be paired
    │   └── ShapeMismatchError    paired sites have different shapes
    └── DumpError             an HDF5 dump is missing, foreign, damaged or too new
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")

__all__ = [
    "BlockdiffError",
    "ModelSpecError",
    "HookMapError",
    "InputError",
    "OptionsError",
    "ModelRunError",
    "PairingError",
    "ShapeMismatchError",
    "DumpError",
    "run_model_code",
]


class BlockdiffError(Exception):
    """Base class of every error blockdiff raises on purpose."""


class ModelSpecError(BlockdiffError):
    """A model spec (``file.py:factory``, ``package.module:factory``) cannot be used."""

    def __init__(self, message: str, *, spec: str | None = None) -> None:
        super().__init__(message)
        self.spec = spec


class HookMapError(BlockdiffError):
    """A hook map is malformed, matches nothing, or names a module that does not exist."""

    def __init__(self, message: str, *, source: str | None = None) -> None:
        super().__init__(message)
        self.source = source


class InputError(BlockdiffError):
    """Model inputs, dtype or device names are unusable."""


class OptionsError(InputError):
    """Options that do not go together, or a value an option does not take.

    ``template`` is the message with each option written ``{name}`` (its parameter's name:
    ``decode``, ``save_dumps``): ``str()`` names them as the Python API spells them,
    :meth:`spelled` as a front door does (the CLI's flags). ``names``: the options it
    names; ``values``: the other fields of the template.

    >>> str(OptionsError("{decode} runs in memory: not with {stream}"))
    'decode runs in memory: not with stream'
    >>> OptionsError("{decode} runs in memory").spelled({"decode": "--decode"})
    '--decode runs in memory'
    """

    def __init__(self, template: str, **values: Any) -> None:
        import string

        self.template, self.values = template, values
        fields_ = [field for _, field, _, _ in string.Formatter().parse(template) if field]
        self.names = tuple(dict.fromkeys(f for f in fields_ if f not in values))
        super().__init__(self.spelled({}))

    def spelled(self, spelling: dict[str, str]) -> str:
        """The message with each option spelled as ``spelling`` says (its own name where
        it says nothing)."""
        return self.template.format(**{name: spelling.get(name, name) for name in self.names}, **self.values)


class ModelRunError(BlockdiffError):
    """A model raised while blockdiff ran it; the original exception is ``__cause__``."""

    def __init__(self, message: str, *, side: str) -> None:
        super().__init__(message)
        self.side = side


class PairingError(BlockdiffError):
    """Reference and candidate sites cannot be paired (block counts, missing sites)."""


class ShapeMismatchError(PairingError):
    """A paired site has different shapes on the two sides."""

    def __init__(self, message: str, *, site: str, reference: tuple, candidate: tuple) -> None:
        super().__init__(message)
        self.site = site
        self.reference = reference
        self.candidate = candidate


class TensorChanged(BlockdiffError):
    """A tensor recorded by reference changed before it was written: capture again with copies."""


class DumpError(BlockdiffError):
    """An HDF5 dump cannot be read or written."""

    def __init__(self, message: str, *, path: str | None = None, site: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.site = site


def run_model_code(side: str, fn: "Callable[..., T]", *args: Any, **kwargs: Any) -> "T":
    """``fn(*args, **kwargs)``; an exception raised by model code (anything but a
    :class:`BlockdiffError`) becomes a :class:`ModelRunError` naming the side, with the
    original as its ``__cause__``."""
    try:
        return fn(*args, **kwargs)
    except BlockdiffError:
        raise
    except Exception as exc:
        raise ModelRunError(f"the {side} model raised {type(exc).__name__}: {exc}", side=side) from exc
