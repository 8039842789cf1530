"""Conversion mistakes inside a fused ``wqkv`` (samples/fused_port.py, a Meta-style port
converted from HF): blamed on their block's attention, and the fused tensor said to hold
what it holds — q's and k's rows permuted as a rotary conversion permutes them (told per
part, as :func:`~blockdiff.conversion.explain` tells it for a separate weight), k's and
v's biases swapped in the fused bias."""

from __future__ import annotations

import pytest
import torch

from blockdiff import diff
from blockdiff.conversion import explain, fused_parts
from tests.conftest import blamed

pytest.importorskip("transformers")

ROTARY = ("is the reference's with its rows permuted the way a rotary conversion permutes q and k: "
          "in each head of 16 rows, its two halves interleaved (rows 0, 8, 1, 9, ...)")


def _diagnosed(report) -> list[str]:
    first = report.first_divergence
    assert blamed(report) == ("block", 1, "attention")
    assert first.module == "model.layers.1.attention"
    assert [d.where for d in report.divergences] == [first.where]  # the other blocks are right
    found = first.check.details["conversion"]
    assert any(f"{first.where}: its weights — " in note and found[0] in note for note in report.notes)
    assert found[0] in first.headline()
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rows_permuted_for_rotary_inside_fused_qkv_are_named_per_part(dtype, ids):
    from samples import fused_port

    report = diff(fused_port.reference(), fused_port.qk_rotary_permuted_in_fused_qkv(block=1).to(dtype), ids)
    assert _diagnosed(report) == [
        "model.layers.1.attention.wqkv.weight differs from the reference's q_proj.weight, k_proj.weight, "
        "v_proj.weight concatenated, in the part of q_proj.weight, k_proj.weight: its parts of q_proj.weight, "
        f"k_proj.weight each {ROTARY}"
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_biases_swapped_inside_fused_qkv_bias_are_named(dtype, ids):
    from samples import fused_port

    report = diff(fused_port.reference_qkv_bias(), fused_port.kv_bias_swapped_in_fused_qkv(block=1).to(dtype), ids)
    assert _diagnosed(report) == [
        "model.layers.1.attention.wqkv.bias holds the reference's q_proj.bias, v_proj.bias, k_proj.bias "
        "in that order (expected q_proj.bias, k_proj.bias, v_proj.bias)"
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clean_fused_port_with_qkv_bias_blames_nothing(dtype, ids):
    from samples import fused_port

    report = diff(fused_port.reference_qkv_bias(), fused_port.port_qkv_bias().to(dtype), ids)
    assert report.first_divergence is None and "conversion" not in report.note_codes


def test_explain_names_the_rotary_permutation_of_q_or_k_rows():
    from samples.fused_port import gguf_rotary_order

    torch.manual_seed(0)
    q, k = torch.randn(64, 8), torch.randn(32, 8)
    assert explain(gguf_rotary_order(q, 4), q, {}) == ROTARY
    assert explain(gguf_rotary_order(k, 2), k, {}) == ROTARY
    back = q.view(4, 8, 2, 8).transpose(1, 2).reshape(64, 8)  # pairs to halves: HF's own conversion
    assert explain(back, q, {}) == ("is the reference's with its rows permuted the way a rotary conversion permutes "
                                    "q and k: in each head of 16 rows, its even rows, then its odd ones (rows 0, 2, 4, 6, ...)")
    swapped = q[[1, 0, *range(2, 64)]]  # some other permutation: only the hint
    assert explain(swapped, q, {}) == "is the reference's with its rows permuted (a q/k head interleave of a rotary conversion?)"


def test_fused_parts_explains_each_wrong_part_and_reads_fused_biases():
    from samples.fused_port import gguf_rotary_order

    torch.manual_seed(0)
    q, k, v, o = torch.randn(32, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 32)
    bq, bk, bv = torch.randn(32), torch.randn(16), torch.randn(16)
    split = {"q.weight": q, "q.bias": bq, "k.weight": k, "k.bias": bk, "v.weight": v, "v.bias": bv, "o.weight": o}
    others = {f"layers.0.{n}": w for n, w in split.items()}
    whole = "differs from the reference's q.weight, k.weight, v.weight concatenated, in the part of"
    assert fused_parts(torch.cat([q, gguf_rotary_order(k, 1), v]), split, others=others) == (
        f"{whole} k.weight: its part of k.weight " + ROTARY)
    assert fused_parts(torch.cat([q, v, v]), split, others=others) == (
        f"{whole} k.weight: its part of k.weight equals the reference's layers.0.v.weight")
    assert fused_parts(torch.cat([q, k, v * 3]), split, others=others) == (
        f"{whole} v.weight: its part of v.weight is the reference's scaled by 3")
    # every part wrong, each told what it is: still the fusion of these parts
    assert fused_parts(torch.cat([q, k, v]) * 2, split, others=others) == (
        f"{whole} q.weight, k.weight, v.weight: its parts of q.weight, k.weight, v.weight each is the reference's scaled by 2")
    # biases: against the split ones' biases, never a weight's rows
    assert fused_parts(torch.cat([bq, bk, bv]), split) is None
    assert fused_parts(torch.cat([bq, bv, bk]), split) == (
        "holds the reference's q.bias, v.bias, k.bias in that order (expected q.bias, k.bias, v.bias)")
    assert fused_parts(torch.cat([bq, bk, -bv]), split, others=others) == (
        "differs from the reference's q.bias, k.bias, v.bias concatenated, in the part of v.bias: "
        "its part of v.bias is the reference's scaled by -1")
    assert fused_parts(torch.randn(32), split) is None  # the size of k and v together, and neither
