"""Dump integrity: a damaged dump never reads as different activations, never raises
anything but a BlockdiffError, and never takes the reading process down.

Cases run in a worker subprocess (tests/dump_fuzz_worker.py); a case that crashes it or
makes it hang is counted as contained, and the worker restarts at the next case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from blockdiff import DumpError
from blockdiff.dump import DumpReader, probe_file
from blockdiff.engine import capture
from samples import tinylm

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dump_fuzz_worker.py")


@pytest.fixture(scope="module")
def small_dump(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "small.h5"
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    capture(tinylm.build(blocks=2, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab_size=128), ids, path)
    return path


def run_cases(original: Path, cases: list[str], workdir: Path, *, per_case: float) -> dict[str, dict]:
    """Run every case; a worker killed by a signal or silent for ``per_case`` seconds marks
    the case it was on as ``crash`` or ``hang`` and a new worker takes the rest."""
    results: dict[str, dict] = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    pending = list(cases)
    while pending:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(original), str(workdir), *pending],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )
        current = None
        os.set_blocking(proc.stdout.fileno(), False)
        buffer, last = "", time.monotonic()
        startup = 60.0  # the first case also waits for the imports
        while True:
            chunk = (proc.stdout.read() or b"").decode()
            if chunk:
                buffer += chunk
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    event = json.loads(line)
                    if event.get("started"):
                        current, last, startup = event["case"], time.monotonic(), 0.0
                    else:
                        results[event["case"]] = event
                        pending.remove(event["case"])
                        current = None
            if proc.poll() is not None and not chunk:
                if current is not None:  # died inside a case
                    results[current] = {"case": current, "outcome": "crash", "detail": f"signal {-proc.returncode}"}
                    pending.remove(current)
                break
            if current is not None and time.monotonic() - last > per_case + startup:
                proc.kill()
                proc.wait()
                results[current] = {"case": current, "outcome": "hang", "detail": f"over {per_case} s"}
                pending.remove(current)
                break
            time.sleep(0.01)
    return results


def summarize(results: dict[str, dict]) -> Counter:
    return Counter(r["outcome"] for r in results.values())


def test_300_bit_flip_mutants_never_pass_silently(small_dump, tmp_path):
    cases = [f"flip:{seed}" for seed in range(300)]
    results = run_cases(small_dump, cases, tmp_path, per_case=5.0)
    counts = summarize(results)
    print(f"300 bit-flip mutants: {dict(counts)}")
    assert len(results) == 300
    assert counts["silent_mismatch"] == 0, [r for r in results.values() if r["outcome"] == "silent_mismatch"]
    assert counts["other_exception"] == 0, [r for r in results.values() if r["outcome"] == "other_exception"]
    assert counts["blockdiff_error"] > 0
    assert all(r["seconds"] < 5.0 for r in results.values() if "seconds" in r)


def test_200_truncation_points_raise_blockdiff_error_quickly(small_dump, tmp_path):
    size = small_dump.stat().st_size
    cases = [f"cut:{size * i // 201}" for i in range(1, 201)]
    assert len(set(cases)) == 200
    results = run_cases(small_dump, cases, tmp_path, per_case=1.0)
    counts = summarize(results)
    print(f"200 truncations of a {size}-byte dump: {dict(counts)}")
    assert counts["blockdiff_error"] == 200, {k: v for k, v in results.items() if v["outcome"] != "blockdiff_error"}
    assert max(r["seconds"] for r in results.values()) < 1.0


def test_the_probe_contains_a_crash_and_a_hang(small_dump, monkeypatch):
    """A file that crashes or hangs libhdf5 becomes a DumpError, not a dead process."""
    import blockdiff.dump.probe as probe  # probe_file reads PROBE_SCRIPT there

    monkeypatch.setattr(probe, "PROBE_SCRIPT", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(DumpError, match=r"crashed libhdf5 \(signal 11\)"):
        DumpReader(small_dump)
    monkeypatch.setattr(probe, "PROBE_SCRIPT", "import time; time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(DumpError, match="hung inside libhdf5"):
        probe_file(small_dump, timeout=1.0)
    assert time.monotonic() - start < 10


def test_the_probe_passes_a_good_dump_and_the_reader_reads_it(small_dump):
    probe_file(small_dump)
    with DumpReader(small_dump) as reader:
        assert reader.verify_all().tensors > 0


def test_checksums_off_writes_no_filter_and_must_be_read_unverified(tmp_path, ids):
    import h5py

    from blockdiff.dump import DumpWriter
    from blockdiff.site import Site

    path = tmp_path / "plain.h5"
    with DumpWriter(path, meta={}, checksums=False) as writer:
        writer.add(Site("block", 0, "ffn", "m", 0, 0, output=torch.ones(3, 4)))
    with h5py.File(path, "r") as f:
        assert not f["tensors/float32.0"].fletcher32 and "crc32c" not in f["index"].attrs
        assert "crc32c" not in json.loads(f["index"][()])["tensors"][0]
    with DumpReader(path, verify=False) as reader:
        assert torch.equal(reader.block_sites(0)[0].output, torch.ones(3, 4))
    with pytest.raises(DumpError, match="checksums off"):
        with DumpReader(path) as reader:
            reader.block_sites(0)


def test_crc32c_is_castagnolis_checksum_of_the_bytes_where_they_are():
    import numpy as np

    from blockdiff.dump.format import crc32c, tensor_crc32c

    assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value
    a = np.arange(1000, dtype=np.float32)
    # A numpy array or a memoryview is read in place, and a checksum continues another.
    assert crc32c(a) == crc32c(a.tobytes()) == crc32c(memoryview(a)[500:], crc32c(memoryview(a)[:500]))
    with pytest.raises(ValueError, match="contiguous"):  # refused, never copied
        crc32c(a.reshape(10, 100)[:, ::2])
    # A tensor's checksum is of its bytes in C order, little-endian: 8 hex digits, as stored
    # since schema 2 (tests/data/schema3.h5 verifies with it, test_dump.py).
    assert tensor_crc32c(a.astype(">f4").reshape(10, 100).T.copy().T) == format(crc32c(a.tobytes()), "08x")
    assert tensor_crc32c(np.zeros(0, np.float32)) == "00000000"
