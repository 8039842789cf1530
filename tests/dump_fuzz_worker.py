"""Worker for tests/test_dump_integrity.py: reads damaged copies of a dump, one case a
line, and prints one JSON line per case. Run in a subprocess, so that a crash or a hang
inside libhdf5 ends this process only; the test counts those and carries on.

    python tests/dump_fuzz_worker.py ORIGINAL.h5 WORKDIR CASE [CASE ...]

A case is ``flip:SEED`` (1-8 random bit flips anywhere in the file) or ``cut:SIZE``
(the file truncated to SIZE bytes).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from blockdiff.dump import DumpReader
from blockdiff.errors import BlockdiffError
from blockdiff.site import map_structure


def fingerprint(path: Path) -> list:
    """Everything a reader returns (metadata, inputs, every site), tensors as raw bits."""

    def tensor(t):
        flat = t.detach().contiguous().reshape(-1)
        return (str(t.dtype), tuple(t.shape), flat.view(__import__("torch").uint8).tolist() if flat.numel() else [])

    with DumpReader(path, probe=False) as dump:
        out = [sorted((k, repr(v)) for k, v in dump.meta.items()), map_structure(dump.inputs(), tensor)]
        for s in dump.iter_sites():
            out.append((s.key, s.module, s.call, s.order, *(map_structure(x, tensor) for x in (s.args, s.kwargs, s.output))))
        dump.verify_all()
    return out


def mutate(original: bytes, case: str) -> bytes:
    kind, _, value = case.partition(":")
    if kind == "cut":
        return original[: int(value)]
    rng = random.Random(int(value))
    data = bytearray(original)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data)


def main() -> None:
    original_path, workdir, *cases = sys.argv[1:]
    original = Path(original_path).read_bytes()
    want = fingerprint(Path(original_path))
    target = Path(workdir) / "mutant.h5"
    for case in cases:
        print(json.dumps({"case": case, "started": True}), flush=True)
        target.write_bytes(mutate(original, case))
        start = time.perf_counter()
        try:
            got = fingerprint(target)
            outcome = "identical" if got == want else "silent_mismatch"
            detail = ""
        except BlockdiffError as exc:
            outcome, detail = "blockdiff_error", str(exc)
        except Exception as exc:  # anything else is a failure of the reader
            outcome, detail = "other_exception", f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        print(json.dumps({"case": case, "outcome": outcome, "detail": detail[:300], "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
