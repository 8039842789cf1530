"""The foreign-writer path end to end: the sample model ported to JAX (samples/jax_tinylm.py),
its weights loaded from the reference's safetensors export, its dump compared with
`blockdiff diff ref.h5 jax.h5` in a real process — free-running (drift), and teacher-forced
(local errors: the sample's --teacher-forced)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

from safetensors.torch import save_model  # noqa: E402

from blockdiff.engine import run  # noqa: E402
from samples import tinylm  # noqa: E402
from tests.test_cli import ROOT, blockdiff_process  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("jax")
    save_model(tinylm.build(), str(folder / "tinylm.safetensors"))
    done = blockdiff_process("capture", "samples/tinylm.py:build", "--out", str(folder / "ref.h5"), "--seq", "12")
    assert done.returncode == 0, done.stderr
    return folder


def port(files: Path, *bug: str) -> Path:
    """The JAX port's dump (with ``--bug`` when given), written by the sample's own command line."""
    name = f"jax{'-' + bug[0].replace('@', '') if bug else ''}.h5"
    from samples import jax_tinylm

    jax_tinylm.main([str(files / "tinylm.safetensors"), str(files / "ref.h5"), str(files / name), *(["--bug", *bug] if bug else [])])
    return files / name


def test_clean_port_blames_nothing(files: Path):
    out = files / "clean.json"
    done = blockdiff_process("diff", str(files / "ref.h5"), str(port(files)), "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert (report["first_divergence"], report["divergences"]) == (None, [])
    assert report["candidate"]["class"].startswith("jax ")
    # Every site compared: float32 in two runtimes agrees to rounding.
    drifts = [b["drift"]["rel_l2"] for b in report["blocks"]]
    assert len(drifts) == 4 and 0 < max(drifts) < 1e-5


@pytest.mark.parametrize("bug, block, subpath", [("gelu@2", 2, "ffn"), ("scale@1", 1, "attention")])
def test_planted_bug_is_blamed_on_its_block_and_subpath(files: Path, bug: str, block: int, subpath: str):
    first = run(str(files / "ref.h5"), str(port(files, bug))).first_divergence
    assert (first.stage, first.block, first.subpath, first.check.what) == ("block", block, subpath, "drift (offline)")


# -- teacher-forced: the port's runs with the reference's values substituted

BUGS = {"gelu@2": (2, "ffn"), "scale@1": (1, "attention")}


@pytest.fixture(scope="module")
def forced(files: Path) -> dict[str, dict]:
    """The report of `blockdiff diff ref.h5 PORT.h5` for each teacher-forced port (clean, and
    each planted bug), each written by the sample's command line in a process of its own."""
    reports = {}
    for bug in ("", *BUGS):
        out = files / f"forced{bug.replace('@', '')}.h5"
        command = [sys.executable, "-m", "samples.jax_tinylm", str(files / "tinylm.safetensors"), str(files / "ref.h5"), str(out)]
        done = subprocess.run(
            [*command, "--teacher-forced", *(["--bug", bug] if bug else [])],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr
        done = blockdiff_process("diff", str(files / "ref.h5"), str(out), "--json", str(out.with_suffix(".json")))
        assert done.returncode == (1 if bug else 0), done.stderr
        reports[bug] = json.loads(out.with_suffix(".json").read_text())
    return reports


def local_errors(report: dict) -> dict[tuple[int, str], float]:
    """Each block's sub-path local errors (module checks), by (block, sub-path)."""
    return {
        (b["index"], name): max(c["rel_l2"] for c in sub["checks"])
        for b in report["blocks"] for name, sub in b["subpaths"].items() if name != "residual"
    }


def test_teacher_forced_clean_port_blames_nothing(forced: dict[str, dict]):
    report = forced[""]
    assert (report["first_divergence"], report["divergences"]) == (None, [])
    assert any(note.startswith("teacher-forced: jax ") for note in report["notes"])
    # Every sub-path judged by its local error (not drift only), the residual and whole block too.
    statuses = {sub["status"] for b in report["blocks"] for sub in b["subpaths"].values()}
    assert statuses == {"checked"} and all(b["block"]["what"] == "block output" for b in report["blocks"])
    assert 0 < max(local_errors(report).values()) < 1e-6


@pytest.mark.parametrize("bug", BUGS)
def test_teacher_forced_bug_is_blamed_as_a_local_error(forced: dict[str, dict], bug: str):
    report, (block, subpath) = forced[bug], BUGS[bug]
    first = report["first_divergence"]
    assert (first["stage"], first["block"], first["subpath"], first["what"]) == ("block", block, subpath, "output")
    assert [(d["block"], d["subpath"]) for d in report["divergences"]] == [(block, subpath)]
    assert report["blocks"][block]["subpaths"][subpath]["status"] == "checked"
    assert report["blocks"][block]["block"]["diverged"]  # the whole block, run on the reference's input
    # The blocks after it drift, but their own sub-paths, fed the reference's values, are clean.
    errors = local_errors(report)
    assert max(e for (b, _), e in errors.items() if (b, _) != (block, subpath)) < 1e-6
    assert report["blocks"][-1]["drift"]["rel_l2"] > 1e-2
