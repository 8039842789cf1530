"""False alarms of clean bfloat16 candidates, every MoE family, seeds 0-4.

For each family of ``samples/hf_moe.py`` (plus Mixtral, Qwen2-MoE, Qwen3-MoE and
SwitchTransformers), builds the tiny model at each seed, diffs it against itself cast to
bfloat16 on 128 tokens (batch 4 × seq 32; SwitchTransformers and NLLB-MoE: encoder 4 × 32,
decoder 4 × 16), and counts the runs that blame anything (a false alarm), with the routing
flips the router checks saw: all flips, those the reference's router at bfloat16 makes too,
those whose reference margin exceeds the logit noise (unexplained without the floor's
router), and those unexplained.

    python benchmarks/moe_families.py                 # every family, seeds 0-4 (~5 min)
    python benchmarks/moe_families.py dbrx jamba --seeds 0 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from blockdiff import diff  # noqa: E402
from samples import hf_moe  # noqa: E402

BUNDLED = ("mixtral", "qwen2_moe", "qwen3_moe")
ALL = (*BUNDLED, *hf_moe.FAMILIES, "switch")


def build(family: str, seed: int) -> torch.nn.Module:
    if family in BUNDLED:
        return hf_moe.build(arch=family, seed=seed)
    if family == "switch":
        return hf_moe.build_switch(seed=seed, expert_capacity=64)
    return hf_moe.build_family(family, seed=seed)


def inputs(family: str, seed: int):
    ids = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(seed))
    if family == "switch":
        return dict(input_ids=ids, decoder_input_ids=ids[:, :16])
    return hf_moe.family_inputs(family, ids)


def run(family: str, seed: int) -> dict:
    report = diff(build(family, seed), build(family, seed).to(torch.bfloat16), inputs(family, seed))
    flips = [m["local_flips"] for m in report.moe if m["local_flips"]]
    fd = report.first_divergence
    return {
        "blamed": None if fd is None else f"{fd.stage} {fd.block} {fd.subpath} ({fd.check.what})",
        "moe_blocks": len(report.moe),
        "flipped": sum(f["flipped"] for f in flips),
        "reproduced": sum(f.get("reproduced_by_floor", 0) for f in flips),
        "beyond_margin": sum(sum(m > f["margin_tolerance"] for m in f["flip_margins"]) for f in flips),
        "unexplained": sum(f["unexplained"] for f in flips),
        "free_flips": sum(len(m["agreement"]["flipped_tokens"]) for m in report.moe),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=list(ALL))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    args = parser.parse_args()
    print(f"{'family':12} {'false alarms':>12} {'moe blocks':>10} {'local flips':>11} {'by floor':>8} "
          f"{'beyond margin':>13} {'unexplained':>11} {'free-run flips':>14}  blamed")
    total = 0
    for family in args.families:
        rows = [run(family, seed) for seed in args.seeds]
        alarms = [f"seed {s}: {r['blamed']}" for s, r in zip(args.seeds, rows) if r["blamed"]]
        total += len(alarms)
        print(
            f"{family:12} {len(alarms):>7}/{len(rows):<4} {rows[0]['moe_blocks']:>10} "
            f"{sum(r['flipped'] for r in rows):>11} {sum(r['reproduced'] for r in rows):>8} "
            f"{sum(r['beyond_margin'] for r in rows):>13} {sum(r['unexplained'] for r in rows):>11} {sum(r['free_flips'] for r in rows):>14}  {'; '.join(alarms)}",
            flush=True,
        )
    print(f"false alarms: {total}")


if __name__ == "__main__":
    main()
