"""View: a report as the renderers show it, read once for the terminal, the PNG and the HTML.

The step between :mod:`.report` and the three renderers at the end of the pipeline
(:mod:`.render` for the terminal, :mod:`.plot` for the PNG, :mod:`.html` for the page).
:meth:`View.of` reads a :class:`~.report.Report` (a ``blockdiff.report/2`` dict goes
through :meth:`Report.from_dict <.report.Report.from_dict>` first) into:

- :class:`Column`: one per site in execution order (embed and context, the blocks, final
  norm and head; an encoder-decoder's stages beside their own block list), each with one
  :class:`Cell` per row of :data:`ROWS` (the four sub-paths and the whole block or stage)
  and its drift;
- the divergences, stated by :func:`headline` (:meth:`Divergence.headline
  <.report.Divergence.headline>`, the part of an MoE ffn in words);
- :class:`MoeRow`: the routing table of an MoE report, its numbers formatted once.

What a cell says, its heatmap level and symbol (:func:`level`, :data:`SYMBOLS`), the
drift sparkline, the colour of a ratio (:func:`ratio_colour`, for the PNG and the HTML)
and how a drop rate reads are decided here; the renderers only lay them out. Drift is
shown against its own threshold (``drift_check`` in the JSON: the reference's own free
run at the candidate's precision), never against a local error's: :attr:`Column.drift_cell`
is drift's cell as the local errors have theirs, and the sparkline draws drift over that
threshold on a fixed scale (:func:`ratio_sparkline`). Needs neither rich nor matplotlib.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .compare import Metrics, from_json_number
from .report import Check, Divergence, Report, SubpathResult, times
from .vocab import SUBPATHS

__all__ = [
    "LEGEND",
    "MOE_COLUMNS",
    "MOE_COUNTS",
    "ROWS",
    "SPARKS",
    "SYMBOLS",
    "WHOLE",
    "Cell",
    "Column",
    "MoeRow",
    "View",
    "drop_rate",
    "dtype_said",
    "fmt",
    "level",
    "not_checked",
    "ratio_colour",
    "ratio_sparkline",
    "sparkline",
]

# The row of the whole-block check (or, for a stage, its own check), after the sub-paths.
WHOLE = "whole"
ROWS = (*SUBPATHS, WHOLE)

# One symbol per heatmap cell, so the heatmap reads the same without colour.
SYMBOLS = {"low": "·", "near": "o", "diverged": "X", "none": "-"}
LEGEND = "· below 0.5   o 0.5 to 1   X diverged   - not needed, absent or not judged"
SPARKS = "▁▂▃▄▅▆▇█"
# The drift sparkline's fixed scale, drift over its threshold: the upper bound of each bar
# but the last. At or below the threshold the lower half (0.5 to 1 is the heatmap's "o"),
# above it the upper half: precision noise draws low in every run, and a bug high.
SPARK_RATIOS = (0.01, 0.1, 0.5, 1.0, 3.0, 10.0, 100.0)
SPARK_LEGEND = "over 1: ▅ to █"

# Colour scale of the ratio to threshold: fixed, so pictures of different runs compare.
# Green below the threshold, paling towards it; orange to dark red above it. The threshold
# (ratio 1) sits at the centre of the log scale. Shared by the PNG and the HTML tables.
RATIO_RANGE = (1e-3, 1e3)
RATIO_COLOURS = ((0.0, "#1a9850"), (0.45, "#c7e9a0"), (0.5, "#fee08b"), (0.56, "#fdae61"), (1.0, "#a50026"))

MOE_COLUMNS = ("block", "side", "entropy", "max load", "min load", "drops", "top-k agree", "flips", "tokens per expert")
# What the two agreement columns count: they read different runs, so they may disagree.
MOE_COUNTS = (
    "top-k agree: tokens whose top-k experts are the same in both free-running models (drift "
    "included); flips: tokens whose top-k experts change when the candidate's router reads the "
    "reference's input (unexplained: margin beyond the precision's logit noise, and not a choice the "
    "reference's router makes at the candidate's precision)"
)


def drill_down(divergence: Divergence) -> str | None:
    """What the drill-down of a divergent module found, in one line; ``None`` when the check
    was not drilled (not a module check, or no live reference).

    The line claims the cause is in the module itself only when every child on both sides
    was judged; otherwise it names what was not (children paired with nothing, pairs that
    could not be judged), or says that this was not recorded (an older report)."""
    check = divergence.check
    children = check.children
    if children is None:
        return None
    module = check.module
    unchecked = not_checked(check)
    first = check.first_child
    if first is not None:
        paired_as = first.paired_as  # "(as gate_proj)": paired by role (the JSON's child.paired_as)
        line = (
            f"first divergent child: {first.module}{'' if paired_as is None else f' (as {paired_as})'}: "
            f"{first.metric} {first.measured:.3g} > threshold {first.threshold.value:.3g} ({times(first)})"
        )
        return line + (f"; not checked: {unchecked}" if unchecked else "")
    if unchecked is None:
        return (
            f"no child module diverges ({len(children)} checked; which children could not be paired is not "
            f"recorded): the cause is in {module}'s own code or in a child not checked"
        )
    if unchecked:
        return (
            f"no child module diverges ({len(children)} checked; {unchecked}): the cause is in {module}'s own "
            "code or in a child not checked"
        )
    if not children:
        return f"no child module diverges ({module} calls none): the cause is in {module} itself (its code or its weights)"
    return f"no child module diverges ({len(children)} checked): the cause is in {module} itself (its code or its weights)"


def not_checked(check: Check) -> str | None:
    """What a drill-down did not check, in words (``2 candidate children not paired: wqkv,
    wo; 4 reference children not paired: q_proj, k_proj, v_proj, o_proj``); ``""`` when it
    checked every child on both sides, ``None`` when that was not recorded."""
    if check.every_child_checked is None:
        return None
    parts = []
    for side in ("candidate", "reference"):
        names = (check.children_not_paired or {}).get(side) or []
        if names:
            parts.append(f"{len(names)} {side} {'child' if len(names) == 1 else 'children'} not paired: {', '.join(names)}")
    judged = check.children_not_judged or []
    if judged:
        parts.append(f"{len(judged)} {'child' if len(judged) == 1 else 'children'} not judged: {', '.join(judged)}")
    return "; ".join(parts)


def level(ratio: float | None, diverged: bool, status: str = "checked") -> str:
    """The heatmap class of one check: ``low``, ``near``, ``diverged`` or ``none``.

    ``none`` is a check that did not run (``not_needed`` on the fast path, ``absent``
    sub-path, ``not_judged``, or no check at all); an offline comparison's ``drift_only``
    checks ran. NaN ratios diverge.

    >>> level(0.3, False), level(0.7, False), level(12.0, True), level(None, False, "absent")
    ('low', 'near', 'diverged', 'none')
    """
    if diverged:
        return "diverged"
    if status not in ("checked", "drift_only") or ratio is None:
        return "none"
    return "near" if ratio >= 0.5 else "low"


def dtype_said(side: dict[str, Any]) -> str:
    """A side's dtype as the header says it: with the dtype its checkpoint was saved in,
    where it was built from one that names it (``checkpoint_dtype``).

    >>> dtype_said({"dtype": "bfloat16", "checkpoint_dtype": "bfloat16"}), dtype_said({"dtype": "float32"})
    ('bfloat16 as saved', 'float32')
    >>> dtype_said({"dtype": "float32", "checkpoint_dtype": "bfloat16"})
    'float32, saved in bfloat16'
    """
    dtype, saved = str(side.get("dtype", "?")), side.get("checkpoint_dtype")
    if saved is None:
        return dtype
    return f"{dtype} as saved" if saved == dtype else f"{dtype}, saved in {saved}"


def fmt(value: float | None, spec: str = ".2e") -> str:
    """A number as the tables show it: ``spec``, ``inf``/``nan`` as words, ``""`` for none.

    >>> fmt(0.0619), fmt(float("inf")), fmt(None), fmt(3.14159, ".3g")
    ('6.19e-02', 'inf', '', '3.14')
    """
    if value is None:
        return ""
    if not math.isfinite(value):
        return str(value)
    return format(value, spec)


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


def ratio_sparkline(ratios: Sequence[float | None]) -> str:
    """One bar per ratio of a value to its threshold, on a fixed scale (:data:`SPARK_RATIOS`):
    ``▁`` below 0.01, ``▂`` below 0.1, ``▃`` below 0.5, ``▄`` up to the threshold, then
    ``▅`` above it, ``▆`` above 3, ``▇`` above 10, ``█`` above 100. The same ratio draws the
    same bar in every run: noise well within its threshold stays low however flat or steep
    it is. A non-finite ratio draws as ``!``, a missing one as ``-``.

    >>> ratio_sparkline([0.0, 0.28, 0.32, 0.7, 1.0, 1.5, 566.0, None, float("nan")])
    '▁▃▃▄▄▅█-!'
    """
    out = []
    for ratio in ratios:
        if ratio is None:
            out.append("-")
        elif math.isnan(ratio):
            out.append("!")
        else:
            below = [bound for bound in SPARK_RATIOS[:3] if ratio < bound]
            above = [bound for bound in SPARK_RATIOS[3:] if ratio > bound]
            out.append(SPARKS[3 - len(below) if below else 3 + len(above)])
    return "".join(out)


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


@dataclass
class Cell:
    """One heatmap cell: a sub-path's worst check, a whole-block check or a stage's check."""

    status: str  # "checked", "not_needed", "absent", "drift_only", "not_judged"
    ratio: float | None = None  # value / threshold; None when nothing ran
    value: float | None = None
    threshold: float | None = None
    diverged: bool = False
    module: str = ""
    what: str = ""
    metric: str = "rel_l2"
    nonfinite: tuple[int, int] = (0, 0)  # (reference, candidate)

    @classmethod
    def of(cls, check: Check | None, status: str = "checked") -> Cell:
        """The cell of ``check``; ``status`` is its sub-path's (a stage's or a whole block's
        check is ``checked``). No check: ``absent``, or the sub-path's reason for none."""
        if check is None:
            return cls(status="absent" if status == "checked" else status)
        return cls(
            status=status,
            ratio=check.ratio,
            value=check.measured,
            threshold=check.threshold.value,
            diverged=check.diverged,
            module=check.module,
            what=check.what,
            metric=check.metric,
            nonfinite=check.nonfinite,
        )

    @classmethod
    def of_subpath(cls, result: SubpathResult | None) -> Cell:
        """The cell of a sub-path: its worst check; ``absent`` when the block has none."""
        if result is None:
            return cls(status="absent")
        return cls.of(result.worst, result.status)

    @property
    def level(self) -> str:
        """Its heatmap class (:func:`level`)."""
        return level(self.ratio, self.diverged, self.status)

    @property
    def text(self) -> str:
        """What the tables print: the local error, or the count of non-finite values when
        the candidate has NaN/Inf that the reference has not."""
        nonfinite_ref, nonfinite_cand = self.nonfinite
        if nonfinite_cand != nonfinite_ref:
            return f"{nonfinite_cand} non-finite"
        return fmt(self.value)


@dataclass
class Column:
    """One site of the report, in execution order: embed and context, the blocks, then
    final norm and head."""

    label: str  # "embed", "0", "1", ..., "head"
    stage: str
    module: str = ""
    block: int | None = None
    stack: str | None = None  # a stage's only when there are several block lists
    cells: dict[str, Cell] = field(default_factory=dict)  # keys from ROWS
    drift: float | None = None
    threshold: float | None = None  # of the whole-block / stage check
    unmapped: list[str] = field(default_factory=list)  # a block's modules in no sub-path
    # Drift judged against its own threshold (``drift_check``; two dumps compared: the
    # whole check, which is drift); a report older than drift checks has its value only.
    drift_cell: Cell = field(default_factory=lambda: Cell(status="absent"))

    @property
    def drift_threshold(self) -> float | None:
        """The threshold drift is judged against here (``drift_check.threshold``), or ``None``."""
        return self.drift_cell.threshold

    @property
    def drift_ratio(self) -> float | None:
        """Drift over its own threshold, or ``None`` where it was not judged."""
        return self.drift_cell.ratio

    @property
    def name(self) -> str:
        """The site in words: ``block 2``, ``final_norm``."""
        return f"block {self.block}" if self.stage == "block" else self.stage


def drop_rate(stats: dict[str, Any]) -> str:
    """The share of routing assignments dropped: at the model's capacity, else
    counterfactual at the first capacity factor (``12.5% @cf1.0``), else ``—``."""
    if stats.get("capacity") is not None:
        return f"{from_json_number(stats['assignment_drop_rate']):.1%}"
    counterfactual = stats.get("counterfactual") or {}
    if not counterfactual:
        return "—"
    cf, entry = next(iter(counterfactual.items()))
    return f"{from_json_number(entry['assignment_drop_rate']):.1%} @cf{cf}"


@dataclass
class MoeRow:
    """One side of one MoE block in the routing table; the cells of :data:`MOE_COLUMNS`
    but the last are text, the block's own (agreement, flips) on the reference's row."""

    block: int
    side: str  # "ref" or "cand"
    entropy: str  # normalized by ln E
    max_load: str
    min_load: str
    drops: str
    agreement: str  # top-k agreement of the free-running sides; "" on the candidate's row
    flips: str  # routing flips on the reference's input; "" on the candidate's row
    counts: list[int]  # tokens per expert, before capacity
    topk_agreement: float | None = None  # the agreement as a number, on both rows

    @property
    def cells(self) -> list[str]:
        """The text cells, in :data:`MOE_COLUMNS` order without the counts."""
        first = self.side == "ref"
        return [
            str(self.block) if first else "",
            self.side,
            self.entropy,
            self.max_load,
            self.min_load,
            self.drops,
            self.agreement,
            self.flips,
        ]

    @classmethod
    def rows(cls, entry: dict[str, Any]) -> list[MoeRow]:
        """The reference's and the candidate's rows of one entry of ``Report.moe``."""
        agreement = entry.get("agreement") or {}
        topk = from_json_number(agreement.get("topk_agreement"))
        local = entry.get("local_flips") or {}
        flips = f"{local.get('flipped', 0)} ({local.get('unexplained', 0)} unexplained)" if local else "—"
        out = []
        for side, short in (("reference", "ref"), ("candidate", "cand")):
            stats = entry[side]
            first = side == "reference"
            out.append(
                cls(
                    block=entry["block"],
                    side=short,
                    entropy=f"{from_json_number(stats['routing_entropy_norm']):.3f}",
                    max_load=f"{from_json_number(stats['max_load']):.1%}",
                    min_load=f"{from_json_number(stats['min_load']):.1%}",
                    drops=drop_rate(stats),
                    agreement=f"{topk:.1%}" if first and topk is not None else "",
                    flips=flips if first else "",
                    counts=list(stats["counts"]),
                    topk_agreement=topk,
                )
            )
        return out


@dataclass
class View:
    """A report read for the renderers (see the module docstring)."""

    report: Report
    columns: list[Column]
    divergences: list[Divergence]
    moe: list[MoeRow]

    @classmethod
    def of(cls, report: Report | dict[str, Any] | View) -> View:
        """The view of ``report``: a :class:`Report`, or its ``blockdiff.report/2`` dict.

        Raises:
            BlockdiffError: ``report`` is neither a report nor a report's dict.
        """
        if isinstance(report, View):
            return report
        if not isinstance(report, Report):
            report = Report.from_dict(report)
        return cls(
            report=report,
            columns=_columns(report),
            divergences=report.divergences,
            moe=[row for entry in report.moe for row in MoeRow.rows(entry)],
        )

    @property
    def tolerance(self) -> str:
        """The policy as the header names it: ``fixed``, ``calibrated``, ``calibrated (stored floors)``."""
        policy = str(self.report.tolerance.get("policy"))
        stored = str(self.report.tolerance.get("floors", "")).startswith("stored")
        return f"{policy} (stored floors)" if stored else policy

    @property
    def drift_only(self) -> bool:
        """Whether only drift was computed (two dumps compared offline): the cells are drift."""
        return _drift_only(self.report)

    @property
    def measured(self) -> str:
        """What the cells hold, as captions name it."""
        return "drift" if self.drift_only else "local error"

    @property
    def first(self) -> Divergence | None:
        """The first divergence, or ``None``."""
        return self.divergences[0] if self.divergences else None

    @property
    def blocks(self) -> list[Column]:
        return [c for c in self.columns if c.stage == "block"]

    @property
    def stages(self) -> list[Column]:
        return [c for c in self.columns if c.stage != "block"]

    @property
    def multi_stack(self) -> bool:
        """Whether the blocks come in several lists (an encoder-decoder's)."""
        return len(self.report.stacks) > 1

    @property
    def drift_judged(self) -> bool:
        """Whether every block's drift was judged against its own threshold (a live
        candidate's report): the sparkline then draws drift over it."""
        drifting = [c for c in self.blocks if c.drift is not None]
        return bool(drifting) and all(c.drift_ratio is not None for c in drifting)

    @property
    def drift_sparkline(self) -> str:
        """The drift of every block as one character per block: over its own threshold on
        a fixed scale (:func:`ratio_sparkline`) where it was judged, else the drift itself
        on the run's own log scale (:func:`sparkline`)."""
        if self.drift_judged:
            return ratio_sparkline([c.drift_ratio if c.drift is not None else None for c in self.blocks])
        return sparkline([c.drift for c in self.blocks])

    @property
    def drift_scale(self) -> str:
        """What the sparkline shows: ``drift / threshold 0.32 … 0.32, over 1: ▅ to █``, or
        for drift not judged ``rel L2 0 … 0.066, log scale``; ``""`` when no block has a
        finite drift."""
        if self.drift_judged:
            ratios = [c.drift_ratio for c in self.blocks if c.drift_ratio is not None and math.isfinite(c.drift_ratio)]
            return f"drift / threshold {min(ratios):.2g} … {max(ratios):.2g}, {SPARK_LEGEND}" if ratios else ""
        values = [c.drift for c in self.blocks if c.drift is not None and math.isfinite(c.drift)]
        return f"rel L2 {min(values):.2g} … {max(values):.2g}, log scale" if values else ""

    def column_of(self, divergence: Divergence) -> int | None:
        """The position in :attr:`columns` of the site ``divergence`` is at."""
        if divergence.stage == "block":
            found = [i for i, c in enumerate(self.columns) if c.stage == "block" and c.block == divergence.block]
        else:
            same = [i for i, c in enumerate(self.columns) if c.stage == divergence.stage]
            # Encoder-decoder reports have two embeds and two final norms: the module tells.
            found = [i for i in same if self.columns[i].module == divergence.module] or same
        return found[0] if found else None


def _drift_only(report: Report) -> bool:
    statuses = {r.status for b in report.blocks for r in b.subpaths.values()} - {"absent"}
    return statuses == {"drift_only"}


def _drift_cell(drift: Metrics | None, check: Check | None, whole: Cell | None) -> Cell:
    """Drift's cell: its check judged against its own threshold; in a comparison of two
    dumps (``whole``), the whole block's or stage's check, which is that drift judged;
    else its value alone."""
    if check is not None:
        return Cell.of(check)
    if drift is None:
        return Cell(status="absent")
    if whole is not None and whole.value == drift.rel_l2:
        return whole
    return Cell(status="checked", value=drift.rel_l2, nonfinite=(drift.nonfinite_ref, drift.nonfinite_cand))


def _columns(report: Report) -> list[Column]:
    """Every site of ``report`` as a column, in execution order (an encoder's final norm
    before the decoder's blocks)."""
    columns: list[tuple[float, int, Column]] = []
    offline = _drift_only(report)
    for stage in report.stages:
        cells = {name: Cell(status="absent") for name in SUBPATHS}
        cells[WHOLE] = Cell.of(stage.local)
        column = Column(
            label=stage.stage,
            stage=stage.stage,
            module=stage.module,
            stack=report.stack_of(stage),
            cells=cells,
            drift=None if stage.drift is None else stage.drift.rel_l2,
            threshold=cells[WHOLE].threshold,
            drift_cell=_drift_cell(stage.drift, stage.drift_check, cells[WHOLE] if offline else None),
        )
        columns.append((stage.order, 0, column))
    for block in report.blocks:
        cells = {name: Cell.of_subpath(block.subpaths.get(name)) for name in SUBPATHS}
        cells[WHOLE] = Cell.of(block.block)
        column = Column(
            label=str(block.index),
            stage="block",
            module=block.module,
            block=block.index,
            stack=block.stack,
            cells=cells,
            drift=None if block.drift is None else block.drift.rel_l2,
            threshold=cells[WHOLE].threshold,
            unmapped=list(block.unmapped),
            drift_cell=_drift_cell(block.drift, block.drift_check, cells[WHOLE] if offline else None),
        )
        columns.append((block.order, 1, column))
    return [c for _, _, c in sorted(columns, key=lambda row: (row[0], row[1]))]
