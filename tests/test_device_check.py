"""The GPU check (benchmarks/device_check.py) in its dry run: every check that can run on
the CPU runs and passes, the ones that need CUDA itself say so; the script cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_passes_every_check_the_cpu_can_run(tmp_path):
    out = tmp_path / "device.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--dry-run", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["device"] == "cpu"
    status = {c["check"]: c["status"] for c in data["checks"]}
    assert "FAIL" not in status.values()
    ran = [name for name, s in status.items() if s == "ok"]
    skipped = [name for name, s in status.items() if s == "skip"]
    # Every check the CPU can stand in for ran: the CLI cases (7), floors, compile, the
    # process group, decode, backward, weights read from disk, the real-size line at a toy size.
    assert sum(name.startswith("1 ") for name in ran) == 7
    assert [name.split()[0] for name in ran if not name.startswith("1 ")] == ["3", "4", "6", "7", "8", "9", "12"]
    # What needs CUDA itself (async copies, flex attention's kernels) is skipped, each with
    # its reason.
    assert [name.split()[0] for name in skipped] == ["2", "5", "10", "11"]
    assert all(c["found"].startswith("skipped: ") for c in data["checks"] if c["status"] == "skip")
    assert done.stdout.splitlines()[-1] == f"{len(ran)} ok, 0 FAIL, {len(skipped)} skipped"
