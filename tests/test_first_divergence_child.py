"""The JSON's ``first_divergence`` (and each of ``divergences``) carries what the terminal
says beside the headline: the drill-down's first divergent child (``child``) and the
converted weights that explain the divergence (``conversion``) — for a forward diff, a
backward's report, and a batch-invariance report's rows; reports written without these
fields still read (docs/report-format.md)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import blockdiff  # noqa: E402
from blockdiff import Report  # noqa: E402
from blockdiff.view import drill_down  # noqa: E402
from samples import bugs, fused_port, tinylm  # noqa: E402
from tests.conftest import ROOT, run_cli  # noqa: E402

# What a child entry holds, at least (the check's own fields, and how it was paired).
CHILD_FIELDS = {"module", "what", "metric", "value", "threshold", "ratio", "diverged", "paired", "paired_as"}


def named_child(line: str | None) -> str | None:
    """The module a drill-down line names as the first divergent child, or None."""
    prefix = "first divergent child: "
    if line is None or not line.startswith(prefix):
        return None
    return line[len(prefix):].split(":")[0].split(" (as ")[0]


def terminal_child(out: str) -> str | None:
    """The module the terminal's drill-down line names (rich may wrap the line)."""
    words = " ".join(out.split())
    marker = "first divergent child: "
    if marker not in words:
        return None
    return words.split(marker, 1)[1].split(":")[0].split(" (as ")[0]


def strip_new_fields(data: dict) -> dict:
    """``data`` as a report written before ``child`` and ``conversion`` existed."""
    old = copy.deepcopy(data)

    def strip(report: dict) -> None:
        for entry in [report.get("first_divergence"), *report.get("divergences", [])]:
            if entry is not None:
                entry.pop("child", None)
                entry.pop("conversion", None)
        for row in (report.get("invariance") or {}).get("per_row", []):
            if row.get("first_divergence") is not None:
                row["first_divergence"].pop("child", None)
                row["first_divergence"].pop("conversion", None)
        if report.get("backward") is not None:
            strip(report["backward"])

    strip(old)
    return old


def reads_back(data: dict) -> None:
    """A new report round-trips; the same report without the new fields reads, and gets
    them back from its checks."""
    assert Report.from_dict(data).to_dict() == data
    old = strip_new_fields(data)
    assert old != data  # something was stripped: the test below reads an old-form report
    expected = copy.deepcopy(data)
    if data.get("invariance") is not None:  # its rows are kept as written: no child in an old one
        expected["invariance"]["per_row"] = old["invariance"]["per_row"]
    assert Report.from_dict(old).to_dict() == expected


def test_a_forward_child_is_on_the_first_divergence_and_the_divergences(ids):
    report = blockdiff.diff(tinylm.build(), bugs.outlier_in_down_proj(block=2), ids)
    first = report.first_divergence
    data = json.loads(json.dumps(report.to_dict()))
    child = data["first_divergence"]["child"]
    assert child is not None and CHILD_FIELDS <= child.keys()
    assert child["module"] == named_child(drill_down(first)) == "blocks.2.ffn.down_proj"
    # As the check serializes itself (the child's own to_dict), with its measured value.
    expected = first.check.first_child.to_dict()
    assert {k: child[k] for k in expected} == expected
    assert child["what"] == "child down_proj" and child["metric"] == "rel_l2" and child["diverged"] is True
    assert child["value"] == expected["rel_l2"] and child["ratio"] > 1
    assert (child["paired"], child["paired_as"]) == ("name", None)
    # The planted weight is the reference's but one: the conversion diagnosis names it.
    assert data["first_divergence"]["conversion"] == [
        "blocks.2.ffn.down_proj.weight differs from the reference's blocks.2.ffn.down_proj.weight"
    ]
    assert data["divergences"][0] == data["first_divergence"]
    reads_back(data)


def test_a_drill_down_that_names_no_child_writes_child_null(gelu_report):
    # tinylm's GELU-for-SiLU is a function, not a child module: nothing to name.
    first = gelu_report.first_divergence
    assert drill_down(first).startswith("no child module diverges")
    assert gelu_report.to_dict()["first_divergence"]["child"] is None


def test_the_clis_json_carries_the_child_the_terminal_names(tmp_path):
    out_json = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "blockdiff", "diff", "samples/hf_llama.py:build", "samples/hf_llama.py:gelu_for_silu",
         "--json", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    said = terminal_child(done.stdout)
    assert said == "model.layers.1.mlp.act_fn", done.stdout
    data = json.loads(out_json.read_text())
    assert data["schema"] == "blockdiff.report/2"
    assert data["first_divergence"]["child"]["module"] == said
    assert data["first_divergence"]["child"]["what"] == "child act_fn"
    reads_back(data)


def test_a_child_paired_by_role_says_so(ids):
    # HF GPT-2's mlp.act against the port's mlp.gelu (tests/test_port_drilldown.py).
    from torch import nn

    report = blockdiff.diff(fused_port.gpt2_reference(), fused_port.gpt2_port(wrong={1: nn.SiLU()}), ids)
    first = report.first_divergence
    assert drill_down(first).startswith("first divergent child: transformer.h.1.mlp.gelu (as act): ")
    child = report.to_dict()["first_divergence"]["child"]
    assert child["module"] == "transformer.h.1.mlp.gelu"
    assert (child["what"], child["paired"], child["paired_as"]) == ("child gelu (as act)", "role", "act")


def test_an_invariance_rows_first_divergence_carries_the_child(tmp_path, capsys):
    code, out, err = run_cli(
        ["invariance", "samples/invariance_bugs.py:matmul_split_by_rows", "--batch", "2", "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    assert terminal_child(out) == "blocks.1.ffn.down_proj", out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_divergence"]["child"]["module"] == "blocks.1.ffn.down_proj"
    rows = [r for r in data["invariance"]["per_row"] if r["first_divergence"] is not None]
    assert rows
    for row in rows:  # every divergent row's own drill-down names the same operation
        assert row["first_divergence"]["child"]["module"] == "blocks.1.ffn.down_proj"
        assert row["first_divergence"]["child"]["threshold"] == 0
    shown = next(r for r in rows if r["row"] == data["invariance"]["row"])
    assert shown["first_divergence"]["child"] == data["first_divergence"]["child"]
    reads_back(data)


def test_a_backward_first_divergence_carries_its_child(tmp_path, capsys):
    code, out, err = run_cli(
        ["diff", "samples/hf_llama.py:build", "samples/backward_bugs.py:silu_backward_wrong", "--backward",
         "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_divergence"] is None  # the forward is right
    back = data["backward"]["first_divergence"]
    assert (back["block"], back["subpath"]) == (1, "ffn")
    assert back["child"]["module"] == terminal_child(out) == "model.layers.1.mlp.act_fn"
    assert (back["child"]["what"], back["child"]["paired"]) == ("child act_fn", "name")
    assert back["child"]["diverged"] is True and back["child"]["ratio"] > 1
    reads_back(data)


def test_a_conversion_diagnosis_is_on_the_first_divergence(tmp_path, capsys):
    # A fused port whose conversion wrote wqkv as q, v, k (tests/test_conversion.py): the
    # fused child diverges, and its weight is named.
    code, out, err = run_cli(
        ["diff", "samples/fused_port.py:reference", "samples/fused_port.py:port_kv_swapped", "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    data = json.loads((tmp_path / "r.json").read_text())
    first = data["first_divergence"]
    assert (first["block"], first["subpath"]) == (0, "attention")
    weight = ("model.layers.0.attention.wqkv.weight holds the reference's q_proj.weight, v_proj.weight, k_proj.weight "
              "in that order (expected q_proj.weight, k_proj.weight, v_proj.weight)")
    assert first["conversion"] and weight in first["conversion"][0]
    assert first["conversion"] == Report.from_dict(data).first_divergence.check.details["conversion"]
    assert weight in " ".join(out.split())  # what the terminal's headline says
    child = first["child"]
    assert child["module"] == "model.layers.0.attention.wqkv"
    assert (child["paired"], child["paired_as"]) == ("fused", "q_proj+k_proj+v_proj")
    reads_back(data)


def test_an_old_report_reads(ids):
    """A report saved before ``child`` and ``conversion`` (schema /1 as well as /2) reads,
    its divergences derived from its checks as ever."""
    data = json.loads(json.dumps(blockdiff.diff(tinylm.build(), bugs.outlier_in_down_proj(block=2), ids).to_dict()))
    old = strip_new_fields(data)
    assert "child" not in old["first_divergence"] and "conversion" not in old["first_divergence"]
    for schema in ("blockdiff.report/1", "blockdiff.report/2"):
        back = Report.from_dict({**old, "schema": schema})
        assert back.first_divergence.check.first_child.module == "blocks.2.ffn.down_proj"
        assert named_child(drill_down(back.first_divergence)) == "blocks.2.ffn.down_proj"
        assert back.to_dict()["first_divergence"] == data["first_divergence"]
    # Older still: a report whose checks were not drilled (no children) reads with child null.
    for block in old["blocks"]:
        for subpath in block["subpaths"].values():
            for check in subpath.get("checks", []):
                for key in ("children", "first_child", "children_not_paired", "children_not_judged"):
                    check.pop(key, None)
    back = Report.from_dict(old)
    assert drill_down(back.first_divergence) is None
    assert back.to_dict()["first_divergence"]["child"] is None
