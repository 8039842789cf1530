"""Plot: a report as a PNG (matplotlib, Agg), drawn from its JSON form.

The last step of the pipeline, beside the terminal (:mod:`.render`) and HTML
(:mod:`.html`): it reads only the ``blockdiff.report/1`` dict (``Report.to_dict()`` or a
saved ``--json`` file), so a report can be drawn long after the diff ran. Panels, top to
bottom, all titled so a reader (or a test) can tell them apart:

1. ``local error / threshold``: sites × (attention, ffn, norm, residual, whole) on a log
   colour scale centred on the threshold; divergent cells marked ``X``, the first
   divergence annotated.
2. ``drift per block``: the free-running candidate's rel L2 at every site, log y, against
   the whole-block (or stage) threshold.
3. ``expert load`` (MoE reports only): per MoE block, each expert's share of the routing
   assignments on the reference and the candidate side.

matplotlib is optional (``pip install 'blockdiff[plot]'``) and imported only when a
picture is drawn. This module also holds the reading of the report dict that
:mod:`.html` shares and that needs no matplotlib (:func:`columns`, :func:`headline`,
:func:`ratio_colour`).
"""

from __future__ import annotations

import itertools
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BlockdiffError
from .report import SCHEMA, Report
from .site import SUBPATHS

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "ROWS",
    "Cell",
    "Column",
    "as_dict",
    "columns",
    "figure",
    "headline",
    "number",
    "ratio_colour",
    "require_matplotlib",
    "where",
    "write_png",
]

# Heatmap rows: the four sub-paths, then the whole block (or, for a stage, its own check).
ROWS = (*SUBPATHS, "whole")
MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install 'blockdiff[plot]'"
# Colour scale of the ratio to threshold: fixed, so pictures of different runs compare.
# Green below the threshold, paling towards it; orange to dark red above it. The threshold
# (ratio 1) sits at the centre of the log scale. Shared by the PNG and the HTML tables.
RATIO_RANGE = (1e-3, 1e3)
RATIO_COLOURS = ((0.0, "#1a9850"), (0.45, "#c7e9a0"), (0.5, "#fee08b"), (0.56, "#fdae61"), (1.0, "#a50026"))


def number(value: Any) -> float | None:
    """A report number as a float: JSON's ``"inf"``/``"-inf"``/``"nan"`` strings back to
    floats, ``None`` stays ``None``.

    >>> number("inf"), number(0.5), number(None)
    (inf, 0.5, None)
    """
    if value is None:
        return None
    return float(value)


@dataclass
class Cell:
    """One heatmap cell: a sub-path's worst check, a whole-block check or a stage's check."""

    status: str  # "checked", "not_needed", "absent"
    ratio: float | None = None  # value / threshold; None when nothing ran
    value: float | None = None
    threshold: float | None = None
    diverged: bool = False
    module: str = ""
    what: str = ""
    metric: str = "rel_l2"
    nonfinite: tuple[int, int] = (0, 0)  # (reference, candidate)


@dataclass
class Column:
    """One site of the report, in the order of the terminal table: embed and context,
    the blocks, then final norm and head."""

    label: str  # "embed", "0", "1", ..., "head"
    stage: str
    module: str = ""
    block: int | None = None
    stack: str | None = None
    cells: dict[str, Cell] = field(default_factory=dict)  # keys from ROWS
    drift: float | None = None
    threshold: float | None = None  # of the whole-block / stage check


def as_dict(report: Report | dict[str, Any]) -> dict[str, Any]:
    """The JSON form of ``report``; raises :class:`BlockdiffError` for anything that is not
    a ``blockdiff.report/1`` report."""
    if isinstance(report, Report):
        return report.to_dict()
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        found = report.get("schema") if isinstance(report, dict) else type(report).__name__
        raise BlockdiffError(f"expected a {SCHEMA} report, found {found!r}")
    return report


def _cell(entry: dict[str, Any] | None) -> Cell:
    if entry is None:
        return Cell(status="absent")
    status = entry.get("status", "checked")
    if "ratio" not in entry:  # a sub-path that ran no check
        return Cell(status=status if status != "checked" else "absent", diverged=bool(entry.get("diverged")))
    metric = entry.get("metric", "rel_l2")
    value = entry.get("value", entry.get(metric, entry.get("rel_l2")))
    return Cell(
        status=status,
        ratio=number(entry["ratio"]),
        value=number(value),
        threshold=number(entry.get("threshold")),
        diverged=bool(entry.get("diverged")),
        module=str(entry.get("module", "")),
        what=str(entry.get("what", "")),
        metric=metric,
        nonfinite=(int(entry.get("nonfinite_ref", 0)), int(entry.get("nonfinite_cand", 0))),
    )


def _drift(entry: dict[str, Any] | None) -> float | None:
    return None if entry is None else number(entry.get("rel_l2"))


def columns(report: Report | dict[str, Any]) -> list[Column]:
    """Every site of ``report`` as a heatmap column (see :class:`Column`), in execution order.

    With one block list: embed and context, the blocks, then final norm and head. With
    several (encoder-decoder), a stage belongs to the block list whose parent module holds
    it (``encoder.final_layer_norm`` to ``encoder.block``) and stands before or after that
    list's blocks.
    """
    data = as_dict(report)
    stages = data.get("stages", [])
    blocks = data.get("blocks", [])
    stacks: list[str] = []
    for block in blocks:
        if block.get("stack") not in stacks:
            stacks.append(block.get("stack"))

    def owner(stage: dict[str, Any]) -> str | None:
        if len(stacks) < 2:
            return None
        for stack in stacks:
            parent = str(stack).rpartition(".")[0]
            if parent and str(stage.get("module", "")).startswith(parent + "."):
                return stack
        return None

    def stage_column(stage: dict[str, Any]) -> Column:
        cells = {name: Cell(status="absent") for name in SUBPATHS}
        cells["whole"] = _cell(stage.get("local"))
        return Column(
            label=stage["stage"],
            stage=stage["stage"],
            module=str(stage.get("module", "")),
            stack=owner(stage),
            cells=cells,
            drift=_drift(stage.get("drift")),
            threshold=cells["whole"].threshold,
        )

    def block_column(block: dict[str, Any]) -> Column:
        cells = {name: _cell(block.get("subpaths", {}).get(name)) for name in SUBPATHS}
        cells["whole"] = _cell(block.get("block"))
        return Column(
            label=str(block["index"]),
            stage="block",
            module=str(block.get("module", "")),
            block=block["index"],
            stack=block.get("stack"),
            cells=cells,
            drift=_drift(block.get("drift")),
            threshold=cells["whole"].threshold,
        )

    before = ("embed", "context")
    stage_columns = [stage_column(s) for s in stages]
    out = [c for c in stage_columns if c.stack is None and c.stage in before]
    for stack in stacks if len(stacks) > 1 else [None]:
        out += [c for c in stage_columns if c.stack is not None and c.stack == stack and c.stage in before]
        out += [block_column(b) for b in blocks if stack is None or b.get("stack") == stack]
        out += [c for c in stage_columns if c.stack is not None and c.stack == stack and c.stage not in before]
    out += [c for c in stage_columns if c.stack is None and c.stage not in before]
    return out


def where(first: dict[str, Any]) -> str:
    """Where a divergence is, in words: ``block 1 ffn``, ``head``."""
    if first.get("stage") == "block":
        return f"block {first.get('block')} {first.get('subpath')}"
    return str(first.get("stage"))


def headline(first: dict[str, Any] | None) -> str:
    """A divergence of the JSON report in one line, as the terminal prints it.

    >>> headline({"stage": "block", "block": 1, "subpath": "ffn", "module": "blocks.1.ffn",
    ...           "metric": "rel_l2", "value": 0.162, "threshold": 1e-4, "ratio": 1620.0})
    'block 1 ffn (blocks.1.ffn): rel_l2 0.162 > threshold 0.0001 (1620.0x)'
    """
    if first is None:
        return "no divergence"
    text = where(first)
    if first.get("part"):
        text += f" [{first['part']}: {first.get('what')}]"
    nonfinite_ref, nonfinite_cand = first.get("nonfinite_ref", 0), first.get("nonfinite_cand", 0)
    if nonfinite_cand != nonfinite_ref:
        return (
            f"{text} ({first.get('module')}): {nonfinite_cand} non-finite values in the candidate, "
            f"{nonfinite_ref} in the reference"
        )
    value, threshold, ratio = (number(first.get(k)) for k in ("value", "threshold", "ratio"))
    return (
        f"{text} ({first.get('module')}): {first.get('metric')} {value:.3g} > threshold "
        f"{threshold:.3g} ({ratio:.1f}x)"
    )


def ratio_colour(ratio: float) -> str:
    """The heatmap colour of a ratio to threshold, as ``#rrggbb`` (no matplotlib needed).

    >>> ratio_colour(0.0), ratio_colour(1.0), ratio_colour(float("inf"))
    ('#1a9850', '#fee08b', '#a50026')
    """
    lo, hi = RATIO_RANGE
    if math.isnan(ratio):
        ratio = hi
    ratio = min(max(ratio, lo), hi)
    t = (math.log10(ratio) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    for (t0, c0), (t1, c1) in itertools.pairwise(RATIO_COLOURS):
        if t <= t1:
            f = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
            rgb = [round(int(c0[k : k + 2], 16) * (1 - f) + int(c1[k : k + 2], 16) * f) for k in (1, 3, 5)]
            return "#" + "".join(f"{v:02x}" for v in rgb)
    return RATIO_COLOURS[-1][1]


def _summary(first: dict[str, Any] | None) -> str:
    return "first divergence: " + headline(first) if first else "No divergence: every local error is within tolerance."


def _side(side: dict[str, Any], limit: int = 60) -> str:
    model = str(side.get("model", "?"))
    if len(model) > limit:
        model = "…" + model[-(limit - 1) :]
    return f"{model} ({side.get('device', '?')}, {side.get('dtype', '?')})"


def require_matplotlib() -> None:
    """Raise :class:`BlockdiffError` with the install hint when matplotlib is missing.

    matplotlib is optional (the ``plot`` extra); the CLI calls this before a diff that
    was asked for ``--plot``, so a missing package fails in a second, not after the diff.
    """
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401
    except ImportError as error:
        raise BlockdiffError(MISSING_MATPLOTLIB) from error


def figure(report: Report | dict[str, Any]) -> Figure:
    """Draw ``report`` as a matplotlib Figure (Agg canvas, no display needed).

    Args:
        report: a ``blockdiff.report/1`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), or a :class:`Report`.

    Returns:
        The figure; its panels are the Axes with a title: ``local error / threshold``,
        ``drift per block`` and, for MoE reports, ``expert load``.

    Raises:
        BlockdiffError: matplotlib is not installed, or ``report`` is not a report.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = as_dict(report)
    cols = columns(data)
    moe = data.get("moe") or []
    width = max(8.0, min(22.0, 3.0 + 0.34 * len(cols)))
    heights = [2.9, 2.6]
    if moe:
        heights.append(1.2 + 0.26 * 2 * len(moe))
    # A Figure without pyplot: no global state, no GUI backend, safe in threads and tests.
    fig = Figure(figsize=(width, sum(heights) + 0.7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    first = data.get("first_divergence")
    title = [f"blockdiff: {_side(data.get('reference', {}))} vs {_side(data.get('candidate', {}))}", _summary(first)]
    # About 14 characters of 10-point text per inch; long specs and headlines wrap.
    fig.suptitle("\n".join(textwrap.fill(line, int(width * 14)) for line in title), fontsize=10)
    _heatmap(axes[0], cols, first)
    _drift_panel(axes[1], cols, first)
    if moe:
        _expert_load(axes[2], moe)
    return fig


def _ticks(ax: Any, cols: list[Column]) -> None:
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([c.label for c in cols], rotation=90 if len(cols) > 24 else 0, fontsize=8)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    stacks = [c.stack for c in cols]
    if len({s for s in stacks if s is not None}) > 1:
        for i in range(1, len(cols)):
            # Encoder-decoder reports: a line where one block list ends and the next begins.
            if stacks[i] is not None and stacks[i - 1] is not None and stacks[i] != stacks[i - 1]:
                ax.axvline(i - 0.5, color="black", lw=1.2)


def _first_column(cols: list[Column], first: dict[str, Any] | None) -> tuple[int, int] | None:
    """(column, row) of the first divergence in the heatmap."""
    if not first:
        return None
    if first.get("stage") == "block":
        subpath = first.get("subpath")
        row = ROWS.index(subpath if subpath in SUBPATHS else "whole")
        found = [i for i, col in enumerate(cols) if col.stage == "block" and col.block == first.get("block")]
    else:
        row = ROWS.index("whole")
        same = [i for i, col in enumerate(cols) if col.stage == first.get("stage")]
        # Encoder-decoder reports have two embeds and two final norms: the module tells.
        found = [i for i in same if cols[i].module == first.get("module")] or same
    return (found[0], row) if found else None


def _heatmap(ax: Any, cols: list[Column], first: dict[str, Any] | None) -> None:
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, LogNorm

    lo, hi = RATIO_RANGE
    grid = np.full((len(ROWS), len(cols)), np.nan)
    for j, col in enumerate(cols):
        for i, row in enumerate(ROWS):
            cell = col.cells[row]
            if cell.ratio is None:
                continue
            ratio = cell.ratio
            if not math.isfinite(ratio):
                ratio = hi if cell.diverged else lo
            grid[i, j] = min(max(ratio, lo), hi)  # exact zeros to the bottom of the scale
    cmap = LinearSegmentedColormap.from_list("blockdiff_ratio", list(RATIO_COLOURS)).with_extremes(bad="#eeeeee")
    image = ax.imshow(
        np.ma.masked_invalid(grid), cmap=cmap, norm=LogNorm(vmin=lo, vmax=hi), aspect="auto", interpolation="nearest"
    )
    colorbar = ax.figure.colorbar(image, ax=ax, extend="both", pad=0.01)
    colorbar.set_label("ratio (1 = threshold)", fontsize=8)
    colorbar.ax.axhline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(ROWS)))
    ax.set_yticklabels(ROWS, fontsize=8)
    _ticks(ax, cols)
    ax.set_title("local error / threshold", loc="left", fontsize=10)
    ax.set_xlabel("site (block index); grey: not needed or absent", fontsize=8)
    for j, col in enumerate(cols):
        for i, row in enumerate(ROWS):
            cell = col.cells[row]
            if cell.diverged:
                ax.add_patch(_rectangle(j - 0.5, i - 0.5, edgecolor="black", linewidth=1.5))
                ax.text(j, i, "X", ha="center", va="center", fontsize=9, fontweight="bold", color="white")
    spot = _first_column(cols, first)
    if spot is not None and first is not None:
        j, i = spot
        ratio = number(first.get("ratio"))
        label = f"first divergence: {where(first)}"
        if first.get("nonfinite_cand", 0) != first.get("nonfinite_ref", 0):
            label += f"\n{first.get('nonfinite_cand')} non-finite values"
        elif ratio is not None and math.isfinite(ratio):
            label += f"\n{ratio:.3g}x threshold"
        left = j > len(cols) / 2
        ax.annotate(
            label,
            xy=(j, i),
            xytext=(-40 if left else 40, -22 if i < 2 else 22),
            textcoords="offset points",
            ha="right" if left else "left",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "black", "alpha": 0.92},
            arrowprops={"arrowstyle": "->", "color": "black"},
            gid="first-divergence",
        )


def _rectangle(x: float, y: float, **style: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, fill=False, **style)


def _drift_panel(ax: Any, cols: list[Column], first: dict[str, Any] | None) -> None:
    xs = range(len(cols))
    drift = [c.drift for c in cols]
    thresholds = [c.threshold for c in cols]
    positive = [v for v in (*drift, *thresholds) if v is not None and math.isfinite(v) and v > 0]
    bottom = min(positive) / 3 if positive else 1e-8
    top = max(positive) * 3 if positive else 1.0
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    ax.step(
        list(xs),
        [t if t is not None and t > 0 else math.nan for t in thresholds],
        where="mid",
        color="grey",
        ls="--",
        lw=1,
        label="local-error threshold (whole block or stage)",
    )
    finite = [(x, v) for x, v in zip(xs, drift) if v is not None and math.isfinite(v) and v > 0]
    if finite:
        ax.plot(*zip(*finite), "o-", color="tab:blue", ms=4, lw=1.2, label="drift (rel L2)")
    zeros = [x for x, v in zip(xs, drift) if v == 0]
    if zeros:
        ax.plot(zeros, [bottom] * len(zeros), "v", color="tab:blue", mfc="none", clip_on=False, label="drift 0 (exact)")
    bad = [x for x, v in zip(xs, drift) if v is not None and not math.isfinite(v)]
    if bad:
        ax.plot(bad, [top] * len(bad), "x", color="tab:red", ms=8, clip_on=False, label="drift non-finite")
    spot = _first_column(cols, first)
    if spot is not None:
        ax.axvline(spot[0], color="tab:red", ls=":", lw=1.2, label="first divergence")
    _ticks(ax, cols)
    ax.set_title("drift per block", loc="left", fontsize=10)
    ax.set_ylabel("rel L2 (log)", fontsize=8)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", framealpha=0.9)


def _expert_load(ax: Any, moe: list[dict[str, Any]]) -> None:
    import numpy as np

    experts = max(len(entry[side]["counts"]) for entry in moe for side in ("reference", "candidate"))
    rows, labels = [], []
    for entry in moe:
        agreement = (entry.get("agreement") or {}).get("topk_agreement")
        for side, short in (("reference", "ref"), ("candidate", "cand")):
            counts = [float(c) for c in entry[side]["counts"]]
            total = sum(counts) or 1.0
            rows.append([c / total for c in counts] + [math.nan] * (experts - len(counts)))
            label = f"block {entry['block']} {short}"
            if side == "candidate" and agreement is not None:
                label = f"{number(agreement):.0%} agree, {short}"
            labels.append(label)
    grid = np.array(rows)
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="Blues", vmin=0, aspect="auto", interpolation="nearest")
    colorbar = ax.figure.colorbar(image, ax=ax, pad=0.01)
    colorbar.set_label("share of assignments", fontsize=8)
    if experts <= 32 and len(rows) <= 48:
        counts = [entry[side]["counts"] for entry in moe for side in ("reference", "candidate")]
        peak = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
        for i, row in enumerate(counts):
            for j, c in enumerate(row):
                ax.text(j, i, str(c), ha="center", va="center", fontsize=7, color="white" if grid[i, j] > peak * 0.6 else "black")
    for i in range(2, len(rows), 2):
        ax.axhline(i - 0.5, color="white", lw=3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks(range(experts))
    ax.set_xticklabels([str(e) for e in range(experts)], fontsize=8)
    ax.set_xlabel("expert (numbers: tokens routed, before capacity; agree: top-k agreement)", fontsize=8)
    ax.set_title("expert load", loc="left", fontsize=10)


def write_png(report: Report | dict[str, Any], path: str | Path) -> None:
    """Write ``report`` as a PNG at ``path`` (see :func:`figure` for the panels).

    The PNG's text chunks hold the title (both sides) and the first divergence in one line
    (``Description``), for tools that read image metadata.

    Args:
        report: a ``blockdiff.report/1`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), or a :class:`Report`.
        path: where to write; the parent directory must exist.

    Raises:
        BlockdiffError: matplotlib is not installed, or ``report`` is not a report.

    >>> write_png(json.loads(Path("report.json").read_text()), "report.png")  # doctest: +SKIP
    """
    data = as_dict(report)
    fig = figure(data)
    fig.savefig(
        Path(path),
        format="png",
        dpi=110,
        metadata={
            "Title": f"blockdiff: {_side(data.get('reference', {}))} vs {_side(data.get('candidate', {}))}",
            "Description": _summary(data.get("first_divergence")),
            "Software": f"blockdiff {data.get('blockdiff_version', '')}".strip(),
        },
    )
