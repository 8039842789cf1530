"""Drift that no local check explains is a divergence: never a pass."""

from __future__ import annotations

import json

import pytest
import torch

from blockdiff import Report, Tolerance, diff
from blockdiff.engine import capture, replay
from samples import bugs, tinylm
from tests.conftest import blamed, run_cli

SCALED = "samples/bugs.py:scaled_between_blocks"


@pytest.mark.parametrize("mode", [[], ["--fast"], ["--cand-dtype", "bfloat16"], ["--stream"]], ids=["plain", "fast", "bf16", "stream"])
def test_code_between_blocks_is_unexplained_drift_in_every_mode(mode, tmp_path, capsys):
    code, out, err = run_cli(["diff", "samples/tinylm.py:build", SCALED, "--json", str(tmp_path / "r.json"), *mode], capsys)
    assert code == 1, err
    data = json.loads((tmp_path / "r.json").read_text())
    first = data["first_divergence"]
    assert (first["stage"], first["block"], first["subpath"], first["module"]) == ("block", 2, "drift", "blocks.2")
    assert "First divergence: block 2 unexplained drift (blocks.2)" in out
    assert any(code == "unexplained-drift" and "--tol drift=VALUE" in note for code, note in zip(data["note_codes"], data["notes"]))
    # Every local check passes: the drift is the only divergence reported.
    assert [d["subpath"] for d in data["divergences"]] == ["drift"]
    assert data["blocks"][2]["drift_check"]["diverged"]
    if "--cand-dtype" in mode:
        assert data["blocks"][2]["drift_check"]["basis"] == "calibrated"
        assert data["blocks"][1]["drift_check"]["ratio"] < 1  # clean up to there, floor-judged


def test_replay_reports_unexplained_drift(tmp_path, ids):
    capture(tinylm.build(), ids, tmp_path / "ref.h5")
    report = replay(tmp_path / "ref.h5", bugs.scaled_between_blocks())
    assert blamed(report) == ("block", 2, "drift")


def test_tolerating_drift_accepts_it(capsys):
    code, out, _ = run_cli(["diff", "samples/tinylm.py:build", SCALED, "-q", "--tol", "drift=1"], capsys)
    assert (code, out.strip()) == (0, "no divergence")


def test_a_local_divergence_explains_the_drift_after_it(ids):
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=1), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(1, "ffn")]
    assert report.blocks[3].drift_check.diverged  # carried on, explained upstream


def test_clean_precision_drift_is_within_its_calibrated_floor(ids):
    report = diff(tinylm.build(), tinylm.build().to(torch.bfloat16), ids)
    checks = [b.drift_check for b in report.blocks] + [s.drift_check for s in report.stages]
    assert all(c.threshold.basis == "calibrated" and c.ratio < 0.5 for c in checks)
    assert blamed(report) is None


def test_drift_checks_survive_the_json_round_trip(ids):
    report = diff(tinylm.build(), bugs.scaled_between_blocks(), ids)
    again = Report.from_dict(report.to_dict())
    assert again.first_divergence.headline() == report.first_divergence.headline()
    assert again.to_dict() == report.to_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_miscompile_never_passes(dtype, ids):
    # The stand-in for a compiler bug, on the plumbing backend (no C++ build); one compiled
    # model serves the full and the fast run. (Experiments judge compiled code, so the ffn
    # is blamed; were an experiment to run eager code, the drift would still be.)
    candidate = bugs.miscompiled(block=1, backend="aot_eager", dtype=dtype)
    for fast_path in (False, True):
        report = diff(tinylm.build(), candidate, ids, fast_path=fast_path, tolerance=Tolerance())
        assert blamed(report) in {("block", 1, "ffn"), ("block", 1, "drift")}, fast_path
