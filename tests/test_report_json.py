"""The JSON report contract: blockdiff.report/1."""

from __future__ import annotations

import json

import torch

from blockdiff import diff
from samples import bugs, tinylm

SUBPATHS = {"attention", "ffn", "norm", "residual"}


def test_report_has_the_contract_keys(ids, tmp_path):
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=2).to(torch.bfloat16), ids)
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema"] == "blockdiff.report/1"
    first = data["first_divergence"]
    assert {"stage", "block", "subpath", "module", "metric", "value", "threshold"} <= set(first)
    assert (first["stage"], first["block"], first["subpath"], first["module"]) == ("block", 2, "ffn", "blocks.2.ffn")
    assert first["metric"] == "rel_l2" and first["value"] > first["threshold"] > 0
    assert isinstance(data["blocks"], list) and len(data["blocks"]) == 4
    for index, block in enumerate(data["blocks"]):
        assert block["index"] == index
        assert set(block["subpaths"]) == SUBPATHS
        for name, sub in block["subpaths"].items():
            assert isinstance(sub["diverged"], bool)
            assert {"rel_l2", "max_abs", "cosine", "sqnr_db", "threshold", "checks"} <= set(sub)
            assert sub["diverged"] == (index == 2 and name == "ffn")
        assert {"rel_l2", "max_abs", "cosine"} <= set(block["drift"])
    assert data["moe"] == []
    assert [s["stage"] for s in data["stages"]] == ["embed", "context", "final_norm", "head"]
    assert data["reference"]["dtype"] == "float32" and data["candidate"]["dtype"] == "bfloat16"
    assert data["tolerance"]["policy"] == "calibrated"


def test_clean_report_has_null_first_divergence(ids):
    data = diff(tinylm.build(), tinylm.build(), ids).to_dict()
    assert data["first_divergence"] is None and data["divergences"] == []
    json.dumps(data, allow_nan=False)


def test_nonfinite_values_are_json_strings(ids):
    data = diff(tinylm.build(), bugs.nan_in_ffn(), ids).to_dict()
    assert data["first_divergence"]["value"] == "inf"
    json.dumps(data, allow_nan=False)


def test_same_diff_twice_gives_identical_json_apart_from_timestamps(ids):
    first = diff(tinylm.build(), bugs.post_norm().to(torch.bfloat16), ids).to_dict()
    second = diff(tinylm.build(), bugs.post_norm().to(torch.bfloat16), ids).to_dict()
    first.pop("created"), second.pop("created")
    assert json.dumps(first) == json.dumps(second)
