"""One rank of the sharded tests (tests/test_sharded.py): runs scenarios through
``blockdiff.run`` inside the process group, in lockstep with the other ranks; each
rank writes what it found as JSON (``OUT.rankN``): every rank must have found the same.

    python tests/sharded_worker.py SCENARIOS.json OUT.json    (each rank, with torchrun's environment)

A scenario: {"name", "reference", "candidate", "dtype", "hooks"?, "backward"?}; ``reference``
may be a dump's path (a replay)."""

from __future__ import annotations

import json
import sys
import traceback
from functools import partial

import torch
import torch.distributed as dist

from blockdiff import Options, RandomTokens, Report, run
from blockdiff import distributed, hookmap
from blockdiff.assertion import DivergenceError, assert_no_divergence
from blockdiff.loading import build_model, is_dump


def side(spec: str, dtype: torch.dtype):
    return spec if is_dump(spec) else partial(build_model, spec, device=torch.device("cpu"), dtype=dtype)


def outcome(report) -> dict:
    first = report.first_divergence
    back = Report.from_dict(json.loads(json.dumps(report.to_dict())))  # the JSON form read back
    return {
        "round_trip": back.to_dict() == report.to_dict()
        and (first is None or back.first_divergence.headline() == first.headline()),
        "diverged": report.diverged,
        "first": None if first is None else {
            "block": first.block, "subpath": first.subpath, "part": first.check.part,
            "what": first.check.what, "module": first.module, "headline": first.headline(),
        },
        "backward": None if report.backward is None else {
            "first": None if report.backward.first_divergence is None else report.backward.first_divergence.headline(),
            "notes": report.backward.notes,
        },
        "moe": report.moe,
        "notes": report.notes,
        "candidate": report.candidate,
    }


def main(scenarios_path: str, out_path: str) -> None:
    distributed.init_from_env()
    scenarios = json.load(open(scenarios_path))
    found = {}
    for scenario in scenarios:
        dtype = getattr(torch, scenario.get("dtype", "float32"))
        hooks = hookmap.load(scenario["hooks"]) if scenario.get("hooks") else None
        try:
            if scenario.get("api") == "assert":  # the assertion helper, on built models
                ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
                ref, cand = side(scenario["reference"], torch.float32)(), side(scenario["candidate"], dtype)()
                try:
                    report = assert_no_divergence(ref, cand, ids, candidate_hooks=hooks)
                except DivergenceError as exc:
                    report = exc.report
                found[scenario["name"]] = outcome(report)
                continue
            report = run(
                side(scenario["reference"], torch.float32),
                side(scenario["candidate"], dtype),
                RandomTokens(seed=scenario.get("seed", 0)),
                options=Options(candidate_hooks=hooks, stream=scenario.get("stream", False), backward=scenario.get("backward", False)),
            )
            found[scenario["name"]] = outcome(report)
        except Exception as exc:  # recorded, so that one scenario's failure names itself
            found[scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    for item in found.values():  # where the traceback went through differs by rank
        item.pop("traceback", None) if dist.get_rank() else None
    json.dump(found, open(f"{out_path}.rank{dist.get_rank()}", "w"), indent=1, default=str)
    distributed.finish()


if __name__ == "__main__":
    main(*sys.argv[1:])
