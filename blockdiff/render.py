"""Render: a report for people, in the terminal (rich).

Fixed order: what could not be computed (notes), then the first divergence in one line,
then a compact heatmap (sub-paths × blocks, one symbol per check by its ratio to the
threshold) with the drift sparkline under it, then the table of local errors (blocks ×
sub-paths, coloured by ratio to threshold) with drift per block, then what to do next.

Colour follows rich's rules: ``NO_COLOR`` and output that is not a terminal get plain
text. Nothing depends on colour: heatmap cells are symbols (:data:`SYMBOLS`) and table
cells carry a ``!`` when they diverge, so red and green need not be told apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .hookmap import Layout
from .report import BlockResult, Check, Report, SubpathResult
from .site import SUBPATHS

# One symbol per heatmap cell, so the heatmap reads the same without colour.
SYMBOLS = {"low": "·", "near": "o", "diverged": "X", "none": "-"}
LEGEND = "· below 0.5   o 0.5 to 1   X diverged   - not needed or absent"
SPARKS = "▁▂▃▄▅▆▇█"


def level(ratio: float | None, diverged: bool, status: str = "checked") -> str:
    """The heatmap class of one check: ``low``, ``near``, ``diverged`` or ``none``.

    ``none`` is a check that did not run (``not_needed`` on the fast path, ``absent``
    sub-path, or no check at all). NaN ratios diverge.

    >>> level(0.3, False), level(0.7, False), level(12.0, True), level(None, False, "absent")
    ('low', 'near', 'diverged', 'none')
    """
    if diverged:
        return "diverged"
    if status != "checked" or ratio is None:
        return "none"
    return "near" if ratio >= 0.5 else "low"


_LEVEL_STYLE = {"low": "green", "near": "yellow", "diverged": "bold red", "none": "dim"}


def _style(ratio: float, diverged: bool) -> str:
    """Table cells take the heatmap's colours."""
    return _LEVEL_STYLE[level(ratio, diverged)]


def _cell(check: Check | None, status: str = "checked") -> Text:
    if status == "not_needed":
        # "-" like the heatmap: "·" there means a small error, not a skipped check.
        return Text("-", style="dim")
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
    render_heatmap(report, console)
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
    # Rows in execution order: an encoder's final norm comes before the decoder's blocks.
    rows = [(stage.order, 0, stage) for stage in report.stages] + [(block.order, 1, block) for block in report.blocks]
    for _, kind, item in sorted(rows, key=lambda row: (row[0], row[1])):
        if kind == 0:
            table.add_row(item.stage, *blank, _cell(item.local), _drift_cell(item.drift and item.drift.rel_l2))
            continue
        name = f"block {item.index}" + (f" ({item.stack})" if _multi_stack(report) else "")
        table.add_row(
            name,
            *(_subpath_cell(item.subpaths.get(sp)) for sp in SUBPATHS),
            _cell(item.block),
            _drift_cell(item.drift and item.drift.rel_l2),
        )
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


def sparkline(values: Sequence[float | None], *, decades: float = 2.0) -> str:
    """One bar per value on a log scale that ends at the largest value.

    The scale reaches down to the smallest positive value but spans at least ``decades``,
    so a jump stands out while a flat series draws flat (high, as it ends at the
    largest). Zero draws as the lowest bar, a non-finite value as ``!``, a missing one as
    ``-``.

    >>> sparkline([0.0, 1e-3, 1e-2, 1e-1, None, float("nan")])
    '▁▁▅█-!'
    >>> sparkline([0.0, 0.0619, 0.0654, 0.0663])
    '▁███'
    """
    positive = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if positive:
        top = math.log10(max(positive))
        span = max(top - math.log10(min(positive)), decades)
    out = []
    for v in values:
        if v is None:
            out.append("-")
        elif not math.isfinite(v):
            out.append("!")
        elif v <= 0:
            out.append(SPARKS[0])
        else:
            step = (1 - (top - math.log10(v)) / span) * (len(SPARKS) - 1)
            out.append(SPARKS[min(len(SPARKS) - 1, max(0, round(step)))])
    return "".join(out)


def _drift(block: BlockResult) -> float | None:
    return None if block.drift is None else block.drift.rel_l2


def drift_sparkline(report: Report) -> str:
    """The drift (rel L2 of the free-running candidate) of every block as one character
    per block, in ``report.blocks`` order, on a log scale (see :func:`sparkline`)."""
    return sparkline([_drift(b) for b in report.blocks])


def _heat_cell(check: Check | None, status: str = "checked") -> str:
    if check is None:
        return level(None, False, status)
    return level(check.ratio, check.diverged, status)


def _heat_rows(blocks: list[BlockResult]) -> list[tuple[str, list[str]]]:
    rows = []
    for name in SUBPATHS:
        cells = []
        for block in blocks:
            result = block.subpaths.get(name)
            cells.append("none" if result is None else _heat_cell(result.worst, result.status))
        rows.append((name, cells))
    rows.append(("whole", [_heat_cell(b.block) for b in blocks]))
    return rows


def _ruler(indices: list[int], cell: int) -> str:
    """Block numbers over the heatmap columns, as many as fit without touching."""
    widest = max(len(str(i)) for i in indices)
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if widest <= s * cell - 1 or s == 1000)
    line = ""
    for position, index in enumerate(indices):
        if index % step == 0 and len(line) <= position * cell:
            line = line.ljust(position * cell) + str(index)
    return line


def render_heatmap(report: Report, console: Console) -> None:
    """Print the compact heatmap: one row per sub-path (and the whole block), one column
    per block, a symbol per check (:data:`SYMBOLS`, coloured when the console allows),
    then the drift sparkline aligned with the columns and the stages outside blocks.

    Example (no colour)::

        local error / threshold: · below 0.5   o 0.5 to 1   X diverged   - not needed or absent
          block      0 1 2 3
          attention  · · · ·
          ffn        · X · ·
          norm       · · · ·
          residual   · · · ·
          whole      · X · ·
          drift      ▁ █ █ █   rel L2 0 … 0.066, log scale
          stages     embed ·   context ·   final_norm ·   head ·

    Args:
        report: the diff's report.
        console: where to print; colour is rich's decision (``NO_COLOR``, not a terminal).
    """
    label = 11
    console.print(Text("local error / threshold: ", style="bold") + Text(LEGEND, style="dim"), highlight=False)
    if report.blocks:
        spark = drift_sparkline(report)
        values = [v for v in (_drift(b) for b in report.blocks) if v is not None and math.isfinite(v)]
        scale = f"   rel L2 {min(values):.2g} … {max(values):.2g}, log scale" if values else ""
        room = max(8, console.width - label - 2)
        cell = 2 if 2 * len(report.blocks) <= room else 1
        per_line = max(1, room // cell)
        stacks: list[tuple[str, list[int]]] = []  # (stack, positions in report.blocks)
        for position, block in enumerate(report.blocks):
            if not stacks or stacks[-1][0] != block.stack:
                stacks.append((block.stack, []))
            stacks[-1][1].append(position)
        for stack, positions in stacks:
            if len(stacks) > 1:
                console.print(Text(f"  {stack}", style="bold"), highlight=False)
            for start in range(0, len(positions), per_line):
                chunk = positions[start : start + per_line]
                blocks = [report.blocks[p] for p in chunk]
                console.print(
                    Text("  " + "block".ljust(label)) + Text(_ruler([b.index for b in blocks], cell), style="dim"),
                    highlight=False,
                )
                for name, cells in _heat_rows(blocks):
                    line = Text("  " + name.ljust(label))
                    for column, c in enumerate(cells):
                        line.append(" " * (cell - 1) if column else "")
                        line.append(SYMBOLS[c], style=_LEVEL_STYLE[c])
                    console.print(line, highlight=False)
                drift = Text("  " + "drift".ljust(label))
                drift.append((" " * (cell - 1)).join(spark[p] for p in chunk), style="cyan")
                if scale and drift.cell_len + len(scale) <= console.width:
                    drift.append(scale, style="dim")
                    scale = ""
                console.print(drift, highlight=False)
        if scale:
            console.print(Text("  " + " " * label + scale.strip(), style="dim"), highlight=False)
    if report.stages:
        line = Text("  " + "stages".ljust(label))
        for column, stage in enumerate(report.stages):
            c = _heat_cell(stage.local)
            line.append(("   " if column else "") + f"{stage.stage} ")
            line.append(SYMBOLS[c], style=_LEVEL_STYLE[c])
        console.print(line, highlight=False)


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
