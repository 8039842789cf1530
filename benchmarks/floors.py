"""What storing noise floors at capture costs, measured side by side in one run.

On the Llama-style model of ``overhead.py`` (8 blocks, hidden 512, intermediate 1376,
vocab 32000; batch 1, seq 256, float32, CPU) it captures the same dump three ways —
plain (streamed), with ``--floors bfloat16``, with ``--floors bfloat16,float16`` — and
prints each one's capture time and file size as a ratio to the plain capture's.

    python benchmarks/floors.py            # about two minutes on 2 cores
    python benchmarks/floors.py --quick    # smaller model, for a smoke run
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.overhead import build, setup, timed  # noqa: E402
from blockdiff.engine import capture  # noqa: E402


def main() -> None:
    sizes, seq, repeat, ids, _ = setup(__doc__, repeat=3)
    model = build(8, **sizes)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, 8 blocks, seq {seq}")
    ways = {
        "plain": [],
        "--floors bfloat16": [(torch.bfloat16, "cpu")],
        "--floors bfloat16,float16": [(torch.bfloat16, "cpu"), (torch.float16, "cpu")],
    }
    with tempfile.TemporaryDirectory() as folder:
        seconds, sizes_on_disk = {}, {}
        for name, floors in ways.items():
            path = Path(folder) / f"{len(floors)}.h5"
            seconds[name] = timed(lambda: capture(model, ids, path, floors=floors), repeat)
            sizes_on_disk[name] = path.stat().st_size
    base_t, base_s = seconds["plain"], sizes_on_disk["plain"]
    print(f"{'capture':28} {'seconds':>8} {'time ratio':>11} {'MiB':>8} {'size ratio':>11}")
    for name in ways:
        print(
            f"{name:28} {seconds[name]:8.2f} {seconds[name] / base_t:11.2f} "
            f"{sizes_on_disk[name] / 2**20:8.1f} {sizes_on_disk[name] / base_s:11.3f}"
        )


if __name__ == "__main__":
    main()
