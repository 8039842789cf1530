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
