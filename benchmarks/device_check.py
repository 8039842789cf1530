"""The GPU paths, checked in one command the day a GPU is lent.

On one CUDA GPU this runs, check by check, what blockdiff's CUDA code promises and prints a
line per check — ``ok`` / ``FAIL`` / ``skip``, what was expected, what was found, seconds —
and writes the same as JSON (``--json PATH``):

1. CPU float32 reference against a CUDA bfloat16 candidate, through the CLI, on HF Llama and
   HF Mixtral: clean → nothing blamed; planted bugs → exact block and sub-path;
2. capture overhead of a CUDA model (asynchronous device-to-host copies) / plain CUDA forward
   on the 58M benchmark model and a ~1B one (goal ≤ 1.10), and the CPU-fp32 vs CUDA-bf16
   diff / both forwards;
3. ``capture --floors bfloat16@cuda:0`` then a replay of a CUDA bfloat16 candidate gives the
   live calibrated diff's verdicts and ratios;
4. ``torch.compile`` (inductor) on CUDA: a clean compiled candidate blames nothing; a bug
   only in the compiled graph is blamed on its block and sub-path;
5. flex attention (its CUDA kernels) against sdpa in bfloat16: nothing blamed;
6. a process group with NCCL (world size 1: its collectives, then a diff inside it; with 2+
   GPUs, the tensor-parallel sample under torchrun);
7. decode steps on CUDA (clean, and a cache bug blamed on its step);
8. the backward diff on CUDA (clean, and a wrong weight gradient blamed, the forward clean).

``--dry-run`` runs the same checks on the CPU (CUDA replaced by the CPU where it can be,
inductor by ``aot_eager``; checks that need CUDA itself are skipped with the reason), and is
part of the default test run, so the script cannot rot.

    python benchmarks/device_check.py --json device.json      # on the GPU machine, ~5 minutes
    python benchmarks/device_check.py --dry-run                # here, ~1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CHECKS: list[tuple[str, Callable[["Context"], tuple[bool | None, str, str]]]] = []


def check(name: str) -> Callable:
    def register(fn: Callable) -> Callable:
        CHECKS.append((name, fn))
        return fn

    return register


class Context:
    """Where the checks run: ``device`` is ``cuda`` on a GPU, ``cpu`` in a dry run."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.cuda = torch.cuda.is_available() and not dry_run
        self.device = "cuda" if self.cuda else "cpu"
        self.scratch = Path(tempfile.mkdtemp(prefix="blockdiff-device-"))

    def skip_without_cuda(self, what: str) -> tuple[None, str, str] | None:
        if self.cuda:
            return None
        return None, what, "skipped: needs CUDA itself" + (" (dry run)" if self.dry_run else " (no GPU here)")


def cli(*args: str, report: bool = True) -> tuple[int, dict[str, Any] | None, str]:
    """``blockdiff`` in this process: exit code, the JSON report (a diff's), what it printed."""
    from blockdiff.cli import main

    out = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="blockdiff-cli-") as folder:
        path = Path(folder) / "r.json"
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                main([*args, *(["--json", str(path), "-q"] if report else [])])
            code = 0
        except SystemExit as exited:
            code = int(exited.code or 0)
        report = json.loads(path.read_text()) if path.exists() else None
    return code, report, out.getvalue()


def blamed(report: dict[str, Any] | None) -> str:
    first = None if report is None else report.get("first_divergence")
    if first is None:
        return "nothing blamed"
    where = f"block {first['block']} {first['subpath']}" if first["stage"] == "block" else first["stage"]
    step = f"step {first['step']} " if "step" in first else ""
    return step + where + (f" ({first['part']})" if first.get("part") else "")


HF_CASES = [
    ("samples/hf_llama.py:build", "samples/hf_llama.py:build", "nothing blamed"),
    ("samples/hf_llama.py:build", "samples/hf_llama.py:gelu_for_silu", "block 1 ffn"),
    ("samples/hf_llama.py:build", "samples/hf_llama.py:attention_scale", "block 1 attention"),
    ("samples/hf_llama.py:build", "samples/hf_llama.py:norm_as_layernorm", "block 1 norm"),
    ("samples/hf_llama.py:build", "samples/hf_llama.py:residual_dropped", "block 1 residual"),
    ("samples/hf_moe.py:build", "samples/hf_moe.py:build", "nothing blamed"),
    ("samples/hf_moe.py:build", "samples/hf_moe.py:not_renormalized", "block 1 ffn (router)"),
]


def _cross_device(reference: str, candidate: str, expected: str) -> Callable[[Context], tuple[bool, str, str]]:
    def run(ctx: Context) -> tuple[bool, str, str]:
        code, report, said = cli("diff", reference, candidate, "--ref-device", "cpu", "--cand-device", ctx.device,
                                 "--cand-dtype", "bfloat16", "--seq", "16")
        found = blamed(report)
        want_code = 0 if expected == "nothing blamed" else 1
        return found == expected and code == want_code, f"{expected}, exit {want_code}", f"{found}, exit {code}" + (
            "" if report is not None else f": {said.strip()[-200:]}"
        )

    return run


for _ref, _cand, _expected in HF_CASES:
    check(f"1 cpu-fp32 vs DEVICE-bf16 {_cand.removeprefix('samples/')}")(_cross_device(_ref, _cand, _expected))


def _launch_bound_models() -> Iterator[tuple[str, torch.nn.Module, torch.Tensor, Any]]:
    """The 58M and ~1B Llamas on CUDA, one at a time (name, model, 256 token ids, layout),
    each freed before the next is built."""
    from benchmarks.overhead import build
    from blockdiff import resolve

    for name, blocks, sizes in (("58M", 8, dict(hidden=512, intermediate=1376, vocab=32000)),
                                ("~1B", 16, dict(hidden=2048, intermediate=5632, vocab=32000))):
        model = build(blocks, **sizes).to("cuda").eval()
        yield name, model, torch.randint(0, sizes["vocab"], (1, 256), device="cuda"), resolve(model)
        del model
        torch.cuda.empty_cache()


@check("2 capture overhead on CUDA / plain CUDA forward (58M, ~1B)")
def capture_overhead(ctx: Context) -> tuple[bool | None, str, str]:
    skipped = ctx.skip_without_cuda("≤ 1.10 on both models")
    if skipped:
        return skipped
    from blockdiff.capture import record
    from blockdiff.store import MemoryStore

    found, ok = [], True
    for name, model, ids, layout in _launch_bound_models():

        def forward(model: torch.nn.Module = model) -> None:
            with torch.no_grad():
                model(ids)
            torch.cuda.synchronize()

        def captured(model: torch.nn.Module = model) -> None:
            record(model, layout, MemoryStore(), ids)
            torch.cuda.synchronize()

        forward(), captured()
        plain = min(_timed(forward) for _ in range(5))
        cap = min(_timed(captured) for _ in range(5))
        ratio = cap / plain
        ok &= ratio <= 1.10
        found.append(f"{name} {ratio:.2f}")
    from benchmarks.overhead import build
    from blockdiff import diff

    reference = build(8, hidden=512, intermediate=1376, vocab=32000).eval()
    candidate = build(8, hidden=512, intermediate=1376, vocab=32000).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, 256))

    def forwards() -> None:
        with torch.no_grad():
            reference(ids)
            candidate(ids.to("cuda"))
        torch.cuda.synchronize()

    forwards()
    both = min(_timed(forwards) for _ in range(3))
    diffed = min(_timed(lambda: diff(reference, candidate, ids)) for _ in range(2))
    found.append(f"diff cpu-fp32 vs cuda-bf16 / both forwards (58M) {diffed / both:.2f}")
    return ok, "capture / forward ≤ 1.10 on both", "; ".join(found)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@check("3 capture --floors bfloat16@DEVICE, replay = the live calibrated diff")
def stored_floors(ctx: Context) -> tuple[bool, str, str]:
    at = "cuda:0" if ctx.cuda else "cpu"
    dump = ctx.scratch / "floors.h5"
    code, _, said = cli("capture", "samples/hf_llama.py:build", "--out", str(dump), "--floors", f"bfloat16@{at}", "--seq", "16",
                        report=False)
    if not dump.exists():
        return False, "a dump with floors", said.strip()[-300:]
    live_code, live, _ = cli("diff", "samples/hf_llama.py:build", "samples/hf_llama.py:gelu_for_silu",
                             "--cand-device", ctx.device, "--cand-dtype", "bfloat16", "--seq", "16")
    replay_code, replay, _ = cli("diff", str(dump), "samples/hf_llama.py:gelu_for_silu",
                                 "--cand-device", ctx.device, "--cand-dtype", "bfloat16")

    def ratios(report: dict[str, Any] | None) -> list[float]:
        found = []
        for block in (report or {}).get("blocks", []):
            for name in sorted(block["subpaths"]):
                for c in block["subpaths"][name].get("checks", []):
                    value = c.get("ratio")
                    found.append(round(float(value), 3) if isinstance(value, (int, float)) else value)
        return found

    same = bool(ratios(live)) and blamed(live) == blamed(replay) and live_code == replay_code and ratios(live) == ratios(replay)
    return same, f"live: {blamed(live)}, exit {live_code}", f"replay: {blamed(replay)}, exit {replay_code}, " + (
        "every check's ratio the same" if ratios(live) == ratios(replay) else "ratios differ")


@check("4 torch.compile on DEVICE: clean, and a bug only in the compiled graph")
def compiled(ctx: Context) -> tuple[bool, str, str]:
    import blockdiff
    from samples import bugs, tinylm

    backend = "inductor" if ctx.cuda else "aot_eager"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    clean = blockdiff.diff(tinylm.build().to(ctx.device), torch.compile(tinylm.build().to(ctx.device), backend=backend), ids)
    bug = blockdiff.diff(tinylm.build().to(ctx.device), torch.compile(
        bugs._plant(1, "ffn", bugs.CompiledOnly).to(ctx.device), backend=backend), ids)

    def where(report: Any) -> str:
        first = report.first_divergence
        return "nothing blamed" if first is None else first.where

    ok = where(clean) == "nothing blamed" and where(bug) == "block 1 ffn"
    return ok, f"{backend}: nothing blamed; block 1 ffn", f"{where(clean)}; {where(bug)}"


@check("5 flex attention (CUDA kernels) vs sdpa, bfloat16")
def flex(ctx: Context) -> tuple[bool | None, str, str]:
    skipped = ctx.skip_without_cuda("nothing blamed")
    if skipped:
        return skipped
    from blockdiff import diff
    from samples import hf_llama

    ids = torch.randint(0, 256, (2, 128), device="cuda")
    report = diff(hf_llama.build().to("cuda", torch.bfloat16), hf_llama.build_flex().to("cuda", torch.bfloat16), ids)
    found = "nothing blamed" if report.first_divergence is None else report.first_divergence.headline()
    return found == "nothing blamed", "nothing blamed", found


@check("6 a process group with NCCL (gloo in a dry run): collectives, a diff inside it")
def process_group(ctx: Context) -> tuple[bool, str, str]:
    port = _free_port()
    script = f"""
import torch, torch.distributed as dist
from blockdiff import distributed, Options, run
backend = "cpu:gloo,cuda:nccl" if {ctx.cuda} else "gloo"
dist.init_process_group(backend, init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
device = "{ctx.device}"
x = torch.arange(6.0, device=device)
parts = [torch.empty_like(x)]
dist.all_gather(parts, x)
assert torch.equal(parts[0], x) and distributed.every_rank("ok") == ["ok"]
report = run("samples/hf_llama.py:build", "samples/hf_llama.py:build",
             options=Options(devices=("cpu", device), dtypes=(torch.float32, torch.bfloat16)))
print("blamed", report.first_divergence is not None)
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    ok = done.returncode == 0 and "blamed False" in done.stdout
    found = "collectives ran, nothing blamed" if ok else (done.stdout + done.stderr).strip()[-300:]
    if ctx.cuda and torch.cuda.device_count() >= 2:
        tp = subprocess.run(["torchrun", "--nproc-per-node", "2", "-m", "blockdiff", "diff", "samples/hf_llama.py:build",
                             "samples/sharded.py:llama_tp", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        ok &= tp.returncode == 0
        found += f"; tensor-parallel sample over 2 GPUs: exit {tp.returncode}"
    else:
        found += "; the tensor-parallel sample needs 2 GPUs: not run"
    return ok, "world size 1: collectives ran, a clean diff blames nothing (blockdiff's lockstep needs 2+ ranks)", found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@check("7 decode steps, cpu-fp32 vs DEVICE-bf16: clean, and a cache written one slot early")
def decode(ctx: Context) -> tuple[bool, str, str]:
    found = []
    for candidate, expected in (("samples/hf_llama.py:build", "nothing blamed"),
                                ("samples/decode_bugs.py:cache_one_slot_early", "step 1 block 1 attention (kv cache)")):
        code, report, said = cli("diff", "samples/hf_llama.py:build", candidate, "--cand-device", ctx.device,
                                 "--cand-dtype", "bfloat16", "--decode", "4", "--seq", "8")
        found.append(blamed(report) if report is not None else said.strip()[-200:])
    return found == ["nothing blamed", "step 1 block 1 attention (kv cache)"], \
        "nothing blamed; step 1 block 1 attention (kv cache)", "; ".join(found)


@check("8 backward, cpu-fp32 vs DEVICE-bf16: clean, and a fused norm's wrong weight gradient")
def backward(ctx: Context) -> tuple[bool, str, str]:
    found = []
    for candidate in ("samples/hf_llama.py:build", "samples/backward_bugs.py:fused_norm_weight_grad"):
        code, report, said = cli("diff", "samples/hf_llama.py:build", candidate, "--cand-device", ctx.device,
                                 "--cand-dtype", "bfloat16", "--backward", "--seq", "8")
        if report is None:
            found.append(said.strip()[-200:])
            continue
        found.append(f"forward: {blamed(report)}, backward: {blamed(report.get('backward'))}")
    expected = ["forward: nothing blamed, backward: nothing blamed", "forward: nothing blamed, backward: block 1 norm"]
    return found == expected, "; ".join(expected), "; ".join(found)


@check("9 weights read from disk (--max-memory), cpu-fp32 vs DEVICE-bf16: clean, and a norm weight planted in block 2")
def disk_weights(ctx: Context) -> tuple[bool, str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from samples import hf_llama

    reference, planted = ctx.scratch / "reference", ctx.scratch / "planted"
    hf_llama.build().save_pretrained(reference, max_shard_size="200KB")
    model = hf_llama.build()
    with torch.no_grad():
        model.model.layers[2].post_attention_layernorm.weight.mul_(1.5)
    model.save_pretrained(planted)
    found = []
    for candidate in (reference, planted):
        code, report, said = cli("diff", str(reference), str(candidate), "--cand-device", ctx.device,
                                 "--cand-dtype", "bfloat16", "--max-memory", "4MiB", "--seq", "16")
        found.append(blamed(report) if report is not None else said.strip()[-200:])
    return found == ["nothing blamed", "block 2 norm"], "nothing blamed; block 2 norm", "; ".join(found)


@check("10 a tensor written in place after its hook (HF Falcon's MLP output), captured on DEVICE: as the hook saw it")
def written_after_hook(ctx: Context) -> tuple[bool | None, str, str]:
    """The race of asynchronous copies (capture.DeviceCopies), closed by the snapshot on the
    forward's stream: the capture with copies on a side stream against the same CUDA model
    captured with synchronous copies (bit for bit), and against its CPU capture."""
    skipped = ctx.skip_without_cuda("equal bit for bit to a synchronous capture; the CPU capture within 1e-4")
    if skipped:
        return skipped
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from blockdiff import resolve
    from blockdiff.capture import Snapshots, capture, record
    from blockdiff.store import MemoryStore
    from samples import tinylm

    model = tinylm.build_adds_into_ffn(block=1)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 64))
    layout = resolve(model)
    on_cpu = MemoryStore()
    record(model, layout, on_cpu, ids)
    model = model.to("cuda")
    stores = {}
    for name, snapshots in (("async", Snapshots()), ("sync", Snapshots(lockstep=True))):
        stores[name] = MemoryStore()
        with capture(model, layout, stores[name], snapshot=snapshots), torch.no_grad():
            model(ids.to("cuda"))
        torch.cuda.synchronize()

    def outputs(store: MemoryStore) -> dict[Any, torch.Tensor]:
        return {s.key: s.primary_output() for i in store.block_indices() for s in store.block_sites(i)}

    got, sync, cpu = (outputs(stores["async"]), outputs(stores["sync"]), outputs(on_cpu))
    unequal = [str(k) for k in sync if not torch.equal(got[k].cpu(), sync[k].cpu())]
    worst = max(float((got[k].cpu() - cpu[k]).norm() / cpu[k].norm().clamp_min(1e-30)) for k in cpu)
    ok = not unequal and worst <= 1e-4
    return ok, "equal bit for bit to a synchronous capture; the CPU capture within 1e-4", \
        f"{len(sync) - len(unequal)}/{len(sync)} sites equal bit for bit; largest rel_l2 against the CPU {worst:.2e}"


@check("11 graph taps (blockdiff.taps): a forward's sites copied by its CUDA graph, record / forward on 58M and ~1B")
def graph_taps(ctx: Context) -> tuple[bool | None, str, str]:
    """The opt-in CUDA-graph capture: each model's graph-tapped record against its eager
    capture (every tensor within 1e-6), and its cost over the eager forward (goal <= 1.10)."""
    skipped = ctx.skip_without_cuda("records equal to the eager capture; record / forward <= 1.10 on both")
    if skipped:
        return skipped
    from blockdiff.capture import record
    from blockdiff.site import iter_tensors
    from blockdiff.store import MemoryStore
    from blockdiff.taps import GraphTaps

    found, ok = [], True
    for name, model, ids, layout in _launch_bound_models():
        try:
            taps = GraphTaps(model, layout, ids)
        except Exception as exc:  # a model that cannot be captured as a graph: say why
            ok = False
            found.append(f"{name}: not capturable: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        eager = MemoryStore()
        record(model, layout, eager, ids)
        tapped = taps.record(ids)
        worst = 0.0
        for a, b in zip(eager.sites(), tapped.sites()):
            for x, y in zip(iter_tensors((a.args, a.kwargs, a.output)), iter_tensors((b.args, b.kwargs, b.output))):
                if x.is_floating_point():
                    worst = max(worst, float((x.float() - y.float()).norm() / x.float().norm().clamp_min(1e-30)))

        def forward(model: torch.nn.Module = model) -> None:
            with torch.no_grad():
                model(ids)
            torch.cuda.synchronize()

        def replayed(taps: GraphTaps = taps) -> None:
            taps.record(ids)
            torch.cuda.synchronize()

        forward(), replayed()
        plain = min(_timed(forward) for _ in range(5))
        tapped_time = min(_timed(replayed) for _ in range(5))
        ratio = tapped_time / plain
        ok &= ratio <= 1.10 and worst <= 1e-6 and len(eager.sites()) == len(tapped.sites())
        found.append(f"{name} {ratio:.2f} ({taps.nbytes / 2**20:.0f} MiB a record, largest rel_l2 to eager {worst:.1e})")
        del model, taps  # the generator frees the model's memory before the next
    return ok, "records equal to the eager capture; record / forward <= 1.10 on both", "; ".join(found)


@check("12 real size: a ~3B Llama, cpu-fp32 vs DEVICE-bf16: clean, and a norm weight planted in a late block")
def real_size(ctx: Context) -> tuple[bool, str, str]:
    """A Llama-shaped model of ~3.0B parameters (hidden 3072, 28 blocks, GQA 24/8, trained-
    looking random weights, built once) on the CPU in float32 against its copy on the GPU in
    bfloat16: nothing blamed; the same with block 26's second norm weight scaled by 1.5:
    that block's norm. Wall time, peak host memory and peak GPU memory printed. The dry run
    builds the same shape at a toy size (hidden 64, 6 blocks)."""
    import copy
    import time

    import transformers
    from transformers.initialization import no_init_weights

    from blockdiff import diff
    from blockdiff.diskweights import peak_memory
    from blockdiff.weights import trained_looking_

    sizes = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                 num_key_value_heads=8, vocab_size=32000) if ctx.cuda else \
        dict(hidden_size=64, intermediate_size=160, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
    late = sizes["num_hidden_layers"] - 2
    started = time.perf_counter()
    config = transformers.LlamaConfig(max_position_embeddings=1024, **sizes)
    with no_init_weights():
        reference = transformers.LlamaForCausalLM(config)
    trained_looking_(reference, seed=0).eval()
    params = sum(p.numel() for p in reference.parameters())
    candidate = copy.deepcopy(reference).to(ctx.device, torch.bfloat16).eval()
    built = time.perf_counter() - started
    ids = torch.randint(0, sizes["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(0))
    found, times = [], []
    for planted in (False, True):
        if planted:
            with torch.no_grad():
                candidate.model.layers[late].post_attention_layernorm.weight.mul_(1.5)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        report = diff(reference, candidate, ids)
        times.append(time.perf_counter() - started)
        found.append(blamed(report.to_dict()))
    gpu = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if ctx.cuda else ""
    expected = ["nothing blamed", f"block {late} norm"]
    return found == expected, "; ".join(expected), (
        f"{'; '.join(found)} ({params / 1e9:.2f}B parameters; built in {built:.0f} s, diffs {times[0]:.0f} s and "
        f"{times[1]:.0f} s; peak host memory {peak_memory() / 2**30:.1f} GiB{gpu})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU; skip what needs CUDA itself")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--only", help="run only the checks whose name starts with this (\"3\", \"1 cpu\")")
    args = parser.parse_args()
    ctx = Context(args.dry_run)
    try:
        return run_checks(ctx, args)
    finally:
        shutil.rmtree(ctx.scratch, ignore_errors=True)


def run_checks(ctx: Context, args: argparse.Namespace) -> int:
    print(f"device: {torch.cuda.get_device_name(0) if ctx.cuda else 'cpu'}  torch {torch.__version__}"
          + ("  (dry run)" if args.dry_run else ""), flush=True)
    results = []
    for name, fn in CHECKS:
        if args.only and not name.startswith(args.only):
            continue
        name = name.replace("DEVICE", ctx.device)
        start = time.perf_counter()
        try:
            ok, expected, found = fn(ctx)
        except Exception as exc:  # one check's failure names itself; the others still run
            ok, expected, found = False, "no error", f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=3)[-300:]}"
        seconds = time.perf_counter() - start
        status = "skip" if ok is None else "ok" if ok else "FAIL"
        results.append({"check": name, "status": status, "expected": expected, "found": found, "seconds": round(seconds, 1)})
        print(f"{status:4}  {name}  [{seconds:.1f} s]\n      expected: {expected}\n      found:    {found}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": ctx.device, "dry_run": args.dry_run, "checks": results}, indent=1))
    failed = [r for r in results if r["status"] == "FAIL"]
    print(f"{len(results) - len(failed) - sum(r['status'] == 'skip' for r in results)} ok, {len(failed)} FAIL, "
          f"{sum(r['status'] == 'skip' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
