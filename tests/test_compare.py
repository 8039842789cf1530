"""Metrics of one tensor pair: hand-computable cases and agreement with float64 math."""

import math

import pytest
import torch

from blockdiff.compare import metrics


def _float64_reference(r: torch.Tensor, c: torch.Tensor) -> tuple[float, float, float]:
    r, c = r.double().flatten(), c.double().flatten()
    norm_r, norm_c = float(r.norm()), float(c.norm())
    return float((c - r).norm()) / norm_r, float((c - r).abs().max()), float(r @ c) / (norm_r * norm_c)


def test_hand_computed_values():
    m = metrics(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))
    assert m.rel_l2 == pytest.approx(0.5 / 5.0, rel=1e-7)
    assert m.max_abs == 0.5
    assert m.cosine == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)), rel=1e-7)
    assert m.sqnr_db == pytest.approx(20 * math.log10(10.0), rel=1e-7)
    assert (m.mismatched, m.numel, m.nonfinite_ref, m.nonfinite_cand) == (1, 2, 0, 0)
    same = metrics(torch.ones(4), torch.ones(4))
    assert (same.rel_l2, same.max_abs, same.cosine, same.sqnr_db) == (0.0, 0.0, 1.0, math.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-7, 1e-3, 0.5])
def test_large_tensors_agree_with_float64(dtype, scale):
    gen = torch.Generator().manual_seed(0)
    r = (torch.randn(2_000_000, generator=gen) * 3 + 1).to(dtype)
    c = (r.float() + scale * torch.randn(2_000_000, generator=gen)).to(dtype)
    rel_l2, max_abs, cosine = _float64_reference(r, c)
    m = metrics(r, c)
    assert m.rel_l2 == pytest.approx(rel_l2, rel=1e-5)
    assert m.max_abs == pytest.approx(max_abs, rel=1e-6)
    assert m.cosine == pytest.approx(cosine, abs=1e-6) and -1.0 <= m.cosine <= 1.0


def test_float64_inputs_keep_float64_precision():
    r = torch.randn(10_000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c = r + 1e-12 * torch.randn(10_000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert metrics(r, c).rel_l2 == pytest.approx(_float64_reference(r, c)[0], rel=1e-9)


def test_values_whose_squares_overflow_float32_are_measured_in_float64():
    r = torch.full((1000,), 3e19)
    c = r.clone()
    c[0] = 3.3e19
    m = metrics(r, c)
    assert m.rel_l2 == pytest.approx(0.3e19 / (3e19 * math.sqrt(1000)), rel=1e-6)
    assert math.isfinite(m.sqnr_db)


def test_same_nonfinite_pattern_compares_the_finite_rest():
    r = torch.tensor([1.0, float("nan"), 2.0, float("inf")])
    c = torch.tensor([1.0, float("nan"), 2.5, float("inf")])
    m = metrics(r, c)
    assert m.rel_l2 == pytest.approx(0.5 / math.sqrt(5), rel=1e-7)
    assert (m.nonfinite_ref, m.nonfinite_cand) == (2, 2)
    other = metrics(r, torch.tensor([1.0, 0.0, 2.0, float("inf")]))
    assert other.rel_l2 == math.inf and (other.nonfinite_ref, other.nonfinite_cand) == (2, 1)


def test_float64_values_beyond_the_range_of_their_squares_still_give_metrics():
    r = torch.full((4,), 1e200, dtype=torch.float64)
    m = metrics(r, r.clone())
    assert (m.nonfinite_ref, m.nonfinite_cand, m.max_abs) == (0, 0, 0.0)


def test_large_tensors_are_compared_chunk_by_chunk_as_the_whole_tensor_computation_does():
    from blockdiff.compare import CHUNK, _metrics

    gen = torch.Generator().manual_seed(3)
    r = torch.randn(3 * CHUNK + 7, generator=gen)
    c = (r + 1e-2 * torch.randn(r.shape, generator=gen)).bfloat16()
    whole = _metrics(r, c, torch.bfloat16, torch.float32)
    chunked = metrics(r, c, dtype=torch.bfloat16)
    assert chunked.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-6)
    assert chunked.cosine == pytest.approx(whole.cosine, abs=1e-9)
    assert (chunked.max_abs, chunked.mismatched, chunked.numel) == (whole.max_abs, whole.mismatched, whole.numel)
    assert chunked.mismatched > 0
    # NaN in one chunk: the whole-tensor path counts and masks them, as before.
    bad = c.clone()
    bad[CHUNK + 5] = float("nan")
    assert metrics(r, bad) == _metrics(r, bad, None, torch.float32)
    assert metrics(r, bad).nonfinite_cand == 1 and metrics(r, bad).rel_l2 == math.inf


@pytest.mark.parametrize("numel", [5, 1000, (1 << 18) + 3])
def test_a_floors_relative_l2_is_the_metrics_relative_l2(numel):
    from blockdiff.compare import rel_l2

    gen = torch.Generator().manual_seed(numel)
    r = torch.randn(numel, generator=gen)
    c = r + 1e-3 * torch.randn(numel, generator=gen)
    nan = c.clone()
    nan[1] = float("nan")
    same_nan = r.clone()
    same_nan[1] = nan[1] = float("nan")
    pairs = [
        (r, c), (r, c.bfloat16()), (r.double(), c.double()), (r, r.clone()), (torch.zeros(numel), c),
        (r, nan), (same_nan, nan), (r * 1e19, c * 1e19), (r * 1e30, c * 1e30),
    ]
    for a, b in pairs:
        expected, got = metrics(a, b).rel_l2, rel_l2(a, b)
        assert got == expected or (math.isnan(got) and math.isnan(expected)), (a.dtype, b.dtype, expected, got)


def test_rel_l2_is_never_reduced_across_ranks_even_when_its_sums_overflow():
    # In a sharded run metrics() goes through the stack's reducer (a collective); rel_l2 is
    # a rank's own floor, and its fallback for float32 sums that overflow runs on one rank
    # alone: were it reduced, that rank would wait for the others forever.
    from blockdiff import compare

    calls = []
    compare.ACROSS_RANKS.append(lambda found: calls.append(found) or found)
    try:
        big = torch.full((8,), 3e19)
        value = compare.rel_l2(big, big * 1.5)
        assert calls == []
        assert value == pytest.approx(0.5, rel=1e-6)
        compare.metrics(big, big)
        assert len(calls) == 1
    finally:
        compare.ACROSS_RANKS.pop()
