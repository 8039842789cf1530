"""Compare: the metrics of one candidate tensor against its reference.

Metric math runs on the CPU: in float32 for inputs of 32 bits or fewer (which float32 holds
exactly; sums are cascade sums), in float64 otherwise. Relative L2 (‖c−r‖/‖r‖) is the headline;
max abs, cosine similarity, SQNR in dB, non-finite counts and the count of elements
outside ``allclose`` come with it. A tensor with NaN/Inf where the other side has none
gets an infinite relative L2, so it always exceeds its tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

# allclose tolerances per dtype of the lower-precision side, for the mismatch count.
ALLCLOSE = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


# Within a sharded run (blockdiff.distributed.lockstep, .apart), top first: what a
# comparison's metrics become, the worst rank's or this rank's own.
ACROSS_RANKS: list[Callable[["Metrics"], "Metrics"]] = []


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
    # ‖c − r‖ itself: what an error budget adds up (not in the JSON, which keeps relative
    # measures; NaN for a report read back from JSON).
    error_l2: float = field(default=math.nan, compare=False, metadata={"json": False})

    def to_dict(self) -> dict:
        return {f.name: json_number(getattr(self, f.name)) for f in fields(self) if f.metadata.get("json", True)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Metrics:
        """The metrics of :meth:`to_dict`, or of a dict that holds them among other keys (a
        check's)."""
        return cls(**{f.name: from_json_number(data[f.name]) for f in fields(cls) if f.metadata.get("json", True)})


def json_number(value: float | int) -> float | int | str:
    """JSON has no Infinity or NaN: those are written as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def from_json_number(value: Any) -> Any:
    """The inverse of :func:`json_number`: ``"inf"``, ``"-inf"`` and ``"nan"`` back to
    floats; numbers and ``None`` as they are.

    >>> from_json_number("inf"), from_json_number(3), from_json_number(None)
    (inf, 3, None)
    """
    return float(value) if isinstance(value, str) else value


def metrics(reference: torch.Tensor, candidate: torch.Tensor, *, dtype: torch.dtype | None = None) -> Metrics:
    """Metrics of ``candidate`` against ``reference`` (same shape; any dtypes or devices).

    Args:
        dtype: the lower-precision dtype of the comparison, choosing the allclose
            tolerances of the mismatch count (default: the candidate's).

    >>> metrics(torch.ones(4), torch.ones(4)).rel_l2
    0.0
    """
    found = _local_metrics(reference, candidate, dtype)
    return ACROSS_RANKS[-1](found) if ACROSS_RANKS else found


def _local_metrics(reference: torch.Tensor, candidate: torch.Tensor, dtype: torch.dtype | None) -> Metrics:
    """:func:`metrics` of this process's tensors alone (in a sharded run, not reduced
    across the ranks)."""
    work = _work_dtype(reference, candidate)
    found = None
    rtol, atol = ALLCLOSE.get(dtype or candidate.dtype, ALLCLOSE[torch.float32])
    sums = _chunk_sums(reference, candidate, work, (rtol, atol))
    if sums is not None:
        found = _from_sums(*sums[:4], 0, 0, sums[4], reference.numel())
    if found is None:  # non-finite values: the whole tensors at once
        found = _metrics(reference, candidate, dtype, work)
    if found is None:  # a float32 sum of squares overflowed: values beyond ~1e19
        found = _metrics(reference, candidate, dtype, torch.float64)
    return found


def rel_l2(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """``metrics(reference, candidate).rel_l2``, the same number, from the only two sums of
    squares it needs (‖r‖² and ‖c − r‖²): a noise floor is a relative L2 and nothing else,
    and the other metrics cost twice as much again. It is this process's own number, never
    reduced across the ranks of a sharded run (a floor is each rank's; the fallback of
    sums that overflow runs on one rank alone, so it must not wait for the others).

    >>> rel_l2(torch.ones(4), torch.ones(4))
    0.0
    """
    sums = _chunk_sums(reference, candidate, _work_dtype(reference, candidate), None)
    ss_r, _, ss_d = sums[:3] if sums is not None else (math.inf, None, math.inf)
    # ‖c‖² is not summed: when ‖r‖² and ‖c − r‖² are this far from overflowing, so is
    # ‖c‖² ≤ 2‖r‖² + 2‖c − r‖², and metrics() takes the same path to the same number.
    if ss_r < _FLOAT32_MAX / 8 and ss_d < _FLOAT32_MAX / 8:  # false for NaN too
        return _rel_l2(ss_r, ss_d)
    return _local_metrics(reference, candidate, None).rel_l2


def _work_dtype(reference: torch.Tensor, candidate: torch.Tensor) -> torch.dtype:
    return torch.float32 if _fits_float32(reference) and _fits_float32(candidate) else torch.float64


# Elements per chunk of a large comparison: 1 MiB of float32, so that the chunk's
# temporaries stay in cache and are reused instead of faulting in fresh pages.
CHUNK = 1 << 18


def _chunk_sums(
    reference: torch.Tensor, candidate: torch.Tensor, work: torch.dtype, tolerance: tuple[float, float] | None
) -> tuple[float, float | None, float, float | None, int | None] | None:
    """The sums of a large pair of finite tensors, one chunk at a time: ‖r‖², ‖c‖², ‖c − r‖²,
    max |c − r| and the count outside ``tolerance`` (rtol, atol); with ``tolerance``
    ``None``, ‖r‖² and ‖c − r‖² only (the rest ``None``).

    The whole-tensor computation makes eight temporaries the size of its inputs (a cast,
    the difference, three squares, two absolute values, a mask): on 32 MB logits each is
    fresh memory the kernel faults in page by page, and the comparison cost four times
    the arithmetic (73 ms against 18 for a pair of [256, 32000] logits). Chunks of
    :data:`CHUNK` elements reuse a few buffers; each chunk's sums are cascade sums as
    before, added up in float64. ``None`` when a sum is not finite (NaN/Inf, or float32
    squares that overflow): the whole-tensor path decides what those mean.

    Tensors of one chunk or less take this path too (a block's activations): the same
    operations on the same elements give the same numbers as the whole-tensor path, in
    fewer temporaries. The count outside the tolerance is a comparison written as 0.0 and
    1.0 into a floating buffer and summed (exact: a chunk holds fewer than 2**24 elements):
    a third of the cost of a boolean mask and its integer sum.
    """
    full = tolerance is not None
    r_all = reference.detach().reshape(-1)
    c_all = candidate.detach().reshape(-1)
    if r_all.device.type != "cpu" or c_all.device.type != "cpu":
        r_all, c_all = r_all.to("cpu"), c_all.to("cpu")
    numel = r_all.numel()
    r, c, d, scratch = (torch.empty(min(CHUNK, numel), dtype=work) for _ in range(4))
    ss_r = ss_c = ss_d = max_abs = 0.0
    mismatched = 0
    for start in range(0, numel, CHUNK):
        n = min(CHUNK, numel - start)
        rc, cc, dc, sc = r[:n], c[:n], d[:n], scratch[:n]
        if r_all.dtype == work:  # read in place: nothing to convert
            rc = r_all[start : start + n]
        else:
            rc.copy_(r_all[start : start + n])
        cc.copy_(c_all[start : start + n])
        torch.sub(cc, rc, out=dc)
        ss_r += float(torch.mul(rc, rc, out=sc).sum())
        ss_d += float(torch.mul(dc, dc, out=sc).sum())
        if not full:
            continue
        ss_c += float(torch.mul(cc, cc, out=sc).sum())
        dc.abs_()
        max_abs = max(max_abs, float(dc.max()))
        # torch.isclose's rule, |c - r| <= atol + rtol * |r|, on the difference at hand;
        # the candidate's chunk is read already: its buffer takes the comparison.
        torch.abs(rc, out=sc).mul_(tolerance[0]).add_(tolerance[1])
        mismatched += int(torch.gt(dc, sc, out=cc).sum())
    sums = (ss_r, ss_c, ss_d) if full else (ss_r, ss_d)
    if not all(math.isfinite(v) for v in sums):
        return None
    if work == torch.float32 and not all(v < _FLOAT32_MAX for v in sums):
        return None  # a chunk's float32 sum would have overflowed: as the whole-tensor path, retry in float64
    if not full:
        return ss_r, None, ss_d, None, None
    return ss_r, ss_c, ss_d, max_abs, mismatched


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _fits_float32(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _metrics(reference: torch.Tensor, candidate: torch.Tensor, dtype: torch.dtype | None, work: torch.dtype) -> Metrics | None:
    """The metrics computed in ``work`` precision, ``None`` if a float32 sum overflowed.

    Inputs of 32 bits or fewer are compared in float32, which holds them exactly: the
    difference of two float32 values is rounded once (relative 6e-8), and the sums of
    squares are cascade sums (relative ~1e-7, where float64 conversions of both tensors
    cost three times as long: 150 ms against 50 for a pair of 32 MB logits).
    """
    r = reference.detach().to("cpu", work)
    c = candidate.detach().to("cpu", work)
    numel = r.numel()
    rtol, atol = ALLCLOSE.get(dtype or candidate.dtype, ALLCLOSE[torch.float32])
    diff = c - r
    # Sums of squares, not torch.linalg.vector_norm: its float32 CPU reduction is not a
    # cascade sum (relative error 3e-4 over 8M elements, against 2e-8 here). NaN and Inf
    # propagate into them: finite sums on all three mean no element to mask.
    squares = [float(x.square().sum()) for x in (r, c, diff)]
    finite = all(math.isfinite(v) for v in squares)
    if not finite:
        fin_r, fin_c = torch.isfinite(r), torch.isfinite(c)
        if bool(fin_r.all()) and bool(fin_c.all()):
            if work == torch.float32:
                return None  # finite values whose float32 squares overflowed: retry in float64
            finite = True  # beyond float64 too (|x| > 1e154): the norms are infinite
    if finite:
        nonfinite_ref = nonfinite_cand = 0
        abs_diff = diff.abs()
        # torch.isclose's rule, |c - r| <= atol + rtol * |r|, on the difference at hand.
        mismatched = int((abs_diff > r.abs().mul_(rtol).add_(atol)).sum())
    else:
        nonfinite_ref = int((~fin_r).sum())
        nonfinite_cand = int((~fin_c).sum())
        mismatched = int((~torch.isclose(c, r, rtol=rtol, atol=atol, equal_nan=True)).sum())
        same_pattern = bool(torch.equal(fin_r, fin_c)) and bool(
            torch.equal(r[~fin_r].nan_to_num(0.0, 1.0, -1.0), c[~fin_c].nan_to_num(0.0, 1.0, -1.0))
        )
        if not same_pattern:
            return Metrics(math.inf, math.inf, math.nan, -math.inf, nonfinite_ref, nonfinite_cand, mismatched, numel, math.inf)
        # Identical non-finite pattern on both sides: compare the finite elements.
        r, c = r[fin_r], c[fin_c]
        diff = c - r
        abs_diff = diff.abs()
        squares = [float(x.square().sum()) for x in (r, c, diff)]
        if work == torch.float32 and not all(math.isfinite(v) for v in squares):
            return None
    max_abs = float(abs_diff.max()) if abs_diff.numel() else 0.0
    return _from_sums(*squares, max_abs, nonfinite_ref, nonfinite_cand, mismatched, numel)


def _rel_l2(ss_r: float, ss_d: float) -> float:
    norm_r, norm_d = math.sqrt(ss_r), math.sqrt(ss_d)
    if norm_r > 0:
        return norm_d / norm_r
    return 0.0 if norm_d == 0 else math.inf


def _from_sums(
    ss_r: float, ss_c: float, ss_d: float, max_abs: float, nonfinite_ref: int, nonfinite_cand: int, mismatched: int, numel: int
) -> Metrics:
    """The metrics from the sums of squares of the reference, the candidate and their difference."""
    squares = (ss_r, ss_c, ss_d)
    norm_r, norm_c, norm_d = (math.sqrt(v) for v in squares)
    rel_l2 = _rel_l2(ss_r, ss_d)
    if norm_r > 0 and norm_c > 0:
        # From the three norms (law of cosines): no dot product to accumulate.
        cosine = max(-1.0, min(1.0, (squares[0] + squares[1] - squares[2]) / (2 * norm_r * norm_c)))
    else:
        cosine = 1.0 if norm_r == norm_c else 0.0
    sqnr_db = math.inf if norm_d == 0 else (20 * math.log10(norm_r / norm_d) if norm_r > 0 else -math.inf)
    return Metrics(rel_l2, max_abs, cosine, sqnr_db, nonfinite_ref, nonfinite_cand, mismatched, numel, norm_d)


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """A dense tensor's bytes as 64-bit words (a view), for comparing bits: a third of the
    time of comparing 16-bit elements (2 ms against 5 for bfloat16 logits); ``None`` when
    they are not whole aligned words in one block of memory."""
    size = t.element_size()
    if t.is_quantized or not t.is_contiguous() or not t.numel() or (t.numel() * size) % 8 or (t.storage_offset() * size) % 8:
        return None
    return t.reshape(-1).view(torch.uint8).view(torch.int64)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two sets of activations are the same bit for bit: names, dtypes, shapes,
    devices and every bit (NaN payloads and signed zeros included).

    A module experiment feeds the candidate's module the reference's activations with the
    candidate's own other arguments. When those activations are the ones the candidate's
    module received in its own forward, the experiment is that call again, and its
    recorded output is the answer: until the first difference (a same-dtype port, a fused
    kernel in one place) no module is run a second time.
    """
    if not a or a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device or x.is_complex():
            return False
        words = _words(x), _words(y)
        if words[0] is not None and words[1] is not None:
            x, y = words
        elif x.is_floating_point():
            if x.element_size() not in _SAME_SIZE_INTS:
                return False
            ints = _SAME_SIZE_INTS[x.element_size()]
            x, y = x.view(ints), y.view(ints)
        if not torch.equal(x, y):
            return False
    return True
