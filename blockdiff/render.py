"""Render: a report for people, in the terminal (rich).

Fixed order: what could not be computed (notes), then the first divergence in one line,
then the table of local errors (blocks × sub-paths, coloured by ratio to threshold) with
drift per block, then what to do next. Colour follows rich's rules: ``NO_COLOR`` and
output that is not a terminal get plain text; cells then carry a ``!`` when they diverge.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .hookmap import Layout
from .report import Check, Report, SubpathResult
from .site import SUBPATHS


def _style(ratio: float, diverged: bool) -> str:
    if diverged:
        return "bold red"
    if ratio >= 0.5:
        return "yellow"
    return "green"


def _cell(check: Check | None, status: str = "checked") -> Text:
    if status == "not_needed":
        return Text("·", style="dim")
    if check is None:
        return Text("—", style="dim")
    nonfinite_ref, nonfinite_cand = check.nonfinite
    if nonfinite_cand != nonfinite_ref:
        value = f"{nonfinite_cand} non-finite"
    else:
        value = f"{check.measured:.2e}"
    mark = "!" if check.diverged else ""
    return Text(value + mark, style=_style(check.ratio, check.diverged))


def _subpath_cell(result: SubpathResult | None) -> Text:
    if result is None:
        return Text("—", style="dim")
    return _cell(result.worst, result.status)


def _drift_cell(value: float | None) -> Text:
    if value is None:
        return Text("—", style="dim")
    return Text(f"{value:.2e}" if math.isfinite(value) else str(value))


def render(report: Report, console: Console | None = None) -> None:
    """Print ``report`` to ``console`` (stdout by default)."""
    console = console or Console()
    ref, cand = report.reference, report.candidate
    console.print(
        f"[bold]blockdiff[/] reference {escape(ref['model'])} ({ref['device']}, {ref['dtype']}) "
        f"vs candidate {escape(cand['model'])} ({cand['device']}, {cand['dtype']}); "
        f"tolerance {report.tolerance['policy']}",
        highlight=False,
    )
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    first = report.first_divergence
    if first is None:
        console.print("[bold green]No divergence[/]: every local error is within tolerance.", highlight=False)
    else:
        console.print(f"[bold red]First divergence[/]: {escape(first.headline())}", highlight=False)
        if first.subpath == "unattributed":
            block = next(b for b in report.blocks if b.index == first.block)
            missing = f" ({', '.join(block.unmapped)} belong to no sub-path)" if block.unmapped else ""
            console.print(
                "  the block diverges but no sub-path explains it: the hook map may be missing "
                f"a module{escape(missing)}; check it with `blockdiff arch`",
                highlight=False,
            )
    if report.first_nonfinite is not None:
        nf = report.first_nonfinite
        console.print(
            f"[red]non-finite[/]: the free-running candidate first holds {nf['nonfinite_cand']} "
            f"NaN/Inf values at {escape(nf['site'])} ({escape(nf['module'])})",
            highlight=False,
        )

    table = Table(
        title="local error (rel L2) per sub-path, whole block or stage; drift of the free-running candidate",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("site", no_wrap=True)
    for name in SUBPATHS:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("whole", justify="right", no_wrap=True)
    table.add_column("drift", justify="right", no_wrap=True)
    blank = [Text("")] * len(SUBPATHS)
    before = [s for s in report.stages if s.stage in ("embed", "context")]
    after = [s for s in report.stages if s.stage not in ("embed", "context")]
    for stage in before:
        table.add_row(stage.stage, *blank, _cell(stage.local), _drift_cell(stage.drift and stage.drift.rel_l2))
    for block in report.blocks:
        name = f"block {block.index}" + (f" ({block.stack})" if _multi_stack(report) else "")
        table.add_row(
            name,
            *(_subpath_cell(block.subpaths.get(sp)) for sp in SUBPATHS),
            _cell(block.block),
            _drift_cell(block.drift and block.drift.rel_l2),
        )
    for stage in after:
        table.add_row(stage.stage, *blank, _cell(stage.local), _drift_cell(stage.drift and stage.drift.rel_l2))
    console.print(table)
    if report.moe:
        console.print(_moe_table(report.moe))
    divergences = report.divergences
    if len(divergences) > 1:
        console.print(f"{len(divergences)} divergent sites:", highlight=False)
        for d in divergences:
            console.print(f"  - {escape(d.headline())}", highlight=False)
    if first is not None:
        console.print(
            "next: read the module named above; `--json PATH` keeps every metric, "
            "`blockdiff arch MODEL` shows how sub-paths were mapped",
            style="dim",
            highlight=False,
        )


def _multi_stack(report: Report) -> bool:
    return len({b.stack for b in report.blocks}) > 1


def render_layout(layout: Layout, label: str, console: Console | None = None) -> None:
    """Print a resolved hook map: what is outside blocks, and per block each sub-path's modules."""
    console = console or Console()
    hm = layout.hook_map
    console.print(
        f"[bold]{escape(label)}[/]: hook map [bold]{escape(hm.name)}[/] ({escape(hm.source)}), "
        f"{len(layout.blocks)} blocks",
        highlight=False,
    )
    for stage, path in layout.outside:
        console.print(f"  {stage:<11} {escape(path)}", highlight=False)
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("block")
    table.add_column("module")
    for name in SUBPATHS:
        table.add_column(name)
    for block in layout.blocks:
        prefix = block.path + "."
        cells = []
        for name in SUBPATHS:
            if name == "residual":
                cells.append(Text("(block glue)", style="dim"))
                continue
            paths = block.subpaths.get(name, [])
            cells.append(Text(", ".join(p.removeprefix(prefix) for p in paths) or "—"))
        table.add_row(str(block.index), block.path, *cells)
    console.print(table)
    unmapped = [p for b in layout.blocks for p in b.unmapped]
    if unmapped:
        console.print(
            f"[yellow]warning:[/] {len(unmapped)} modules with parameters belong to no sub-path "
            f"(e.g. {escape(unmapped[0])}); their errors cannot be separated from the block's glue",
            highlight=False,
        )


BARS = " ▁▂▃▄▅▆▇█"


def _bar(counts: list[int]) -> str:
    """Per-expert counts as one row of bars, scaled to the largest."""
    top = max(counts) if counts else 0
    if top == 0:
        return BARS[0] * len(counts)
    return "".join(BARS[round(c / top * (len(BARS) - 1))] for c in counts)


def _drop_rate(stats: dict) -> str:
    if stats.get("capacity") is not None:
        return f"{stats['assignment_drop_rate']:.1%}"
    counterfactual = stats.get("counterfactual") or {}
    if not counterfactual:
        return "—"
    cf, entry = next(iter(counterfactual.items()))
    return f"{entry['assignment_drop_rate']:.1%} @cf{cf}"


def _moe_table(moe: list[dict]) -> Table:
    """Per MoE block and side: routing entropy, loads, drops, agreement, counts."""
    table = Table(
        title="MoE routing per block (entropy normalized by ln E; drops: the model's capacity, "
        "or counterfactual at the first capacity factor)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for name in ("block", "side", "entropy", "max load", "min load", "drops", "top-k agree", "flips", "tokens per expert"):
        table.add_column(name, no_wrap=True, justify="left" if name in ("side", "tokens per expert") else "right")
    for entry in moe:
        agreement = entry["agreement"]
        local = entry.get("local_flips") or {}
        flips = f"{local.get('flipped', 0)} ({local.get('unexplained', 0)} unexplained)" if local else "—"
        for side in ("reference", "candidate"):
            stats = entry[side]
            first = side == "reference"
            table.add_row(
                str(entry["block"]) if first else "",
                "ref" if first else "cand",
                f"{stats['routing_entropy_norm']:.3f}",
                f"{stats['max_load']:.1%}",
                f"{stats['min_load']:.1%}",
                _drop_rate(stats),
                f"{agreement['topk_agreement']:.1%}" if first else "",
                flips if first else "",
                _bar(stats["counts"]),
            )
    return table
