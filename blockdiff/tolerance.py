"""Tolerance: the threshold each local error is judged against.

Two policies (docs/design.md, "Tolerance"):

- **fixed**: a relative-L2 threshold per dtype (the lower-precision side's), the same for
  every site unless a sub-path or stage is overridden.
- **calibrated** (default when the sides' dtypes or devices differ): the noise floor of a
  site is the *reference's own module* run in the candidate's dtype and device on the
  reference's inputs; a site diverges when its local error exceeds
  ``multiplier × floor + atol``. The rule of PyTorch's dynamo accuracy checker
  (multiplier 2 for float32, 3 for 16-bit dtypes): is the candidate worse than the
  trusted code at the same precision?

Overrides (``--tol ffn=0.05``) set a fixed threshold for one sub-path or stage under
either policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dtypes import dtype_name
from .errors import InputError
from .vocab import POLICIES, TARGETS

# Fixed thresholds on relative L2, per dtype of the lower-precision side. Measured on the
# sample and tiny HF Llama/Qwen3 with trained-looking weights: clean bfloat16 local errors
# are 2.8e-3 to 6.2e-3 and the smallest planted bug is 0.12 (RMSNorm as LayerNorm);
# float16 errors are about 8x smaller than bfloat16's (tests/test_localize_sample.py runs
# the fixed policy on both).
FIXED = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}
MULTIPLIER = {torch.float64: 2.0, torch.float32: 2.0, torch.float16: 3.0, torch.bfloat16: 3.0}
# Added to the calibrated threshold, so a floor of exactly zero (same code, same dtype)
# still tolerates reordered arithmetic.
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


_PRECISION = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 0}


def working_dtype(reference: torch.dtype, candidate: torch.dtype) -> torch.dtype:
    """The lower-precision of the two sides' dtypes (the candidate's on a tie)."""
    return candidate if _PRECISION.get(candidate, 2) <= _PRECISION.get(reference, 2) else reference


@dataclass(frozen=True)
class Threshold:
    value: float
    basis: str  # "fixed", "calibrated" or "override"
    floor: float | None = None
    # For an override: the threshold the policy would have set without it.
    default: float | None = None


@dataclass
class Tolerance:
    """How local errors are judged.

    Args:
        policy: ``"fixed"``, ``"calibrated"`` or ``None`` (calibrated when dtypes or
            devices differ, else fixed).
        overrides: fixed relative-L2 thresholds per sub-path or stage name
            (``attention``, ``ffn``, ``norm``, ``residual``, ``block``, ``embed``,
            ``context``, ``final_norm``, ``head``).
        multiplier: calibrated multiplier; default by dtype (2 for float32, 3 for 16-bit).
        atol: calibrated additive slack; default by dtype.
        fixed: fixed threshold; default by dtype.

    >>> Tolerance(policy="fixed", overrides={"ffn": 0.05}).threshold("ffn", torch.bfloat16).value
    0.05
    """

    policy: str | None = None
    overrides: dict[str, float] = field(default_factory=dict)
    multiplier: float | None = None
    atol: float | None = None
    fixed: float | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise InputError(f"unknown tolerance policy {self.policy!r}; expected fixed or calibrated")
        for name, value in self.overrides.items():
            if name not in TARGETS:
                raise InputError(
                    f"unknown tolerance target {name!r}; expected one of {', '.join(TARGETS)}"
                )
            if not value > 0:
                raise InputError(f"tolerance for {name} must be a positive number, found {value}")

    @staticmethod
    def parse_override(text: str) -> tuple[str, float]:
        """``"ffn=0.05"`` → ``("ffn", 0.05)``: one ``SUBPATH=VALUE`` as users type it
        (``--tol``, ``--blockdiff-tol``). The name is checked by the constructor.

        Raises:
            InputError: not ``NAME=NUMBER``.

        >>> Tolerance.parse_override("ffn=0.05")
        ('ffn', 0.05)
        """
        name, sep, number = text.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            return name.strip(), float(number)
        except ValueError:
            raise InputError(f"expected SUBPATH=VALUE (e.g. ffn=0.05), found {text!r}") from None

    def resolved(self, *, same_dtype: bool, same_device: bool) -> "Tolerance":
        """This tolerance with the policy chosen: calibrated when dtypes or devices differ."""
        if self.policy is not None:
            return self
        policy = "fixed" if same_dtype and same_device else "calibrated"
        return Tolerance(policy, dict(self.overrides), self.multiplier, self.atol, self.fixed)

    @property
    def calibrated(self) -> bool:
        return self.policy == "calibrated"

    def multiplier_for(self, dtype: torch.dtype) -> float:
        """The calibrated multiplier for a working dtype."""
        return self.multiplier if self.multiplier is not None else MULTIPLIER.get(dtype, 2.0)

    def threshold(self, target: str, dtype: torch.dtype, floor: float | None = None) -> Threshold:
        """The threshold of one site: ``target`` is its sub-path or stage name."""
        if target in self.overrides:
            default = Tolerance(self.policy, {}, self.multiplier, self.atol, self.fixed).threshold(target, dtype, floor)
            return Threshold(self.overrides[target], "override", floor, default.value)
        if self.calibrated and floor is not None:
            mult = self.multiplier_for(dtype)
            atol = self.atol if self.atol is not None else ATOL.get(dtype, 1e-5)
            return Threshold(mult * floor + atol, "calibrated", floor)
        value = self.fixed if self.fixed is not None else FIXED.get(dtype, FIXED[torch.float32])
        return Threshold(value, "fixed", floor)

    def to_dict(self, dtype: torch.dtype) -> dict:
        return {
            "policy": self.policy,
            "dtype": dtype_name(dtype),
            "multiplier": self.multiplier_for(dtype),
            "atol": self.atol if self.atol is not None else ATOL.get(dtype, 1e-5),
            "fixed": self.fixed if self.fixed is not None else FIXED.get(dtype, FIXED[torch.float32]),
            "overrides": dict(self.overrides),
        }
