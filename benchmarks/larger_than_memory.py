"""Models larger than memory: a diff reading both sides from disk (``--max-memory``) against
the diff of the two models whole in memory, side by side in one run.

    python benchmarks/larger_than_memory.py                  # 8 and 32 blocks, hidden 1024
    python benchmarks/larger_than_memory.py --real           # 2 x 2.2 GB checkpoints, --max-memory 1GiB

Each diff is a ``blockdiff diff`` process of its own (this one imports no torch, so the
peak a child reports is its own): its peak resident memory (``ru_maxrss`` from ``wait4``)
and wall time, and for the diff from disk the rate it read weights at (from its report's
note). Checkpoints are Hugging Face Llama directories written by ``save_pretrained`` in
sharded safetensors (500 MB shards) by a child process, kept under ``--dir`` between runs.

``--real`` is issue 56's figure: two float32 checkpoints of 2.2 GB (8 blocks, hidden 2048),
a norm weight planted in block 5 of the candidate, and a bfloat16 copy of the reference
diffed with ``--cand-dtype bfloat16``; the diffs in memory beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WRITE = """
import sys, torch, transformers
hidden, blocks, out, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=blocks, num_attention_heads=hidden // 128,
    num_key_value_heads=hidden // 128, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False,
)
model = transformers.LlamaForCausalLM(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.8, 1.2)
    if kind == "bug":
        model.model.layers[5 if blocks > 5 else blocks - 1].post_attention_layernorm.weight.mul_(1.5)
    if kind == "bf16":
        model = model.to(torch.bfloat16)
model.save_pretrained(out, max_shard_size="500MB")
"""


def checkpoint(folder: Path, hidden: int, blocks: int, kind: str) -> str:
    path = folder / f"llama-h{hidden}-b{blocks}-{kind}"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-c", _WRITE, str(hidden), str(blocks), str(path), kind], check=True)
    return str(path)


def diff(*args: str) -> dict:
    """One ``blockdiff diff`` process: exit code, peak resident memory, wall time, read rate."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "r.json"
        said, errors = Path(scratch) / "out", Path(scratch) / "err"  # files: a pipe could fill before wait4 returns
        started = time.perf_counter()
        with open(said, "w") as out_file, open(errors, "w") as err_file:
            child = subprocess.Popen(
                [sys.executable, "-m", "blockdiff", "diff", *args, "--seq", "32", "--batch", "1", "--json", str(report), "-q"],
                cwd=ROOT, stdout=out_file, stderr=err_file, env={**os.environ, "NO_COLOR": "1"},
            )
            _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        out, err = said.read_text(), errors.read_text()
        code = os.waitstatus_to_exitcode(status)
        if code not in (0, 1):
            raise SystemExit(f"blockdiff diff {' '.join(args)} exited {code}:\n{err[-3000:]}")
        notes = json.loads(report.read_text())["notes"]
    said = next((n for n in notes if n.startswith("weights read from disk")), "")
    rate = re.search(r"read at ([0-9]+) MB/s", said)
    return {
        "code": code, "peak": usage.ru_maxrss * 1024, "wall": wall, "verdict": out.strip().splitlines()[-1],
        "rate": int(rate.group(1)) if rate else None,
    }


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def compare(ref: str, cand: str, budget: str, *extra: str) -> None:
    streamed = diff(ref, cand, "--max-memory", budget, *extra)
    whole = diff(ref, cand, *extra)
    print(f"  read from disk (--max-memory {budget}): exit {streamed['code']}, peak {gib(streamed['peak'])}, "
          f"{streamed['wall']:.1f} s, weights read at {streamed['rate']} MB/s — {streamed['verdict']}")
    print(f"  whole in memory:                 exit {whole['code']}, peak {gib(whole['peak'])}, "
          f"{whole['wall']:.1f} s — {whole['verdict']}")
    print(f"  peak ratio {streamed['peak'] / whole['peak']:.2f}, wall-time ratio {streamed['wall'] / whole['wall']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "blockdiff-larger-than-memory"))
    parser.add_argument("--real", action="store_true", help="the 2 x 2.2 GB figure")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", default="8,32")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    if args.real:
        ref = checkpoint(folder, 2048, 8, "clean")
        size = sum(f.stat().st_size for f in Path(ref).glob("*.safetensors"))
        print(f"float32 Llama, 8 blocks, hidden 2048: {size / 1e9:.2f} GB per checkpoint")
        print("norm weight of block 5 scaled by 1.5:")
        compare(ref, checkpoint(folder, 2048, 8, "bug"), "1GiB")
        print("a bfloat16 copy of the reference, --cand-dtype bfloat16:")
        compare(ref, checkpoint(folder, 2048, 8, "bf16"), "1GiB", "--cand-dtype", "bfloat16")
        return
    for blocks in (int(b) for b in args.blocks.split(",")):
        ref = checkpoint(folder, args.hidden, blocks, "clean")
        size = sum(f.stat().st_size for f in Path(ref).glob("*.safetensors"))
        print(f"{blocks} blocks, hidden {args.hidden}: {size / 1e9:.2f} GB per checkpoint, planted bug in block 5")
        compare(ref, checkpoint(folder, args.hidden, blocks, "bug"), "1GiB")


if __name__ == "__main__":
    main()
