"""The JSON report contract: blockdiff.report/2 (and /1, still read)."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from blockdiff import BlockdiffError, Report, Tolerance, diff, hookmap
from blockdiff.assertion import render_text
from blockdiff.engine import capture, compare_dumps
from blockdiff.report import Note
from samples import bugs, tinylm

SUBPATHS = {"attention", "ffn", "norm", "residual"}
ROOT = Path(__file__).resolve().parents[1]


def test_report_has_the_contract_keys(ids, tmp_path):
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=2).to(torch.bfloat16), ids)
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema"] == "blockdiff.report/2"
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


# Report.from_dict: the JSON form read back --------------------------------------------


def _ffn_and_norm_bugs():
    """GELU in blocks 0 and 2, and block 2's first norm as LayerNorm: three divergences, two
    in one block (the norm runs before the FFN there)."""
    model = bugs.norm_as_layernorm(block=2)
    for block in (0, 2):
        model.blocks[block].ffn.act = torch.nn.functional.gelu
    return model


def _offline(ids, tmp_path):
    capture(tinylm.build(), ids, tmp_path / "ref.h5")
    capture(bugs.residual_dropped(block=2), ids, tmp_path / "bad.h5")
    return compare_dumps(tmp_path / "ref.h5", tmp_path / "bad.h5")


def _unattributed(ids, tmp_path):
    text = tmp_path / "partial.toml"  # a hook map that leaves the FFN out
    text.write_text(
        'name = "partial"\nmatch = ["TinyLM"]\n[outside]\nembed = "embed"\nhead = "lm_head"\n'
        '[blocks]\npath = "blocks"\n[blocks.subpaths]\nattention = "attn"\nnorm = ["attn_norm", "ffn_norm"]\n'
    )
    partial = hookmap.load(text)
    return diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids, reference_hooks=partial, candidate_hooks=partial)


REPORTS = {
    "ffn bug, calibrated": lambda ids, _: diff(tinylm.build(), bugs.gelu_for_silu(block=2).to(torch.bfloat16), ids),
    "three divergences": lambda ids, _: diff(tinylm.build(), _ffn_and_norm_bugs(), ids),
    "moe router bug": lambda ids, _: diff(tinylm.build_moe(), bugs.moe_not_renormalized().to(torch.bfloat16), ids),
    "moe capacity, clean": lambda ids, _: diff(tinylm.build_moe_capacity(), tinylm.build_moe_capacity().to(torch.bfloat16), ids),
    "clean bf16": lambda ids, _: diff(tinylm.build(), tinylm.build().to(torch.bfloat16), ids),
    "nan, fast path": lambda ids, _: diff(tinylm.build(), bugs.nan_in_ffn(), ids, fast_path=True),
    "tolerated override": lambda ids, _: diff(
        tinylm.build(), bugs.gelu_for_silu(block=2), ids, tolerance=Tolerance(overrides={"ffn": 1.0})
    ),
    "unattributed": _unattributed,
    "offline dumps": _offline,
}


@pytest.mark.parametrize("name", list(REPORTS))
def test_from_dict_gives_the_report_back(name, ids, tmp_path):
    report = REPORTS[name](ids, tmp_path)
    data = report.to_dict()
    for stored in (data, json.loads(json.dumps(data))):  # as written, and as read from a file
        back = Report.from_dict(stored)
        assert back.to_dict() == data
        assert [d.to_dict() for d in back.divergences] == data["divergences"]
        first, again = report.first_divergence, back.first_divergence
        assert (first is None) == (again is None)
        if first is not None:
            assert again.to_dict() == first.to_dict() and again.headline() == first.headline()
            assert again.check.threshold == first.check.threshold
        # Execution order too: the terminal prints the two alike, row for row.
        assert render_text(back) == render_text(report)


def test_from_dict_orders_sites_of_an_encoder_decoder_as_they_ran():
    pytest.importorskip("transformers")
    from samples import hf_families

    g = torch.Generator().manual_seed(0)
    inputs = hf_families.inputs("t5", torch.randint(0, 100, (1, 8), generator=g))
    report = diff(hf_families.build(family="t5"), hf_families.cross_attention_bug(block=3), inputs)
    back = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.to_dict() == report.to_dict()

    def sites(r: Report) -> list[str]:
        items = [(s.order, s.module) for s in r.stages] + [(b.order, b.module) for b in r.blocks]
        return [module for _, module in sorted(items)]

    assert sites(back) == sites(report)
    assert sites(back).index("encoder.final_layer_norm") < sites(back).index("decoder.block.0")


def test_from_dict_refuses_what_is_not_a_report():
    with pytest.raises(BlockdiffError, match=r"expected a blockdiff.report/2 report \(or blockdiff.report/1\), found 'other/2'"):
        Report.from_dict({"schema": "other/2"})
    with pytest.raises(BlockdiffError, match="found 'list'"):
        Report.from_dict([1, 2])


# Notes as (code, text) ------------------------------------------------------------------

DOCUMENTED = set(re.findall(r"^\s*\| `([a-z-]+)`(?:, `([a-z-]+)`)? \|", (ROOT / "docs" / "report-format.md").read_text(), re.M))
DOCUMENTED_CODES = {code for pair in DOCUMENTED for code in pair if code}


def test_every_note_code_written_in_the_code_is_documented():
    written = set()
    for path in (ROOT / "blockdiff").rglob("*.py"):
        written |= set(re.findall(r'\b(?:Note|coded)\(\s*"([a-z-]+)"', path.read_text()))
    assert written == DOCUMENTED_CODES


NOTED = {
    "offline dumps": (_offline, {"offline-drift"}),
    "backward after a forward bug": (
        lambda ids, _: diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids, backward=True),
        {"backward", "backward-after-forward"},
    ),
}


@pytest.mark.parametrize("name", list(NOTED))
def test_every_note_of_a_report_has_its_code_and_reads_back(name, ids, tmp_path):
    make, expected = NOTED[name]
    report = make(ids, tmp_path)
    codes = report.note_codes + (report.backward.note_codes if report.backward else [])
    assert expected <= set(codes) <= DOCUMENTED_CODES
    data = json.loads(json.dumps(report.to_dict()))
    assert data["note_codes"] == report.note_codes and data["notes"] == [str(n) for n in report.notes]
    back = Report.from_dict(data)
    assert back.note_codes == report.note_codes
    assert (back.backward and back.backward.note_codes) == (report.backward and report.backward.note_codes)
    old = {k: v for k, v in data.items() if k != "note_codes"}  # a report written before codes
    assert Report.from_dict(old).notes == data["notes"] and set(Report.from_dict(old).note_codes) == {""}


def test_a_note_is_its_text_and_pickles_with_its_code():
    note = Note("boundary-move", "embed (embed): the output differs")
    assert note == "embed (embed): the output differs" and "output differs" in note
    again = pickle.loads(pickle.dumps(note))  # across ranks (distributed.every_rank)
    assert again.code == "boundary-move" and again == note
