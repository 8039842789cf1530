"""What a backward diff costs, measured side by side in one run.

On a small Hugging Face Llama (6 blocks, hidden 512, intermediate 1376, vocab 8192, 45M
parameters; batch 2, 128 tokens, CPU, 2 threads) it times one forward and backward of each side on the default loss (no
blockdiff: the loss and ``torch.autograd.grad`` of every parameter), then
``blockdiff diff --backward`` of the same two sides, and prints the ratio diff / (forward
and backward of both sides) for three pairs (goal ≤ 4):

- float32 against float32 (fixed thresholds: no floors);
- float32 against its own bfloat16 cast (calibrated: the candidate is the floor's twin, so
  its experiments are the floors);
- float32 against a bfloat16 candidate that is not the reference's code (calibrated: every
  floor measured on the reference's own code in bfloat16).

Each figure is the best of ``--repeat`` runs (default 5), wall-clock and CPU time, the
two timed in turn so that a busy machine slows both alike.

    python benchmarks/backward.py            # about a minute on 2 cores
    python benchmarks/backward.py --quick    # 2 blocks, for a smoke run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from blockdiff import Options, run  # noqa: E402
from blockdiff.loss import next_token_loss  # noqa: E402


def build(blocks: int, *, other_code: bool = False) -> torch.nn.Module:
    """The Llama; ``other_code``: the same weights, every module under a subclass of its
    class (another implementation of the same model, as far as blockdiff can tell: every
    floor is measured)."""
    import transformers

    from blockdiff.weights import trained_looking_

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=blocks,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
    )
    model = trained_looking_(transformers.LlamaForCausalLM(config), seed=0).eval()
    if other_code:  # every module of a class of its own: no experiment is the floor's
        for module in model.modules():
            module.__class__ = type("Ported" + type(module).__name__, (type(module),), {})
    return model


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    params = [p for p in model.parameters() if p.is_floating_point()]
    loss = next_token_loss(model(input_ids=ids, use_cache=False), ids)
    torch.autograd.grad(loss, params)


def timed(fn) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process's, every thread) of one ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    repeat = int(argv[argv.index("--repeat") + 1]) if "--repeat" in argv else (1 if quick else 5)
    torch.set_num_threads(2)
    blocks = 2 if quick else 6
    ids = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(0))
    pairs = {
        "float32 vs float32 (fixed)": (build(blocks), build(blocks)),
        "float32 vs its bfloat16 cast (calibrated)": (build(blocks), build(blocks).to(torch.bfloat16)),
        "float32 vs other bfloat16 code (calibrated)": (build(blocks), build(blocks, other_code=True).to(torch.bfloat16)),
    }
    print(f"Llama, {blocks} blocks, hidden 512, batch 2 x 128 tokens, CPU, 2 threads; best of {repeat}")
    for name, (reference, candidate) in pairs.items():
        reports = []

        def plain() -> None:
            forward_backward(reference, ids)
            forward_backward(candidate, ids)

        def diff() -> None:
            reports.append(run(reference, candidate, ids, options=Options(backward=True)))

        plain(), diff()  # warm-up
        # Side by side: each repeat times both, so that a busy machine slows both alike.
        runs = [(timed(plain), timed(diff)) for _ in range(repeat)]
        assert not any(r.diverged for r in reports), reports[-1].verdict()
        (wall, cpu), (diff_wall, diff_cpu) = [tuple(min(t[i][k] for t in runs) for k in (0, 1)) for i in (0, 1)]
        print(f"  {name}: forward+backward of both sides {wall:.3f} s, diff --backward {diff_wall:.3f} s: "
              f"ratio {diff_wall / wall:.2f} wall, {diff_cpu / cpu:.2f} CPU (goal <= 4)")


if __name__ == "__main__":
    main(sys.argv[1:])
