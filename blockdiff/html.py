"""HTML: a report as one self-contained page, drawn from its JSON form.

Beside the terminal (:mod:`.render`) and the PNG (:mod:`.plot`) at the end of the
pipeline. The page fetches nothing: CSS is inline, the heatmap is a table with inline
colours, the figure (when matplotlib is installed) is an inline ``data:`` PNG, and the
report itself is embedded as JSON in ``<script type="application/json"
id="blockdiff-report">`` so the page is also the data. Fixed order, as in the terminal:
the first divergence in plain text, notes, the sites × sub-paths table with drift, the
figure, every divergence, the MoE routing table.

Everything that comes from the user (model specs, class and module names, notes) is
escaped with :func:`html.escape`; the embedded JSON escapes ``<``, ``>`` and ``&`` so no
string in it can close the script element.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from .errors import BlockdiffError
from .plot import ROWS, Cell, Column, as_dict, columns, figure, headline, number, ratio_colour
from .render import LEGEND, SYMBOLS, level, sparkline
from .report import Report
from .site import SUBPATHS

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
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float | None, spec: str = ".2e") -> str:
    if value is None:
        return ""
    if not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _text_colour(background: str) -> str:
    r, g, b = (int(background[k : k + 2], 16) for k in (1, 3, 5))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#000"


def _cell(cell: Cell, *, blank: bool = False) -> str:
    """One table cell: the local error, its symbol and ratio, coloured by the ratio."""
    if blank:
        return "<td></td>"
    kind = level(cell.ratio, cell.diverged, cell.status if cell.ratio is not None else "absent")
    if cell.ratio is None:
        text = "not needed" if cell.status == "not_needed" else "absent"
        return f'<td class="none" title="{_e(text)}"><span class="sym">{SYMBOLS["none"]}</span></td>'
    nonfinite_ref, nonfinite_cand = cell.nonfinite
    if nonfinite_cand != nonfinite_ref:
        shown = f"{nonfinite_cand} non-finite"
    else:
        shown = _fmt(cell.value)
    background = ratio_colour(cell.ratio)
    style = f"background:{background};color:{_text_colour(background)}"
    title = (
        f"{cell.module}: {cell.what}; {cell.metric} {_fmt(cell.value, '.3g')}, "
        f"threshold {_fmt(cell.threshold, '.3g')}, ratio {_fmt(cell.ratio, '.3g')}"
    )
    classes = ' class="diverged"' if cell.diverged else ""
    return (
        f'<td{classes} style="{style}" title="{_e(title)}">{_e(shown)} '
        f'<span class="sym">{SYMBOLS[kind]}</span><br><small>{_e(_fmt(cell.ratio, ".3g"))}x</small></td>'
    )


def _heat_table(cols: list[Column]) -> str:
    head = "".join(f"<th>{_e(name)}</th>" for name in ROWS)
    rows = []
    for col in cols:
        name = f"block {col.block}" if col.stage == "block" else col.stage
        cells = "".join(_cell(col.cells[row], blank=col.stage != "block" and row in SUBPATHS) for row in ROWS)
        rows.append(
            f'<tr><td class="name">{_e(name)} <small class="meta">{_e(col.module)}</small></td>'
            f"{cells}<td>{_e(_fmt(col.drift))}</td></tr>"
        )
    return (
        '<table class="heat" id="heatmap">\n'
        f'<thead><tr><th class="name">site</th>{head}<th>drift</th></tr></thead>\n'
        "<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _side_table(data: dict[str, Any]) -> str:
    keys = ("model", "class", "device", "dtype", "hook_map")
    head = "".join(f"<th>{_e(k.replace('_', ' '))}</th>" for k in keys)
    rows = []
    for side in ("reference", "candidate"):
        entry = data.get(side) or {}
        cells = "".join(f'<td class="name">{_e(entry.get(k, ""))}</td>' for k in keys)
        rows.append(f'<tr><th class="name">{side}</th>{cells}</tr>')
    return f'<table class="sides"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _drop_rate(stats: dict[str, Any]) -> str:
    if stats.get("capacity") is not None:
        return f"{number(stats['assignment_drop_rate']):.1%}"
    counterfactual = stats.get("counterfactual") or {}
    if not counterfactual:
        return "—"
    cf, entry = next(iter(counterfactual.items()))
    return f"{number(entry['assignment_drop_rate']):.1%} @cf{cf}"


def _counts(counts: list[int]) -> str:
    top = max(counts, default=0) or 1
    spans = "".join(
        f'<span style="background:rgba(33,113,181,{0.08 + 0.8 * c / top:.2f});'
        f'color:{"#fff" if c / top > 0.7 else "#000"}">{int(c)}</span>'
        for c in counts
    )
    return f'<td class="name counts">{spans}</td>'


def _moe_table(moe: list[dict[str, Any]]) -> str:
    names = ("block", "side", "entropy", "max load", "min load", "drops", "top-k agree", "flips", "tokens per expert")
    head = "".join(f"<th>{n}</th>" for n in names)
    rows = []
    for entry in moe:
        agreement = entry.get("agreement") or {}
        local = entry.get("local_flips") or {}
        flips = f"{local.get('flipped', 0)} ({local.get('unexplained', 0)} unexplained)" if local else "—"
        for side in ("reference", "candidate"):
            stats = entry[side]
            first = side == "reference"
            cells = [
                _e(entry["block"]) if first else "",
                "ref" if first else "cand",
                f"{number(stats['routing_entropy_norm']):.3f}",
                f"{number(stats['max_load']):.1%}",
                f"{number(stats['min_load']):.1%}",
                _e(_drop_rate(stats)),
                f"{number(agreement['topk_agreement']):.1%}" if first and "topk_agreement" in agreement else "",
                _e(flips) if first else "",
            ]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + _counts(stats["counts"]) + "</tr>")
    return (
        '<table class="moe" id="moe">\n'
        f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"
    )


def _image(data: dict[str, Any]) -> str:
    try:
        fig = figure(data)
    except BlockdiffError:
        return '<p class="meta">(the figure needs matplotlib: <code>pip install \'blockdiff[plot]\'</code>)</p>'
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<figure><img alt="heatmap of local errors and drift per block" src="data:image/png;base64,{encoded}"></figure>'


def _embedded_json(data: dict[str, Any]) -> str:
    # Inside <script>, "</script>" or "<!--" in any string would end or confuse the
    # element; \u escapes keep the JSON identical once parsed.
    text = json.dumps(data)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def document(report: Report | dict[str, Any], *, image: bool = True) -> str:
    """The HTML page of ``report`` as a string (see :func:`write_html`)."""
    data = as_dict(report)
    cols = columns(data)
    ref, cand = data.get("reference") or {}, data.get("candidate") or {}
    first = data.get("first_divergence")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="blockdiff {_e(data.get("blockdiff_version", ""))}">',
        f"<title>blockdiff: {_e(ref.get('model', '?'))} vs {_e(cand.get('model', '?'))}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<h1>blockdiff report</h1>",
    ]
    if first:
        parts.append(f'<p class="verdict diverged" id="verdict"><strong>First divergence</strong>: {_e(headline(first))}</p>')
        if first.get("subpath") == "unattributed":
            parts.append(
                "<p>The block diverges but no sub-path explains it: the hook map may be missing a "
                "module; check it with <code>blockdiff arch</code>.</p>"
            )
    else:
        parts.append(
            '<p class="verdict clean" id="verdict"><strong>No divergence</strong>: '
            "every local error is within tolerance.</p>"
        )
    nonfinite = data.get("first_nonfinite")
    if nonfinite:
        parts.append(
            f"<p>Non-finite: the free-running candidate first holds {_e(nonfinite.get('nonfinite_cand'))} "
            f"NaN/Inf values at {_e(nonfinite.get('site'))} ({_e(nonfinite.get('module'))}).</p>"
        )
    tolerance = data.get("tolerance") or {}
    inputs = data.get("inputs") or {}
    parts += [
        _side_table(data),
        (f'<p class="meta">tolerance {_e(tolerance.get("policy", "?"))}; inputs {_e(inputs.get("kind", "?"))} '
        f'{_e(inputs.get("shape", ""))}; blockdiff {_e(data.get("blockdiff_version", ""))}; '
        f'created {_e(data.get("created", ""))}</p>'),
    ]
    notes = data.get("notes") or []
    if notes:
        parts.append("<ul class=\"notes\">" + "".join(f"<li>note: {_e(n)}</li>" for n in notes) + "</ul>")
    parts += [
        "<h2>Local error per sub-path, whole block or stage; drift</h2>",
        (f'<p class="legend">Cells: local error (rel L2), symbol, and ratio to the threshold '
        f"(colour, log scale: green below, red above). {_e(LEGEND)}. Hover a cell for its module "
        "and threshold. Drift: the free-running candidate against the reference.</p>"),
        _heat_table(cols),
    ]
    blocks = [c for c in cols if c.stage == "block"]
    if blocks:
        drifts = [c.drift for c in blocks]
        finite = [v for v in drifts if v is not None and math.isfinite(v)]
        scale = f" rel L2 {min(finite):.2g} … {max(finite):.2g}, log scale" if finite else ""
        parts += [
            "<h2>Drift per block</h2>",
            (f'<p><span class="spark" id="drift-sparkline">{_e(sparkline(drifts))}</span>'
            f'<span class="meta">{_e(scale)}</span></p>'),
        ]
    if image:
        parts.append(_image(data))
    divergences = data.get("divergences") or []
    if len(divergences) > 1:
        parts.append(f"<h2>{len(divergences)} divergent sites</h2>")
        parts.append("<ol>" + "".join(f"<li>{_e(headline(d))}</li>" for d in divergences) + "</ol>")
    moe = data.get("moe") or []
    if moe:
        parts += [
            "<h2>MoE routing per block</h2>",
            ('<p class="legend">Entropy normalized by ln E; drops at the model\'s capacity, or counterfactual '
            "at the first capacity factor; tokens per expert before capacity.</p>"),
            _moe_table(moe),
        ]
    parts += [
        f'<script type="application/json" id="blockdiff-report">\n{_embedded_json(data)}\n</script>',
        "</body>",
        "</html>",
        "",
    ]
    return "\n".join(parts)


def write_html(report: Report | dict[str, Any], path: str | Path, *, image: bool = True) -> None:
    """Write ``report`` as one self-contained HTML file at ``path``.

    Nothing in the page is fetched from the network. The figure of :func:`blockdiff.plot.figure`
    is inlined as a ``data:`` PNG when matplotlib is installed (and ``image`` is true);
    without it the page has the tables only. The report is embedded as JSON:
    ``json.loads`` of ``<script id="blockdiff-report">``'s text gives ``report`` back.

    Args:
        report: a ``blockdiff.report/1`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), or a :class:`Report`.
        path: where to write (UTF-8).
        image: inline the PNG figure when matplotlib is available.

    Raises:
        BlockdiffError: ``report`` is not a ``blockdiff.report/1`` report.
    """
    Path(path).write_text(document(report, image=image), encoding="utf-8")
