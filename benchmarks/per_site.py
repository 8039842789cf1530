"""What a site costs on a dispatch-bound model: figure 9 of ``benchmarks/overhead.py``.

    python benchmarks/per_site.py            # --quick: fewer rounds, a smoke run

A tiny Hugging Face Llama (hidden 64, 8 blocks, 8 tokens, one thread): a forward of ~3 ms
made of Python and dispatch, as a small CUDA forward is made of kernel launches. Measured
side by side, medians of interleaved runs:

- the forward alone;
- empty pre- and post-hooks with keyword arguments on every site's module, registered once
  (what torch's hook dispatch costs) and registered for each forward (what adding and
  removing them costs too: blockdiff puts its hooks on for one run and takes them off);
- ``capture.record`` into a ``MemoryStore`` (blockdiff's in-memory capture).

Each line: the run over the forward, and microseconds a site beyond the forward.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blockdiff import resolve  # noqa: E402
from blockdiff.capture import record  # noqa: E402
from blockdiff.store import MemoryStore  # noqa: E402
from samples import hf_llama  # noqa: E402


def main(quick: bool = False) -> None:
    torch.set_num_threads(1)
    rounds, k = (3, 10) if quick else (7, 40)
    model = hf_llama.build(num_hidden_layers=8).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    layout = resolve(model)
    modules = dict(model.named_modules())
    paths = list(layout.site_of())

    def forward() -> None:  # the forward a capture runs (capture.record: no cache object)
        with torch.no_grad():
            model(ids, use_cache=False)

    def nothing(*_: object) -> None:
        return None

    def hooked() -> list:
        handles = []
        for path in paths:
            handles.append(modules[path].register_forward_pre_hook(nothing, with_kwargs=True))
            handles.append(modules[path].register_forward_hook(nothing, with_kwargs=True))
        return handles

    def hooks_each_forward() -> None:
        handles = hooked()
        forward()
        for handle in handles:
            handle.remove()

    def capture() -> None:
        record(model, layout, MemoryStore(), ids)

    def timed(fn, k: int = k) -> float:
        times = []
        for _ in range(k):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    for _ in range(5):
        forward(), hooks_each_forward(), capture()
    once = hooked()
    hooks_once = [timed(forward) for _ in range(5)]
    for handle in once:
        handle.remove()
    runs: dict[str, list[float]] = {"forward": [], "hooks each forward": [], "capture": []}
    for _ in range(rounds):  # interleaved: the machine's drift falls on every line alike
        runs["forward"].append(timed(forward))
        runs["hooks each forward"].append(timed(hooks_each_forward))
        runs["capture"].append(timed(capture))
    plain = statistics.median(runs["forward"])
    print(f"dispatch-bound model: {len(paths)} sites, forward {plain * 1e3:.2f} ms")
    for name, values in [("empty hooks, registered once", hooks_once), *runs.items()]:
        if name == "forward":
            continue
        took = statistics.median(values)
        print(f"  {name:30s} {took / plain:6.3f} x forward   {(took - plain) / len(paths) * 1e6:6.1f} us a site")
    print("  goal (issue 57, figure 9): capture <= 1.15 x forward, <= 10 us a site")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
