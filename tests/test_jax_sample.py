"""The foreign-writer path end to end: the sample model ported to JAX (samples/jax_tinylm.py),
its weights loaded from the reference's safetensors export, its dump compared with
`blockdiff diff ref.h5 jax.h5` in a real process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("jax")

from safetensors.torch import save_model  # noqa: E402

from blockdiff.engine import run  # noqa: E402
from samples import tinylm  # noqa: E402
from tests.test_cli import blockdiff_process  # noqa: E402


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
