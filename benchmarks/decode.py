"""What a decode diff costs, measured side by side in one run.

On a small Hugging Face Llama (4 blocks, hidden 256, intermediate 688, vocab 4096; batch 1,
a prompt of 32 tokens, float32, CPU) it times a 32-step cached generation on both sides
(prefill and 32 greedy steps, each side its own DynamicCache, no blockdiff), then
``blockdiff diff --decode 32`` of the model against itself, pair by pair, and prints their
ratio (goal ≤ 4); the same against a candidate with a bug in block 1 (where no experiment
is answered by a recorded call); then the diff at 16, 32 and 64 steps, whose time should
grow linearly with the steps (the experiments carry their caches from step to step: no
prefix replay).

    python benchmarks/decode.py            # about a minute on 2 cores
    python benchmarks/decode.py --quick    # 2 blocks, for a smoke run
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from blockdiff import Options, run  # noqa: E402


def build(blocks: int) -> torch.nn.Module:
    import transformers

    from blockdiff.weights import trained_looking_

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=blocks,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
    )
    return trained_looking_(transformers.LlamaForCausalLM(config), seed=0).eval()


def generate(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> None:
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    ids = prompt
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1)[:, None]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    quick = "--quick" in sys.argv
    torch.set_num_threads(2)
    blocks, repeat = (2, 1) if quick else (4, 5)
    reference, candidate = build(blocks), build(blocks)
    prompt = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    print(f"model: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M parameters, {blocks} blocks, prompt 32")
    diff = lambda steps: run(reference, candidate, prompt, options=Options(decode=steps))  # noqa: E731
    diff(2)  # warm up
    # Side by side: each pair is a generation on both sides and a diff, one right after the other.
    pairs = []
    for _ in range(repeat):
        both = best(lambda: (generate(reference, prompt, 32), generate(candidate, prompt, 32)), 1)
        pairs.append((both, best(lambda: diff(32), 1)))
    ratios = sorted(d / g for g, d in pairs)
    both, diffed = sorted(g for g, _ in pairs)[len(pairs) // 2], sorted(d for _, d in pairs)[len(pairs) // 2]
    print(f"32-step generation, both sides: {both * 1e3:.0f} ms (median of {repeat})")
    print(f"decode diff, 32 steps:          {diffed * 1e3:.0f} ms (median of {repeat})")
    print(f"ratio: median {ratios[len(ratios) // 2]:.2f}, pairs {', '.join(f'{r:.2f}' for r in ratios)}   (goal <= 4)")
    # A candidate that diverges from the prompt on (block 1's attention scaled): from there
    # on no experiment is answered by a recorded call, every experiment cache is made.
    buggy = build(blocks)
    buggy.model.layers[1].self_attn.scaling *= 1.05
    pairs = []
    for _ in range(max(1, repeat // 2)):
        both = best(lambda: (generate(reference, prompt, 32), generate(buggy, prompt, 32)), 1)
        pairs.append(best(lambda: run(reference, buggy, prompt, options=Options(decode=32)), 1) / both)
    print(f"with a bug in block 1 (every experiment runs): ratio median {sorted(pairs)[len(pairs) // 2]:.2f}")
    diffs = {steps: best(lambda: diff(steps), max(1, repeat // 2)) for steps in (16, 32, 64)}
    print(
        f"decode diff at 16 / 32 / 64 steps: {diffs[16]:.2f} / {diffs[32]:.2f} / {diffs[64]:.2f} s; "
        f"per step {diffs[16] / 17 * 1e3:.0f} / {diffs[32] / 33 * 1e3:.0f} / {diffs[64] / 65 * 1e3:.0f} ms "
        "(linear: the same per step)"
    )


if __name__ == "__main__":
    main()
