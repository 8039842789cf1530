"""Render: a report for people, in the terminal (rich).

Fixed order: what could not be computed (notes), then the verdict in one line (with a
backward, both verdicts in that one line), then a compact heatmap (sub-paths × blocks,
one symbol per check by its ratio to the threshold) with the drift sparkline under it
(drift over its own threshold, on a fixed scale), then the table of local errors (blocks
× sub-paths, coloured by ratio to threshold) with drift per block (coloured by its ratio
to its own threshold), then what to do next (``advice``); a backward's heatmap and table
after it, laid out by the same functions.

Every line fits the console's width (80 columns and down to 60). Tables never cut a
number: a console too narrow for a table (80 columns) gets it with narrower gaps, and a
narrower one (60) gets its columns stacked in several tables, each repeating the row
names (:func:`_fitted`). Sentences wrap at spaces under a hanging indent, never inside a
`quoted command` (:func:`_say`); a model path too long for its line loses the middle of
its directories, never its file name and factory (:func:`shorten`).

It lays out the report's :class:`~.view.View`, which the PNG (:mod:`.plot`) and the HTML
(:mod:`.html`) read too: what each cell says and its symbol come from there.

Colour follows rich's rules: ``NO_COLOR`` and output that is not a terminal get plain
text. Nothing depends on colour: heatmap cells are symbols (:data:`~.view.SYMBOLS`) and
table cells carry a ``!`` when they diverge, so red and green need not be told apart.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .hookmap import AUTO_DETECTED, Layout
from .report import Report, named_headline
from .view import (
    drill_down,
    LEGEND,
    MOE_COLUMNS,
    MOE_COUNTS,
    ROWS,
    SYMBOLS,
    WHOLE,
    Cell,
    MoeRow,
    View,
    dtype_said,
    fmt,
    level,
)
from .vocab import SUBPATHS, UNATTRIBUTED

# What the CLI says after a divergence; a test failure says its own (``advice=None``).
ADVICE = (
    "next: read the module named above; `--json PATH` keeps every metric, "
    "`blockdiff arch MODEL` shows how sub-paths were mapped"
)
# ... when the JSON report was written already (``path`` is where), or is what was shown.
ADVICE_JSON_WRITTEN = (
    "next: read the module named above; {path} keeps every metric, "
    "`blockdiff arch MODEL` shows how sub-paths were mapped"
)
ADVICE_SAVED = (
    "next: read the module named above; `blockdiff report {path} --html PATH` keeps it as a page, "
    "`blockdiff arch MODEL` shows how sub-paths were mapped"
)

# What to do when a module belongs to no sub-path, or detection missed one.
HOOKS_FIX = "write a hook map (docs/hook-maps.md) and pass it with --hooks FILE.toml"

_LEVEL_STYLE = {"low": "green", "near": "yellow", "diverged": "bold red", "none": "dim"}


def _cell(cell: Cell) -> Text:
    if cell.status == "not_needed":
        # "-" like the heatmap: "·" there means a small error, not a skipped check.
        return Text("-", style="dim")
    if cell.ratio is None:
        return Text("—", style="dim")
    mark = "!" if cell.diverged else ""
    # Table cells take the heatmap's colours, by the ratio alone (drift-only checks too).
    return Text(cell.text + mark, style=_LEVEL_STYLE[level(cell.ratio, cell.diverged)])


def _drift_cell(cell: Cell) -> Text:
    """Drift: coloured by its ratio to drift's own threshold where it was judged, ``!``
    where it exceeds it; plain where it was not (two dumps compared)."""
    if cell.value is None:
        return Text("—", style="dim")
    if cell.ratio is None:
        return Text(cell.text)
    return _cell(cell)


# Breaks no line inside it: the spaces of a `quoted command` and of "(cpu, float32)".
_NBSP = "\u00a0"


def shorten(spec: str, room: int) -> str:
    """``spec`` (a model path, a dump's path) in at most ``room`` characters: the middle of
    its directories replaced by ``…``, its file name and factory kept whole. A file name and
    factory longer than ``room`` are kept all the same, after ``…/``.

    >>> shorten("/tmp/some/very/long/directory/for/a/model/tinylm.py:build", 40)
    '/tmp/some/very/long/…/tinylm.py:build'
    >>> shorten("samples/tinylm.py:build", 40), shorten("mypkg.models.very.deep.module:build", 24)
    ('samples/tinylm.py:build', 'mypkg.….module:build')
    """
    if len(spec) <= room:
        return spec
    cut = spec.rfind("/")
    if cut < 0:  # package.module:factory: keep the last module and the factory
        cut = spec.rfind(".", 0, spec.find(":") if ":" in spec else len(spec))
    if cut <= 0:
        return spec
    head, tail = spec[:cut], spec[cut:]
    keep = room - len(tail) - 1
    if keep < 1:
        return "…" + tail
    head = head[:keep]
    separator = tail[0]
    if separator in head:  # end on a whole directory (or module) name
        head = head[: head.rindex(separator) + 1]
    return head + "…" + tail


def _lines(text: str, width: int, indent: int) -> list[str]:
    """``text`` wrapped at spaces into lines of at most ``width``, the second and later
    indented by ``indent``; a `quoted command` and a word longer than a line stay whole.
    Lines are balanced: as narrow as they can be in as few lines, so that no word is left
    alone on the last one."""
    protected = "`".join(
        part.replace(" ", _NBSP) if i % 2 else part for i, part in enumerate(text.split("`"))
    )

    def wrap(paragraph: str, width: int, first: str) -> list[str]:
        return textwrap.wrap(
            paragraph, width=width, initial_indent=first, subsequent_indent=" " * indent,
            break_long_words=False, break_on_hyphens=False,
        ) or [first.rstrip()]

    width = max(width, indent + 20)
    lines: list[str] = []
    for paragraph in protected.split("\n"):  # a line break in the text stays one
        first = " " * indent if lines else ""
        wrapped = wrap(paragraph, width, first)
        narrow = width
        while len(wrapped) > 1 and narrow > indent + 20:
            fewer = wrap(paragraph, narrow - 1, first)
            if len(fewer) > len(wrapped):
                break
            wrapped, narrow = fewer, narrow - 1
        lines += wrapped
    return [line.replace(_NBSP, " ") for line in lines]


def _say(console: Console, head: str, body: str, *, head_style: str | None = None, style: str | None = None,
         indent: int = 2) -> None:
    """Print ``head`` + ``body`` (plain text, not markup) wrapped to the console's width
    (:func:`_lines`), ``head`` in ``head_style``, the whole in ``style``."""
    for number, line in enumerate(_lines(head + body, console.width, indent)):
        text = Text(line, style=style or "")
        if number == 0 and head_style and line.startswith(head):
            text.stylize(head_style, 0, len(head.rstrip(": ")))
        console.print(text, highlight=False)


def _header(view: View, width: int) -> list[Text]:
    """Which models ran, on what, and the tolerance policy: one line when it fits, else
    one line each under aligned labels, a path shortened to fit (:func:`shorten`)."""
    ref, cand = view.report.reference, view.report.candidate

    def details(meta: dict) -> tuple[str, str]:
        ranks = f", {meta['ranks']} ranks" if meta.get("ranks") else ""
        quantized = f"; {meta['quantization']}" if meta.get("quantization") else ""
        return f"({meta['device']}{ranks}, {dtype_said(meta)}", f"{quantized})"

    def side(meta: dict) -> str:
        where, quantized = details(meta)
        return f"{meta['model']} {where}{quantized}"

    one = f"blockdiff reference {side(ref)} vs candidate {side(cand)}; tolerance {view.tolerance}"
    if len(one) <= width:
        lines = [one]
    else:
        label = len("blockdiff reference ")
        lines = []
        for name, meta in (("reference", ref), ("candidate", cand)):
            where, quantized = details(meta)
            where = where.replace(" ", _NBSP)
            closing = quantized.split(" ")[0] if quantized else ")"  # ")" or "; word"
            room = width - label - len(where) - len(closing) - 1
            model = shorten(str(meta["model"]), max(room, 16))
            lead = ("blockdiff " if name == "reference" else " " * len("blockdiff ")) + name + " "
            text = f"{lead}{model} {where}{quantized}"
            lines += [line.replace(_NBSP, " ") for line in _lines(text, width, label)]
        lines.append(" " * len("blockdiff ") + f"tolerance {view.tolerance}")
    out = []
    for line in lines:
        text = Text(line)
        if line.startswith("blockdiff "):
            text.stylize("bold", 0, len("blockdiff"))
        out.append(text)
    return out


def render(report: Report | dict[str, Any], console: Console | None = None, *, advice: str | None = ADVICE) -> None:
    """Print ``report`` to ``console`` (stdout by default), every line within its width.

    Args:
        report: a :class:`~.report.Report`, or its ``blockdiff.report/2`` dict.
        console: where to print; colour is rich's decision (``NO_COLOR``, not a terminal).
        advice: the closing line after a divergence, what to do next: the CLI's
            (:data:`ADVICE`) unless given; ``None`` prints none.
    """
    console = console or Console()
    view = View.of(report)
    for line in _header(view, console.width):
        console.print(line, highlight=False)
    for note in view.report.notes:
        _say(console, "note: ", note, head_style="yellow", indent=6)
    first = view.first
    _headline(view.report, console)
    if first is not None:
        if first.subpath == UNATTRIBUTED:
            position = view.column_of(first)
            unmapped = [] if position is None else view.columns[position].unmapped
            missing = f" ({', '.join(unmapped)} belong to no sub-path)" if unmapped else ""
            _say(
                console, "  ",
                "the block diverges but no sub-path explains it: the hook map may be missing "
                f"a module{missing}; check it with `blockdiff arch`, then {HOOKS_FIX}",
                indent=4,
            )
        drill = drill_down(first)
        if drill is not None:
            _say(console, "  ", drill, indent=4)
    _heatmap(view, console)
    if view.report.decode is not None:
        _steps(view.report, console)
    if view.report.first_nonfinite is not None:
        nf = view.report.first_nonfinite
        _say(
            console, "non-finite: ",
            f"the free-running candidate first holds {nf['nonfinite_cand']} "
            f"NaN/Inf values at {nf['site']} ({nf['module']})",
            head_style="red",
        )

    for table in _error_tables(view, console.width):
        console.print(table)
    for table in _moe_tables(view.moe, console.width) if view.moe else []:
        console.print(table)
    if view.moe:
        _say(console, "", MOE_COUNTS, style="dim", indent=0)
    if len(view.divergences) > 1:
        console.print(f"{len(view.divergences)} divergent sites:", highlight=False)
        for d in view.divergences:
            _say(console, "  - ", d.headline(), indent=4)
    if first is not None and advice is not None:
        _say(console, "", advice, style="dim", indent=6)
    if view.report.backward is not None:
        _backward(view.report, console)


def _headline(report: Report, console: Console) -> None:
    """The verdict, first: the forward's; with a backward (``--backward``) one line naming
    both, ``Verdict: forward: no divergence; backward: block 1 residual …`` (the HTML's
    words), continued under a hanging indent."""
    if report.backward is None:
        first = report.first_divergence
        if first is None:
            _say(console, "No divergence: ", "every local error is within tolerance.", head_style="bold green")
        else:
            _say(console, "First divergence: ", first.headline(), head_style="bold red", indent=4)
    elif report.diverged:
        _say(console, "Verdict: ", report.verdict(), head_style="bold red", indent=4)
    else:
        _say(console, "No divergence: ", "every local error is within tolerance, forward and backward.",
             head_style="bold green")


def _backward(report: Report, console: Console) -> None:
    """After the forward's report, the backward's (``--backward``), laid out as the
    forward's (blocks as the forward's, read head to embedding): notes, heatmap with its
    drift sparkline, the table of its numbers, its divergences, the first one's drill-down."""
    backward = report.backward
    assert backward is not None
    view = View.of(backward)
    console.print(Text("Backward (gradients, judged from the head to the embedding):", style="bold"), highlight=False)
    for note in backward.notes[1:]:  # the first is the forward report's already
        _say(console, "note: ", note, head_style="yellow", indent=6)
    first = view.first
    if first is not None:
        _say(console, "First divergent gradient: ", named_headline(first), head_style="bold red", indent=4)
        drill = drill_down(first)
        if drill is not None:
            _say(console, "  ", drill, indent=4)
    _heatmap(view, console)
    for table in _error_tables(view, console.width, measured="gradients' local error"):
        console.print(table)
    if len(view.divergences) > 1:
        console.print(f"{len(view.divergences)} divergent gradients:", highlight=False)
        for divergence in view.divergences:
            _say(console, "  - ", named_headline(divergence), indent=4)


# Left-aligned columns of the tables; the rest hold numbers, right-aligned.
_LEFT = ("site", "side", "tokens per expert")
# Measures tables unbounded: a measurement within a console's width never exceeds it.
_UNBOUNDED = Console(width=10_000, file=io.StringIO())


def _table(
    title: str | None, keys: Sequence[str], names: Sequence[str], rows: list[dict[str, Any]], *, compact: bool
) -> Table:
    """The columns ``keys`` and ``names`` of ``rows``, but the rows with nothing in ``names``;
    ``compact`` leaves two spaces between columns, not three, and none at the sides."""
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=not compact, collapse_padding=compact
    )
    for name in (*keys, *names):
        table.add_column(name, no_wrap=True, justify="left" if name in _LEFT else "right")
    for row in rows:
        if any(str(row[name]) for name in names):
            table.add_row(*(row[name] for name in (*keys, *names)))
    return table


def _fitted(
    title: str, keys: Sequence[str], names: Sequence[str], rows: list[dict[str, Any]], width: int
) -> list[Table]:
    """``rows`` as one or more tables no wider than ``width``, so that no value is cut: as
    wide as it reads best when it fits (the local errors in 120 columns), else with
    narrower gaps (in 80), else the columns ``names`` stacked in as many narrow tables as
    it takes (in 60, two), each repeating the columns ``keys``, the title on the first.
    Below one column of ``names`` beside ``keys``, rich cuts what it must."""
    tables = [_table(title, keys, names, rows, compact=False)]
    for per in range(len(names), 0, -1):
        if all(_UNBOUNDED.measure(table).maximum <= width for table in tables):
            break
        tables = [
            _table(title if start == 0 else None, keys, names[start : start + per], rows, compact=True)
            for start in range(0, len(names), per)
        ]
    return tables


def _error_tables(view: View, width: int, *, measured: str | None = None) -> list[Table]:
    """The local errors (blocks and stages × sub-paths, whole block or stage) and drift
    (its cell coloured by its ratio to drift's own threshold)."""
    rows = []
    # Columns in execution order: an encoder's final norm comes before the decoder's blocks.
    for column in view.columns:
        row = {name: _cell(column.cells[name]) for name in ROWS}
        row.update(site=column.name, drift=_drift_cell(column.drift_cell))
        if column.stage != "block":
            row.update((name, Text("")) for name in SUBPATHS)  # a stage has its own check only
        elif view.multi_stack:
            row["site"] += f" ({column.stack})"
        rows.append(row)
    title = f"{measured or view.measured} (rel L2) per sub-path, whole block or stage; drift of the free-running candidate"
    return _fitted(title, ("site",), (*ROWS, "drift"), rows, width)


def _ruler(indices: list[int], cell: int) -> str:
    """Block numbers over the heatmap columns, as many as fit without touching."""
    widest = max(len(str(i)) for i in indices)
    step = next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if widest <= s * cell - 1 or s == 1000)
    line = ""
    for position, index in enumerate(indices):
        if index % step == 0 and len(line) <= position * cell:
            line = line.ljust(position * cell) + str(index)
    return line


def _symbol(line: Text, cell: Cell) -> None:
    kind = cell.level
    line.append(SYMBOLS[kind], style=_LEVEL_STYLE[kind])


def render_heatmap(report: Report | dict[str, Any] | View, console: Console) -> None:
    """Print the compact heatmap: one row per sub-path (and the whole block), one column
    per block, a symbol per check (:data:`~.view.SYMBOLS`, coloured when the console
    allows), then the drift sparkline aligned with the columns (drift over its own
    threshold on a fixed scale: :func:`~.view.ratio_sparkline`) and the stages outside blocks.

    Example (no colour)::

        local error / threshold: · below 0.5   o 0.5 to 1   X diverged   - not needed, absent or not judged
          block      0 1 2 3
          attention  · · · ·
          ffn        · X · ·
          norm       · · · ·
          residual   · · · ·
          whole      · X · ·
          drift      ▁ █ █ █   drift / threshold 0 … 5.8e+02, over 1: ▅ to █
          stages     embed ·   context ·   final_norm ·   head ·

    Args:
        report: the diff's report (or its dict, or its view).
        console: where to print; colour is rich's decision (``NO_COLOR``, not a terminal).
    """
    _heatmap(View.of(report), console)


def _heatmap(view: View, console: Console) -> None:
    label = 11
    caption = f"{view.measured} / threshold: "
    if len(caption) + len(LEGEND) <= console.width:
        console.print(Text(caption, style="bold") + Text(LEGEND, style="dim"), highlight=False)
    else:  # the legend under its caption, its entries whole
        console.print(Text(caption.rstrip(), style="bold"), highlight=False)
        for line in _packed([Text(entry) for entry in LEGEND.split("   ")], "  ", "  ", console.width):
            line.stylize("dim")
            console.print(line, highlight=False)
    blocks = view.blocks
    if blocks:
        spark = view.drift_sparkline
        scale = f"   {view.drift_scale}" if view.drift_scale else ""
        room = max(8, console.width - label - 2)
        cell = 2 if 2 * len(blocks) <= room else 1
        per_line = max(1, room // cell)
        stacks: list[tuple[str | None, list[int]]] = []  # (stack, positions in blocks)
        for position, block in enumerate(blocks):
            if not stacks or stacks[-1][0] != block.stack:
                stacks.append((block.stack, []))
            stacks[-1][1].append(position)
        for stack, positions in stacks:
            if len(stacks) > 1:
                console.print(Text(f"  {stack}", style="bold"), highlight=False)
            for start in range(0, len(positions), per_line):
                chunk = positions[start : start + per_line]
                columns = [blocks[p] for p in chunk]
                console.print(
                    Text("  " + "block".ljust(label)) + Text(_ruler([c.block for c in columns], cell), style="dim"),
                    highlight=False,
                )
                for name in ROWS:
                    line = Text("  " + name.ljust(label))
                    for position, column in enumerate(columns):
                        line.append(" " * (cell - 1) if position else "")
                        _symbol(line, column.cells[name])
                    console.print(line, highlight=False)
                drift = Text("  " + "drift".ljust(label))
                drift.append((" " * (cell - 1)).join(spark[p] for p in chunk), style="cyan")
                if scale and drift.cell_len + len(scale) <= console.width:
                    drift.append(scale, style="dim")
                    scale = ""
                console.print(drift, highlight=False)
        if scale:  # under the sparkline, wrapped under itself
            _say(console, "  " + " " * label, scale.strip(), style="dim", indent=2 + label)
    if view.stages:
        entries = []
        for stage in view.stages:
            entry = Text(f"{stage.stage} ")
            _symbol(entry, stage.cells[WHOLE])
            entries.append(entry)
        for line in _packed(entries, "  " + "stages".ljust(label), "  " + " " * label, console.width):
            console.print(line, highlight=False)


def _steps(report: Report, console: Console) -> None:
    """A decode's steps × blocks: one row per step (every step of a short decode; of a long
    one, the steps that diverge and the first), ``X`` where a block diverges at that step,
    and the step's first divergence beside it. The heatmap above is the shown step's."""
    indices = [b.index for b in report.blocks]
    steps = report.steps or []
    shown = steps if len(steps) <= 16 else [s for s in steps if s["step"] == 0 or s["first_divergence"]]
    label = 8
    console.print(Text(f"decode steps × blocks (the heatmap is step {report.decode['step']}'s):", style="bold"),
                  highlight=False)
    console.print(Text("  " + "step".ljust(label) + " ".join(str(i % 10) for i in indices), style="dim"), highlight=False)
    for summary in shown:
        line = Text("  " + str(summary["step"]).ljust(label))
        for position, index in enumerate(indices):
            mark = "X" if summary["diverged"].get(str(index)) else "·"
            line.append(mark, style="bold red" if mark == "X" else "dim")
            if position < len(indices) - 1:
                line.append(" ")
        first = summary["first_divergence"]
        if first is not None:
            where = f"block {first['block']} {first['subpath']}" if first["stage"] == "block" else first["stage"]
            line.append(f"  {where}"[: max(0, console.width - len(line) - 1)], style="red")
        console.print(line, highlight=False)
    if len(shown) < len(steps):
        console.print(Text(f"  ({len(steps) - len(shown)} other steps: no divergence)", style="dim"), highlight=False)


def _packed(entries: list[Text], first: str, rest: str, width: int) -> list[Text]:
    """``entries`` three spaces apart, as many per line as fit in ``width``: the first line
    after ``first``, the others after ``rest`` (at least one entry per line)."""
    lines: list[Text] = []
    line = Text(first)
    count = 0
    for entry in entries:
        if count and line.cell_len + 3 + entry.cell_len > width:
            lines.append(line)
            line, count = Text(rest), 0
        if count:
            line.append("   ")
        line.append_text(entry)
        count += 1
    lines.append(line)
    return lines


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
    for table in (_layout_table(layout, compact=False), _layout_table(layout, compact=True)):
        # Narrower gaps before rich cuts a module name short (80 columns, HF names).
        if _UNBOUNDED.measure(table).maximum <= console.width:
            break
    console.print(table)
    console.print("  attention: each block's token mixer (attention, state space, convolution)", style="dim", highlight=False)
    unmapped = [p for b in layout.blocks for p in b.unmapped]
    warnings = []
    if unmapped:
        warnings.append(
            f"{len(unmapped)} modules with parameters belong to no sub-path (e.g. {unmapped[0]}); "
            "their errors cannot be separated from the block's glue"
        )
    lacking = [name for name in ("attention", "ffn") if not any(name in b.subpaths for b in layout.blocks)]
    if lacking:
        warnings.append(f"no block has {' or '.join(lacking)} modules")
    if layout.hook_map.source == AUTO_DETECTED and not any(stage == "embed" for stage, _ in layout.outside):
        warnings.append("no embedding was found")
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    if warnings:
        console.print(f"  to fix: {HOOKS_FIX}", highlight=False)


def _layout_table(layout: Layout, *, compact: bool) -> Table:
    """Per block of ``layout``, each sub-path's modules; ``compact``: two spaces between
    columns, none at the sides."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=not compact, collapse_padding=compact)
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
            cell = Text(", ".join(p.removeprefix(prefix) for p in paths) or "—")
            if name == "ffn" and block.moe is not None:
                k = f", top-{block.moe['top_k']}" if "top_k" in block.moe else ""
                cell.append(f"\nrouter {block.moe['router'].removeprefix(prefix)} ({block.moe['format']}{k})", style="cyan")
            cells.append(cell)
        table.add_row(str(block.index), block.path, *cells)
    return table


BARS = " ▁▂▃▄▅▆▇█"


def _bar(counts: list[int]) -> str:
    """Per-expert counts as one row of bars, scaled to the largest."""
    top = max(counts) if counts else 0
    if top == 0:
        return BARS[0] * len(counts)
    return "".join(BARS[round(c / top * (len(BARS) - 1))] for c in counts)


def _moe_tables(rows: list[MoeRow], width: int) -> list[Table]:
    """Per MoE block and side: routing entropy, loads, drops, agreement, counts."""
    title = (
        "MoE routing per block (entropy normalized by ln E; drops: the model's capacity, "
        "or counterfactual at the first capacity factor)"
    )
    cells = [dict(zip(MOE_COLUMNS, [*row.cells, _bar(row.counts)], strict=True)) for row in rows]
    return _fitted(title, MOE_COLUMNS[:2], MOE_COLUMNS[2:], cells, width)


def render_ranking(report: Report, console: Console, *, top: int) -> None:
    """The worst ``top`` entries of ``report.ranking`` (see :meth:`Report.rank`): where the
    local error is largest over its baseline, sub-paths and their children alike.

    One line per entry, ``local error / baseline = ratio``, within the console's width: a
    module path too long for its column loses the middle of its path (:func:`shorten`),
    never its last name.
    """
    ranking = report.ranking or []
    basis = report.tolerance.get("baseline")
    over = f"the reference's own floor at {basis}" if basis else "each check's threshold"
    worst = f"worst {min(top, len(ranking))} of {len(ranking)}"
    line = f"ranking: local error over {over}, {worst}"
    if len(line) <= console.width:
        console.print(line, highlight=False)
    else:
        console.print(f"ranking: {worst}", highlight=False)
        _say(console, "  ", f"local error over {over}", indent=4)
    entries = ranking[:top]
    if not entries:
        return
    rows = []
    for place, entry in enumerate(entries, start=1):
        where = entry["stage"] if entry["stage"] != "block" else f"block {entry['block']} {entry['subpath']}"
        rows.append((
            f"{place:>2}.", where, entry["child"] or entry["module"], fmt(entry["value"], ".3g"),
            fmt(entry["baseline"], ".3g"), f"{fmt(entry['ratio'], '.1f')}x",
            f"share {entry['share']:.0%}" if entry.get("share") is not None else "",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def laid(row: tuple[str, ...], module: int) -> str:
        place, where, name, value, baseline, ratio, share = row
        return (
            f"  {place} {where:<{widths[1]}}  {shorten(name, module):<{module}}  {value:>{widths[3]}} / "
            f"{baseline:<{widths[4]}} = {ratio:>{widths[5]}}  {share}"
        ).rstrip()

    # The module column gives way when a line is wider than the console.
    wide = max(len(laid(row, widths[2])) for row in rows)
    module = max(12, widths[2] - max(0, wide - console.width))
    for row in rows:
        console.print(laid(row, module), highlight=False)
    console.print("  local error / baseline = ratio", style="dim", highlight=False)
    if any(row[6] for row in rows):
        _say(console, "  ", "share: of the error all sub-paths added (to first order, of the final drift)",
             style="dim", indent=4)
