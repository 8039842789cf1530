"""Which layer hurts most: every check ranked over a baseline, children included."""

from __future__ import annotations

import json

import pytest
import torch

import blockdiff
from blockdiff import Report
from samples import quant
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def outlier_ranking():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return blockdiff.diff(quant.outlier(), quant.outlier_int8_dynamic(), ids, rank=True)


def test_the_outlier_layer_ranks_first_and_drills_to_its_projection(outlier_ranking):
    ranking = outlier_ranking.ranking
    assert (ranking[0]["block"], ranking[0]["subpath"], ranking[0]["child"]) == (2, "ffn", None)
    assert (ranking[1]["block"], ranking[1]["child"]) == (2, "blocks.2.ffn.down_proj")
    # Every other ffn loses far less: the outlier's layer stands out.
    others = [e["value"] for e in ranking if e["subpath"] == "ffn" and e["child"] is None and e["block"] != 2]
    assert ranking[0]["value"] > 2 * max(others)
    assert all(e["baseline"] == 1e-4 and e["ratio"] == pytest.approx(e["value"] / 1e-4) for e in ranking)
    assert [e["ratio"] for e in ranking] == sorted((e["ratio"] for e in ranking), reverse=True)


def test_a_baseline_of_another_precision(ids):
    report = blockdiff.diff(quant.outlier(), quant.outlier_int8_dynamic(), ids, rank=True, baseline_dtype=torch.bfloat16)
    top = report.ranking[0]
    assert (top["block"], top["child"]) == (2, "blocks.2.ffn.down_proj")
    assert 0 < top["baseline"] < 0.01 and report.tolerance["baseline"] == "bfloat16@cpu"
    # The baseline is the reference's own floor in bfloat16: every entry has one of its own.
    assert len({e["baseline"] for e in report.ranking}) > 10


def test_ranking_through_the_cli_and_the_json(tmp_path, capsys, outlier_ranking):
    args = ["diff", "samples/quant.py:outlier", "samples/quant.py:outlier_int8_dynamic", "--rank", "3", "--json", str(tmp_path / "r.json")]
    code, out, err = run_cli(args, capsys)
    assert code == 1, err  # the verdict still decides the exit code
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ranking: local error over each check's threshold"))
    assert lines[start + 1].split()[:4] == ["1.", "block", "2", "ffn"]
    assert "blocks.2.ffn.down_proj" in lines[start + 2]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ranking"][0]["module"] == "blocks.2.ffn"
    assert Report.from_dict(data).to_dict() == data
    code, _, err = run_cli(["diff", "samples/tinylm.py:build", "--baseline-dtype", "bfloat16"], capsys)
    assert code == 2 and "give --rank too" in err


def test_a_plain_diff_has_no_ranking(ids):
    report = blockdiff.diff(quant.outlier(), quant.outlier(), ids)
    assert report.ranking is None and "ranking" not in report.to_dict()


def test_the_report_names_the_quantization_it_sees(ids):
    report = blockdiff.diff(quant.outlier(), quant.outlier_int8_dynamic(), ids)
    assert report.candidate["quantization"] == "torch.ao dynamic quantized Linear in 29 modules"
    assert report.candidate["dtype"] == "float32" and "quantization" not in report.reference
    report = blockdiff.diff(quant.outlier(), quant.outlier_fp8(), ids)
    assert report.candidate["quantization"] == "float8_e4m3fn weights in 28 modules"


def test_torchao_int8_weight_only_ranks_the_outlier_layer_first(ids):
    pytest.importorskip("torchao")
    report = blockdiff.diff(quant.outlier(), quant.outlier_int8_weight_only(), ids, rank=True)
    assert report.candidate["quantization"] == "Int8Tensor weights in 29 modules"
    assert [(e["block"], e["subpath"], e["child"]) for e in report.ranking[:2]] == [(2, "ffn", None), (2, "ffn", "blocks.2.ffn.down_proj")]


class ScaledFFN(__import__("samples.tinylm", fromlist=["SwiGLU"]).SwiGLU):
    """The FFN's output times (1 + 1e-3): a known, linear error."""

    def forward(self, x):
        return super().forward(x) * 1.001


def test_the_error_budget_on_a_hand_computable_case(ids):
    from samples import tinylm

    candidate = tinylm.build()
    candidate.blocks[1].ffn.__class__ = ScaledFFN
    report = blockdiff.diff(tinylm.build(), candidate, ids, tolerance=blockdiff.Tolerance(overrides={"ffn": 1.0, "drift": 1.0, "block": 1.0}))
    block = report.blocks[1]
    # Only the FFN differs, and the block adds its output to the residual stream: all of
    # the block output's error is the FFN's, and it is exactly 1e-3 × ‖FFN output‖.
    assert block.budget["ffn"]["share"] == pytest.approx(1.0)
    assert block.budget["incoming"]["share"] == 0.0
    assert block.budget["ffn"]["error"] == pytest.approx(block.drift.rel_l2 * _norm_of_block_output(ids, 1), rel=1e-4)
    # The next block only passes it on.
    assert report.blocks[2].budget["incoming"]["share"] == pytest.approx(1.0)
    from blockdiff.html import document

    assert 'id="budget"' in document(report, image=False)
    assert report.to_dict()["blocks"][1]["budget"]["ffn"]["share"] == pytest.approx(1.0)


def _norm_of_block_output(ids, index: int) -> float:
    from blockdiff.capture import record
    from blockdiff.store import MemoryStore
    from samples import tinylm

    model = tinylm.build()
    store = MemoryStore()
    record(model, blockdiff.resolve(model), store, ids)
    (site,) = [s for s in store.block_sites(index) if s.subpath is None]
    return float(site.primary_output().double().norm())
