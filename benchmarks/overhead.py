"""blockdiff's overhead, measured side by side in one run.

On a Llama-style model of about 58M parameters (8 blocks, hidden 512, intermediate 1376,
vocab 32000; batch 1, seq 256, float32, CPU, 2 threads) it prints each figure as a ratio:

1. capture of all sites to memory / plain forward              (goal <= 1.08)
   beside it, a plain forward measured the same way (what the measurement reads with
   no overhead at all: its noise on the machine at hand)
2. capture streamed to HDF5 / plain forward                     (goal <= 1.25)
3. HDF5 write throughput / numpy.tofile of the same bytes       (goal >= 0.85)
   with its ceiling: numpy.tofile with the CRC-32C of its bytes taken on the other core
4. full diff with localization / (reference + candidate forward) (goal <= 2.5)
5. the same with a bfloat16 candidate, calibrated floors (goal <= 3.0), with this CPU's
   bfloat16 / float32 forward-time ratio measured beside it (a CPU without bfloat16 units
   runs bfloat16 slower than float32, and every bfloat16 experiment weighs more there);
   ``--emulate-avx2`` measures it again in a process limited to AVX2 (such a CPU)
6. peak RSS of a streamed diff at 8 and 32 blocks, minus weights (goal: grows by at most
   one block's activations); measured as the diff's peak above the RSS it starts from,
   with both models already built (the peak counter is reset first: Linux only), the
   median of three processes per size with the range, and the RSS the run holds from its
   first judged block to its last

and two start-up lines: ``blockdiff --help``, a usage error and the README's sample diff
(to its first printed line), each against its goal; ``blockdiff diff`` on the same model
given as a ``config.json``, from the command to its first printed line, beside the imports
alone. ``--real-size`` prints
figures 1, 4 and 5 on a Llama of 501M parameters instead (built once, its build time apart;
not in a full run: it takes minutes more than the rest).

7. a decode diff of 32 steps / 32-step generation on both sides (``benchmarks/decode.py``,
   goal <= 4), and its cost per step at 16, 32, 64 steps (goal: linear)
8. a backward diff / forward and backward of both sides (``benchmarks/backward.py``, goal <= 4)
9. what a site costs on a dispatch-bound model (``benchmarks/per_site.py``: a tiny HF Llama
   whose forward is Python and dispatch, as a small CUDA forward is kernel launches):
   capture / forward (goal <= 1.15) and microseconds a site (goal <= 10), beside empty
   hooks registered once and for each forward

and, when transformers is installed, HF's ``model_addition_debugger_context`` on the same
model for comparison. Dump checksums are measured too: dump write and read throughput
with CRC-32C checksums against the same dump written with ``checksums=False``.

    python benchmarks/overhead.py            # about five minutes on 2 cores
    python benchmarks/overhead.py --quick    # smaller model, for a smoke run
    python benchmarks/overhead.py --device cuda   # capture overhead of a CUDA model (figures 1, 2)
    python benchmarks/overhead.py --only 5        # one figure (2: streamed capture, 3: dump writes, 5: the mixed-precision diff, 6: memory)
    python benchmarks/overhead.py --real-size     # figures 1, 4, 5 on a 501M Llama
    python benchmarks/overhead.py --startup       # the start-up lines alone
    python benchmarks/overhead.py --only 5 --emulate-avx2   # figure 5 here and as on a CPU without bfloat16 units
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from blockdiff import diff, resolve  # noqa: E402
from blockdiff.capture import record  # noqa: E402
from blockdiff.dump import DumpReader, DumpWriter  # noqa: E402
from blockdiff.dump.format import crc32c  # noqa: E402
from blockdiff.engine import capture  # noqa: E402
from blockdiff.site import iter_tensors  # noqa: E402
from blockdiff.store import MemoryStore  # noqa: E402


def build(
    blocks: int, *, hidden: int, intermediate: int, vocab: int, seed: int = 0, heads: int = 8, kv_heads: int = 8
) -> torch.nn.Module:
    """HF Llama when transformers is installed, else the sample at the same sizes."""
    from blockdiff.weights import trained_looking_

    try:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=blocks,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        )
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    except ImportError:
        from samples import tinylm

        model = tinylm.TinyLM(tinylm.Config(
            vocab_size=vocab, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, blocks=blocks
        ))
    return trained_looking_(model, seed=seed).eval()


def timed(fn, repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(base, fn, repeat: int, *, after=None) -> dict[str, float | str]:
    """``fn``'s cost over ``base``'s, each run of ``fn`` between two of ``base`` and over
    their mean, so that both see the same load (a drift during the triple cancels): the
    median ratio, in wall time and in this process's CPU time (which other processes on
    the machine disturb less), with the range of the pairs. Until 13:20 on 2026-12-04 each
    run was taken over the faster of its two neighbours, which reads above 1 on average
    with no overhead at all (the lower of two draws against one draw: a plain forward
    against plain forwards read a median 1.028 that way in that day's 18 full runs, and
    0.997-1.000 over the mean in one process); that reading is kept beside (``wall,
    faster``), so the runs before stay comparable. ``after``: run after each pair, outside
    the timing."""
    base(), fn()
    if after is not None:
        after()
    ratios: dict[str, list[float]] = {"wall": [], "cpu": [], "wall, faster": []}
    for _ in range(repeat):
        for clock, key in ((time.perf_counter, "wall"), (time.process_time, "cpu")):
            gc.collect()
            start = clock(); base(); first = clock() - start
            start = clock(); fn(); cost = clock() - start
            start = clock(); base(); second = clock() - start
            ratios[key].append(cost / ((first + second) / 2))
            if key == "wall":
                ratios["wall, faster"].append(cost / min(first, second))
            if after is not None:
                after()
    out: dict[str, float | str] = {}
    for key, values in ratios.items():
        out[key] = statistics.median(values)
        out[f"{key} range"] = f"{min(values):.2f}-{max(values):.2f}"
    return out


def written_back() -> None:
    """Wait until what this process (or any before it) wrote is on the disk: a figure that
    writes starts without earlier dumps being written back beneath it. On the test
    machine's disk a backlog of 1.2-1.4 GB made figure 2 2.41 instead of 1.26-1.27
    (docs/performance.md)."""
    if hasattr(os, "sync"):
        os.sync()


def forward(model, ids):
    with torch.no_grad():
        model(ids, use_cache=False) if hasattr(model, "config") else model(ids)


def throughput(arrays: list[np.ndarray], folder: Path) -> dict[str, float]:
    """Bytes per second: numpy.tofile (bare, and with the fsync and rename of a durable
    dump), plain h5py, and blockdiff's DumpWriter (CRC-32C per tensor, index, metadata
    digest, atomic rename; and durable: with the fsyncs), all writing the same arrays; and the dump's checksums on against off,
    interleaved run by run: the median of the per-pair ratios."""
    import h5py

    from blockdiff.site import Site

    total = sum(a.nbytes for a in arrays)
    raw, plain, dump = folder / "raw.bin", folder / "plain.h5", folder / "dump.h5"

    def write_raw(durable: bool = False):
        target = folder / "raw.tmp" if durable else raw
        with target.open("wb") as f:
            for a in arrays:
                a.tofile(f)
            f.flush()
            if durable:  # what DumpWriter.close does: fsync, rename, fsync the directory
                os.fsync(f.fileno())
        if durable:
            os.replace(target, raw)
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def write_plain():
        with h5py.File(plain, "w") as f:
            for i, a in enumerate(arrays):
                f.create_dataset(f"t{i}", data=a, chunks=a.shape)

    flat = np.concatenate([a.reshape(-1) for a in arrays])

    def write_chunks():
        # The floor under any HDF5 layout: the same bytes (but the last partial chunk) as
        # whole 1 MiB chunks of one dataset through libhdf5's fastest path, and nothing
        # else (no checksum, index, staging of partial chunks or metadata).
        n = 2**18
        with h5py.File(plain, "w", libver=("v110", "v110")) as f:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk((n,))
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            space = h5py.h5s.create_simple((-(-flat.size // n) * n,), (h5py.h5s.UNLIMITED,))
            dset = h5py.h5d.create(f.id, b"x", h5py.h5t.py_create(flat.dtype), space, dcpl=dcpl)
            for start in range(0, flat.size - n + 1, n):
                dset.write_direct_chunk((start,), flat[start : start + n])

    def write_syscall():
        # The same bytes in one write(2) each from Python (what numpy.tofile also does).
        fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in arrays:
                os.write(fd, a)
        finally:
            os.close(fd)

    sites = [Site("block", 0, "ffn", f"m{i}", 0, i, output=torch.from_numpy(a)) for i, a in enumerate(arrays)]

    def write_dump(checksums: bool = True, durable: bool = False):
        with DumpWriter(dump, meta={"model": "bench"}, checksums=checksums, durable=durable) as w:
            for site in sites:
                w.add(site)

    beside = ThreadPoolExecutor(1, thread_name_prefix="bench-crc")

    def write_summed():
        # The least a dump with checksums does: every byte written (numpy.tofile) and read
        # once more for its CRC-32C on the other core at the same time; no format, no
        # index, no rename.
        summed = beside.submit(lambda: [crc32c(a) for a in arrays])
        write_raw()
        summed.result()

    def write_empty():
        # What every dump costs whatever it holds: its thread, the file, its attributes,
        # the index, the digest, the close and the rename.
        with DumpWriter(dump, meta={"model": "bench"}):
            pass

    def read_dump(verify: bool):
        with DumpReader(dump, verify=verify, probe=False) as r:
            for s in r.iter_sites():
                pass

    def read_plain():
        with h5py.File(plain, "r") as f:
            for name in f:
                f[name][()]

    # Each writer interleaved with the others run by run, so that all see the same state of
    # the page cache and the disk, in rounds (below).
    writers = {
        "tofile": write_raw,
        "tofile + fsync": lambda: write_raw(durable=True),
        "h5py plain": write_plain,
        "blockdiff dump": write_dump,
        "tofile + CRC-32C beside": write_summed,  # figure 3's ceiling
        "blockdiff dump, durable": lambda: write_dump(durable=True),
        "h5py direct chunks": write_chunks,
        "blockdiff empty dump": write_empty,
        "os.write": write_syscall,
    }
    times: dict[str, list[float]] = {name: [] for name in writers}
    # CPU time of the whole process (every thread), for the writers figure 3 compares.
    cpu: dict[str, list[float]] = {"tofile": [], "blockdiff dump": []}

    written_back()

    def fresh() -> None:
        # Every write makes a new file: deleting the last one (freeing its blocks, ~35 ms
        # for 100 MB on this disk) is not part of writing the next.
        for path in (raw, plain, dump):
            path.unlink(missing_ok=True)

    # 36 rounds: with 7, tofile's median alone moved figure 3 by 0.1 from run to run; each
    # round in its own order, every writer after every other one equally often
    # (balanced_orders): how long a write takes here depends on the write before it — in one
    # fixed order tofile always came after a whole write and the dump after h5py's, in 21
    # seeded random orders the dump came after the durable writers 8 times of 21 and never
    # after h5py's direct chunks, tofile after those 5 times (docs/performance.md).
    for order in balanced_orders(list(writers), copies=2):
        for name in order:
            fn = writers[name]
            fresh()
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - start)
            if name in cpu:
                cpu[name].append(time.process_time() - start_cpu)
    out = {name: total / statistics.median(t) for name, t in times.items()}
    out["empty dump"] = statistics.median(times.pop("blockdiff empty dump"))
    out.update({f"cpu {name}": statistics.median(t) for name, t in cpu.items()})
    write_plain()
    out["read plain"] = total / timed(read_plain, 5)
    # Checksums on and off: pairs of runs, the ratio of each pair, their median.
    ratios: dict[str, list[float]] = {"write": [], "read": []}
    for _ in range(15):
        pair = {}
        for checksums in (True, False):
            fresh()
            start = time.perf_counter()
            write_dump(checksums)
            pair["write", checksums] = time.perf_counter() - start
            start = time.perf_counter()
            read_dump(checksums)  # verify only where there are checksums to verify
            pair["read", checksums] = time.perf_counter() - start
        for kind in ratios:
            ratios[kind].append(pair[kind, False] / pair[kind, True])
    out["checksums write on/off"] = statistics.median(ratios["write"])
    out["checksums read on/off"] = statistics.median(ratios["read"])
    beside.shutdown()
    return out


def balanced_orders(names: list[str], *, copies: int = 1) -> list[list[str]]:
    """Orders of ``names`` (a Williams design, ``copies`` times over) in which each name
    comes right after each other name equally often (twice per copy for an odd number of
    names, once for an even one), and first in a round equally often."""
    n = len(names)
    first = [0]
    for k in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(i + j) % n for j in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[i] for i in row] for _ in range(copies) for row in rows]


def dump_arrays(model, ids) -> list[np.ndarray]:
    """Figure 3's bytes: every floating-point tensor a capture of ``model`` records, once."""
    store = MemoryStore()
    record(model, resolve(model), store, ids)
    arrays, seen = [], set()
    for site in store.sites():
        for t in iter_tensors((site.args, site.kwargs, site.output)):
            if id(t) not in seen and t.is_floating_point():
                seen.add(id(t))
                arrays.append(t.numpy())
    return arrays


def total_bytes(arrays: list[np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays)


def write_lines(rates: dict[str, float], arrays: list[np.ndarray]) -> str:
    return "\n".join((
        f"3. HDF5 write / numpy.tofile (same bytes) {rates['blockdiff dump'] / rates['tofile']:8.3f}   (goal >= 0.85)"
        f"   [{rates['tofile'] / 1e9:.2f} vs {rates['blockdiff dump'] / 1e9:.2f} GB/s, {total_bytes(arrays) / 1e6:.0f} MB]",
        f"   durable dump (--fsync) / (tofile + fsync + rename) {rates['blockdiff dump, durable'] / rates['tofile + fsync']:8.3f}"
        f"   [{rates['tofile + fsync'] / 1e9:.2f} vs {rates['blockdiff dump, durable'] / 1e9:.2f} GB/s]; "
        f"plain h5py / tofile {rates['h5py plain'] / rates['tofile']:.3f}",
        f"   its ceiling: tofile with the CRC-32C of every array taken on the other core beside it / tofile "
        f"{rates['tofile + CRC-32C beside'] / rates['tofile']:.3f}; the dump / that ceiling "
        f"{rates['blockdiff dump'] / rates['tofile + CRC-32C beside']:.3f}",
        f"   the write path: h5py write_direct_chunk of the same bytes alone / tofile "
        f"{rates['h5py direct chunks'] / rates['tofile']:.3f}; os.write of each array / tofile {rates['os.write'] / rates['tofile']:.3f}",
        f"   CPU time (all threads): tofile {rates['cpu tofile'] * 1e3:.1f} ms, dump {rates['cpu blockdiff dump'] * 1e3:.1f} ms "
        f"({rates['cpu blockdiff dump'] / rates['cpu tofile']:.2f}x, on {os.cpu_count()} cores: the dump's wall time cannot be "
        f"below {rates['cpu blockdiff dump'] / os.cpu_count() * 1e3:.1f} ms, tofile's is {total_bytes(arrays) / rates['tofile'] * 1e3:.1f})",
        f"   an empty dump (its thread, the file, attributes, index, digest, close, rename): {rates['empty dump'] * 1e3:.1f} ms, "
        f"{rates['empty dump'] * rates['tofile'] / total_bytes(arrays):.2f} of tofile's time for the {total_bytes(arrays) / 1e6:.0f} MB",
        f"   dump throughput, checksums on / off (goal >= 0.85): write {rates['checksums write on/off']:.3f}, "
        f"read verified / unverified {rates['checksums read on/off']:.3f} (median of 15 interleaved pairs)",
    ))


RSS_CHILD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/benchmarks")
torch.set_num_threads(2)
from overhead import build
from blockdiff import diff
blocks, hidden, inter, vocab, seq = map(int, sys.argv[2:7])
import copy, gc
from blockdiff import engine
from blockdiff.dump.memory import release_freed_memory
ref = build(blocks, hidden=hidden, intermediate=inter, vocab=vocab)
cand = copy.deepcopy(ref)  # what a second build() gives (seeded), bit for bit, without drawing it again
weights = sum(p.numel() * p.element_size() for m in (ref, cand) for p in m.parameters())
ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
gc.collect()
release_freed_memory()  # start from a heap without the models' construction garbage
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
judged = []  # the RSS after each block is judged, what the run holds from block to block
def held(what, done, total):
    if what == "localize":
        release_freed_memory()  # what the localizer does after each block, taken first here
        judged.append(status("VmRSS"))
if sys.argv[7] == "stream":
    engine.PROGRESS.set(held)
# Reset the peak (VmHWM) after the models are built: only the diff's own peak counts.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
if sys.argv[7] == "capture":
    import tempfile
    from blockdiff.engine import capture
    with tempfile.TemporaryDirectory() as tmp:
        capture(ref, ids, tmp + "/ref.h5")
else:
    diff(ref, cand, ids, stream=sys.argv[7] == "stream")
peak = status("VmHWM")
print(json.dumps({"peak": peak, "before": before, "weights": weights, "judged": judged}))
"""


def peak_rss(blocks: int, sizes: dict, seq: int, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(ROOT), str(blocks), str(sizes["hidden"]), str(sizes["intermediate"]),
         str(sizes["vocab"]), str(seq), mode],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def streamed_memory(sizes: dict, seq: int, quick: bool, *, runs: int = 3) -> str:
    """Figure 6: the diff's peak above the RSS it started from (the weights of both models
    are already resident then: what capture and localization add), streamed at 8 and 32
    blocks, each the median of ``runs`` processes (the sizes alternating, so that both see
    the same machine), with the range; beside it what a streamed run holds from block to
    block (its RSS after each judged block, first to last), and the in-memory diff once."""
    small, large = (2, 8) if quick else (8, 32)
    block_acts = 1 * seq * sizes["hidden"] * 4 * 8  # ~8 hidden-sized tensors recorded per block
    peaks: dict[int, list[float]] = {small: [], large: []}
    held: list[float] = []
    for _ in range(runs):
        for blocks in (small, large):
            found = peak_rss(blocks, sizes, seq, "stream")
            peaks[blocks].append(found["peak"] - found["before"])
            if blocks == large:
                held.append(found["judged"][-1] - found["judged"][0])
    grow = statistics.median(peaks[large]) - statistics.median(peaks[small])
    each = [b - a for a, b in zip(peaks[small], peaks[large])]

    def mib(values: list[float]) -> str:
        return f"{statistics.median(values) / 2**20:.0f} MiB ({min(values) / 2**20:.0f}-{max(values) / 2**20:.0f})"

    lines = [
        f"6. streamed diff, peak above its starting RSS, median of {runs} runs (range): {small} blocks {mib(peaks[small])}, "
        f"{large} blocks {mib(peaks[large])}; growth {grow / 2**20:.1f} MiB = {grow / block_acts:.1f} blocks' "
        f"activations ({block_acts / 2**20:.1f} MiB each; run by run {min(each) / block_acts:.1f} to "
        f"{max(each) / block_acts:.1f})   (goal <= 1 block)",
        f"   held from the first judged block to the last ({large} blocks): {statistics.median(held) / 2**20:+.1f} MiB "
        f"(runs {', '.join(f'{h / 2**20:+.1f}' for h in held)})",
    ]
    a, b = peak_rss(small, sizes, seq, "memory"), peak_rss(large, sizes, seq, "memory")
    memory = (b["peak"] - b["before"]) - (a["peak"] - a["before"])
    lines.append(
        f"   in-memory diff, the same (one run): {small} blocks {(a['peak'] - a['before']) / 2**20:.0f} MiB, {large} blocks "
        f"{(b['peak'] - b['before']) / 2**20:.0f} MiB; growth {memory / 2**20:.1f} MiB = {memory / block_acts:.1f} blocks' activations"
    )
    return "\n".join(lines)


# The real-size line (--real-size): a Llama of 501M parameters (16 blocks, hidden 1536, 12
# heads over 4 key-value heads, intermediate 4096, vocab 32000).
REAL_SIZE = dict(hidden=1536, intermediate=4096, vocab=32000, heads=12, kv_heads=4)


def real_size(seq: int, *, repeat: int = 5) -> str:
    """Figures 1, 4 and 5 on a model of ~0.5B parameters, built once: the candidate is a
    copy of the reference (what a second build gives, bit for bit), cast to bfloat16 for
    figure 5; the building's time is printed apart. Five pairs each, eleven for figure 1
    since 2026-12-04 14:20: with two, figure 1 read 1.20 in one run where five pairs in
    the same hour gave 1.03 (a forward here swings by 20% from one to the next), and with
    five its pairs spread 0.96-1.17 in a run that read 1.089. Figure 1 is measured before
    the candidate is copied, as in a full run, where its model is the only one built: with
    the copy's 2 GB beside it, the page faults of the 190 MB a capture holds cost this
    machine's kernel 5-7 s of system time in ten triples, against 1 s without
    (docs/performance.md, *Real size and start-up*)."""
    start = time.perf_counter()
    reference = build(16, **REAL_SIZE)
    built = time.perf_counter() - start
    ids = torch.randint(0, REAL_SIZE["vocab"], (1, seq), generator=torch.Generator().manual_seed(0))
    layout = resolve(reference)
    in_memory = interleaved(lambda: forward(reference, ids), lambda: record(reference, layout, MemoryStore(), ids), 11)
    start = time.perf_counter()
    candidate = copy.deepcopy(reference)
    copied = time.perf_counter() - start
    two_forwards = timed(lambda: (forward(reference, ids), forward(candidate, ids)), repeat)
    full = timed(lambda: diff(reference, candidate, ids), 1)
    candidate.to(torch.bfloat16)
    mixed = interleaved(lambda: (forward(reference, ids), forward(candidate, ids)), lambda: diff(reference, candidate, ids), repeat)
    params = sum(p.numel() for p in reference.parameters())
    return "\n".join((
        f"real size: {type(reference).__name__}, {params / 1e6:.0f}M parameters, 16 blocks, batch 1, seq {seq}: built in "
        f"{built:.1f} s, the candidate copied from it in {copied:.1f} s; two forwards {two_forwards:.2f} s",
        f"   1. capture to memory / forward            {in_memory['wall']:8.3f}   (goal <= 1.08)   "
        f"[wall, pairs {in_memory['wall range']}; CPU time {in_memory['cpu']:.3f}]",
        f"   4. diff / (ref + cand forward), fp32      {full / two_forwards:8.3f}   (goal <= 2.5)",
        f"   5. diff fp32 vs bf16, calibrated / (ref + cand forward) {mixed['wall']:6.3f}   (goal <= 3.0)   "
        f"[wall, pairs {mixed['wall range']}; CPU time {mixed['cpu']:.3f}]",
    ))


def first_line(command: list[str], *, cwd: Path | None = None) -> tuple[float, float]:
    """Seconds from starting ``command`` to its first line on stdout, and to its end."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"},
        cwd=cwd,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    first = time.perf_counter() - start
    proc.stdout.read()
    proc.wait()
    return first, time.perf_counter() - start


# The start-up of the command itself, each as a user starts it from a clone's root (what it
# is timed to, and its goal in seconds): the help and a usage error (to the end: neither
# needs torch), and the README's sample diff to the first line it prints.
CLI_STARTS = {
    "blockdiff --help": (["--help"], "end", 0.5),
    "a usage error": (["diff", "--no-such-option"], "end", 0.5),
    "the README's sample diff": (["diff", "samples/tinylm.py:build", "samples/bugs.py:gelu_for_silu"], "first", 3.0),
}


def cli_startup(*, runs: int = 5) -> str:
    """The ``CLI_STARTS`` commands (``python -m blockdiff``), in turns, ``runs`` times: for
    each the median seconds with the range, against its goal."""
    times: dict[str, list[float]] = {name: [] for name in CLI_STARTS}
    for _ in range(runs):
        for name, (args, until, _) in CLI_STARTS.items():
            first, end = first_line([sys.executable, "-m", "blockdiff", *args], cwd=ROOT)
            times[name].append(first if until == "first" else end)
    parts = [
        f"{name} {statistics.median(times[name]):.2f} s ({min(times[name]):.2f}-{max(times[name]):.2f}; "
        f"{'to its first line, ' if until == 'first' else ''}goal <= {goal} s)"
        for name, (_, until, goal) in CLI_STARTS.items()
    ]
    return f"start-up of the command: {', '.join(parts)} (median of {runs} runs, range)"


def startup(sizes: dict, seq: int, *, runs: int = 3) -> str:
    """The command's own start-up (:func:`cli_startup`), then the diff of the figures'
    model given as a config.json (:func:`config_startup`)."""
    return f"{cli_startup()}\n{config_startup(sizes, seq, runs=runs)}"


def config_startup(sizes: dict, seq: int, *, runs: int = 3) -> str:
    """The time from the command to the first printed line of ``blockdiff diff`` on the
    model of figures 1-5 given as a ``config.json`` (both sides built from it), the median
    of ``runs`` with the range; beside it, in the same turns, a process that only imports
    what that command imports (torch, transformers' Llama, blockdiff's CLI and engine)."""
    try:
        import transformers
    except ImportError:
        return "start-up: not measured (the model is given as a Hugging Face config.json: needs transformers)"
    imports = "import torch, blockdiff.cli, blockdiff.engine; from transformers import LlamaForCausalLM"
    with tempfile.TemporaryDirectory() as tmp:
        transformers.LlamaConfig(
            vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(tmp)
        command = [sys.executable, "-m", "blockdiff", "diff", str(Path(tmp) / "config.json"), "--batch", "1", "--seq", str(seq)]
        runs_ = [(first_line(command), first_line([sys.executable, "-c", imports])[1]) for _ in range(runs)]
    first = [f for (f, _), _ in runs_]
    total = [t for (_, t), _ in runs_]
    bare = [b for _, b in runs_]

    def seconds(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} s ({min(values):.1f}-{max(values):.1f})"

    return (f"start-up: blockdiff diff CONFIG.json --batch 1 --seq {seq}, to its first printed line {seconds(first)}, "
            f"to its end {seconds(total)}; the imports alone {seconds(bare)} (median of {runs} runs, range)")


def setup(doc: str, *, repeat: int) -> tuple[dict, int, int, torch.Tensor, bool]:
    """What every benchmark here measures on: ``--quick`` or not from the command line,
    two threads; returns the model sizes, sequence length, repeats, token ids (batch 1)
    and whether it is a quick run."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, for a smoke run")
    parser.add_argument("--device", default="cpu", help="overhead.py: measure capture on this device (cuda)")
    parser.add_argument("--only", type=int, choices=(2, 3, 5, 6), help="overhead.py: measure this figure alone")
    parser.add_argument("--real-size", action="store_true", help="overhead.py: figures 1, 4, 5 on a 501M Llama alone")
    parser.add_argument("--startup", action="store_true", help="overhead.py: the start-up lines alone")
    parser.add_argument(
        "--emulate-avx2", action="store_true",
        help="overhead.py: figure 5 again in a process limited to AVX2 (a CPU without bfloat16 units)",
    )
    args = parser.parse_args()
    DEVICE[0] = torch.device(args.device)
    ONLY[0] = args.only
    LINES.update(real_size=args.real_size, startup=args.startup)
    EMULATE[0] = args.emulate_avx2
    torch.set_num_threads(2)
    sizes, seq = dict(hidden=512, intermediate=1376, vocab=32000), 256
    if args.quick:
        sizes, seq, repeat = dict(hidden=128, intermediate=344, vocab=4000), 64, min(repeat, 3)
    ids = torch.randint(0, sizes["vocab"], (1, seq), generator=torch.Generator().manual_seed(0))
    return sizes, seq, repeat, ids, args.quick


# Pairs of figures 1 and 2 (each capture between two forwards): the median of 5 moved by
# ±0.05 from run to run here, where the figures' goals are 0.08 and 0.25 over a forward
# (11 from 2026-12-04 05:00, 15 from 13:20).
PAIRS = 15
DEVICE = [torch.device("cpu")]  # --device
ONLY: list[int | None] = [None]  # --only
LINES = {"real_size": False, "startup": False}  # --real-size, --startup
EMULATE = [False]  # --emulate-avx2


def streamed_capture(model, ids, folder: Path, repeat: int, *, synced=lambda fn: fn) -> dict[str, float | str]:
    """Figure 2: each capture between two plain forwards (see :func:`interleaved`), into a
    new file (replacing one would time its deletion too), removed after the pair: dumps
    left to be written back to the disk slowed the next ones' writes (:func:`written_back`).
    ``synced``: what makes a run end when its device's work does (CUDA)."""
    path = folder / "capture.h5"
    written_back()
    return interleaved(
        synced(lambda: forward(model, ids)), synced(lambda: capture(model, ids, path)), repeat, after=lambda: path.unlink()
    )


def streamed_line(streamed: dict) -> str:
    return (f"2. capture streamed to HDF5 / forward     {streamed['wall']:8.3f}   (goal <= 1.25)   "
            f"[wall, pairs {streamed['wall range']}; CPU time {streamed['cpu']:.3f}, pairs {streamed['cpu range']}; "
            f"over the faster neighbour {streamed['wall, faster']:.3f}]")


def on_device(sizes: dict, ids: torch.Tensor, repeat: int) -> None:
    """Capture of a model on a CUDA device against its plain forward: activations copied to
    the CPU on a side stream into pinned buffers while the forward goes on
    (:class:`~blockdiff.capture.DeviceCopies`)."""
    device = DEVICE[0]
    if not torch.cuda.is_available():
        sys.exit(f"--device {device}: torch sees no CUDA device here")
    model = build(8, **sizes).to(device)
    ids = ids.to(device)
    layout = resolve(model)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize(device)
        return run

    plain = timed(synced(lambda: forward(model, ids)), repeat)
    in_memory = timed(synced(lambda: record(model, layout, MemoryStore(), ids)), repeat)
    with tempfile.TemporaryDirectory() as tmp:
        streamed = streamed_capture(model, ids, Path(tmp), repeat, synced=synced)
    print(f"model on {device} ({torch.cuda.get_device_name(device)}): plain forward {plain * 1e3:.1f} ms")
    print(f"1. capture to memory / forward            {in_memory / plain:8.3f}   (goal <= 1.08)")
    print(streamed_line(streamed))


def mixed_precision(reference, bf16, ids, repeat: int) -> dict:
    """Figure 5 (each diff between two pairs of forwards, see :func:`interleaved`) and, in
    the same run, this CPU's bfloat16 / float32 forward-time ratio: the median over
    ``repeat`` pairs of forwards of the two models, one after the other."""
    mixed = interleaved(lambda: (forward(reference, ids), forward(bf16, ids)), lambda: diff(reference, bf16, ids), repeat)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(repeat):
        for name, model in (("fp32", reference), ("bf16", bf16)):
            gc.collect()
            start = time.perf_counter()
            forward(model, ids)
            times[name].append(time.perf_counter() - start)
    mixed["bf16/fp32"] = statistics.median(b / f for f, b in zip(times["fp32"], times["bf16"]))
    mixed.update({name: statistics.median(t) for name, t in times.items()})
    return mixed


# What limits PyTorch and oneDNN to AVX2, as on a CPU without AVX-512 or AMX bfloat16
# units: oneDNN's limit is the one that makes its bfloat16 matmuls slow (PyTorch's alone
# leaves them on the bfloat16 units); DNNL_ is the older spelling of ONEDNN_.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"}


def mixed_line(mixed: dict) -> str:
    """Figure 5 as printed, and the forward-time ratio that says which kind of CPU it ran on."""
    return "\n".join((
        f"5. diff fp32 vs bf16, calibrated / (ref + cand forward) {mixed['wall']:6.3f}   (goal <= 3.0)   "
        f"[wall, pairs {mixed['wall range']}; CPU time {mixed['cpu']:.3f}, pairs {mixed['cpu range']}]",
        f"   this CPU ({torch.backends.cpu.get_cpu_capability()}): bf16 / fp32 forward {mixed['bf16/fp32']:.2f} "
        f"(fp32 {mixed['fp32'] * 1e3:.1f} ms, bf16 {mixed['bf16'] * 1e3:.1f} ms; median of pairs)",
    ))


def emulated_avx2(quick: bool) -> None:
    """Figure 5 measured again in a process of its own limited to AVX2 (:data:`AVX2`), as
    on a CPU that runs bfloat16 slower than float32: its figure-5 lines."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--only", "5", *(["--quick"] if quick else [])],
        capture_output=True, text=True, env={**os.environ, **AVX2}, timeout=3600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("5.", "   this CPU"))]
    print(f"   emulated AVX2-only CPU ({' '.join(f'{k}={v}' for k, v in AVX2.items())}), a process of its own:")
    if done.returncode != 0 or not lines:
        print(f"   not measured (exit {done.returncode}) {done.stderr.strip()[-300:]}")
    for line in lines:
        print(f"   {line}")


def main() -> None:
    sizes, seq, repeat, ids, quick = setup(__doc__, repeat=5)
    if DEVICE[0].type == "cuda":
        on_device(sizes, ids, repeat)
        return
    model = build(8, **sizes)
    params = sum(p.numel() for p in model.parameters())
    layout = resolve(model)
    print(f"model: {type(model).__name__}, {params / 1e6:.1f}M parameters, 8 blocks, batch 1, seq {seq}, "
          f"float32, CPU, {torch.get_num_threads()} threads")
    if ONLY[0] == 5:
        reference, bf16 = build(8, **sizes), build(8, **sizes).to(torch.bfloat16)
        print(mixed_line(mixed_precision(reference, bf16, ids, repeat)))
        if EMULATE[0]:
            emulated_avx2(quick)
        return
    if ONLY[0] == 2:
        with tempfile.TemporaryDirectory() as tmp:
            print(streamed_line(streamed_capture(model, ids, Path(tmp), repeat if quick else PAIRS)))
        return
    if ONLY[0] == 6:
        print(streamed_memory(sizes, seq, quick))
        return
    if LINES["startup"]:
        print(startup(sizes, seq))
        return
    if LINES["real_size"]:
        print(real_size(seq))
        return
    if ONLY[0] == 3:
        arrays = dump_arrays(model, ids)
        with tempfile.TemporaryDirectory() as tmp:
            print(write_lines(throughput(arrays, Path(tmp)), arrays))
        return

    plain = timed(lambda: forward(model, ids), repeat)
    pairs = repeat if quick else PAIRS
    # Each capture between two plain forwards, as figures 2 and 5 (see interleaved); and a
    # plain forward measured the same way: what the measurement reads with no overhead.
    in_memory = interleaved(lambda: forward(model, ids), lambda: record(model, layout, MemoryStore(), ids), pairs)
    alone = interleaved(lambda: forward(model, ids), lambda: forward(model, ids), pairs)
    with tempfile.TemporaryDirectory() as tmp:
        streamed = streamed_capture(model, ids, Path(tmp), pairs)
        arrays = dump_arrays(model, ids)
        rates = throughput(arrays, Path(tmp))
    reference, candidate = build(8, **sizes), build(8, **sizes)
    two_forwards = timed(lambda: (forward(reference, ids), forward(candidate, ids)), repeat)
    full = timed(lambda: diff(reference, candidate, ids), max(1, repeat // 2))
    fast = timed(lambda: diff(reference, candidate, ids, fast_path=True), max(1, repeat // 2))
    # The same weights give every module its own inputs again in the experiments, and its
    # recorded output answers. A candidate whose weights differ by one part in 1e6
    # differs everywhere: every experiment runs.
    differing = build(8, **sizes)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for param in differing.parameters():
            param.mul_(1 + 1e-6 * torch.randn(param.shape, generator=gen))
    two_differing = timed(lambda: (forward(reference, ids), forward(differing, ids)), repeat)
    everywhere = timed(lambda: diff(reference, differing, ids), max(1, repeat // 2))
    everywhere_fast = timed(lambda: diff(reference, differing, ids, fast_path=True), max(1, repeat // 2))
    bf16 = candidate.to(torch.bfloat16)
    mixed = mixed_precision(reference, bf16, ids, repeat)

    print(f"plain forward                             {plain * 1e3:8.1f} ms")
    print(f"1. capture to memory / forward            {in_memory['wall']:8.3f}   (goal <= 1.08)   "
          f"[wall, pairs {in_memory['wall range']}; CPU time {in_memory['cpu']:.3f}, pairs {in_memory['cpu range']}; "
          f"over the faster neighbour {in_memory['wall, faster']:.3f}]")
    print(f"   a plain forward measured as figures 1 and 2 measure a capture (no overhead: the measurement's own reading "
          f"here) {alone['wall']:.3f}   [wall, pairs {alone['wall range']}; CPU time {alone['cpu']:.3f}; "
          f"over the faster neighbour {alone['wall, faster']:.3f}]")
    print(streamed_line(streamed))
    print(write_lines(rates, arrays))
    print(f"4. diff / (ref + cand forward), fp32      {full / two_forwards:8.3f}   (goal <= 2.5)   --fast: {fast / two_forwards:.3f}")
    print(f"   the same, candidate weights x (1 + 1e-6 noise): {everywhere / two_differing:.3f}   "
          f"--fast: {everywhere_fast / two_differing:.3f}   (every experiment runs)")
    print(mixed_line(mixed))
    if EMULATE[0]:
        emulated_avx2(quick)

    small, large = (2, 4) if quick else (8, 16)
    a, b = peak_rss(small, sizes, seq, "capture"), peak_rss(large, sizes, seq, "capture")
    print(f"   capture streamed to HDF5, peak above its starting RSS: {small} blocks {(a['peak'] - a['before']) / 2**20:.0f} MiB, "
          f"{large} blocks {(b['peak'] - b['before']) / 2**20:.0f} MiB")
    print(streamed_memory(sizes, seq, quick))
    print(startup(sizes, seq))

    executions(quick)
    try:
        from transformers.model_debugging_utils import model_addition_debugger_context
    except ImportError:
        return
    with tempfile.TemporaryDirectory() as tmp:
        def debugger():
            with model_addition_debugger_context(model, debug_path=tmp, do_prune_layers=False):
                forward(model, ids)

        try:
            hf = timed(debugger, max(1, repeat // 2))
            print(f"   HF model_addition_debugger_context / forward {hf / plain:8.3f}")
        except Exception as exc:  # the debugger's own requirements
            print(f"   HF model_addition_debugger_context: not measured ({type(exc).__name__}: {exc})")


def executions(quick: bool) -> None:
    """Figures 7 and 8, the decode and backward diffs, and figure 9, a site's cost, by their own benchmarks (each in a
    process of its own, so that neither's memory or threads weigh on the other), each as
    it runs alone: after the disk's backlog of the figures before is written (the
    13 GB figure 3 writes), figure 8 the best of its default 5 runs (of 3, its
    other classes read 3.74-4.01 in full runs where alone they read 3.40-3.73)."""
    here = Path(__file__).resolve().parent
    for figure, script, args in (("7. decode", "decode.py", []), ("8. backward", "backward.py", []), ("9. a site", "per_site.py", [])):
        written_back()
        done = subprocess.run(
            [sys.executable, str(here / script), *(["--quick"] if quick else args)], capture_output=True, text=True, timeout=1800
        )
        lines = [line for line in done.stdout.splitlines() if any(w in line for w in ("ratio", "per step", "x forward", "sites,"))]
        if done.returncode != 0 or not lines:
            print(f"{figure} ({script}): not measured (exit {done.returncode}) {done.stderr.strip()[-300:]}")
            continue
        print(f"{figure} ({script}):")
        for line in lines:
            print(f"   {line.strip()}")


if __name__ == "__main__":
    main()
