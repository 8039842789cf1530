"""Report: the verdict of a diff as data, and its JSON form (``blockdiff.report/1``).

A :class:`Report` holds, per stage outside blocks and per block, the local-error checks of
every sub-path, the block-level check and the drift, and derives the divergences from
them. ``Report.to_dict()`` is the JSON contract documented in ``docs/report-format.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compare import Metrics, json_number
from .vocab import PART_OF, SUBPATHS, UNATTRIBUTED
from .tolerance import Threshold

SCHEMA = "blockdiff.report/1"


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
        return out


@dataclass
class SubpathResult:
    """The checks of one sub-path in one block (several for two norms, or residual)."""

    status: str  # "checked", "not_needed" (fast path), "absent" (the block has none)
    checks: list[Check] = field(default_factory=list)
    order: float = 0  # execution order of its first site, for the verdict

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
        return out


@dataclass
class StageResult:
    """A site outside the blocks: embedding, context, final norm or head."""

    stage: str
    module: str
    local: Check | None
    drift: Metrics | None
    order: float = 0


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


@dataclass
class Divergence:
    stage: str
    block: int | None
    subpath: str | None
    module: str
    check: Check
    stack: str | None = None

    def to_dict(self) -> dict[str, Any]:
        nonfinite_ref, nonfinite_cand = self.check.nonfinite
        return {
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
        }

    def headline(self) -> str:
        where = f"block {self.block} {self.subpath}" if self.stage == "block" else self.stage
        if self.check.part is not None:
            where += f" [{self.check.part}: {self.check.what}]"
        nonfinite_ref, nonfinite_cand = self.check.nonfinite
        if nonfinite_cand != nonfinite_ref:
            return (
                f"{where} ({self.module}): {nonfinite_cand} non-finite values in the candidate, "
                f"{nonfinite_ref} in the reference"
            )
        return (
            f"{where} ({self.module}): {self.check.metric} {self.check.measured:.3g} > threshold "
            f"{self.check.threshold.value:.3g} ({self.check.ratio:.1f}x)"
        )


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

    @property
    def divergences(self) -> list[Divergence]:
        """Every divergent stage or (block, sub-path), in execution order."""
        found: list[tuple[int, Divergence]] = []
        for stage in self.stages:
            if stage.local is not None and stage.local.diverged:
                found.append((stage.order, Divergence(stage.stage, None, None, stage.module, stage.local)))
        for block in self.blocks:
            any_subpath = False
            for name, result in sorted(block.subpaths.items(), key=lambda kv: kv[1].order):
                if result.diverged:
                    any_subpath = True
                    worst = result.worst
                    assert worst is not None
                    if name == "residual" and block.unmapped:
                        # Modules outside every sub-path ran unfrozen: the glue is not alone.
                        name = UNATTRIBUTED
                    found.append(
                        (result.order, Divergence("block", block.index, name, worst.module, worst, block.stack))
                    )
            tolerated = any(c.tolerated for r in block.subpaths.values() for c in r.checks)
            if not any_subpath and not tolerated and block.block is not None and block.block.diverged:
                # The block diverges but no sub-path explains it: never pass it silently.
                # (A sub-path the user tolerated with an override does explain it.)
                found.append(
                    (block.order, Divergence("block", block.index, UNATTRIBUTED, block.module, block.block, block.stack))
                )
        return [d for _, d in sorted(found, key=lambda pair: pair[0])]

    @property
    def first_divergence(self) -> Divergence | None:
        found = self.divergences
        return found[0] if found else None

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
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
            "stages": [
                {
                    "stage": s.stage,
                    "module": s.module,
                    "local": None if s.local is None else s.local.to_dict(),
                    "drift": None if s.drift is None else s.drift.to_dict(),
                }
                for s in self.stages
            ],
            "blocks": [
                {
                    "index": b.index,
                    "module": b.module,
                    "stack": b.stack,
                    "subpaths": {
                        name: (b.subpaths[name].to_dict() if name in b.subpaths else {"status": "absent", "diverged": False})
                        for name in SUBPATHS
                    },
                    "block": None if b.block is None else b.block.to_dict(),
                    "drift": None if b.drift is None else b.drift.to_dict(),
                    "unmapped": b.unmapped,
                }
                for b in self.blocks
            ],
            "moe": self.moe,
            "notes": self.notes,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
