"""Hardening: interrupted runs leave no file and no hook, write errors are clear, and
non-finite values in the reference are reported as such."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockdiff import diff
from blockdiff.cli import main
from samples import tinylm
from tests.test_hooks_never_leak import hook_count

ROOT = Path(__file__).resolve().parent.parent

SLOW_FACTORY = """
import time
from samples import tinylm

def build():
    model = tinylm.build(blocks=8)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: time.sleep(0.3))
    return model
"""


def start(args: list[str], tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "slow.py").write_text(SLOW_FACTORY)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "blockdiff.cli", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_interruptible,
    )


def _interruptible() -> None:
    """Ctrl-C's default in the child, as at a terminal: under a parent started in the
    background (``cmd &`` in a script) SIGINT is ignored, and stays ignored in children."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(pattern: str, folder: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not list(folder.glob(pattern)):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the capture never started writing"
        time.sleep(0.05)


def test_sigint_during_capture_exits_130_and_leaves_no_file(tmp_path):
    proc = start(["capture", "slow:build", "--out", str(tmp_path / "ref.h5")], tmp_path)
    wait_for(".ref.h5.tmp-*", tmp_path, proc)
    time.sleep(0.4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "Interrupted." in err.decode() and "Traceback" not in err.decode()
    assert not (tmp_path / "ref.h5").exists()
    assert not list(tmp_path.glob(".ref.h5.tmp-*"))


def test_sigint_during_diff_exits_130_and_leaves_no_dump(tmp_path):
    kept = tmp_path / "kept"
    proc = start(["diff", "slow:build", "--save-dumps", str(kept)], tmp_path)
    wait_for("kept/.reference.h5.tmp-*", tmp_path, proc)
    time.sleep(0.4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert not (kept / "reference.h5").exists() and not (kept / "candidate.h5").exists()
    assert not list(kept.glob(".*.tmp-*"))


class Interrupting(torch.nn.Module):
    """Raises KeyboardInterrupt (as SIGINT would) the n-th time it runs."""

    def __init__(self, inner: torch.nn.Module, after: int) -> None:
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.after:
            raise KeyboardInterrupt
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("after", [1, 2], ids=["during capture", "during localization"])
def test_interrupt_removes_every_hook(after, ids):
    # A bfloat16 candidate, so that localization runs its modules again.
    reference, candidate = tinylm.build(), tinylm.build().to(torch.bfloat16)
    candidate.blocks[2].ffn = Interrupting(candidate.blocks[2].ffn, after)
    with pytest.raises(KeyboardInterrupt):
        diff(reference, candidate, ids)
    assert hook_count(reference) == 0 and hook_count(candidate) == 0
    assert "forward" not in vars(candidate.blocks[2].ffn)  # no forward left wrapped


def test_write_error_mid_dump_is_one_line_and_leaves_no_file(tmp_path):
    import resource

    def small_files():
        # Files may not grow past 64 KiB: the writer's thread gets EFBIG ("File too large")
        # part way through the dump, as on a full disk (Python ignores SIGXFSZ).
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "ref.h5"
    done = subprocess.run(
        [sys.executable, "-m", "blockdiff", "capture", "samples/tinylm.py:build", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, preexec_fn=small_files, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("Error:"), done.stderr
    assert "ref.h5" in err[0] and "File too large" in err[0]
    assert not out.exists() and not list(tmp_path.glob(".ref.h5.tmp-*"))


def test_non_finite_values_already_in_the_reference_are_reported(ids):
    def broken():
        model = tinylm.build()
        with torch.no_grad():
            model.embed.weight[int(ids[0, 3])] = float("nan")
        return model

    report = diff(broken(), broken().to(torch.bfloat16), ids)
    assert report.reference_nonfinite is not None
    assert report.reference_nonfinite["site"] == "embed"
    assert report.reference_nonfinite["nonfinite_ref"] > 0
    assert "reference-nonfinite" in report.note_codes
    assert report.to_dict()["reference_nonfinite"]["module"] == "embed"
