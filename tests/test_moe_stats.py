"""Tests for blockdiff.moe_stats: routing statistics with hand-computable answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from blockdiff import moe_stats
from blockdiff.moe_stats import Routing, agreement, moe_block_stats, side_stats

INF = float("inf")


def idx(rows) -> torch.Tensor:
    """[T, k] int64 indices from a list of lists (or a flat list for k = 1)."""
    t = torch.tensor(rows, dtype=torch.long)
    return t[:, None] if t.dim() == 1 else t


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=0.0)


def test_all_is_exactly_the_public_api():
    assert sorted(moe_stats.__all__) == sorted(
        ["Routing", "side_stats", "agreement", "moe_block_stats"]
    )


# --- entropy and load ---------------------------------------------------------------


def test_uniform_logits_have_entropy_ln_e():
    s = side_stats(Routing(torch.zeros(3, 4), idx([0, 1, 2])))
    assert s["routing_entropy"] == approx(math.log(4))
    assert s["routing_entropy_norm"] == approx(1.0)


def test_one_hot_like_logits_have_zero_entropy():
    logits = 1000.0 * torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 3]]
    s = side_stats(Routing(logits, idx([0, 1, 2, 3, 3])))
    assert s["routing_entropy"] == 0.0
    assert s["routing_entropy_norm"] == 0.0


def test_routing_entropy_is_mean_over_tokens():
    # token 0: p = [1/4, 3/4]; token 1: uniform over E = 2 -> ln 2.
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)
    s = side_stats(Routing(logits, idx([1, 0])))
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert s["routing_entropy"] == approx((h0 + math.log(2)) / 2)
    assert s["routing_entropy_norm"] == approx((h0 + math.log(2)) / 2 / math.log(2))


def test_low_precision_logits_are_converted_to_float64():
    logits = torch.tensor([[0.0, 1.0, -2.0], [0.5, 0.25, 0.0]])
    exact = side_stats(Routing(logits.double(), idx([1, 0])))
    half = side_stats(Routing(logits.to(torch.bfloat16), idx([1, 0])))
    # bf16 holds these values exactly, so float64 math must give identical numbers.
    assert half["routing_entropy"] == exact["routing_entropy"]


def test_counts_and_load_statistics():
    s = side_stats(Routing(torch.zeros(6, 4), idx([0, 0, 1, 3, 3, 3])))
    assert s["tokens"] == 6 and s["experts"] == 4 and s["top_k"] == 1
    assert s["counts"] == [2, 1, 0, 3]
    q = [2 / 6, 1 / 6, 0.0, 3 / 6]
    h = -sum(x * math.log(x) for x in q if x > 0)
    assert s["load_entropy"] == approx(h / math.log(4))
    assert s["effective_experts"] == approx(math.exp(h))
    assert s["max_load"] == approx(0.5)
    assert s["min_load"] == 0.0


def test_balanced_load_counts_every_expert_k2():
    s = side_stats(Routing(torch.zeros(4, 4), idx([[0, 1], [2, 3], [1, 0], [3, 2]])))
    assert s["counts"] == [2, 2, 2, 2]
    assert s["load_entropy"] == approx(1.0)
    assert s["effective_experts"] == approx(4.0)
    assert s["max_load"] == s["min_load"] == 0.25


def test_all_to_one_expert_has_one_effective_expert():
    s = side_stats(Routing(torch.zeros(5, 3), idx([2] * 5)))
    assert s["counts"] == [0, 0, 5]
    assert s["load_entropy"] == 0.0
    assert s["effective_experts"] == 1.0
    assert s["max_load"] == 1.0 and s["min_load"] == 0.0


def test_int32_indices_are_accepted():
    a = side_stats(Routing(torch.zeros(3, 3), idx([0, 2, 2])))
    b = side_stats(Routing(torch.zeros(3, 3), idx([0, 2, 2]).to(torch.int32)))
    assert a == b


# --- capacity -------------------------------------------------------------------------


def test_model_capacity_drops_late_tokens():
    s = side_stats(Routing(torch.zeros(8, 2), idx([0] * 8), capacity=3))
    assert s["capacity"] == 3
    assert s["dispatch"] == "simulated"
    assert s["counts"] == [8, 0]
    assert s["counts_after"] == [3, 0]
    assert s["assignment_drop_rate"] == 5 / 8
    assert s["token_drop_rate"] == 5 / 8
    assert s["simulated_matches_model"] is None
    assert s["counterfactual"] is None


def test_first_come_is_token_major_for_k2():
    # C = 1. Token 0 arrives first and takes both experts, so token 1 loses both.
    # A slot-major order (all first choices before second choices) would drop no token.
    r = Routing(torch.zeros(2, 2), idx([[0, 1], [1, 0]]), capacity=1)
    s = side_stats(r)
    assert s["counts_after"] == [1, 1]
    assert s["assignment_drop_rate"] == 0.5
    assert s["token_drop_rate"] == 0.5


def test_first_come_drops_only_the_overflow_k2():
    # Expert 1 is asked for by tokens 0, 1, 2; with C = 2 only token 2's slot is dropped.
    s = side_stats(Routing(torch.zeros(3, 3), idx([[0, 1], [1, 2], [2, 1]]), capacity=2))
    assert s["counts"] == [1, 3, 2]
    assert s["counts_after"] == [1, 2, 2]
    assert s["assignment_drop_rate"] == 1 / 6
    assert s["token_drop_rate"] == 0.0


def test_first_come_is_by_position_checked_against_kept():
    logits, indices = torch.zeros(4, 2), idx([1, 0, 0, 0])
    by_position = torch.tensor([[True], [True], [True], [False]])
    other = torch.tensor([[True], [False], [True], [True]])
    s = side_stats(Routing(logits, indices, capacity=2, kept=by_position))
    assert s["simulated_matches_model"] is True
    s = side_stats(Routing(logits, indices, capacity=2, kept=other))
    assert s["simulated_matches_model"] is False


def test_kept_overrides_the_simulation():
    # The model kept first choices first (slot-major): no token lost, unlike first-come.
    kept = torch.tensor([[True, False], [True, False]])
    s = side_stats(Routing(torch.zeros(2, 2), idx([[0, 1], [1, 0]]), capacity=1, kept=kept))
    assert s["dispatch"] == "model"
    assert s["counts_after"] == [1, 1]
    assert s["assignment_drop_rate"] == 0.5
    assert s["token_drop_rate"] == 0.0
    assert s["simulated_matches_model"] is False

    kept = torch.tensor([[True, True], [False, False]])
    s = side_stats(Routing(torch.zeros(2, 2), idx([[0, 1], [1, 0]]), capacity=1, kept=kept))
    assert s["token_drop_rate"] == 0.5
    assert s["simulated_matches_model"] is True


def test_kept_on_a_dropless_model():
    kept = torch.tensor([[True], [False], [True]])
    s = side_stats(Routing(torch.zeros(3, 2), idx([0, 1, 1]), kept=kept))
    assert s["capacity"] is None
    assert s["counts_after"] == [1, 1]
    assert s["assignment_drop_rate"] == 1 / 3
    assert s["token_drop_rate"] == 1 / 3
    assert s["simulated_matches_model"] is False  # dropless should keep everything
    s = side_stats(Routing(torch.zeros(3, 2), idx([0, 1, 1]), kept=torch.ones(3, 1).bool()))
    assert s["simulated_matches_model"] is True


def test_dropless_model_drops_nothing_and_reports_counterfactuals():
    # T = 5, E = 2, k = 1: T·k/E = 2.5, so C = ceil(2.5) = 3 and ceil(3.125) = 4.
    s = side_stats(Routing(torch.zeros(5, 2), idx([0] * 5)))
    assert s["capacity"] is None
    assert s["dispatch"] == "dropless"
    assert s["counts_after"] == [5, 0]
    assert s["assignment_drop_rate"] == 0.0 and s["token_drop_rate"] == 0.0
    assert s["counterfactual"] == {
        "1.0": {
            "capacity": 3,
            "counts_after": [3, 0],
            "assignment_drop_rate": 2 / 5,
            "token_drop_rate": 2 / 5,
        },
        "1.25": {
            "capacity": 4,
            "counts_after": [4, 0],
            "assignment_drop_rate": 1 / 5,
            "token_drop_rate": 1 / 5,
        },
    }


def test_counterfactual_capacity_counts_top_k_assignments():
    # T = 4, E = 3, k = 2: T·k/E = 8/3, so C = ceil(8/3) = 3, ceil(10/3) = 4, ceil(16/3) = 6.
    r = Routing(torch.zeros(4, 3), idx([[0, 1]] * 4))
    cf = side_stats(r, capacity_factors=(1.0, 1.25, 2))["counterfactual"]
    assert [cf[key]["capacity"] for key in ("1.0", "1.25", "2.0")] == [3, 4, 6]
    assert cf["1.0"]["counts_after"] == [3, 3, 0]
    assert cf["1.0"]["assignment_drop_rate"] == 2 / 8
    assert cf["1.0"]["token_drop_rate"] == 1 / 4  # token 3 loses both experts
    assert cf["1.25"]["counts_after"] == [4, 4, 0]
    assert cf["1.25"]["assignment_drop_rate"] == 0.0


# --- agreement ------------------------------------------------------------------------


def test_flips_binned_by_reference_margin():
    # E = 3, k = 1; the runner-up logit is 0 so each margin is the top logit exactly.
    tops = [0.0005, 0.001, 0.05, 0.1, 5.0, 0.0]
    ref_logits = torch.tensor([[m, 0.0, -1.0] for m in tops], dtype=torch.float64)
    ref = Routing(ref_logits, idx([0] * 6))
    cand = Routing(ref_logits.clone(), idx([1, 0, 1, 2, 0, 0]))
    a = agreement(ref, cand)
    assert a["tokens"] == 6 and a["top_k"] == 1
    assert a["topk_agreement"] == 0.5
    assert a["top1_agreement"] == 0.5
    assert a["mean_overlap"] == 0.5
    assert a["flipped_tokens"] == [0, 2, 3]
    assert a["flip_margins"] == [0.0005, 0.05, 0.1]
    assert a["flips_by_margin"] == [
        {"low": 0.0, "high": 0.001, "tokens": 2, "flipped": 1},  # 0.0005 and the tie
        {"low": 0.001, "high": 0.01, "tokens": 1, "flipped": 0},  # lower edge is in
        {"low": 0.01, "high": 0.1, "tokens": 1, "flipped": 1},
        {"low": 0.1, "high": 1.0, "tokens": 1, "flipped": 1},
        {"low": 1.0, "high": None, "tokens": 1, "flipped": 0},
    ]


def test_custom_margin_bins_and_k2_margin():
    # k = 2: margin is z_(2) - z_(3) of the reference logits, whatever indices say.
    ref_logits = torch.tensor(
        [[3.0, 2.0, 0.0, -1.0], [0.0, 3.5, 4.0, 3.75], [3.0, 0.0, 2.0, 1.5]],
        dtype=torch.float64,
    )
    ref = Routing(ref_logits, idx([[0, 1], [2, 3], [0, 2]]))
    cand = Routing(ref_logits, idx([[1, 0], [2, 3], [0, 3]]))
    a = agreement(ref, cand, margin_bins=(0.0, 1.0, INF))
    assert a["topk_agreement"] == approx(2 / 3)  # order inside the set is ignored
    assert a["top1_agreement"] == approx(2 / 3)  # token 0: 0 vs 1
    assert a["mean_overlap"] == approx((1 + 1 + 0.5) / 3)
    assert a["flipped_tokens"] == [2]
    assert a["flip_margins"] == [0.5]
    assert a["flips_by_margin"] == [
        {"low": 0.0, "high": 1.0, "tokens": 2, "flipped": 1},  # margins 0.25 and 0.5
        {"low": 1.0, "high": None, "tokens": 1, "flipped": 0},  # margin 2.0
    ]


def test_k_equal_e_has_infinite_margin_and_no_flips():
    ref = Routing(torch.randn(3, 2), idx([[0, 1], [1, 0], [0, 1]]))
    cand = Routing(torch.randn(3, 2), idx([[1, 0], [1, 0], [0, 1]]))
    a = agreement(ref, cand)
    assert a["topk_agreement"] == 1.0
    assert a["top1_agreement"] == approx(2 / 3)
    assert a["flipped_tokens"] == [] and a["flip_margins"] == []
    assert a["flips_by_margin"][-1] == {"low": 1.0, "high": None, "tokens": 3, "flipped": 0}
    assert sum(b["tokens"] for b in a["flips_by_margin"]) == 3


def test_load_delta_by_hand():
    logits = torch.zeros(2, 2)
    a = agreement(Routing(logits, idx([0, 0])), Routing(logits, idx([0, 1])))
    assert a["load_delta"] == 0.5
    a = agreement(Routing(logits, idx([0, 0])), Routing(logits, idx([1, 1])))
    assert a["load_delta"] == 1.0


def test_mean_kl_is_zero_for_identical_logits_and_uses_0_log_0():
    logits = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    a = agreement(Routing(logits, idx([0])), Routing(logits.clone(), idx([0])))
    assert a["mean_kl"] == 0.0
    # p_r = [1, 0], p_c = [1/2, 1/2]: KL = ln 2; the p_r = 0 term must count 0, not NaN.
    ref = Routing(torch.tensor([[0.0, -INF]], dtype=torch.float64), idx([0]))
    cand = Routing(torch.tensor([[0.0, 0.0]], dtype=torch.float64), idx([0]))
    assert agreement(ref, cand)["mean_kl"] == approx(math.log(2))


def _np_softmax_log(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_load_delta_and_mean_kl_match_direct_float64_formulas():
    g = torch.Generator().manual_seed(0)
    t, e, k = 32, 6, 2
    zr = torch.randn(t, e, generator=g, dtype=torch.float64)
    zc = zr + 0.7 * torch.randn(t, e, generator=g, dtype=torch.float64)
    ir, ic = zr.topk(k).indices, zc.topk(k).indices
    a = agreement(Routing(zr.float(), ir), Routing(zc.float(), ic))

    # Independent numpy float64 versions (from the float32 logits the sides were given).
    nr, nc = zr.float().double().numpy(), zc.float().double().numpy()
    fr = np.bincount(ir.numpy().ravel(), minlength=e) / (t * k)
    fc = np.bincount(ic.numpy().ravel(), minlength=e) / (t * k)
    lr, lc = _np_softmax_log(nr), _np_softmax_log(nc)
    kl = (np.exp(lr) * (lr - lc)).sum(axis=1).mean()
    assert a["load_delta"] == approx(0.5 * np.abs(fr - fc).sum())
    assert a["mean_kl"] == approx(float(kl))
    assert a["mean_kl"] > 0.01  # the sides really differ

    sets_r = [set(row) for row in ir.tolist()]
    sets_c = [set(row) for row in ic.tolist()]
    same = [sr == sc for sr, sc in zip(sets_r, sets_c)]
    assert a["topk_agreement"] == approx(sum(same) / t)
    assert a["mean_overlap"] == approx(sum(len(sr & sc) for sr, sc in zip(sets_r, sets_c)) / (t * k))
    assert a["flipped_tokens"] == [i for i, s in enumerate(same) if not s]
    zs = np.sort(nr, axis=1)[:, ::-1]
    assert a["flip_margins"] == [approx(zs[i, k - 1] - zs[i, k]) for i in a["flipped_tokens"]]


# --- the block entry point and the output format --------------------------------------


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_plain(v) for v in x)
    return x is None or type(x) in (bool, int, float, str)


def test_moe_block_stats_combines_both_sides_and_is_plain_json():
    g = torch.Generator().manual_seed(1)
    zr = torch.randn(10, 4, generator=g)
    zc = zr + 0.3 * torch.randn(10, 4, generator=g)
    ref = Routing(zr, zr.topk(2).indices)
    cand = Routing(zc.to(torch.bfloat16), zc.topk(2).indices, capacity=4)
    out = moe_block_stats(ref, cand)
    assert set(out) == {"reference", "candidate", "agreement"}
    assert out["reference"] == side_stats(ref)
    assert out["candidate"] == side_stats(cand)
    assert out["agreement"] == agreement(ref, cand)
    assert _plain(out)
    text = json.dumps(out, allow_nan=False)
    assert json.loads(text) == out


# --- errors ---------------------------------------------------------------------------

Z = torch.zeros


@pytest.mark.parametrize(
    ("ref", "cand", "match"),
    [
        (Routing(Z(4, 3), idx([0] * 4)), Routing(Z(5, 3), idx([0] * 5)),
         r"logits: candidate has shape \[5,3\], reference \[4,3\]"),
        (Routing(Z(4, 3), idx([0] * 4)), Routing(Z(4, 2), idx([0] * 4)),
         r"logits: candidate has shape \[4,2\], reference \[4,3\]"),
        (Routing(Z(4, 3), idx([0] * 4)), Routing(Z(4, 3), idx([[0, 1]] * 4)),
         r"indices: candidate has shape \[4,2\], reference \[4,1\]"),
        (Routing(Z(4, 3), idx([0, 1, 3, 0])), Routing(Z(4, 3), idx([0] * 4)),
         r"reference routing: expert indices should lie in \[0, 3\), found 3 at token 2"),
        (Routing(Z(4, 3), idx([0] * 4)), Routing(Z(4, 3), idx([0, -1, 0, 0])),
         r"candidate routing: expert indices should lie in \[0, 3\), found -1 at token 1"),
        (Routing(Z(4, 3), idx([0] * 3)), Routing(Z(4, 3), idx([0] * 4)),
         r"indices should have shape \[T=4, k\], found \[3,1\]"),
    ],
)
def test_mismatched_or_invalid_sides_raise_value_error(ref, cand, match):
    with pytest.raises(ValueError, match=match):
        agreement(ref, cand)
    with pytest.raises(ValueError, match=match):
        moe_block_stats(ref, cand)


@pytest.mark.parametrize(
    ("routing", "match"),
    [
        (Routing(Z(4), idx([0] * 4)), r"logits should have shape \[T, E\], found \[4\]"),
        (Routing(Z(0, 3), idx([]).reshape(0, 1)), r"no tokens"),
        (Routing(Z(2, 1), idx([0, 0])), r"at least 2 experts, found E=1"),
        (Routing(Z(2, 2), idx([[0, 1, 0]] * 2)), r"1 <= k <= E=2, found k=3"),
        (Routing(Z(2, 3), idx([[0, 1], [2, 2]])), r"distinct experts .* found \[2, 2\] at token 1"),
        (Routing(Z(2, 3), torch.zeros(2, 1)), r"integer tensor, found torch.float32"),
        (Routing(Z(2, 3), idx([0, 1]), capacity=-1), r"non-negative int or None, found -1"),
        (Routing(Z(2, 3), idx([0, 1]), kept=torch.ones(2, 2).bool()),
         r"kept should have the shape of indices \[2,1\], found \[2,2\]"),
        (Routing(Z(2, 3), idx([0, 1]), kept=torch.ones(2, 1)), r"kept should be a bool tensor"),
    ],
)
def test_invalid_routing_raises_value_error(routing, match):
    with pytest.raises(ValueError, match=match):
        side_stats(routing)


def test_invalid_options_raise_value_error():
    r = Routing(Z(2, 3), idx([0, 1]))
    with pytest.raises(ValueError, match="positive numbers, found 0"):
        side_stats(r, capacity_factors=(1.0, 0))
    with pytest.raises(ValueError, match="strictly increasing"):
        agreement(r, r, margin_bins=(0.0, 1.0, 0.5))
    with pytest.raises(ValueError, match="at least 2 edges"):
        agreement(r, r, margin_bins=(0.0,))


def test_capacity_applies_per_group_when_asked():
    """Two sequences of 4 tokens, all routed to expert 0, capacity 3 per sequence: each
    sequence keeps its first 3 tokens and drops its last."""
    logits = torch.tensor([[2.0, 0.0]] * 8)
    indices = torch.zeros(8, 1, dtype=torch.long)
    stats = side_stats(Routing(logits, indices, capacity=3, groups=2))
    assert stats["counts_after"] == [6, 0]
    assert stats["assignment_drop_rate"] == 2 / 8
    kept = torch.tensor([[True], [True], [True], [False]] * 2)
    assert side_stats(Routing(logits, indices, capacity=3, kept=kept, groups=2))["simulated_matches_model"] is True
    with pytest.raises(ValueError, match="groups must divide"):
        side_stats(Routing(logits, indices, capacity=3, groups=3))
