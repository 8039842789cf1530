"""Summary: what a dump holds — its metadata, and per stage and block the sites with their
shapes, dtypes and simple statistics — for ``blockdiff inspect``."""

from __future__ import annotations

from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .dtypes import dtype_name
from .dump import DumpReader
from .site import Site, describe_key, iter_tensors


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and (floating tensors) mean, std, min, max and non-finite count."""
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    if t.is_floating_point() and t.numel():
        x = t.detach().to(torch.float64)
        finite = x[torch.isfinite(x)]
        out["nonfinite"] = int(x.numel() - finite.numel())
        if finite.numel():
            out.update(
                mean=float(finite.mean()),
                std=float(finite.std()) if finite.numel() > 1 else 0.0,
                min=float(finite.min()),
                max=float(finite.max()),
            )
    return out


def site_summary(site: Site) -> dict[str, Any]:
    output = [tensor_stats(t) for t in iter_tensors(site.output)]
    hidden = site.hidden_input()
    return {
        "site": describe_key(site.key),
        "stage": site.stage,
        "block": site.block,
        "subpath": site.subpath,
        "module": site.module,
        "call": site.call,
        "input": None if hidden is None else tensor_stats(hidden),
        "output": output,
    }


def summarize(dump: DumpReader) -> dict[str, Any]:
    """The whole dump as plain data; reads one block's sites at a time. A dump of decode
    steps (schema 5) lists every step's sites, each with its ``step``, step after step."""
    steps = dump.steps()
    views = [(None, dump)] if steps is None else [(t, dump.at_step(t)) for t in range(steps + 1)]
    outside, blocks = [], []
    for step, view in views:
        stamp = {} if step is None else {"step": step}
        outside += [{**site_summary(s), **stamp} for s in view.outside_sites()]
        blocks += [
            {"index": index, **stamp, "sites": [{**site_summary(s), **stamp} for s in view.block_sites(index)]}
            for index in view.block_indices()
        ]
    inputs = dump.inputs()
    return {
        "path": str(dump.path),
        "meta": {k: v for k, v in dump.meta.items() if k != "layout"},
        "inputs": None if inputs is None else [tensor_stats(t) for t in iter_tensors(inputs)],
        "sites": len(dump),
        "stages": outside,
        "blocks": blocks,
    }


def _fmt(stats: dict[str, Any] | None) -> tuple[str, str, str]:
    if stats is None:
        return "—", "", ""
    shape = "×".join(str(d) for d in stats["shape"]) or "scalar"
    numbers = ""
    if "mean" in stats:
        numbers = f"mean {stats['mean']:.3g} std {stats['std']:.3g} [{stats['min']:.3g}, {stats['max']:.3g}]"
    if stats.get("nonfinite"):
        numbers += f" {stats['nonfinite']} non-finite"
    return shape, stats["dtype"], numbers


def render_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print :func:`summarize`'s result: metadata first, then one row per site."""
    console = console or Console()
    console.print(f"[bold]{escape(summary['path'])}[/]: {summary['sites']} sites", highlight=False)
    for key, value in summary["meta"].items():
        console.print(f"  {key:<18} {escape(str(value))}", highlight=False)
    if summary.get("inputs"):
        shapes = ", ".join("×".join(map(str, t["shape"])) + f" {t['dtype']}" for t in summary["inputs"])
        console.print(f"  {'inputs':<18} {shapes}", highlight=False)
    if "verified" in summary:
        v = summary["verified"]
        console.print(
            f"[green]verified[/]: {v['tensors']} tensors in {v['sites']} sites, {v['bytes']} bytes, every checksum matches",
            highlight=False,
        )
    decode = summary["meta"].get("decode")
    if isinstance(decode, dict):
        console.print(
            f"decode: the prompt ({decode.get('prompt_length')} tokens), then {decode.get('steps')} steps of one token "
            f"({decode.get('cache')} cache); the sites of each step in turn", highlight=False,
        )
    table = Table(box=box.SIMPLE_HEAD)
    columns = ("step", "site", "module", "output", "dtype", "statistics") if isinstance(decode, dict) else ("site", "module", "output", "dtype", "statistics")
    for name in columns:
        table.add_column(name, no_wrap=True, min_width=len(name))
    by_step: dict[Any, list] = {}
    for site in summary["stages"]:
        by_step.setdefault(site.get("step"), [[], [], []])[0 if site["stage"] in ("embed", "context") else 2].append(site)
    for block in summary["blocks"]:
        by_step.setdefault(block.get("step"), [[], [], []])[1].extend(block["sites"])
    for step, (before, inside, after) in by_step.items():
        for site in before + inside + after:
            shape, dtype, numbers = _fmt(site["output"][0] if site["output"] else None)
            cells = (site["site"], escape(site["module"]), shape, dtype, numbers)
            table.add_row(*((str(step),) + cells if isinstance(decode, dict) else cells))
    console.print(table)
