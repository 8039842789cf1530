"""blockdiff: find where two implementations of a transformer first diverge, and whether
it is a bug or precision.

Pipeline: hook map (:mod:`.hookmap`) → capture (:mod:`.capture`) → store
(:mod:`.store`) → localize (:mod:`.localize`) → compare (:mod:`.compare`) →
report (:mod:`.report`) → render (:mod:`.render`). :func:`diff` runs it all.
"""

__version__ = "0.1.0"

from .engine import diff  # noqa: E402
from .errors import (  # noqa: E402
    BlockdiffError,
    DumpError,
    HookMapError,
    InputError,
    ModelRunError,
    ModelSpecError,
    PairingError,
    ShapeMismatchError,
)
from .hookmap import HookMap, Layout, resolve  # noqa: E402
from .report import Report  # noqa: E402
from .tolerance import Tolerance  # noqa: E402
from .weights import trained_looking_  # noqa: E402

__all__ = [
    "__version__",
    "diff",
    "Report",
    "Tolerance",
    "HookMap",
    "Layout",
    "resolve",
    "trained_looking_",
    "BlockdiffError",
    "DumpError",
    "HookMapError",
    "InputError",
    "ModelRunError",
    "ModelSpecError",
    "PairingError",
    "ShapeMismatchError",
]
