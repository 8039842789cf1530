"""What ranking costs, measured side by side in one run.

On the Llama-style model of ``overhead.py`` (8 blocks, hidden 512, intermediate 1376, vocab
32000; batch 1, seq 256, CPU) against its dynamic-int8 quantization (every check differs,
every module is drilled), it times a plain diff, ``rank=True`` (every module's children
drilled and ranked) and ``rank=True, baseline_dtype=bfloat16`` (plus the reference's floors
at bfloat16), and prints each as a ratio to the plain diff.

    python benchmarks/rank.py            # a few minutes on 2 cores
    python benchmarks/rank.py --quick    # smaller model, for a smoke run
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.overhead import build, setup, timed  # noqa: E402
from blockdiff import diff  # noqa: E402


def main() -> None:
    sizes, seq, repeat, ids, _ = setup(__doc__, repeat=2)
    reference = build(8, **sizes)
    candidate = torch.ao.quantization.quantize_dynamic(build(8, **sizes), {torch.nn.Linear}, dtype=torch.qint8)
    ways = {
        "diff": {},
        "diff --rank": {"rank": True},
        "diff --rank --baseline-dtype bfloat16": {"rank": True, "baseline_dtype": torch.bfloat16},
    }
    seconds = {name: timed(lambda kw=kw: diff(reference, candidate, ids, **kw), repeat) for name, kw in ways.items()}
    print(f"model: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M parameters, 8 blocks, seq {seq}; candidate: dynamic int8")
    print(f"{'run':42} {'seconds':>8} {'ratio':>6}")
    for name, value in seconds.items():
        print(f"{name:42} {value:8.2f} {value / seconds['diff']:6.2f}")


if __name__ == "__main__":
    main()
