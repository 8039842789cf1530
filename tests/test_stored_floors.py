"""Noise floors stored at capture: a replay is calibrated exactly as the live diff is."""

from __future__ import annotations

import json

import pytest
import torch

import blockdiff
from blockdiff.dump import DumpReader
from blockdiff.engine import capture, compare_dumps, replay
import functools

from samples import bugs, hf_llama, hf_moe, tinylm
from tests.conftest import blamed, run_cli
from tests.test_pytest_plugin import session, write_tests  # noqa: F401  (the fixture)

pytest_plugins = ["pytester"]

PRECISIONS = [(torch.bfloat16, "cpu"), (torch.float16, "cpu")]


def _checks(report) -> dict:
    """Every judged check by where it is: (ratio, basis)."""
    found = {}
    for block in report.blocks:
        for name, result in block.subpaths.items():
            for i, check in enumerate(result.checks):
                found[(block.index, name, i)] = check
        found[(block.index, "block")] = block.block
        found[(block.index, "drift")] = block.drift_check
    for stage in report.stages:
        found[(stage.stage, "local")] = stage.local
        found[(stage.stage, "drift")] = stage.drift_check
    return {k: (c.ratio, c.threshold.basis) for k, c in found.items() if c is not None}


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    """One float32 golden per reference model, with bfloat16 and float16 floors."""
    folder = tmp_path_factory.mktemp("floors")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    paths = {}
    builds = [("tinylm", tinylm.build), ("moe", tinylm.build_moe), ("unnormalized", tinylm.build_moe_unnormalized), ("hf_llama", hf_llama.build)]
    builds += [(f"hf_{arch}", functools.partial(hf_moe.build, arch=arch)) for arch in sorted({a for a, _ in hf_moe.BUGS.values()})]
    for name, build in builds:
        paths[name] = folder / f"{name}.h5"
        capture(build(), ids, paths[name], floors=PRECISIONS)
    return paths


def other_code(build):
    """``build``'s model as code of its own: every module under a subclass of its class, of
    the same name (the hook maps find it). Clean and the same computation, but not the
    reference's code cast (not its twin): every live floor is measured, as a stored one is."""

    def built(**kwargs):
        model = build(**kwargs)
        for module in model.modules():
            own = type(module)
            module.__class__ = type(own.__name__, (own,), {"__qualname__": own.__qualname__, "__module__": own.__module__})
        return model

    return built


MOE_GOLDEN = {"build_moe": "moe", "build_moe_unnormalized": "unnormalized"}
CASES = (
    [("tinylm", tinylm.build, "clean", other_code(tinylm.build))]
    + [("tinylm", tinylm.build, name, getattr(bugs, name)) for name in bugs.BUGS]
    + [("moe", tinylm.build_moe, "clean", other_code(tinylm.build_moe))]
    + [(MOE_GOLDEN[b[0]], getattr(tinylm, b[0]), name, getattr(bugs, name)) for name, b in bugs.MOE_BUGS.items()]
    + [("hf_llama", hf_llama.build, name, getattr(hf_llama, name)) for name in hf_llama.BUGS]
    + [("hf_llama", hf_llama.build, "clean", other_code(hf_llama.build))]
    + [
        (f"hf_{arch}", functools.partial(hf_moe.build, arch=arch), name, functools.partial(getattr(hf_moe, name), arch=arch))
        for name, (arch, _) in hf_moe.BUGS.items()
    ]
    + [("hf_mixtral", hf_moe.build, "clean", other_code(hf_moe.build))]
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("golden, build, bug, make", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_replay_with_stored_floors_is_the_live_calibrated_diff(goldens, golden, build, bug, make, dtype, ids):
    live = blockdiff.diff(build(), make().to(dtype), ids)
    stored = replay(goldens[golden], make().to(dtype))
    assert blamed(stored) == blamed(live)
    assert (bug == "clean") == (blamed(live) is None)
    assert stored.tolerance["policy"] == "calibrated" and stored.tolerance["floors"] == f"stored {str(dtype)[6:]}@cpu"
    expected, got = _checks(live), _checks(stored)
    assert got.keys() == expected.keys()
    for key, (ratio, basis) in expected.items():
        assert got[key][1] == basis
        assert got[key][0] == pytest.approx(ratio, rel=0.01, abs=1e-9), key


@pytest.mark.parametrize("golden, build", [("tinylm", tinylm.build), ("hf_llama", hf_llama.build)])
def test_a_models_own_cast_is_clean_against_stored_floors_and_live(goldens, golden, build, ids):
    """The reference's own cast: live, its every floor is its own number (the floor side's
    code is its code: tests/test_twins.py); replayed, the stored floors, measured on the
    reference's calls cast, judge it; both blame nothing."""
    live = blockdiff.diff(build(), build().to(torch.bfloat16), ids)
    stored = replay(goldens[golden], build().to(torch.bfloat16))
    assert blamed(live) is None and blamed(stored) is None
    assert stored.tolerance["floors"] == "stored bfloat16@cpu"
    assert all(basis == "calibrated" for _, basis in _checks(stored).values())
    assert all(c.threshold.floor == c.metrics.rel_l2 for b in live.blocks for r in b.subpaths.values() for c in r.checks)


def test_without_floors_for_the_candidate_the_report_says_why(goldens, tmp_path, ids):
    capture(tinylm.build(), ids, tmp_path / "plain.h5")
    report = replay(tmp_path / "plain.h5", tinylm.build().to(torch.bfloat16))
    assert report.tolerance["policy"] == "fixed" and "floors" not in report.tolerance
    assert any("it stores none: capture it with --floors bfloat16@cpu" in note for note in report.notes)
    capture(tinylm.build(), ids, tmp_path / "fp16.h5", floors=[(torch.float16, "cpu")])
    report = replay(tmp_path / "fp16.h5", tinylm.build().to(torch.bfloat16))
    assert any("it stores floors for float16@cpu, not for the candidate's bfloat16@cpu" in note for note in report.notes)


def test_stored_floors_judge_an_offline_comparison(goldens, tmp_path, ids):
    capture(tinylm.build().to(torch.bfloat16), ids, tmp_path / "clean.h5")
    capture(bugs.gelu_for_silu(block=1).to(torch.bfloat16), ids, tmp_path / "gelu.h5")
    clean = compare_dumps(goldens["tinylm"], tmp_path / "clean.h5")
    assert blamed(clean) is None and clean.tolerance["policy"] == "calibrated"
    assert all(c.threshold.basis == "calibrated" for b in clean.blocks for r in b.subpaths.values() for c in r.checks)
    assert "judged against its stored drift floors" in clean.notes[-1]
    assert blamed(compare_dumps(goldens["tinylm"], tmp_path / "gelu.h5")) == ("block", 1, "ffn")


def test_capture_floors_through_the_cli(tmp_path, capsys):
    golden = tmp_path / "golden.h5"
    code, _, err = run_cli(["capture", "samples/tinylm.py:build", "--out", str(golden), "--floors", "bfloat16,float16@cpu"], capsys)
    assert code == 0, err
    with DumpReader(golden) as dump:
        assert dump.meta["schema_version"] == 4
        assert set(dump.floors()) == {"bfloat16@cpu", "float16@cpu"}
    args = ["diff", str(golden), "samples/bugs.py:gelu_for_silu", "--cand-dtype", "bfloat16", "--json", str(tmp_path / "r.json")]
    code, out, _ = run_cli(args, capsys)
    data = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and data["tolerance"]["floors"] == "stored bfloat16@cpu"
    assert "calibrated (stored floors)" in out
    code, _, err = run_cli(["capture", "samples/tinylm.py:build", "--out", str(tmp_path / "x.h5"), "--floors", "int3"], capsys)
    assert code == 2 and "unknown dtype 'int3'" in err


GOLDEN_BF16 = """
import os

def test_bf16(blockdiff_golden):
    reference = tinylm.build()
    candidate = (bugs.gelu_for_silu() if os.environ.get("PLANT_BUG") else tinylm.build()).to(torch.bfloat16)
    report = blockdiff_golden.check(candidate, IDS, floors=["bfloat16"], reference=reference)
    if report is not None:
        assert report.tolerance["floors"] == "stored bfloat16@cpu"
"""


def test_a_bfloat16_golden_test_with_stored_floors(pytester, session, monkeypatch):  # noqa: F811
    write_tests(pytester, GOLDEN_BF16)
    session("--blockdiff-update").assert_outcomes(passed=1)
    golden = pytester.path / "__blockdiff__" / "test_model__test_bf16.h5"
    with DumpReader(golden) as dump:
        assert dump.meta["dtype"] == "float32" and set(dump.floors()) == {"bfloat16@cpu"}
    session().assert_outcomes(passed=1)
    monkeypatch.setenv("PLANT_BUG", "1")
    result = session()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E * blockdiff.DivergenceError: block 1 ffn (blocks.1.ffn): rel_l2 * > threshold *"])
