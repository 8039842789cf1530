"""Plot: a report as a PNG (matplotlib, Agg).

The last step of the pipeline, beside the terminal (:mod:`.render`) and HTML
(:mod:`.html`): it lays out the report's :class:`~.view.View`, so it draws a
:class:`~.report.Report` or its ``blockdiff.report/2`` dict (``Report.to_dict()`` or a
saved ``--json`` file) alike, long after the diff ran. Panels, top to bottom, all titled
so a reader (or a test) can tell them apart:

1. ``local error / threshold``: sites × (attention, ffn, norm, residual, whole) on a log
   colour scale centred on the threshold (:func:`~.view.ratio_colour`'s scale, which the
   HTML tables share); divergent cells marked ``X``, the first divergence annotated.
2. ``drift per block``: the free-running candidate's rel L2 at every site, log y, against
   drift's own threshold there (``drift_check.threshold`` in the JSON: what the reference's
   own free run at the candidate's precision allows; the dashed line, ``gid``
   ``drift-threshold``), each point coloured by its ratio to it on the heatmap's scale.
   Two dumps compared: the whole check's threshold, which judges that drift; a report
   older than drift checks draws no line.
3. ``expert load`` (MoE reports only): per MoE block, each expert's share of the routing
   assignments on the reference and the candidate side.

matplotlib is optional (``pip install 'blockdiff[plot]'``) and imported only when a
picture is drawn.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import BlockdiffError
from .report import Divergence, Report
from .view import RATIO_COLOURS, RATIO_RANGE, ROWS, WHOLE, Column, MoeRow, View, dtype_said, ratio_colour
from .vocab import SUBPATHS

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["figure", "require_matplotlib", "write_png"]

MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install 'blockdiff[plot]'"


def _summary(report: Report) -> str:
    """The verdict: the forward's, or with a backward both (the PNG draws the forward)."""
    if report.backward is not None:
        return "verdict: " + report.verdict()
    first = report.first_divergence
    return "first divergence: " + first.headline() if first else "No divergence: every local error is within tolerance."


def _title(report: Report) -> str:
    return f"blockdiff: {_side(report.reference)} vs {_side(report.candidate)}"


def _side(side: dict[str, Any], limit: int = 60) -> str:
    model = str(side.get("model", "?"))
    if len(model) > limit:
        model = "…" + model[-(limit - 1) :]
    return f"{model} ({side.get('device', '?')}, {dtype_said(side)})"


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


def figure(report: Report | dict[str, Any] | View) -> Figure:
    """Draw ``report`` as a matplotlib Figure (Agg canvas, no display needed).

    Args:
        report: a ``blockdiff.report/2`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), a :class:`Report`, or its :class:`~.view.View`.

    Returns:
        The figure; its panels are the Axes with a title: ``local error / threshold``,
        ``drift per block`` and, for MoE reports, ``expert load``.

    Raises:
        BlockdiffError: matplotlib is not installed, or ``report`` is not a report.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    view = View.of(report)
    cols = view.columns
    width = max(8.0, min(22.0, 3.0 + 0.34 * len(cols)))
    heights = [2.9, 2.6]
    if view.moe:
        heights.append(1.2 + 0.26 * len(view.moe))
    # A Figure without pyplot: no global state, no GUI backend, safe in threads and tests.
    fig = Figure(figsize=(width, sum(heights) + 0.7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    title = [_title(view.report), _summary(view.report)]
    # About 14 characters of 10-point text per inch; long specs and headlines wrap.
    fig.suptitle("\n".join(textwrap.fill(line, int(width * 14)) for line in title), fontsize=10)
    spot = _first_spot(view)
    _heatmap(axes[0], cols, view.first, spot)
    _drift_panel(axes[1], cols, spot)
    if view.moe:
        _expert_load(axes[2], view.moe)
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


def _first_spot(view: View) -> tuple[int, int] | None:
    """(column, row) of the first divergence in the heatmap."""
    first = view.first
    column = None if first is None else view.column_of(first)
    if first is None or column is None:
        return None
    # An unattributed divergence is the whole block's.
    return column, ROWS.index(first.subpath if first.subpath in SUBPATHS else WHOLE)


def _heatmap(ax: Any, cols: list[Column], first: Divergence | None, spot: tuple[int, int] | None) -> None:
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
    ax.set_xlabel("site (block index); grey: not needed, absent or not judged", fontsize=8)
    for j, col in enumerate(cols):
        for i, row in enumerate(ROWS):
            cell = col.cells[row]
            if cell.diverged:
                ax.add_patch(_rectangle(j - 0.5, i - 0.5, edgecolor="black", linewidth=1.5))
                ax.text(j, i, "X", ha="center", va="center", fontsize=9, fontweight="bold", color="white")
    if spot is not None and first is not None:
        j, i = spot
        ratio = first.check.ratio
        label = f"first divergence: {first.where}"
        nonfinite_ref, nonfinite_cand = first.check.nonfinite
        if nonfinite_cand != nonfinite_ref:
            label += f"\n{nonfinite_cand} non-finite values"
        elif math.isfinite(ratio):
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


def _drift_panel(ax: Any, cols: list[Column], spot: tuple[int, int] | None) -> None:
    xs = range(len(cols))
    drift = [c.drift for c in cols]
    thresholds = [c.drift_threshold for c in cols]
    positive = [v for v in (*drift, *thresholds) if v is not None and math.isfinite(v) and v > 0]
    bottom = min(positive) / 3 if positive else 1e-8
    top = max(positive) * 3 if positive else 1.0
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    if any(t is not None for t in thresholds):
        ax.step(
            list(xs),
            [t if t is not None and t > 0 else math.nan for t in thresholds],
            where="mid",
            color="grey",
            ls="--",
            lw=1,
            label="drift's own threshold (drift_check)",
            gid="drift-threshold",
        )
    finite = [(x, v) for x, v in zip(xs, drift) if v is not None and math.isfinite(v) and v > 0]
    if finite:
        ax.plot(*zip(*finite), "-", color="tab:blue", lw=1.2, label="drift (rel L2); colour: drift / threshold")
        colours = [
            "tab:blue" if cols[x].drift_ratio is None else ratio_colour(cols[x].drift_ratio) for x, _ in finite
        ]
        ax.scatter(*zip(*finite), c=colours, s=30, edgecolors="black", linewidths=0.6, zorder=3, gid="drift")
    zeros = [x for x, v in zip(xs, drift) if v == 0]
    if zeros:
        ax.plot(zeros, [bottom] * len(zeros), "v", color="tab:blue", mfc="none", clip_on=False, label="drift 0 (exact)")
    bad = [x for x, v in zip(xs, drift) if v is not None and not math.isfinite(v)]
    if bad:
        ax.plot(bad, [top] * len(bad), "x", color="tab:red", ms=8, clip_on=False, label="drift non-finite")
    if spot is not None:
        ax.axvline(spot[0], color="tab:red", ls=":", lw=1.2, label="first divergence")
    _ticks(ax, cols)
    ax.set_title("drift per block", loc="left", fontsize=10)
    ax.set_ylabel("rel L2 (log)", fontsize=8)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.9)


def _expert_load(ax: Any, moe: list[MoeRow]) -> None:
    import numpy as np

    experts = max(len(row.counts) for row in moe)
    rows, labels = [], []
    for row in moe:
        total = sum(float(c) for c in row.counts) or 1.0
        rows.append([c / total for c in row.counts] + [math.nan] * (experts - len(row.counts)))
        if row.side == "cand" and row.topk_agreement is not None:
            labels.append(f"{row.topk_agreement:.0%} agree, {row.side}")
        else:
            labels.append(f"block {row.block} {row.side}")
    grid = np.array(rows)
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="Blues", vmin=0, aspect="auto", interpolation="nearest")
    colorbar = ax.figure.colorbar(image, ax=ax, pad=0.01)
    colorbar.set_label("share of assignments", fontsize=8)
    if experts <= 32 and len(rows) <= 48:
        peak = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
        for i, row in enumerate(moe):
            for j, c in enumerate(row.counts):
                ax.text(j, i, str(c), ha="center", va="center", fontsize=7, color="white" if grid[i, j] > peak * 0.6 else "black")
    for i in range(2, len(rows), 2):
        ax.axhline(i - 0.5, color="white", lw=3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xticks(range(experts))
    ax.set_xticklabels([str(e) for e in range(experts)], fontsize=8)
    ax.set_xlabel("expert (numbers: tokens routed, before capacity; agree: top-k agreement)", fontsize=8)
    ax.set_title("expert load", loc="left", fontsize=10)


def write_png(report: Report | dict[str, Any] | View, path: str | Path) -> None:
    """Write ``report`` as a PNG at ``path`` (see :func:`figure` for the panels).

    The PNG's text chunks hold the title (both sides) and the first divergence in one line
    (``Description``), for tools that read image metadata.

    Args:
        report: a ``blockdiff.report/2`` dict (``Report.to_dict()`` or a loaded
            ``--json`` file), a :class:`Report`, or its :class:`~.view.View`.
        path: where to write; the parent directory must exist.

    Raises:
        BlockdiffError: matplotlib is not installed, or ``report`` is not a report.

    >>> write_png(json.loads(Path("report.json").read_text()), "report.png")  # doctest: +SKIP
    """
    view = View.of(report)  # a foreign file fails here, before matplotlib is looked for
    fig = figure(view)
    fig.savefig(
        Path(path),
        format="png",
        dpi=110,
        metadata={
            "Title": _title(view.report),
            "Description": _summary(view.report),
            "Software": f"blockdiff {view.report.version}".strip(),
        },
    )
