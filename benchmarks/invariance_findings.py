"""What ``blockdiff invariance`` finds on real Hugging Face code on this machine.

For HF Llama, Qwen3 and Mixtral (the tiny configurations of ``samples/``), float32 and
bfloat16, every row of a batch of 8 and of 32 (16 random tokens each, no padding, then 8
rows padded on the left) is run alone and inside the batch, bit for bit; each line says
whether the model is invariant there and, if not, the first operation that breaks it, on
how many rows, and by how much. A finding, whatever it is: the README quotes the last run.

    python benchmarks/invariance_findings.py          # a few minutes on 2 cores
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from blockdiff.invariance import invariance  # noqa: E402

MODELS = {
    "Llama": "samples/hf_llama.py:build",
    "Qwen3": "samples/hf_llama.py:build_qwen3",
    "Mixtral": "samples/hf_moe.py:build",
}


def finding(spec: str, dtype: torch.dtype, batch: int, padding: str | None) -> str:
    start = time.perf_counter()
    report = invariance(spec, batch=batch, seq=16, padding=padding, dtype=dtype)
    took = time.perf_counter() - start
    first = report.first_divergence
    if first is None:
        return f"invariant ({took:.0f} s)"
    site = next(s for s in report.invariance["sites"] if s["module"] == first.module)
    child = first.check.first_child
    what = f", {first.check.what}" if first.check.part is not None else ""
    where = f"{first.where} ({first.module}{what}" + (f", child {child.module.rsplit('.', 1)[-1]}" if child is not None else "") + ")"
    return f"{where}: {len(site['rows'])}/{batch} rows, largest rel_l2 {site['largest']:.2g} ({took:.0f} s)"


def main() -> None:
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, spec in MODELS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for batch, padding in ((8, None), (32, None), (8, "left")):
                label = f"{name:8s} {str(dtype).removeprefix('torch.'):9s} batch {batch:2d}{' left-padded' if padding else ''}"
                print(f"{label:40s} {finding(spec, dtype, batch, padding)}", flush=True)


if __name__ == "__main__":
    main()
