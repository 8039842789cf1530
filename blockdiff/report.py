"""Report: the verdict of a diff as data, and its JSON form (``blockdiff.report/2``; /1 still read).

A :class:`Report` holds, per stage outside blocks and per block, the local-error checks of
every sub-path, the block-level check and the drift, and derives the divergences from
them. ``Report.to_dict()`` is the JSON contract documented in ``docs/report-format.md``;
``Report.from_dict()`` reads it back (a saved ``--json`` file), so the renderers after
this step (:mod:`.view`) read one kind of report whichever way it came.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compare import Metrics, from_json_number, json_number
from .errors import BlockdiffError
from .tolerance import Threshold
from .vocab import DRIFT, BEFORE_BLOCKS, CACHE_PARTS, PART_OF, REPLICAS, SUBPATHS, UNATTRIBUTED

SCHEMA = "blockdiff.report/2"
# Every schema this version reads: /1 (blockdiff 0.4 and earlier) is /2 without decode steps.
READS = ("blockdiff.report/1", SCHEMA)



def _budget(budget: dict[str, dict[str, Any]], number: Any) -> dict[str, dict[str, Any]]:
    """A block's budget with each number through ``number`` (to or from JSON: NaN and
    infinities are strings there)."""
    return {source: {key: number(value) for key, value in entry.items()} for source, entry in budget.items()}


# A site's drift is measured at its output: just after its local checks in execution order.
DRIFT_AFTER = 1e-3

# How a child check paired by role (or fused) names the reference's child it stands for:
# "child w1 (as gate_proj)", "child wqkv (as q_proj+k_proj+v_proj)" (children.ChildPair.what).
_PAIRED_AS = re.compile(r"\(as ([^()]+)\)$")


@dataclass
class Check:
    """One local-error comparison: what was compared, its metrics and its threshold.

    Most checks judge the relative L2 of ``metrics``; a check with its own measure (the
    routing-flip margin ratio of an MoE router) carries it as ``value`` under ``metric``.
    """

    what: str  # "output", "block output", "input of model.layers.1.mlp", "router logits", ...
    module: str
    metrics: Metrics | None
    threshold: Threshold
    value: float | None = None
    metric: str = "rel_l2"
    details: dict[str, Any] | None = None
    # Where the compared site ran, when it differs from its sub-path's first site (a
    # block's second norm): a divergence is placed by its first diverging check. Not in
    # the JSON, whose divergence list keeps the order.
    order: float | None = field(default=None, compare=False)
    # Drill-down of a divergent module check: its leaf children judged one by one
    # (Experiments.children_checks); None when not drilled.
    children: list["Check"] | None = None
    # The check's name among floors (Experiments.with_floor): how a baseline of another
    # precision is looked up for it (ranking). Not in the JSON.
    key: str | None = field(default=None, compare=False)
    # What the drill-down could not check (Experiments.children_checks), beside ``children``:
    # the children, by their path below their module, that pair with nothing on the other
    # side ({"reference": [...], "candidate": [...]}), and pairs that cannot be judged
    # ("NAME (why)"). None when not recorded (not drilled; an older report; a backward
    # drill-down, which pairs by name and says nothing of the rest).
    children_not_paired: dict[str, list[str]] | None = None
    children_not_judged: list[str] | None = None

    @property
    def first_child(self) -> "Check | None":
        """The first child, in the order they ran, that diverges (drilled checks only)."""
        return next((c for c in self.children or [] if c.diverged), None)

    @property
    def paired_as(self) -> str | None:
        """A drilled child check paired by role or fused: the reference's child (or
        children, ``+``-joined) it stands for (``gate_proj`` of ``child w1 (as gate_proj)``);
        ``None`` for a child paired by name, or any other check."""
        found = _PAIRED_AS.search(self.what)
        return None if found is None else found.group(1)

    def child_dict(self) -> dict[str, Any]:
        """This check as a divergence's ``child`` (the first divergent child of its drill-down):
        :meth:`to_dict` with ``value`` always set (the measured value, as a divergence has it),
        ``paired`` (``name``, ``role`` or ``fused``) and ``paired_as`` (:attr:`paired_as`)."""
        paired_as = self.paired_as
        paired = "name" if paired_as is None else "fused" if "+" in self.what else "role"
        return {**self.to_dict(), "value": json_number(self.measured), "paired": paired, "paired_as": paired_as}

    @property
    def every_child_checked(self) -> bool | None:
        """Whether the drill-down judged every child of the module on both sides (none
        left unpaired or unjudged); ``None`` when that was not recorded or not drilled."""
        if self.children is None or self.children_not_paired is None or self.children_not_judged is None:
            return None
        return not any(self.children_not_paired.values()) and not self.children_not_judged

    @property
    def measured(self) -> float:
        if self.value is not None:
            return self.value
        assert self.metrics is not None
        return self.metrics.rel_l2

    @property
    def ratio(self) -> float:
        if self.threshold.value <= 0:
            return math.inf if self.measured > 0 else 0.0
        return self.measured / self.threshold.value

    @property
    def diverged(self) -> bool:
        return not self.measured <= self.threshold.value  # NaN counts as diverged

    @property
    def tolerated(self) -> bool:
        """Within a user's override but beyond what the policy alone allows: the error is
        there, and explains a divergence of the whole block."""
        t = self.threshold
        return not self.diverged and t.default is not None and self.measured > t.default

    @property
    def nonfinite(self) -> tuple[int, int]:
        """(reference, candidate) counts of NaN/Inf."""
        if self.metrics is None:
            return (0, 0)
        return (self.metrics.nonfinite_ref, self.metrics.nonfinite_cand)

    @property
    def part(self) -> str | None:
        """``router`` or ``experts`` for the checks of an MoE block's ffn."""
        return PART_OF.get(self.what)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"what": self.what, "module": self.module, "metric": self.metric}
        if self.part is not None:
            out["part"] = self.part
        if self.metrics is not None:
            out.update(self.metrics.to_dict())
        if self.value is not None:
            out["value"] = json_number(self.value)
        out.update(
            {
                "threshold": json_number(self.threshold.value),
                "floor": None if self.threshold.floor is None else json_number(self.threshold.floor),
                "basis": self.threshold.basis,
                "ratio": json_number(self.ratio),
                "diverged": self.diverged,
            }
        )
        if self.threshold.default is not None:
            out["default_threshold"] = json_number(self.threshold.default)
            out["tolerated"] = self.tolerated
        if self.details is not None:
            out["details"] = self.details
        if self.children is not None:
            out["children"] = [child.to_dict() for child in self.children]
            first = self.first_child
            out["first_child"] = None if first is None else first.module
            if self.children_not_paired is not None:
                out["children_not_paired"] = {side: list(names) for side, names in self.children_not_paired.items()}
            if self.children_not_judged is not None:
                out["children_not_judged"] = list(self.children_not_judged)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Check:
        """The check of :meth:`to_dict`; ``part``, ``ratio``, ``diverged`` and ``tolerated``
        are derived again."""
        return cls(
            what=data["what"],
            module=data["module"],
            metrics=Metrics.from_dict(data) if "rel_l2" in data else None,
            threshold=Threshold(
                from_json_number(data["threshold"]),
                data["basis"],
                from_json_number(data.get("floor")),
                from_json_number(data.get("default_threshold")),
            ),
            value=from_json_number(data["value"]) if "value" in data else None,
            metric=data.get("metric", "rel_l2"),
            details=data.get("details"),
            children=[cls.from_dict(c) for c in data["children"]] if "children" in data else None,
            children_not_paired=(
                {side: list(names) for side, names in data["children_not_paired"].items()}
                if data.get("children_not_paired") is not None else None
            ),
            children_not_judged=list(data["children_not_judged"]) if data.get("children_not_judged") is not None else None,
        )


def _optional(value: Any, read: Any) -> Any:
    """``read(value)``, or ``None`` for ``None``."""
    return None if value is None else read(value)


@dataclass
class SubpathResult:
    """The checks of one sub-path in one block (several for two norms, or residual)."""

    status: str  # "checked", "not_needed" (fast path), "absent" (the block has none)
    checks: list[Check] = field(default_factory=list)
    order: float = 0  # execution order of its first site, for the verdict
    # Backward: its divergence follows from the forward's there ("forward block 1 ffn"):
    # not a divergence of its own (docs/backward.md).
    explained_by: str | None = None

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: (c.diverged, c.ratio), default=None)

    @property
    def diverged(self) -> bool:
        return any(c.diverged for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        out: dict[str, Any] = {"status": self.status, "diverged": self.diverged}
        if worst is not None:
            out.update({k: v for k, v in worst.to_dict().items() if k != "diverged"})
        out["checks"] = [c.to_dict() for c in self.checks]
        if self.explained_by is not None:
            out["explained_by"] = self.explained_by
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SubpathResult:
        """The sub-path of :meth:`to_dict` (its ``order`` is set by :meth:`Report.from_dict`)."""
        return cls(data["status"], [Check.from_dict(c) for c in data["checks"]], explained_by=data.get("explained_by"))


@dataclass
class StageResult:
    """A site outside the blocks: embedding, context, final norm or head."""

    stage: str
    module: str
    local: Check | None
    drift: Metrics | None
    order: float = 0
    drift_check: Check | None = None  # drift judged against its tolerance (live candidates)
    # Its output differs but what reaches the next stage agrees: code moved across the
    # module boundary ({"reaches": "block 0 input", "rel_l2": ...}); blames nothing.
    boundary_move: dict[str, Any] | None = None
    explained_by: str | None = None  # backward: as SubpathResult.explained_by

    @property
    def drift_order(self) -> float:
        """Where its drift is measured: its output, just after its local check."""
        return self.order + DRIFT_AFTER

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "module": self.module,
            "local": _optional(self.local, Check.to_dict),
            "drift": _optional(self.drift, Metrics.to_dict),
            "drift_check": _optional(self.drift_check, Check.to_dict),
            "boundary_move": self.boundary_move,
            **({"explained_by": self.explained_by} if self.explained_by is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageResult:
        return cls(
            data["stage"],
            data["module"],
            _optional(data.get("local"), Check.from_dict),
            _optional(data.get("drift"), Metrics.from_dict),
            drift_check=_optional(data.get("drift_check"), Check.from_dict),
            boundary_move=data.get("boundary_move"),
            explained_by=data.get("explained_by"),
        )


@dataclass
class BlockResult:
    index: int
    module: str
    stack: str
    subpaths: dict[str, SubpathResult]
    block: Check | None  # candidate block on the reference input, nothing frozen
    drift: Metrics | None
    order: float = 0
    unmapped: list[str] = field(default_factory=list)
    drift_check: Check | None = None  # the block output's drift judged (live candidates)
    # Where the block output's error comes from, to first order (Localizer.budget):
    # {"incoming" | sub-path: {"error": absolute L2 error, "share": fraction}}.
    budget: dict[str, dict[str, float]] | None = None
    explained_by: str | None = None  # backward: the whole-block check's, as SubpathResult.explained_by

    @property
    def drift_order(self) -> float:
        """Where its drift is measured: the block's output, after every sub-path's check."""
        return max([self.order, *(r.order for r in self.subpaths.values())]) + DRIFT_AFTER

    def blamed(self, subpath: str) -> str:
        """The sub-path a divergence of ``subpath`` is reported on: ``residual`` is
        ``unattributed`` when modules outside every sub-path ran unfrozen with the glue."""
        return UNATTRIBUTED if subpath == "residual" and self.unmapped else subpath

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "module": self.module,
            "stack": self.stack,
            "subpaths": {
                name: (self.subpaths[name].to_dict() if name in self.subpaths else {"status": "absent", "diverged": False})
                for name in SUBPATHS
            },
            "block": _optional(self.block, Check.to_dict),
            "drift": _optional(self.drift, Metrics.to_dict),
            "drift_check": _optional(self.drift_check, Check.to_dict),
            "unmapped": self.unmapped,
            **({"budget": _budget(self.budget, json_number)} if self.budget is not None else {}),
            **({"explained_by": self.explained_by} if self.explained_by is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockResult:
        """The block of :meth:`to_dict`: an ``absent`` sub-path (no ``checks``) is left out,
        as it was; orders are set by :meth:`Report.from_dict`."""
        stored = data.get("subpaths") or {}
        return cls(
            index=data["index"],
            module=data["module"],
            stack=data.get("stack", ""),
            subpaths={
                name: SubpathResult.from_dict(stored[name]) for name in SUBPATHS if "checks" in stored.get(name, {})
            },
            block=_optional(data.get("block"), Check.from_dict),
            drift=_optional(data.get("drift"), Metrics.from_dict),
            unmapped=list(data.get("unmapped", [])),
            budget=_budget(data["budget"], from_json_number) if data.get("budget") is not None else None,
            drift_check=_optional(data.get("drift_check"), Check.from_dict),
            explained_by=data.get("explained_by"),
        )


@dataclass
class Divergence:
    stage: str
    block: int | None
    subpath: str | None
    module: str
    check: Check
    stack: str | None = None
    step: int | None = None  # the decode step (Report.decode), None for one forward pass

    def to_dict(self) -> dict[str, Any]:
        """The divergence as ``first_divergence`` and each of ``divergences`` hold it; ``child``
        and ``conversion`` are derived from the check (:meth:`Report.from_dict` reads neither:
        a report without them, written before they were, reads the same)."""
        nonfinite_ref, nonfinite_cand = self.check.nonfinite
        child = self.check.first_child
        conversion = (self.check.details or {}).get("conversion")
        return {
            **({} if self.step is None else {"step": self.step}),
            "stage": self.stage,
            "block": self.block,
            "stack": self.stack,
            "subpath": self.subpath,
            "part": self.check.part,
            "module": self.module,
            "what": self.check.what,
            "metric": self.check.metric,
            "value": json_number(self.check.measured),
            "threshold": json_number(self.check.threshold.value),
            "ratio": json_number(self.check.ratio),
            "nonfinite_ref": nonfinite_ref,
            "nonfinite_cand": nonfinite_cand,
            # What the terminal says beside the headline: the drill-down's first divergent
            # child, and the converted weights that explain it (docs/report-format.md).
            "child": None if child is None else child.child_dict(),
            "conversion": None if conversion is None else list(conversion),
        }

    @property
    def where(self) -> str:
        """Where it is, in words: ``block 1 ffn``, ``head``, ``block 2 unexplained drift``."""
        place = f"block {self.block}" if self.stage == "block" else self.stage
        if self.step is not None:
            place = f"step {self.step} {place}"
        if self.subpath == DRIFT:
            return f"{place} unexplained drift"
        return f"{place} {self.subpath}" if self.stage == "block" else place

    def headline(self) -> str:
        """The divergence in one line, as every renderer states it.

        A residual check that compared the input reaching a module names it so: the
        module (often a norm) computed nothing wrong, the block's glue before it did.

        >>> first.headline()  # doctest: +SKIP
        'block 1 ffn (blocks.1.ffn): rel_l2 0.162 > threshold 0.0001 (1619.6x)'
        >>> residual.headline()  # doctest: +SKIP
        'block 1 residual (input of blocks.1.ffn_norm): rel_l2 0.89 > threshold 0.0001 (8901.9x)'
        """
        where = self.where
        part, what = self.check.part, self.check.what
        if part is not None:  # an MoE ffn's part, in words: "(experts, routing frozen at the reference's)"
            words = what.replace(" (", ", ").removesuffix(")") if what.endswith(")") else what
            where += f" ({words if words.startswith(part) else f'{part}: {words}'})"
        module = self.module
        if self.subpath == "residual" and self.check.what.startswith("input of"):
            module = f"input of {module}"  # as the JSON's "what" and the HTML say it
        elif self.subpath == "residual" and self.check.what.startswith("input handed over"):
            module = f"{module}: {self.check.what}"  # a pipeline stage's hand-over
        if (self.check.metric == "routing_differs" or self.check.what == REPLICAS) and self.check.details:
            return f"{where} ({module}): {self.check.details.get('message', 'routing differs')}"
        nonfinite_ref, nonfinite_cand = self.check.nonfinite
        if nonfinite_cand != nonfinite_ref:
            return (
                f"{where} ({module}): {nonfinite_cand} non-finite values in the candidate, "
                f"{nonfinite_ref} in the reference"
            )
        weights = (self.check.details or {}).get("conversion")
        return (
            f"{where} ({module}): {self.check.metric} {self.check.measured:.3g} > threshold "
            f"{self.check.threshold.value:.3g} ({times(self.check)})"
            + (f"; {weights[0]}" if weights else "")  # a converted weight explains it (blockdiff.conversion)
        )


def times(check: Check) -> str:
    """How far over its threshold a check is: ``1619.6x``, or ``not bit-exact`` against a
    threshold of 0 (batch invariance)."""
    return "not bit-exact" if check.threshold.value == 0 else f"{check.ratio:.1f}x"


def named_headline(divergence: Divergence) -> str:
    """:meth:`Divergence.headline` with what the check compared after where it is
    (``block 2 ffn (input gradient) (blocks.2.ffn): …``): a backward divergence is an input
    or a parameter gradient."""
    head, where = divergence.headline(), divergence.where
    if divergence.subpath == DRIFT or not head.startswith(where + " ("):
        return head
    return f"{where} ({divergence.check.what}){head[len(where):]}"


class Note(str):
    """A report note: the sentence a person reads, and ``code``, what it is about — stable
    across wordings, so scripts and tests read the code (``Report.note_codes``; every code
    is listed in docs/report-format.md). A note is its text everywhere a string is used.

    >>> note = Note("boundary-move", "embed (model.embed): the output differs ...")
    >>> note.code, note.startswith("embed")
    ('boundary-move', True)
    """

    code: str

    def __new__(cls, code: str, text: str) -> Note:
        note = super().__new__(cls, text)
        note.code = code
        return note

    def __getnewargs__(self) -> tuple[str, str]:  # type: ignore[override]  # pickled across ranks
        return self.code, str(self)


def coded(code: str, texts: list[str]) -> list[str]:
    """``texts`` as notes of ``code``."""
    return [Note(code, text) for text in texts]


@dataclass
class Report:
    """Everything a diff found. ``first_divergence`` is ``None`` when nothing diverged."""

    reference: dict[str, Any]
    candidate: dict[str, Any]
    inputs: dict[str, Any]
    tolerance: dict[str, Any]
    stages: list[StageResult]
    blocks: list[BlockResult]
    moe: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    first_nonfinite: dict[str, Any] | None = None
    reference_nonfinite: dict[str, Any] | None = None
    created: str = ""
    version: str = ""
    ranking: list[dict[str, Any]] | None = None  # --rank: Report.rank(), worst first
    # --decode: the run's steps (steps, prompt_length, cache, step: the one whose stages
    # and blocks these are, tokens_differ_at), and each step summed up (docs/decode.md).
    decode: dict[str, Any] | None = None
    steps: list[dict[str, Any]] | None = None
    # --backward: the gradients' report, its stages and blocks in backward execution order
    # (head first, embedding last); its verdict is the backward's (docs/backward.md).
    backward: "Report | None" = None
    # blockdiff invariance: the batch, the rows judged, each row's first divergence, and per
    # divergent site its rows and largest difference (docs/invariance.md).
    invariance: dict[str, Any] | None = None

    @property
    def divergences(self) -> list[Divergence]:
        """Every divergent stage or (block, sub-path), in execution order."""
        found: list[tuple[int, Divergence]] = []
        for stage in self.stages:
            if stage.local is not None and stage.local.diverged and stage.boundary_move is None and stage.explained_by is None:
                found.append((stage.order, Divergence(stage.stage, None, None, stage.module, stage.local)))
        for block in self.blocks:
            any_subpath = False
            for name, result in sorted(block.subpaths.items(), key=lambda kv: kv[1].order):
                if result.diverged:
                    any_subpath = True
                    if result.explained_by is not None:  # a backward check the forward explains
                        continue
                    # A wrong cache write is what the attention's output then shows: named first.
                    worst = next((c for c in result.checks if c.diverged and c.part in CACHE_PARTS), result.worst)
                    assert worst is not None
                    blamed = block.blamed(name)
                    position = min((c.order for c in result.checks if c.diverged and c.order is not None), default=result.order)
                    found.append((position, Divergence("block", block.index, blamed, worst.module, worst, block.stack)))
            tolerated = any(c.tolerated for r in block.subpaths.values() for c in r.checks)
            if not any_subpath and not tolerated and block.block is not None and block.block.diverged and block.explained_by is None:
                # The block diverges but no sub-path explains it: never pass it silently.
                # (A sub-path the user tolerated with an override does explain it.)
                found.append(
                    (block.order, Divergence("block", block.index, UNATTRIBUTED, block.module, block.block, block.stack))
                )
        found.sort(key=lambda pair: pair[0])
        # A local error the user tolerated (--tol) explains the drift it causes, too.
        explained = [position for position, _ in found] + self._tolerated_positions()
        drift = self.unexplained_drift(before=min(explained, default=None))
        if drift is not None:
            found.insert(0, drift)
        if self.decode is not None:  # these are one decode step's stages and blocks
            for _, divergence in found:
                divergence.step = self.decode.get("step")
        return [d for _, d in found]

    def _tolerated_positions(self) -> list[float]:
        """Where local checks the user tolerated with an override (``tolerated``) are."""
        found = [s.order for s in self.stages if s.local is not None and s.local.tolerated]
        for block in self.blocks:
            found += [r.order for r in block.subpaths.values() if any(c.tolerated for c in r.checks)]
            if block.block is not None and block.block.tolerated:
                found.append(block.order)
        return found

    def unexplained_drift(self, *, before: float | None) -> tuple[float, Divergence] | None:
        """The first site whose drift exceeds its tolerance with no local divergence at or
        before it (``before``: where the first local divergence is), as a divergence.

        Drift that no local check explains is never a pass: the candidate's free run
        computes something its modules do not compute when run alone (a compiled graph, a
        fused kernel, code the hook map does not see), or precision accumulates past
        what the reference's own code at that precision does.
        """
        items: list[tuple[float, StageResult | BlockResult]] = [
            (s.drift_order, s) for s in self.stages if s.boundary_move is None  # its next input agrees
        ]
        items += [(b.drift_order, b) for b in self.blocks]
        for position, item in sorted(items, key=lambda pair: pair[0]):
            if before is not None and position >= before:
                return None
            check = item.drift_check
            if check is None or not check.diverged:
                continue
            if isinstance(item, BlockResult):
                return position, Divergence("block", item.index, DRIFT, item.module, check, item.stack)
            return position, Divergence(item.stage, None, DRIFT, item.module, check)
        return None

    def rank(self, baseline: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every sub-path, stage and drilled child check, worst first, by its local error
        over a baseline: the floor ``baseline`` holds for it (another precision's, by check
        key), else the check's own threshold.

        Each entry: ``stage``, ``block``, ``subpath``, ``module`` (the sub-path's or
        stage's), ``child`` (a drilled child's module, else ``None``), ``value``,
        ``baseline``, ``ratio``, and ``share``: for a sub-path, its share of all the error
        the sub-paths added (their budgets), which stands for its share of the final drift
        to first order (``None`` for stages and children).
        """
        entries: list[dict[str, Any]] = []
        # Every error the sub-paths added, to first order (the blocks' budgets): a
        # sub-path's share of it stands for its share of the final drift.
        added = sum(v["error"] for b in self.blocks for k, v in (b.budget or {}).items() if k != "incoming")

        def add(stage: str, block: BlockResult | None, subpath: str | None, module: str, check: Check, child: str | None) -> None:
            if check.metrics is None:
                return
            base = baseline.get(check.key) if baseline is not None and check.key is not None else None
            base = base if isinstance(base, (int, float)) and base > 0 else check.threshold.value
            share = None
            if block is not None and child is None and block.budget and subpath in block.budget and added > 0:
                share = json_number(block.budget[subpath]["error"] / added)
            entries.append(
                {
                    "stage": stage,
                    "block": None if block is None else block.index,
                    "subpath": subpath,
                    "module": module,
                    "child": child,
                    "value": json_number(check.measured),
                    "baseline": json_number(base),
                    "ratio": json_number(check.measured / base),
                    "share": share,
                }
            )

        for stage in self.stages:
            if stage.local is not None:
                add(stage.stage, None, None, stage.module, stage.local, None)
        for block in self.blocks:
            for name, result in block.subpaths.items():
                for check in result.checks:
                    add("block", block, name, check.module, check, None)
                    for child in check.children or []:
                        add("block", block, name, check.module, child, child.module)
        return sorted(entries, key=lambda e: -from_json_number(e["ratio"]))

    @property
    def first_divergence(self) -> Divergence | None:
        found = self.divergences
        return found[0] if found else None

    @property
    def diverged(self) -> bool:
        """Whether anything diverged: the forward, or (``--backward``) the gradients."""
        return self.first_divergence is not None or (self.backward is not None and self.backward.diverged)

    def verdict(self) -> str:
        """The verdict in one line; with a backward, the forward's and the backward's apart:
        ``forward: no divergence; backward: block 2 ffn (input gradient) (blocks.2.ffn): rel_l2 …``."""
        first = self.first_divergence
        forward = "no divergence" if first is None else first.headline()
        if self.backward is None:
            return forward
        back = self.backward.first_divergence
        return f"forward: {forward}; backward: {'no divergence' if back is None else named_headline(back)}"

    @property
    def stacks(self) -> list[str]:
        """The block lists, in the order of their blocks (two for an encoder-decoder)."""
        return list(dict.fromkeys(b.stack for b in self.blocks))

    def stack_of(self, stage: StageResult) -> str | None:
        """The block list a stage belongs to when there are several: the one whose parent
        module holds it (``encoder.final_layer_norm`` to ``encoder.block``); else ``None``."""
        stacks = self.stacks
        if len(stacks) < 2:
            return None
        for stack in stacks:
            parent = str(stack).rpartition(".")[0]
            if parent and stage.module.startswith(parent + "."):
                return stack
        return None

    @property
    def note_codes(self) -> list[str]:
        """Each note's code, in order (``""`` for a note written without one: a report
        read from JSON that predates codes)."""
        return [getattr(note, "code", "") for note in self.notes]

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        out = {
            "schema": SCHEMA,
            "blockdiff_version": self.version,
            "created": self.created,
            "reference": self.reference,
            "candidate": self.candidate,
            "inputs": self.inputs,
            "tolerance": self.tolerance,
            "first_divergence": None if first is None else first.to_dict(),
            "divergences": [d.to_dict() for d in self.divergences],
            "first_nonfinite": self.first_nonfinite,
            "reference_nonfinite": self.reference_nonfinite,
            "stages": [s.to_dict() for s in self.stages],
            "blocks": [b.to_dict() for b in self.blocks],
            "moe": self.moe,
            "notes": [str(note) for note in self.notes],
            "note_codes": self.note_codes,
        }
        if self.ranking is not None:
            out["ranking"] = self.ranking
        if self.decode is not None:
            out["decode"] = self.decode
            out["steps"] = self.steps or []
        if self.backward is not None:
            out["backward"] = {**self.backward.to_dict(), "direction": "backward"}
        if self.invariance is not None:
            out["invariance"] = self.invariance
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        """The report of a ``blockdiff.report/2`` dict (:meth:`to_dict`, or a loaded
        ``--json`` file), with its checks, thresholds and metrics as objects again.

        The divergences are derived from the checks, as for a live report. The JSON form
        keeps execution order only in its lists: stages and blocks are ordered as their
        block lists run (a stage beside the blocks of the list whose parent module holds
        it, embed and context before the blocks), and a block's sub-paths as the stored
        ``divergences`` list them.

        Raises:
            BlockdiffError: ``data`` is not a ``blockdiff.report/2`` report.

        >>> Report.from_dict(report.to_dict()).to_dict() == report.to_dict()  # doctest: +SKIP
        True
        """
        if not isinstance(data, dict) or data.get("schema") not in READS:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise BlockdiffError(f"expected a {SCHEMA} report (or {READS[0]}), found {found!r}")
        try:
            report = cls(
                reference=data.get("reference", {}),
                candidate=data.get("candidate", {}),
                inputs=data.get("inputs", {}),
                tolerance=data.get("tolerance", {}),
                stages=[StageResult.from_dict(s) for s in data.get("stages", [])],
                blocks=[BlockResult.from_dict(b) for b in data.get("blocks", [])],
                moe=data.get("moe", []),
                notes=_notes(data.get("notes", []), data.get("note_codes")),
                first_nonfinite=data.get("first_nonfinite"),
                reference_nonfinite=data.get("reference_nonfinite"),
                created=data.get("created", ""),
                version=data.get("blockdiff_version", ""),
                ranking=data.get("ranking"),
                decode=data.get("decode"),
                steps=data.get("steps"),
                backward=cls.from_dict(data["backward"]) if data.get("backward") is not None else None,
                invariance=data.get("invariance"),
            )
            report._restore_order(data.get("divergences") or [], backward=data.get("direction") == "backward")
        except KeyError as exc:
            raise BlockdiffError(f"not a complete {SCHEMA} report: an entry has no {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise BlockdiffError(f"not a well-formed {SCHEMA} report ({type(exc).__name__}: {exc})") from None
        return report

    def _restore_order(self, divergences: list[dict[str, Any]], *, backward: bool = False) -> None:
        """Orders for the stages, blocks and sub-paths of a report read from JSON (see
        :meth:`from_dict`); a backward report's run from the head to the embedding."""
        stacks = self.stacks if len(self.stacks) > 1 else []
        owner = [self.stack_of(s) for s in self.stages]

        def stages(stack: str | None, *, before: bool) -> list[StageResult]:
            return [s for s, o in zip(self.stages, owner) if o == stack and (s.stage in BEFORE_BLOCKS) == before]

        sequence: list[StageResult | BlockResult] = stages(None, before=True)
        for stack in stacks:
            sequence += stages(stack, before=True)
            sequence += [b for b in self.blocks if b.stack == stack]
            sequence += stages(stack, before=False)
        if not stacks:
            sequence += self.blocks
        sequence += stages(None, before=False)
        if backward:
            sequence.reverse()
        listed = {(d.get("block"), d.get("subpath")): i for i, d in enumerate(divergences) if d.get("stage") == "block"}
        for position, item in enumerate(sequence):
            item.order = position
            if isinstance(item, BlockResult):
                names = sorted(
                    item.subpaths,
                    key=lambda name: (listed.get((item.index, item.blamed(name)), len(listed)), SUBPATHS.index(name)),
                )
                for rank, name in enumerate(names, start=1):
                    item.subpaths[name].order = position + rank / (len(names) + 1)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


def _notes(texts: list[str], codes: list[str] | None) -> list[str]:
    """A report's notes read from JSON: each with its code where the report stores them
    (``note_codes``, one per note), as written before codes otherwise."""
    if not isinstance(codes, list) or len(codes) != len(texts):
        return list(texts)
    return [Note(code, text) if code else text for code, text in zip(codes, texts)]
