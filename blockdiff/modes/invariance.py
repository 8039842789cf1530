"""Batch invariance: the first operation whose output for a sequence depends on its batch.

The two "implementations" are one model: the **reference** is a row of token ids run alone
(batch 1, its own length), the **candidate** the same row inside a batch
(:class:`~blockdiff.sides.batched.RowSide`: other rows random or given, maybe padded, with
the attention mask and position ids a server would pass). Sites pair row by row, and every
experiment of a diff runs — module, block, residual, drill-down to the child module — each
on the whole batch with the row's inputs the row alone's, so the answer is an operation
(``model.layers.3.mlp.down_proj``). Invariance means equality: the default threshold is 0
(bit-exact); ``tolerance`` accepts a bound. Each chosen row is one localization; the report
is the row whose divergence comes first, and says for every divergent site on which rows
it differs and by how much (``Report.invariance``, docs/invariance.md).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import InputError, run_model_code
from ..hookmap import HookMap
from ..inputs import RandomTokens, accepts
from ..moe import capacity_of
from ..report import Note, Report
from ..sides.batched import RowCut, RowSide, rows_of
from ..sides.factory import open_side
from ..sides.live import LiveSide
from ..store import MemoryStore
from ..tolerance import Tolerance
from .judging import localize
from .options import Options

PADDING = ("left", "right")


def invariance(
    model: Any,
    tokens: Any = None,
    *,
    batch: int = 8,
    seq: int = 16,
    seed: int = 0,
    rows: Sequence[int] | None = None,
    padding: str | None = None,
    lengths: Sequence[int] | None = None,
    tolerance: float = 0.0,
    hooks: HookMap | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    label: str | None = None,
) -> Report:
    """Each chosen row of a batch alone against the same row inside the batch.

    Args:
        model: a model, a factory or a model spec (as :func:`blockdiff.run` takes them).
        tokens: token ids ``[batch, tokens]`` (a tensor or a token file); random ones
            (``batch`` × ``seq``, ``seed``) when ``None``.
        rows: the rows judged (default: every row).
        padding: ``"left"`` or ``"right"``: rows of ``lengths`` tokens (default: the first
            row all of them, the last half), padded to the longest, with the attention mask
            and position ids (needs a model that takes ``attention_mask``).
        tolerance: the relative-L2 bound a row may differ by (0: bit-exact).

    Returns:
        The report of the row whose first divergence comes first (the first row when none
        diverges), with ``report.invariance`` summing up every row.
    """
    if padding is not None and padding not in PADDING:
        raise InputError(f"--padding must be left or right, found {padding!r}")
    if not tolerance >= 0:
        raise InputError(f"--tol must be a bound of 0 or more, found {tolerance}")
    with ExitStack() as opened:
        side = open_side("reference", model, opened=opened, hooks=hooks, label=label, device=device, dtype=dtype)
        if not isinstance(side, LiveSide):
            raise InputError("invariance runs a PyTorch model (not a dump, nor an ONNX graph)")
        ids = _tokens(side, tokens, batch=batch, seq=seq, seed=seed)
        count, length = ids.shape
        if count < 2:
            raise InputError(f"a batch of {count} row: batch invariance needs --batch 2 or more")
        lengths = list(lengths) if lengths is not None else _lengths(count, length, padding)
        if len(lengths) != count or not all(1 <= n <= length for n in lengths):
            raise InputError(f"--lengths must give each of the {count} rows a length from 1 to {length}, found {lengths}")
        if padding is None and any(n != length for n in lengths):
            raise InputError("rows of different lengths need --padding left or right")
        chosen = list(rows) if rows is not None else list(range(count))
        if not chosen or not all(0 <= r < count for r in chosen):
            raise InputError(f"--rows must name rows of the batch (0 to {count - 1}), found {chosen}")
        masked = accepts(side.model, "attention_mask")
        if padding is not None and not masked:
            raise InputError(f"{type(side.model).__name__} takes no attention_mask: a padded batch needs one (--padding)")
        cuts = list(rows_of(count, lengths, padding))
        batch_inputs = _batch_inputs(side.model, ids, cuts, masked)
        tolerance_ = Tolerance("fixed", fixed=float(tolerance))
        with side.running():
            in_batch = LiveSide("candidate", side.model, side.layout, label=label)
            whole = MemoryStore(in_batch.meta)
            run_model_code("candidate", in_batch.record, batch_inputs, whole, hold=None)
            found = []
            for row in chosen:
                cut = cuts[row]
                alone = _alone_inputs(side.model, ids[row : row + 1, : lengths[row]], masked)
                side.store = MemoryStore(side.meta)
                run_model_code("reference", side.record, alone, side.store, hold=None)
                cand = RowSide.of(in_batch, cut, whole, label=f"row {row} inside a batch of {count}")
                report = localize(side, cand, alone, Options(tolerance=tolerance_))
                found.append((row, report))
            shared = run_model_code(
                "reference", _capacities, side, [r for _, r in found], alone_tokens=min(lengths), batch_tokens=count * length
            )
    summed = _summed(found, count=count, lengths=lengths, padding=padding, tolerance=tolerance, model=label or str(model))
    if shared:
        summed.invariance["capacities"] = shared  # type: ignore[index]
        summed.notes[1:1] = [
            f"block {c['block']} ffn: its expert capacity ({c['module']}) is {c['alone']} for a row alone "
            f"({c['alone_tokens']} tokens) and {c['in_batch']} inside the batch ({c['batch_tokens']} tokens): which tokens "
            "it drops depends on the other rows"
            for c in shared
        ]
    return summed


def _capacities(side: LiveSide, reports: list[Report], *, alone_tokens: int, batch_tokens: int) -> list[dict[str, Any]]:
    """The MoE blocks whose ffn diverged on some row and whose expert capacity (the hook
    map's ``capacity``) depends on how many tokens the batch holds: what they drop then
    depends on the other rows."""
    diverged = {b.index for report in reports for b in report.blocks if "ffn" in b.subpaths and b.subpaths["ffn"].diverged}
    found = []
    for block in side.layout.blocks:
        path = (block.moe or {}).get("capacity")
        if block.index not in diverged or path is None:
            continue
        alone, in_batch = capacity_of(side, path, alone_tokens), capacity_of(side, path, batch_tokens)
        if alone is not None and in_batch is not None and alone != in_batch:
            found.append({
                "block": block.index, "module": path, "alone": alone, "in_batch": in_batch,
                "alone_tokens": alone_tokens, "batch_tokens": batch_tokens,
            })
    return found


def _tokens(side: LiveSide, tokens: Any, *, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The batch's token ids, as the side takes inputs (:meth:`~blockdiff.sides.live.LiveSide.inputs`:
    random ids within its vocabulary, or a token file's, checked against it)."""
    ids = side.inputs(tokens if tokens is not None else RandomTokens(batch=batch, seq=seq, seed=seed))[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise InputError("batch invariance needs token ids [batch, tokens]")
    return ids


def _lengths(count: int, length: int, padding: str | None) -> list[int]:
    """The first row all ``length`` tokens, the last half of them (padded batches)."""
    if padding is None:
        return [length] * count
    return [length - (row * (length // 2)) // (count - 1) for row in range(count)]


def _batch_inputs(model: nn.Module, ids: torch.Tensor, cuts: list[RowCut], masked: bool) -> Any:
    """The batch as a server runs it: each row's tokens at its real positions (pad id 0
    elsewhere), the attention mask and the position ids counted over the real tokens."""
    count, length = ids.shape
    padded = torch.zeros_like(ids)
    mask = torch.zeros(count, length, dtype=torch.long)
    for row, cut in enumerate(cuts):
        n = cut.real.stop - cut.real.start
        padded[row, cut.real] = ids[row, :n]
        mask[row, cut.real] = 1
    if not masked:
        return padded
    found: dict[str, torch.Tensor] = {"input_ids": padded, "attention_mask": mask}
    if accepts(model, "position_ids"):
        found["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return found


def _alone_inputs(model: nn.Module, ids: torch.Tensor, masked: bool) -> Any:
    """One row alone, given what a server gives it: its tokens, a mask of ones, its positions."""
    if not masked:
        return ids
    found: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if accepts(model, "position_ids"):
        found["position_ids"] = torch.arange(ids.shape[1])[None]
    return found


def _order(report: Report) -> float:
    """Where a report's first divergence is in execution order."""
    first = report.first_divergence
    return (first.check.order or 0) if first is not None else 0


def _summed(
    found: list[tuple[int, Report]], *, count: int, lengths: list[int], padding: str | None, tolerance: float, model: str
) -> Report:
    """One report for every row: the row whose first divergence comes first in execution
    order, with every row's first divergence and, per divergent site, its rows."""
    diverged = [(row, report) for row, report in found if report.first_divergence is not None]
    row, report = min(diverged, key=lambda pair: _order(pair[1])) if diverged else found[0]
    sites: dict[tuple[str, str], dict[str, Any]] = {}
    for r, each in found:
        for divergence in each.divergences:
            entry = sites.setdefault((divergence.where, divergence.module), {
                "where": divergence.where, "module": divergence.module, "what": divergence.check.what, "rows": [], "largest": 0.0,
            })
            entry["rows"].append(r)
            entry["largest"] = max(entry["largest"], float(divergence.check.measured))
    report.invariance = {
        "batch": count,
        "rows": [r for r, _ in found],
        "lengths": lengths,
        "padding": padding,
        "tolerance": tolerance,
        "row": row,
        "per_row": [
            {"row": r, "length": lengths[r], "first_divergence": None if each.first_divergence is None else each.first_divergence.to_dict()}
            for r, each in found
        ],
        "sites": list(sites.values()),
    }
    bound = "bit-exact (threshold 0)" if tolerance == 0 else f"within rel_l2 {tolerance:g}"
    report.reference["model"] = f"{model}, row {row} alone"
    notes: list[str] = [Note(
        "batch-invariance", f"batch invariance: each of rows {_ranges([r for r, _ in found])} run alone (the reference) against the same row "
        f"inside a batch of {count}{'' if padding is None else f' padded on the {padding}'} (the candidate), "
        f"{bound}; shown: row {row}" + (", whose divergence comes first" if diverged else "")
    )]
    for entry in sites.values():
        notes.append(
            Note("invariance-rows", f"{entry['where']} ({entry['module']}): differs on rows {_ranges(entry['rows'])} "
            f"(largest rel_l2 {entry['largest']:.3g})")
        )
    report.notes[:0] = notes
    return report


def _ranges(rows: list[int]) -> str:
    """``0-3, 5`` for rows 0, 1, 2, 3, 5."""
    spans: list[list[int]] = []
    for r in sorted(rows):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


__all__ = ["PADDING", "invariance"]
