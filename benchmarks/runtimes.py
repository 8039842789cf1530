"""What a teacher-forced diff of a candidate in another runtime costs, against the runs it needs.

For the runtimes sample (samples/runtimes.py: the tiny Hugging Face Llama saved to a
directory; its f32 GGUF run by llama.cpp; the same directory loaded by mlx-lm), measured side
by side in one process: one forward of the reference, one run of the candidate in its
runtime, and a whole `blockdiff diff` of the two (the reference recorded, the candidate's free
run and its two replaced runs, localization, the report). Prints each median and
diff / (reference forward + candidate run). Run: python benchmarks/runtimes.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contextlib import ExitStack  # noqa: E402

from blockdiff.engine import run  # noqa: E402
from blockdiff.errors import InputError  # noqa: E402
from blockdiff.sides.factory import open_side  # noqa: E402
from blockdiff.inputs import RandomTokens  # noqa: E402
from samples import runtimes  # noqa: E402


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm: loads, first-call costs
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = RandomTokens(batch=2, seq=16, seed=0)
    ids = torch.randint(0, runtimes.VOCAB, (tokens.batch, tokens.seq), generator=torch.Generator().manual_seed(0))
    reference = runtimes.reference()

    def forward() -> None:
        with torch.no_grad():
            reference(ids)

    candidates = []
    opened = ExitStack()
    try:
        path = runtimes.gguf("f32")
        ref_side = open_side("reference", reference, opened=opened)
        gguf_side = open_side("candidate", str(path), opened=opened, like=ref_side)  # the GGUF loaded once
        candidates.append(("llama.cpp (f32 GGUF)", lambda: gguf_side.replaced(ids, lambda name: None), str(path)))
    except (ImportError, InputError) as exc:
        print(f"llama.cpp: skipped ({exc})")
    try:
        import mlx.core as mx

        mlx_model = runtimes.mlx_model()

        def mlx_run() -> None:
            mx.eval(mlx_model(mx.array(ids.numpy())))

        candidates.append(("MLX (mlx-lm)", mlx_run, runtimes.mlx_model))
    except ImportError as exc:
        print(f"MLX: skipped ({exc})")

    ref_time = median_seconds(forward, args.repeat)
    print(f"reference forward (HF Llama, 4 blocks, hidden 64, batch 2 x 16 tokens, 1 thread): {ref_time * 1e3:.1f} ms")
    for name, run_once, spec in candidates:
        own = median_seconds(run_once, args.repeat)
        whole = median_seconds(lambda: run(reference, spec, ids), args.repeat)
        print(
            f"{name}: one run {own * 1e3:.1f} ms; blockdiff diff {whole * 1e3:.1f} ms; "
            f"diff / (reference forward + one run) = {whole / (ref_time + own):.1f}x"
        )
    opened.close()


if __name__ == "__main__":
    main()
