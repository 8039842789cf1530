"""Batch invariance: each row alone against the same row inside a batch, bit for bit; a
planted bug that makes a row depend on the others is named at its block, sub-path and
child module, and a model that is invariant reports nothing."""

from __future__ import annotations

import json

import pytest

from blockdiff import InputError, Report
from blockdiff.modes.invariance import invariance
from tests.conftest import run_cli

pytest.importorskip("transformers")

BUGS = "samples/invariance_bugs.py"
# bug → (block, sub-path, module blamed, first divergent child or None, extra CLI options).
PLANTED = {
    "norm_over_batch": (1, "norm", "blocks.1.ffn_norm", None, []),
    "matmul_split_by_rows": (1, "ffn", "blocks.1.ffn", "blocks.1.ffn.down_proj", []),
    # Hugging Face's attention with a padding mask is not bit-exact to the row alone
    # (1e-7 in float32, 1e-3 in bfloat16, measured: docs/invariance.md): the bound keeps
    # that apart from a mask that is missing (0.75).
    "ignores_padding_mask": (0, "attention", "model.layers.0.self_attn", None, ["--padding", "left", "--tol", "0.01"]),
    "moe_capacity": (0, "ffn", "blocks.0.ffn", None, []),
}


def blamed(data: dict) -> tuple:
    first = data["first_divergence"]
    return (first["block"], first["subpath"], first["module"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_dependence_on_the_batch_is_named_through_the_cli(bug, dtype, tmp_path, capsys):
    block, subpath, module, child, extra = PLANTED[bug]
    code, out, err = run_cli(
        ["invariance", f"{BUGS}:{bug}", "--batch", "4", "--dtype", dtype, "--json", str(tmp_path / "r.json"), *extra], capsys
    )
    assert code == 1, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert blamed(data) == (block, subpath, module)
    report = Report.from_dict(data)
    first = report.first_divergence
    if child is not None:  # the drill-down names the operation
        assert first.check.first_child.module == child
        assert f"first divergent child: {child}" in out
    else:
        assert not any(c.diverged for c in first.check.children or [])
    site = next(s for s in data["invariance"]["sites"] if s["module"] == module)
    assert site["rows"] and site["largest"] > 0
    if bug == "ignores_padding_mask":  # only the padded rows (the first holds every token)
        assert site["rows"] == [1, 2, 3]
    if bug == "moe_capacity":  # the router agrees; the capacity is named
        assert first.check.part == "experts"
        assert any(n.startswith("block 0 ffn: its expert capacity (blocks.0.ffn.capacity) is 4 for a row alone") for n in report.notes)
    assert data["invariance"]["batch"] == 4 and data["invariance"]["rows"] == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_that_is_invariant_reports_nothing(dtype, tmp_path, capsys):
    code, out, err = run_cli(["invariance", "samples/tinylm.py:build", "--batch", "4", "--dtype", dtype], capsys)
    assert code == 0, out + err
    assert "No divergence" in out and "bit-exact (threshold 0)" in " ".join(out.split())
    # Padded on either side, a row's real tokens are what it computes alone (within the
    # bound Hugging Face's masked attention keeps).
    for side in ("left", "right"):
        report = invariance("samples/hf_llama.py:build", batch=4, padding=side, tolerance=0.01)
        assert report.first_divergence is None and report.invariance["padding"] == side


def test_rows_lengths_and_the_report_round_trip(tmp_path):
    report = invariance(f"{BUGS}:ignores_padding_mask", batch=3, seq=8, rows=[2], padding="right", lengths=[8, 8, 5])
    assert report.invariance["rows"] == [2] and report.invariance["lengths"] == [8, 8, 5]
    back = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.invariance == report.invariance and back.to_dict() == report.to_dict()


def test_the_assertion_names_the_operation_and_passes_an_invariant_model():
    from blockdiff import DivergenceError, assert_batch_invariant

    assert assert_batch_invariant("samples/tinylm.py:build", batch=2).first_divergence is None
    with pytest.raises(DivergenceError, match=r"block 1 norm \(blocks.1.ffn_norm\)"):
        assert_batch_invariant(f"{BUGS}:norm_over_batch", batch=2)


def test_invariance_refuses_what_it_cannot_do(capsys):
    with pytest.raises(InputError, match="takes no attention_mask"):
        invariance("samples/tinylm.py:build", batch=2, padding="left")
    with pytest.raises(InputError, match="--rows must name rows of the batch"):
        invariance("samples/tinylm.py:build", batch=2, rows=[5])
    with pytest.raises(InputError, match="need --padding"):
        invariance("samples/tinylm.py:build", batch=2, seq=4, lengths=[4, 3])
    code, out, err = run_cli(["invariance", "samples/tinylm.py:build", "--batch", "1"], capsys)
    assert code == 2 and "--batch" in err
    code, out, err = run_cli(["invariance", "samples/tinylm.py:build", "--rows", "a"], capsys)
    assert code == 2 and "expected whole numbers" in err
