"""Conversion diagnosis: when a divergent module's weights are the cause, say which and how.

A port loads the reference's weights through a conversion script, and most port bugs are
there: a weight taken from the wrong tensor, a matrix not transposed, rows permuted (the
q/k head interleave of a rotary conversion), a scale, a round trip through a lower
precision. When a module diverges, its parameters are paired with the reference
module's (:func:`paired_parameters`: by name, else by order among those of one shape),
and each that differs is explained where it can be (:func:`explain`) — in the report's
notes and on the check (``details["conversion"]``), and in the headline
(docs/cli.md, "Ports and converted weights"). Weights that are only the reference's rounded
through a lower precision (a checkpoint saved in bfloat16 run in float32) are precision, not
a mistake: they are said once for the whole report, in one note naming the dtype that
judges them as precision, and kept on each check apart (``details["rounded_through"]``).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .diskweights import held
from .report import Divergence, Note, Report
from .sides import Side


def _module(side: Side, path: str) -> nn.Module | None:
    found = side.attribute(path) if "." in path else None
    if found is None and hasattr(side, "module"):
        try:
            found = side.module(path)  # type: ignore[attr-defined]
        except AttributeError:
            return None
    return found if isinstance(found, nn.Module) else None


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and floating buffers (a rotary table's ``inv_freq``), by name;
    a Hugging Face ``Conv1D``'s weight (``[in, out]``) as ``nn.Linear`` holds it, transposed,
    so that a port's Linear compares with it as it should hold it."""
    found = dict(module.named_parameters())
    found.update({n: b for n, b in module.named_buffers() if b.is_floating_point() and n not in found})
    for rel, child in module.named_modules():
        if type(child).__name__ == "Conv1D" and isinstance(getattr(child, "weight", None), torch.Tensor):
            found[f"{rel}.weight" if rel else "weight"] = child.weight.detach().T
    return found


def paired_parameters(ref: nn.Module, cand: nn.Module) -> list[tuple[str, str]]:
    """(candidate name, reference name) for the candidate module's weights
    (:func:`weights`): the same name below the module where both have it, else the same
    place in the order of the weights of one shape (``w1, w3`` against ``gate_proj,
    up_proj``)."""
    ref_params = weights(ref)
    cand_params = weights(cand)
    pairs = [(name, name) for name in cand_params if name in ref_params and ref_params[name].shape == cand_params[name].shape]
    taken = {name for name, _ in pairs}
    for shape in {tuple(p.shape) for p in cand_params.values()}:
        mine = [n for n, p in cand_params.items() if tuple(p.shape) == shape and n not in taken]
        theirs = [n for n, p in ref_params.items() if tuple(p.shape) == shape and n not in taken]
        if len(mine) == len(theirs):  # else which goes with which is a guess (a fused wqkv beside q, k, v): none
            pairs += list(zip(mine, theirs))
    return pairs


def _plain(t: torch.Tensor) -> bool:
    """A floating tensor held as itself (a quantized or sharded weight's subclass is not
    compared: its elements are not its values; nor an offloaded weight's placeholder)."""
    data = t.data if isinstance(t, nn.Parameter) else t
    return type(data) is torch.Tensor and data.is_floating_point() and data.device.type != "meta"  # offloaded: not here


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, wherever each is (a CUDA candidate's weight against a CPU
    reference's: compared on ``a``'s device)."""
    return a.shape == b.shape and bool(torch.equal(a.float(), b.to(a.device).float()))


def explain(got: torch.Tensor, expected: torch.Tensor, others: dict[str, torch.Tensor]) -> str | None:
    """What ``got`` (a candidate weight) is instead of ``expected`` (the reference's),
    when it is one of: another reference parameter (``others``, by name), ``expected``
    transposed, its rows permuted, a scaled copy, a round trip through a lower precision;
    ``None`` when it is none of these (or is ``expected``). Compared in ``got``'s dtype:
    a candidate in bfloat16 holds the reference's weights rounded to it."""
    dtype = got.dtype
    as_got = lambda t: t.detach().to(dtype).float().cpu()  # noqa: E731
    lower = dtype in (torch.bfloat16, torch.float16)
    got, exact = got.detach().float().cpu(), expected.detach().float().cpu()
    expected = as_got(expected)
    if _same(got, expected):
        return None
    for name, other in others.items():
        if other.shape == got.shape and _same(got, as_got(other)):
            return f"equals the reference's {name}"
    if expected.dim() == 2 and expected.shape[0] == expected.shape[1] and _same(got, expected.T):
        return "is the reference's transposed"
    if expected.dim() == 2 and got.shape == expected.shape:
        order = _row_order(got, expected)
        if order is not None:
            return "is the reference's with its rows permuted " + _rotary_permutation(order)
    ratio = _scale(got, expected, rtol=1e-2 if lower else 1e-5)
    if ratio is not None:
        return f"is the reference's scaled by {ratio:.3g}"
    for low in () if lower else (torch.bfloat16, torch.float16):
        if _same(got, exact.to(low).float()):
            return f"is the reference's rounded through {str(low).removeprefix('torch.')}"
    return None


def _row_order(got: torch.Tensor, expected: torch.Tensor) -> list[int] | None:
    """The row of ``expected`` that each row of ``got`` is, when ``got`` is ``expected``
    with its rows permuted (not in order); else ``None``."""
    index = {tuple(row.tolist()): i for i, row in enumerate(expected)}
    order = [index.get(tuple(row.tolist())) for row in got]
    if None in order or sorted(order) != list(range(len(order))) or order == list(range(len(order))):
        return None
    return order  # type: ignore[return-value]


def _rotary_permutation(order: list[int]) -> str:
    """How rows in ``order`` are permuted, when it is the q/k permutation of a rotary
    conversion (per head of ``d`` rows, between the two rotary layouts: halves
    ``0..d/2-1 | d/2..d-1`` and interleaved pairs): the head size and the first rows;
    else only a hint that it may be one."""
    rows = len(order)
    for size in range(8, rows + 1, 2):  # a head of fewer rows: a guess, not a finding
        if rows % size:
            continue
        first = ", ".join(map(str, order[:4]))
        halves = torch.arange(rows).view(rows // size, 2, size // 2).transpose(1, 2).reshape(-1).tolist()
        if order == halves:  # rows 0, d/2, 1, d/2 + 1, ...: halves to pairs
            return (f"the way a rotary conversion permutes q and k: in each head of {size} rows, "
                    f"its two halves interleaved (rows {first}, ...)")
        pairs = torch.arange(rows).view(rows // size, size // 2, 2).transpose(1, 2).reshape(-1).tolist()
        if order == pairs:  # rows 0, 2, 4, ..., 1, 3, ...: pairs to halves
            return (f"the way a rotary conversion permutes q and k: in each head of {size} rows, "
                    f"its even rows, then its odd ones (rows {first}, ...)")
    return "(a q/k head interleave of a rotary conversion?)"


def _scale(got: torch.Tensor, expected: torch.Tensor, *, rtol: float) -> float | None:
    if got.shape != expected.shape or not expected.abs().sum():
        return None
    nonzero = expected != 0
    ratio = float((got[nonzero] / expected[nonzero]).median())
    if abs(ratio - 1.0) > rtol and torch.allclose(got, expected * ratio, rtol=rtol, atol=1e-8):
        return ratio
    return None


def fused_parts(
    got: torch.Tensor, ref_weights: dict[str, torch.Tensor], *, others: dict[str, torch.Tensor] | None = None
) -> str | None:
    """A fused weight (``wqkv``, ``w13``) against the reference's split ones: the
    consecutive 2-D weights of the reference module (in order) with ``got``'s input size
    whose rows add up to ``got``'s; a fused bias (1-D) likewise against the reference
    module's biases (``q_proj.bias``, ``k_proj.bias``, ``v_proj.bias``). ``None`` when they
    concatenate to ``got``, or when no such parts make it up in any order and none of them
    is in it (a weight that is not the fusion of those); else what ``got`` holds: those
    parts in another order, or which of them differs — and, with ``others`` (reference
    parameters by name, as for :func:`explain`), what each part that differs is instead
    (:func:`explain` on the part: its rows permuted, transposed, scaled, another weight)."""
    if got.dim() == 2:
        names = [n for n, w in ref_weights.items() if w.dim() == 2 and w.shape[1] == got.shape[1]]
    elif got.dim() == 1:
        names = [n for n, w in ref_weights.items() if w.dim() == 1 and n.rsplit(".", 1)[-1] == "bias"]
    else:
        return None
    dtype = got.dtype
    for start in range(len(names)):
        rows, window = 0, []
        for name in names[start:]:
            rows += ref_weights[name].shape[0]
            window.append(name)
            if rows >= got.shape[0]:
                break
        if rows != got.shape[0] or len(window) < 2:
            continue
        parts = [ref_weights[n].detach().to(dtype).float().cpu() for n in window]
        mine = got.detach().float().cpu()
        if _same(mine, torch.cat(parts)):
            return None
        if len(window) <= 4:
            for order in itertools.permutations(range(len(window))):
                if list(order) != list(range(len(window))) and _same(mine, torch.cat([parts[i] for i in order])):
                    held = ", ".join(window[i] for i in order)
                    return f"holds the reference's {held} in that order (expected {', '.join(window)})"
        offsets, wrong, whys = 0, [], {}
        for name, part in zip(window, parts):
            if not _same(mine[offsets:offsets + part.shape[0]], part):
                wrong.append(name)
                why = None if others is None else explain(got[offsets:offsets + part.shape[0]], ref_weights[name], others)
                if why is not None:
                    whys.setdefault(why, []).append(name)
            offsets += part.shape[0]
        # Some parts are the reference's, or each that is not is told what it is instead:
        # the fusion of these parts, some wrong.
        if len(wrong) < len(window) or sum(map(len, whys.values())) == len(wrong):
            found = f"differs from the reference's {', '.join(window)} concatenated, in the part of {', '.join(wrong)}"
            told = [
                f"its part of {held[0]} {why}" if len(held) == 1 else f"its parts of {', '.join(held)} each {why}"
                for why, held in whys.items()
            ]
            return found + (": " + "; ".join(told) if told else "")
    return None


ROUNDED = "is the reference's rounded through "


def diagnose(ref: Side, cand: Side, report: Report) -> None:
    """For each divergence in ``report`` on a module both sides hold live, its
    parameters against the reference's: each one that differs, and what it is instead
    where :func:`explain` can tell, on the check (``details["conversion"]``) and in the
    notes; weights only rounded through a lower precision, on the check
    (``details["rounded_through"]``: the dtype and the weights) and in one note for all."""
    if not (ref.live and cand.live) or ref.lockstep or cand.lockstep:
        return  # a sharded candidate's weights are shards: each rank would say something else
    ref_model, cand_model = _module(ref, ""), _module(cand, "")
    rounded: dict[str, dict[str, list[str]]] = {}  # dtype -> divergent module -> its weights rounded through it
    for divergence in report.divergences:
        if divergence.stage == "block" and divergence.subpath not in ("attention", "ffn", "norm"):
            continue  # the glue, the block as a whole, drift: no one module's weights
        ref_path = reference_path(ref, cand, divergence.stage, divergence.block, divergence.subpath, divergence.module)
        ref_module, cand_module = (_module(ref, ref_path) if ref_path else None), _module(cand, divergence.module)
        if ref_module is None or cand_module is None:
            continue
        with held(ref_model, ref_path or ""), held(cand_model, divergence.module):
            # Weights read from disk: those of the unit (block) holding the module, on each side.
            _diagnose(divergence, ref_path or "", ref_module, cand_module, ref_model, report, rounded)
    if rounded:
        report.notes.append(Note("rounded-weights", _rounded_note(rounded, cand.meta.get("dtype"))))


def _rounded_note(rounded: dict[str, dict[str, list[str]]], dtype: object) -> str:
    """The one note for every weight of the candidate that is the reference's rounded
    through a lower precision (``rounded``: by that dtype, the divergent modules and their
    weights), naming the option
    that judges it as precision: the candidate run in that dtype is the reference's code
    at that precision, which its noise floor measures."""
    parts = []
    for low, modules in rounded.items():
        names = [name for weights in modules.values() for name in weights]
        parts.append(
            f"the candidate's weights are the reference's rounded through {low} ({len(names)} "
            f"weight{'s' if len(names) != 1 else ''} of {len(modules)} divergent module{'s' if len(modules) != 1 else ''}), "
            f"and it runs in {dtype}: run it in {low} (--cand-dtype {low}) to judge that as precision"
        )
    return "; ".join(parts)


def _diagnose(
    divergence: Divergence, ref_path: str, ref_module: nn.Module, cand_module: nn.Module, ref_model: nn.Module | None,
    report: Report, rounded: dict[str, dict[str, list[str]]],
) -> None:
    """:func:`diagnose`'s work for one divergence, the weights of both modules in memory;
    weights only rounded are added to ``rounded`` (by dtype), not to the notes."""
    everything = {n: p for n, p in weights(ref_model).items() if _plain(p)} if ref_model is not None else {}
    found = []
    mine_rounded: dict[str, list[str]] = {}
    ref_params, cand_params = weights(ref_module), weights(cand_module)
    for mine, theirs in paired_parameters(ref_module, cand_module):
        got, expected = cand_params[mine], ref_params[theirs]
        if not (_plain(got) and _plain(expected)):
            continue
        if got.dtype != expected.dtype and _same(got, expected.to(got.dtype)):
            continue  # the reference's, in the candidate's dtype
        if _same(got, expected):
            continue
        why = explain(got, expected, {n: p for n, p in everything.items() if n != f"{ref_path}.{theirs}"})
        if why is not None and why.startswith(ROUNDED):
            low = why.removeprefix(ROUNDED)
            rounded.setdefault(low, {}).setdefault(divergence.module, []).append(f"{divergence.module}.{mine}")
            mine_rounded.setdefault(low, []).append(f"{divergence.module}.{mine}")
            continue
        found.append(f"{divergence.module}.{mine} differs from the reference's {ref_path}.{theirs}" + (f": it {why}" if why else ""))
    paired = {mine for mine, _ in paired_parameters(ref_module, cand_module)}
    for mine, got in cand_params.items():
        if mine not in paired and _plain(got):
            fused = fused_parts(got, {n: p for n, p in ref_params.items() if _plain(p)}, others=everything)
            if fused is not None:
                found.append(f"{divergence.module}.{mine} {fused}")
    if not found and not mine_rounded:
        return
    details = dict(divergence.check.details or {})
    if found:
        details["conversion"] = found
        report.notes.append(Note("conversion", f"{divergence.where}: its weights — " + "; ".join(found)))
    if mine_rounded:
        details["rounded_through"] = [{"dtype": low, "weights": names} for low, names in mine_rounded.items()]
    divergence.check.details = details


def reference_path(ref: Side, cand: Side, stage: str, block: int | None, subpath: str | None, module: str) -> str | None:
    """The reference module paired with the candidate's ``module``: the one at the same
    place of the reference's layout (stage; block, sub-path and ordinal)."""
    if stage != "block":
        mine = [path for s, path in cand.layout.outside if s == stage]
        theirs = [path for s, path in ref.layout.outside if s == stage]
    else:
        blocks = {b.index: b for b in cand.layout.blocks}, {b.index: b for b in ref.layout.blocks}
        if block not in blocks[0] or block not in blocks[1]:
            return None
        mine = blocks[0][block].subpaths.get(subpath or "", [])
        theirs = blocks[1][block].subpaths.get(subpath or "", [])
    if module not in mine:
        return None
    at = mine.index(module)
    return theirs[at] if at < len(theirs) else None


__all__ = ["diagnose", "explain", "paired_parameters", "reference_path", "weights"]
