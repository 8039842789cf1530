"""Compare: the metrics of one candidate tensor against its reference.

All metric math runs in float64 on the CPU. Relative L2 (‖c−r‖/‖r‖) is the headline;
max abs, cosine similarity, SQNR in dB, non-finite counts and the count of elements
outside ``allclose`` come with it. A tensor with NaN/Inf where the other side has none
gets an infinite relative L2, so it always exceeds its tolerance.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

# allclose tolerances per dtype of the lower-precision side, for the mismatch count.
ALLCLOSE = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@dataclass(frozen=True)
class Metrics:
    rel_l2: float
    max_abs: float
    cosine: float
    sqnr_db: float
    nonfinite_ref: int
    nonfinite_cand: int
    mismatched: int
    numel: int

    def to_dict(self) -> dict:
        return {k: json_number(v) for k, v in asdict(self).items()}


def json_number(value: float | int) -> float | int | str:
    """JSON has no Infinity or NaN: those are written as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def metrics(reference: torch.Tensor, candidate: torch.Tensor, *, dtype: torch.dtype | None = None) -> Metrics:
    """Metrics of ``candidate`` against ``reference`` (same shape; any dtypes or devices).

    Args:
        dtype: the lower-precision dtype of the comparison, choosing the allclose
            tolerances of the mismatch count (default: the candidate's).

    >>> metrics(torch.ones(4), torch.ones(4)).rel_l2
    0.0
    """
    r = reference.detach().to("cpu", torch.float64)
    c = candidate.detach().to("cpu", torch.float64)
    numel = r.numel()
    rtol, atol = ALLCLOSE.get(dtype or candidate.dtype, ALLCLOSE[torch.float32])
    # NaN and Inf propagate into a float64 sum (which cannot overflow from float16/32/
    # bfloat16 values): a finite sum on both sides means no element to mask.
    if bool(torch.isfinite(r.sum())) and bool(torch.isfinite(c.sum())):
        nonfinite_ref = nonfinite_cand = 0
        diff = c - r
        abs_diff = diff.abs()
        # torch.isclose's rule, |c - r| <= atol + rtol * |r|, on the difference at hand.
        mismatched = int((abs_diff > r.abs().mul_(rtol).add_(atol)).sum())
    else:
        fin_r, fin_c = torch.isfinite(r), torch.isfinite(c)
        nonfinite_ref = int((~fin_r).sum())
        nonfinite_cand = int((~fin_c).sum())
        mismatched = int((~torch.isclose(c, r, rtol=rtol, atol=atol, equal_nan=True)).sum())
        same_pattern = bool(torch.equal(fin_r, fin_c)) and bool(
            torch.equal(r[~fin_r].nan_to_num(0.0, 1.0, -1.0), c[~fin_c].nan_to_num(0.0, 1.0, -1.0))
        )
        if not same_pattern:
            return Metrics(math.inf, math.inf, math.nan, -math.inf, nonfinite_ref, nonfinite_cand, mismatched, numel)
        # Identical non-finite pattern on both sides: compare the finite elements.
        r, c = r[fin_r], c[fin_c]
        diff = c - r
        abs_diff = diff.abs()
    norm_r = float(torch.linalg.vector_norm(r))
    norm_d = float(torch.linalg.vector_norm(diff))
    norm_c = float(torch.linalg.vector_norm(c))
    if norm_r > 0:
        rel_l2 = norm_d / norm_r
    else:
        rel_l2 = 0.0 if norm_d == 0 else math.inf
    max_abs = float(abs_diff.max()) if abs_diff.numel() else 0.0
    if norm_r > 0 and norm_c > 0:
        cosine = float(torch.dot(r.flatten(), c.flatten()) / (norm_r * norm_c))
    else:
        cosine = 1.0 if norm_r == norm_c else 0.0
    sqnr_db = math.inf if norm_d == 0 else (20 * math.log10(norm_r / norm_d) if norm_r > 0 else -math.inf)
    return Metrics(rel_l2, max_abs, cosine, sqnr_db, nonfinite_ref, nonfinite_cand, mismatched, numel)
