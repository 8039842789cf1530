"""blockdiff: find where two implementations of a transformer first diverge, and whether
it is a bug or precision.

Pipeline: hook map (:mod:`.hookmap`) → sides (:mod:`.sides`) → capture
(:mod:`.capture`) → store (:mod:`.store`, :mod:`.dump`) → pairing (:mod:`.pairing`) →
experiments (:mod:`.experiments`) → localize (:mod:`.localize`) → compare
(:mod:`.compare`) → report (:mod:`.report`) → view (:mod:`.view`) → render
(:mod:`.render`, :mod:`.plot`, :mod:`.html`). :func:`run` chooses diff, replay or
offline comparison from what the two sides are; :func:`diff` is the live diff;
:func:`assert_no_divergence` (:mod:`.assertion`) turns it into a test verdict.

The public names are loaded on first access (PEP 562): the pytest plugin
(:mod:`.pytest_plugin`) imports this package in every pytest session, and a session
that never uses blockdiff must not pay for importing torch and h5py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__  # noqa: E402

# The errors import nothing heavy: loaded eagerly.
from .errors import (  # noqa: E402
    BlockdiffError,
    DumpError,
    HookMapError,
    InputError,
    OptionsError,
    ModelRunError,
    ModelSpecError,
    PairingError,
    ShapeMismatchError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .assertion import DivergenceError, assert_no_divergence
    from .assertion import assert_batch_invariant
    from .engine import Options, diff, run
    from .inputs import RandomTokens
    from .autodetect import resolve
    from .hookmap import HookMap, Layout
    from .report import Report
    from .tolerance import Tolerance
    from .weights import trained_looking_

# Public name → the submodule that defines it (each imports torch).
_LAZY = {
    "diff": ".engine",
    "run": ".engine",
    "Options": ".engine",
    "RandomTokens": ".inputs",
    "Report": ".report",
    "Tolerance": ".tolerance",
    "HookMap": ".hookmap",
    "Layout": ".hookmap",
    "resolve": ".autodetect",
    "trained_looking_": ".weights",
    "assert_no_divergence": ".assertion",
    "DivergenceError": ".assertion",
    "assert_batch_invariant": ".assertion",
}

__all__ = [
    "__version__",
    "diff",
    "run",
    "Options",
    "RandomTokens",
    "Report",
    "Tolerance",
    "HookMap",
    "Layout",
    "resolve",
    "trained_looking_",
    "assert_no_divergence",
    "DivergenceError",
    "assert_batch_invariant",
    "BlockdiffError",
    "DumpError",
    "HookMapError",
    "InputError",
    "OptionsError",
    "ModelRunError",
    "ModelSpecError",
    "PairingError",
    "ShapeMismatchError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
