"""HTML: a report as one self-contained page.

Beside the terminal (:mod:`.render`) and the PNG (:mod:`.plot`) at the end of the
pipeline, it lays out the report's :class:`~.view.View`, so it takes a
:class:`~.report.Report` or its ``blockdiff.report/2`` dict alike. The page fetches
nothing: CSS is inline, the heatmap is a table with inline colours, the figure (when
matplotlib is installed) is an inline ``data:`` PNG, and the report itself is embedded
as JSON in ``<script type="application/json" id="blockdiff-report">`` so the page is
also the data (the dict it was given, or the report's ``to_dict()``). Fixed order, as
in the terminal: the first divergence in plain text, notes, the sites × sub-paths table
with drift, the figure, every divergence, the MoE routing table.

Everything that comes from the user (model specs, class and module names, notes) is
escaped with :func:`html.escape`; the embedded JSON escapes ``<``, ``>`` and ``&`` so no
string in it can close the script element.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from .errors import BlockdiffError
from .plot import figure
from .report import Report, named_headline
from .view import (
    drill_down,
    LEGEND,
    MOE_COLUMNS,
    ROWS,
    SYMBOLS,
    Cell,
    Column,
    MoeRow,
    View,
    dtype_said,
    fmt,
    ratio_colour,
)
from .vocab import SUBPATHS, UNATTRIBUTED

__all__ = ["document", "write_html"]

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto;
       max-width: 80em; padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
h2 { font-size: 1.1em; margin-top: 1.6em; }
.verdict { font-size: 1.1em; padding: 0.6em 0.8em; border-radius: 4px; }
.verdict.diverged { background: #fde0dc; border-left: 5px solid #a50026; }
.verdict.clean { background: #e3f4d7; border-left: 5px solid #1a9850; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { padding: 0.25em 0.6em; border: 1px solid #ddd; text-align: right; white-space: nowrap; }
th { background: #f4f4f4; }
td.name, th.name { text-align: left; }
td.none { color: #999; background: #f7f7f7; }
td.diverged { font-weight: bold; outline: 2px solid #000; outline-offset: -2px; }
td small { color: inherit; opacity: 0.8; }
.sym { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
.spark { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; font-size: 1.4em;
         letter-spacing: 0.15em; }
.legend, .meta { color: #555; }
.counts span { display: inline-block; min-width: 1.8em; text-align: center; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace; }
img { max-width: 100%; height: auto; }
#steps td.bad { background: #fde0dc; font-weight: bold; }
#steps td.good { color: #999; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _text_colour(background: str) -> str:
    r, g, b = (int(background[k : k + 2], 16) for k in (1, 3, 5))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#000"


def _number(value: float | None) -> str:
    """A number for a ``data-`` attribute: as Python writes it, every digit kept."""
    return "" if value is None else repr(float(value))


def _cell(cell: Cell, *, blank: bool = False, name: str = "local error") -> str:
    """One table cell: the value (local error, or ``name`` drift: class ``drift``), its
    symbol and ratio to its own threshold, coloured by the ratio; ``data-value`` and
    ``data-threshold`` hold both numbers whole. A value with no threshold (drift not
    judged) stands uncoloured."""
    if blank:
        return "<td></td>"
    kinds = ["drift"] if name == "drift" else []
    if cell.ratio is None:
        if cell.value is not None:
            return f'<td{_classes(kinds)} data-value="{_number(cell.value)}">{_e(cell.text)}</td>'
        text = "not needed" if cell.status == "not_needed" else "absent"
        return f'<td{_classes([*kinds, "none"])} title="{_e(text)}"><span class="sym">{SYMBOLS["none"]}</span></td>'
    background = ratio_colour(cell.ratio)
    style = f"background:{background};color:{_text_colour(background)}"
    what = f"{cell.module}: {cell.what}; " if cell.module else ""
    title = (
        f"{what}{name} {cell.metric} {fmt(cell.value, '.3g')}, "
        f"threshold {fmt(cell.threshold, '.3g')}, ratio {fmt(cell.ratio, '.3g')}"
    )
    classes = _classes([*kinds, "diverged"] if cell.diverged else kinds)
    return (
        f'<td{classes} style="{style}" title="{_e(title)}" data-value="{_number(cell.value)}" '
        f'data-threshold="{_number(cell.threshold)}">{_e(cell.text)} '
        f'<span class="sym">{SYMBOLS[cell.level]}</span><br><small>{_e(fmt(cell.ratio, ".3g"))}x</small></td>'
    )


def _classes(names: list[str]) -> str:
    return f' class="{" ".join(names)}"' if names else ""


def _heat_table(cols: list[Column], *, name: str = "heatmap") -> str:
    head = "".join(f"<th>{_e(name)}</th>" for name in ROWS)
    rows = []
    for col in cols:
        cells = "".join(_cell(col.cells[row], blank=col.stage != "block" and row in SUBPATHS) for row in ROWS)
        drift = _cell(col.drift_cell, name="drift")
        rows.append(f'<tr><td class="name">{_e(col.name)} <small class="meta">{_e(col.module)}</small></td>{cells}{drift}</tr>')
    return (
        f'<table class="heat" id="{name}">\n'
        f'<thead><tr><th class="name">site</th>{head}<th>drift</th></tr></thead>\n'
        "<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _side_table(report: Report) -> str:
    keys = ("model", "class", "device", "dtype", "hook_map")
    head = "".join(f"<th>{_e(k.replace('_', ' '))}</th>" for k in keys)
    rows = []
    for side, entry in (("reference", report.reference), ("candidate", report.candidate)):
        cells = "".join(f'<td class="name">{_e(dtype_said(entry) if k == "dtype" else entry.get(k, ""))}</td>' for k in keys)
        rows.append(f'<tr><th class="name">{side}</th>{cells}</tr>')
    return f'<table class="sides"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _counts(counts: list[int]) -> str:
    top = max(counts, default=0) or 1
    spans = "".join(
        f'<span style="background:rgba(33,113,181,{0.08 + 0.8 * c / top:.2f});'
        f'color:{"#fff" if c / top > 0.7 else "#000"}">{int(c)}</span>'
        for c in counts
    )
    return f'<td class="name counts">{spans}</td>'


def _moe_table(moe: list[MoeRow]) -> str:
    head = "".join(f"<th>{n}</th>" for n in MOE_COLUMNS)
    rows = []
    for row in moe:
        cells = "".join(f"<td>{_e(c)}</td>" for c in row.cells)
        rows.append(f"<tr>{cells}{_counts(row.counts)}</tr>")
    return (
        '<table class="moe" id="moe">\n'
        f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _image(view: View) -> str:
    try:
        fig = figure(view)
    except BlockdiffError:
        return '<p class="meta">(the figure needs matplotlib: <code>pip install \'blockdiff[plot]\'</code>)</p>'
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<figure><img alt="heatmap of local errors and drift per block" src="data:image/png;base64,{encoded}"></figure>'


def _steps_table(report: Report) -> str:
    """A decode's steps × blocks: per step, the sub-paths that diverge in each block, and
    the step's first divergence."""
    indices = [b.index for b in report.blocks]
    head = "".join(f"<th>block {i}</th>" for i in indices)
    rows = []
    for summary in report.steps or []:
        cells = "".join(
            f'<td class="{"bad" if summary["diverged"].get(str(i)) else "good"}">'
            f'{_e(", ".join(summary["diverged"].get(str(i), [])) or "·")}</td>'
            for i in indices
        )
        first = summary.get("first_divergence")
        where = "" if first is None else (
            f"block {first['block']} {first['subpath']}" if first["stage"] == "block" else first["stage"]
        )
        rows.append(f"<tr><th>step {_e(summary['step'])}</th>{cells}<td>{_e(where)}</td></tr>")
    return f'<table id="steps"><tr><th></th>{head}<th>first divergence</th></tr>{"".join(rows)}</table>'


def _sparkline(view: View) -> str:
    """The drift sparkline, each bar coloured by drift's ratio to its own threshold where
    it was judged."""
    bars = view.drift_sparkline
    if not view.drift_judged:
        return _e(bars)
    return "".join(
        _e(bar) if column.drift_ratio is None else f'<span style="color:{ratio_colour(column.drift_ratio)}">{_e(bar)}</span>'
        for bar, column in zip(bars, view.blocks)
    )


def _embedded_json(data: dict[str, Any]) -> str:
    # Inside <script>, "</script>" or "<!--" in any string would end or confuse the
    # element; \u escapes keep the JSON identical once parsed.
    text = json.dumps(data)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def document(report: Report | dict[str, Any], *, image: bool = True) -> str:
    """The HTML page of ``report`` as a string (see :func:`write_html`)."""
    view = View.of(report)
    # The page embeds the dict it was given (a saved file as it was), or the report's own.
    data = report.to_dict() if isinstance(report, Report) else report
    report = view.report
    ref, cand = report.reference, report.candidate
    first = view.first
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="blockdiff {_e(report.version)}">',
        f"<title>blockdiff: {_e(ref.get('model', '?'))} vs {_e(cand.get('model', '?'))}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<h1>blockdiff report</h1>",
    ]
    if report.backward is not None:  # --backward: both verdicts, apart
        state = "diverged" if report.diverged else "clean"
        parts.append(f'<p class="verdict {state}" id="verdict"><strong>Verdict</strong>: {_e(report.verdict())}</p>')
    if first:
        if report.backward is None:
            parts.append(f'<p class="verdict diverged" id="verdict"><strong>First divergence</strong>: {_e(first.headline())}</p>')
        if first.subpath == UNATTRIBUTED:
            parts.append(
                "<p>The block diverges but no sub-path explains it: the hook map may be missing a "
                "module; check it with <code>blockdiff arch</code>.</p>"
            )
        drill = drill_down(first)
        if drill is not None:
            parts.append(f'<p id="drill-down">{_e(drill[0].upper() + drill[1:])}</p>')
    elif report.backward is None:
        parts.append(
            '<p class="verdict clean" id="verdict"><strong>No divergence</strong>: '
            "every local error is within tolerance.</p>"
        )
    nonfinite = report.first_nonfinite
    if nonfinite:
        parts.append(
            f"<p>Non-finite: the free-running candidate first holds {_e(nonfinite.get('nonfinite_cand'))} "
            f"NaN/Inf values at {_e(nonfinite.get('site'))} ({_e(nonfinite.get('module'))}).</p>"
        )
    tolerance, inputs = report.tolerance, report.inputs
    parts += [
        _side_table(report),
        (f'<p class="meta">tolerance {_e(tolerance.get("policy", "?"))}; inputs {_e(inputs.get("kind", "?"))} '
        f'{_e(inputs.get("shape", ""))}; blockdiff {_e(report.version)}; '
        f'created {_e(report.created)}</p>'),
    ]
    notes = report.notes
    if notes:
        parts.append("<ul class=\"notes\">" + "".join(f"<li>note: {_e(n)}</li>" for n in notes) + "</ul>")
    parts += [
        "<h2>Local error per sub-path, whole block or stage; drift</h2>",
        (f'<p class="legend">Cells: local error (rel L2), symbol, and ratio to the threshold '
        f"(colour, log scale: green below, red above). {_e(LEGEND)}. Hover a cell for its module "
        "and threshold. Drift: the free-running candidate against the reference, with its ratio to "
        "drift's own threshold (the reference's own free run at the candidate's precision where precisions differ, "
        "else the fixed one) and coloured by it.</p>"),
        _heat_table(view.columns),
    ]
    if report.backward is not None:
        parts += _backward_section(report.backward)
    if report.decode is not None:
        parts += [
            f"<h2>Decode steps × blocks (the table above is step {_e(report.decode.get('step'))}'s)</h2>",
            _steps_table(report),
        ]
    if view.blocks:
        scale = f" {view.drift_scale}" if view.drift_scale else ""
        parts += [
            "<h2>Drift per block</h2>",
            f'<p><span class="spark" id="drift-sparkline">{_sparkline(view)}</span><span class="meta">{_e(scale)}</span></p>',
        ]
    if image:
        parts.append(_image(view))
    divergences = view.divergences
    if len(divergences) > 1:
        parts.append(f"<h2>{len(divergences)} divergent sites</h2>")
        parts.append("<ol>" + "".join(f"<li>{_e(d.headline())}</li>" for d in divergences) + "</ol>")
    if view.moe:
        parts += [
            "<h2>MoE routing per block</h2>",
            ('<p class="legend">Entropy normalized by ln E; drops at the model\'s capacity, or counterfactual '
            "at the first capacity factor; tokens per expert before capacity.</p>"),
            _moe_table(view.moe),
        ]
    budgets = [(b.index, b.budget) for b in view.report.blocks if b.budget]
    if budgets:
        sources = list(dict.fromkeys(k for _, budget in budgets for k in budget))
        head = "".join(f"<th>{_e(k)}</th>" for k in sources)
        rows = "".join(
            f"<tr><th>block {index}</th>" + "".join(f"<td>{budget.get(k, {}).get('share', 0):.0%}</td>" for k in sources) + "</tr>"
            for index, budget in budgets
        )
        parts += [
            "<h2>Error budget per block</h2>",
            ('<p class="legend">Share of each block output\'s error, to first order: what came in with the '
             "block input, and what each sub-path added (its local error × its output's norm).</p>"),
            f'<table id="budget"><tr><th></th>{head}</tr>{rows}</table>',
        ]
    parts += [
        f'<script type="application/json" id="blockdiff-report">\n{_embedded_json(data)}\n</script>',
        "</body>",
        "</html>",
        "",
    ]
    return "\n".join(parts)


def _backward_section(back: Report) -> list[str]:
    """The gradients' report (``--backward``): its notes, its table (blocks from the last
    to the first, as the backward runs), its first divergence drilled down, and the rest."""
    view = View.of(back)
    first = view.first
    parts = [
        '<h2 id="backward">Backward: gradients, judged from the head to the embedding</h2>',
        ('<p class="legend">Cells: each module\'s backward from the reference\'s output gradient on the '
         "reference's input (its input and parameter gradients, the worst shown), the residual with the "
         "reference's own modules, the whole block; drift: the free-running candidate's input gradients.</p>"),
    ]
    if back.notes[1:]:  # the first is the forward's notes' already
        parts.append('<ul class="notes">' + "".join(f"<li>note: {_e(n)}</li>" for n in back.notes[1:]) + "</ul>")
    parts.append(_heat_table(view.columns, name="backward-heatmap"))
    if first is not None:
        parts.append(f'<p id="backward-first"><strong>First divergent gradient</strong>: {_e(named_headline(first))}</p>')
        drill = drill_down(first)
        if drill is not None:
            parts.append(f'<p id="backward-drill-down">{_e(drill[0].upper() + drill[1:])}</p>')
    if len(view.divergences) > 1:
        parts.append("<ol>" + "".join(f"<li>{_e(named_headline(d))}</li>" for d in view.divergences) + "</ol>")
    return parts


def write_html(report: Report | dict[str, Any], path: str | Path, *, image: bool = True) -> None:
    """Write ``report`` as one self-contained HTML file at ``path``.

    Nothing in the page is fetched from the network. The figure of :func:`blockdiff.plot.figure`
    is inlined as a ``data:`` PNG when matplotlib is installed (and ``image`` is true);
    without it the page has the tables only. The report is embedded as JSON:
    ``json.loads`` of ``<script id="blockdiff-report">``'s text gives ``report`` back.

    Args:
        report: a ``blockdiff.report/2`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), or a :class:`Report`.
        path: where to write (UTF-8).
        image: inline the PNG figure when matplotlib is available.

    Raises:
        BlockdiffError: ``report`` is not a ``blockdiff.report/2`` report.
    """
    Path(path).write_text(document(report, image=image), encoding="utf-8")
