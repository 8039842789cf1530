"""Localize: freeze three sub-paths at the reference, swap in the candidate's fourth.

Works block by block from two site stores (DESIGN.md, "The localization procedure"):

- **module sub-paths** (attention, ffn, each norm) and the stages outside blocks: the
  candidate's module is called with its own recorded call, the hidden state replaced by
  the reference's; its output is compared with the reference's output;
- **residual**: the candidate's whole block runs on the reference block input with every
  sub-path module's output replaced by the reference's; the block output and the input
  reaching each frozen module are compared with the reference's;
- **block**: the candidate block on the reference input with nothing frozen. When it
  diverges and no sub-path does, the block is reported ``unattributed``;
- **drift**: the free-running candidate against the reference at each site.

Under the calibrated policy, the same experiments run on a copy of the *reference's*
module in the candidate's dtype and device give each check its noise floor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .compare import Metrics, metrics
from .errors import PairingError, ShapeMismatchError
from .hookmap import BlockLayout, Layout
from .inputs import model_device, model_dtype
from .report import BlockResult, Check, StageResult, SubpathResult
from .site import (
    MODULE_SUBPATHS,
    Site,
    describe_key,
    for_replay,
    hidden_location,
    primary_tensor,
    replace_primary,
    with_hidden,
)
from .store import SiteStore
from .tolerance import Tolerance, working_dtype


@dataclass
class Side:
    """One side of a diff: a live model (or none, for a stored dump), its layout and store."""

    name: str  # "reference" or "candidate"
    model: nn.Module | None
    layout: Layout | None
    store: SiteStore

    @property
    def device(self) -> torch.device:
        return model_device(self.model) if self.model is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model) if self.model is not None else torch.float32

    def module(self, path: str) -> nn.Module:
        assert self.model is not None
        return self.model.get_submodule(path)


def _cast_like(tensor: torch.Tensor, like: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` in the dtype of ``like`` (the side's own recorded tensor)."""
    return _cast(tensor, like.dtype if like is not None else None, device)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; cast to ``dtype`` when both are floating point."""
    if dtype is not None and tensor.is_floating_point() and dtype.is_floating_point:
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def _check_shapes(label: str, what: str, ref: torch.Tensor, cand: torch.Tensor) -> None:
    if tuple(ref.shape) != tuple(cand.shape):
        raise ShapeMismatchError(
            f"{label} {what}: candidate has shape {list(cand.shape)}, reference {list(ref.shape)}",
            site=label,
            reference=tuple(ref.shape),
            candidate=tuple(cand.shape),
        )


class Localizer:
    """Runs the experiments of one diff. Build it, then iterate :meth:`stages` / :meth:`blocks`.

    Args:
        reference, candidate: the two sides. The candidate needs a live model; the
            reference needs one for calibrated floors.
        tolerance: the judging policy, already resolved (see :meth:`Tolerance.resolved`).
        fast_path: skip a block's sub-path experiments when the block-level local error is
            within tolerance (they are reported as ``not_needed``).
    """

    def __init__(self, reference: Side, candidate: Side, tolerance: Tolerance, *, fast_path: bool = False) -> None:
        if candidate.model is None:
            raise PairingError("the candidate needs a live model for localization")
        self.ref = reference
        self.cand = candidate
        self.tolerance = tolerance
        self.fast_path = fast_path
        self.device = candidate.device
        self.dtype = working_dtype(reference.dtype, candidate.dtype)
        self.calibrate = tolerance.calibrated and reference.model is not None

    # -- single-module experiments -------------------------------------------------------

    def _module_output(
        self, module: nn.Module, call: Site, hidden: dict[str, torch.Tensor] | None, *, cast: torch.dtype | None
    ) -> torch.Tensor:
        """``module`` called with ``call``'s arguments, floating ones cast to ``cast`` if
        given, and its activations replaced by ``hidden`` (in the call's own dtypes)."""
        args = for_replay(call.args, device=self.device, dtype=cast)
        kwargs = for_replay(call.kwargs, device=self.device, dtype=cast)
        if hidden:
            own = call.hidden_inputs()
            hidden = {
                role: _cast(t, cast if cast is not None else (own[role].dtype if role in own else None), self.device)
                for role, t in hidden.items()
            }
            args, kwargs = with_hidden(args, kwargs, hidden)
        out = primary_tensor(module(*args, **kwargs))
        if out is None:
            raise PairingError(f"{call.label}: the module returned no tensor")
        return out

    def _floor_module(self, module: nn.Module) -> nn.Module:
        """A copy of a reference module in the working dtype, on the candidate's device."""
        return copy.deepcopy(module).to(device=self.device, dtype=self.dtype)

    def _module_check(self, target: str, r: Site, c: Site) -> Check:
        ref_out = r.primary_output()
        if ref_out is None:
            raise PairingError(f"{r.label}: the reference recorded no output tensor")
        out = self._module_output(self.cand.module(c.module), c, r.hidden_inputs(), cast=None)
        _check_shapes(describe_key(c.key), "output", ref_out, out)
        floor = None
        if self.calibrate:
            ref_copy = self._floor_module(self.ref.module(r.module))
            floor = metrics(ref_out, self._module_output(ref_copy, r, None, cast=self.dtype), dtype=self.dtype).rel_l2
            del ref_copy
        return Check(
            "output",
            c.module,
            metrics(ref_out, out, dtype=self.dtype),
            self.tolerance.threshold(target, self.dtype, floor),
        )

    # -- whole-block experiments -----------------------------------------------------------

    def _run_block(
        self,
        block: nn.Module,
        call: Site,
        hidden: dict[str, torch.Tensor] | None,
        modules: dict[str, str],
        frozen: dict[tuple[str, int], torch.Tensor] | None,
        *,
        cast: torch.dtype | None,
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """Run ``block`` on ``hidden``; with ``frozen``, every sub-path module's output is
        replaced by the given tensor. Returns the block output and the hidden input that
        reached each sub-path module, keyed by (sub-path, ordinal).

        The hooks below are added to the block's modules for this one call and removed in
        ``finally``; the replacing hook keeps the module's tuple structure.
        """
        reached: dict[tuple[str, int], torch.Tensor] = {}
        counters: dict[str, int] = {}
        current: dict[str, tuple[str, int]] = {}
        handles = []

        def pre(rel: str, subpath: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                ordinal = counters.get(subpath, 0)
                counters[subpath] = ordinal + 1
                current[rel] = (subpath, ordinal)
                loc = hidden_location(args, kwargs)
                if loc is not None:
                    tensor = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
                    reached[(subpath, ordinal)] = tensor.detach().clone()
                return None

            return hook

        def post(rel: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
                key = current.pop(rel)
                if frozen is None or key not in frozen:
                    return None
                own = primary_tensor(output)
                return replace_primary(output, _cast_like(frozen[key], own, self.device))

            return hook

        try:
            named = dict(block.named_modules())
            for rel, subpath in modules.items():
                handles.append(named[rel].register_forward_pre_hook(pre(rel, subpath), with_kwargs=True))
                handles.append(named[rel].register_forward_hook(post(rel), with_kwargs=True))
            out = self._module_output(block, call, hidden, cast=cast)
        finally:
            for handle in handles:
                handle.remove()
        return out, reached

    def _block_checks(
        self,
        r_layout: BlockLayout,
        c_layout: BlockLayout,
        r_block: Site,
        c_block: Site,
        r_sites: dict[tuple, Site],
        c_sites: dict[tuple, Site],
        *,
        frozen: bool,
    ) -> list[Check]:
        """The residual experiment (``frozen``) or the block-level one (nothing frozen)."""
        target = "residual" if frozen else "block"
        ref_in, ref_out = r_block.hidden_inputs(), r_block.primary_output()
        if "primary" not in ref_in or ref_out is None:
            raise PairingError(f"{r_block.label}: no hidden input or output recorded")
        frozen_r = {(s.subpath, s.ordinal): s.primary_output() for s in r_sites.values()} if frozen else None
        out, reached = self._run_block(
            self.cand.module(c_block.module), c_block, ref_in, _relative(c_layout), frozen_r, cast=None
        )
        label = describe_key(c_block.key)
        _check_shapes(label, "output", ref_out, out)
        # (what, module, reference tensor, candidate tensor, (sub-path, ordinal) or None)
        compared: list[tuple[str, str, torch.Tensor, torch.Tensor, tuple | None]] = [
            ("block output", c_block.module, ref_out, out, None)
        ]
        if frozen:
            for key, site in sorted(r_sites.items(), key=lambda kv: kv[1].order):
                expected, at = site.hidden_input(), (site.subpath, site.ordinal)
                if expected is not None and at in reached:
                    module = c_sites[key].module
                    compared.append((f"input of {module}", module, expected, reached[at], at))
        floors: list[float | None] = [None] * len(compared)
        if self.calibrate:
            ref_block = self._floor_module(self.ref.module(r_block.module))
            f_out, f_reached = self._run_block(ref_block, r_block, None, _relative(r_layout), frozen_r, cast=self.dtype)
            del ref_block
            for i, (_, _, expected, _, at) in enumerate(compared):
                got = f_out if at is None else f_reached.get(at)
                if got is not None:
                    floors[i] = metrics(expected, got, dtype=self.dtype).rel_l2
        checks = []
        for (what, module, expected, got, _), floor in zip(compared, floors):
            _check_shapes(label, what, expected, got)
            checks.append(
                Check(what, module, metrics(expected, got, dtype=self.dtype), self.tolerance.threshold(target, self.dtype, floor))
            )
        return checks

    # -- per stage and per block ----------------------------------------------------------

    def stages(self) -> Iterator[StageResult]:
        """Local errors and drift of the sites outside blocks (embed, context, final norm, head)."""
        ref_sites = {s.key: s for s in self.ref.store.outside_sites()}
        cand_sites = {s.key: s for s in self.cand.store.outside_sites()}
        _check_paired(ref_sites, cand_sites)
        for key, r in sorted(ref_sites.items(), key=lambda kv: kv[1].order):
            c = cand_sites[key]
            check = self._module_check(r.stage, r, c)
            yield StageResult(r.stage, c.module, check, _drift(r, c, self.dtype), order=r.order)

    def blocks(self) -> Iterator[BlockResult]:
        """One :class:`BlockResult` per block, in order; reads one block's sites at a time."""
        ref_blocks = self.ref.store.block_indices()
        cand_blocks = self.cand.store.block_indices()
        if len(ref_blocks) != len(cand_blocks):
            raise PairingError(
                f"the reference has {len(ref_blocks)} blocks and the candidate {len(cand_blocks)}; "
                "blockdiff compares models with the same number of blocks"
            )
        for index in ref_blocks:
            yield self.block(index)

    def block(self, index: int) -> BlockResult:
        r_all = {s.key: s for s in self.ref.store.block_sites(index)}
        c_all = {s.key: s for s in self.cand.store.block_sites(index)}
        block_key = ("block", index, None, 0)
        if block_key not in r_all or block_key not in c_all:
            raise PairingError(f"block {index}: the block's own call was not recorded on both sides")
        r_block, c_block = r_all.pop(block_key), c_all.pop(block_key)
        r_layout = _layout_block(self.ref.layout, index)
        c_layout = _layout_block(self.cand.layout, index)
        _check_paired(r_all, c_all)
        block_check = None
        if c_layout is not None:
            (block_check,) = self._block_checks(r_layout, c_layout, r_block, c_block, r_all, c_all, frozen=False)
        skip = self.fast_path and block_check is not None and not block_check.diverged
        subpaths: dict[str, SubpathResult] = {}
        for key, r in sorted(r_all.items(), key=lambda kv: kv[1].order):
            result = subpaths.setdefault(r.subpath, SubpathResult("not_needed" if skip else "checked", order=r.order))
            if not skip:
                result.checks.append(self._module_check(r.subpath, r, c_all[key]))
        last = max((s.order for s in r_all.values()), default=r_block.order)
        residual = SubpathResult("not_needed" if skip else "checked", order=last + 0.5)
        if not skip and c_layout is not None and r_layout is not None:
            residual.checks = self._block_checks(r_layout, c_layout, r_block, c_block, r_all, c_all, frozen=True)
        subpaths["residual"] = residual
        return BlockResult(
            index=index,
            module=c_block.module,
            stack=c_layout.stack if c_layout else "",
            subpaths=subpaths,
            block=block_check,
            drift=_drift(r_block, c_block, self.dtype),
            order=r_block.order,
            unmapped=list(c_layout.unmapped) if c_layout else [],
        )


def _check_paired(reference: dict[tuple, Site], candidate: dict[tuple, Site]) -> None:
    unpaired = sorted(set(reference) ^ set(candidate), key=str)
    if unpaired:
        side = "candidate" if unpaired[0] in reference else "reference"
        raise PairingError(
            f"{describe_key(unpaired[0])}: recorded on one side only (missing in the {side}); "
            "the two models have different anatomy, or a hook map is wrong (`blockdiff arch`)"
        )


def _layout_block(layout: Layout | None, index: int) -> BlockLayout | None:
    if layout is None:
        return None
    return layout.blocks[index] if index < len(layout.blocks) else None


def _relative(layout: BlockLayout) -> dict[str, str]:
    """Sub-path module paths relative to the block → sub-path."""
    prefix = layout.path + "."
    return {path[len(prefix):]: subpath for subpath, paths in layout.subpaths.items() for path in paths}


def _drift(r: Site, c: Site, dtype: torch.dtype) -> Metrics | None:
    ref_out, cand_out = r.primary_output(), c.primary_output()
    if ref_out is None or cand_out is None:
        return None
    _check_shapes(describe_key(c.key), "output", ref_out, cand_out)
    return metrics(ref_out, cand_out, dtype=dtype)


def iter_paired(reference: SiteStore, candidate: SiteStore) -> Iterator[tuple[Site, Site]]:
    """Every pair of sites with the same key, in the order their outputs are produced:
    embed and context, then per block its sub-path sites and the block itself, then the
    final norm and head."""
    c_out = {s.key: s for s in candidate.outside_sites()}
    outside = [r for r in reference.outside_sites() if r.key in c_out]
    for r in outside:
        if r.stage in ("embed", "context"):
            yield r, c_out[r.key]
    for index in reference.block_indices():
        c_block = {s.key: s for s in candidate.block_sites(index)}
        sites = [r for r in reference.block_sites(index) if r.key in c_block]
        for r in sorted(sites, key=lambda s: (s.subpath is None, s.order)):
            yield r, c_block[r.key]
    for r in outside:
        if r.stage not in ("embed", "context"):
            yield r, c_out[r.key]


def first_nonfinite(reference: SiteStore, candidate: SiteStore) -> dict[str, Any] | None:
    """The first site (execution order) whose free-running candidate output holds NaN/Inf
    that the reference's does not, with the counts."""
    for r, c in iter_paired(reference, candidate):
        ro, co = r.primary_output(), c.primary_output()
        if ro is None or co is None or not co.is_floating_point():
            continue
        bad_c = int((~torch.isfinite(co)).sum())
        bad_r = int((~torch.isfinite(ro)).sum()) if ro.is_floating_point() else 0
        if bad_c != bad_r:
            return {
                "site": describe_key(c.key),
                "module": c.module,
                "nonfinite_cand": bad_c,
                "nonfinite_ref": bad_r,
            }
    return None


__all__ = ["Side", "Localizer", "first_nonfinite", "iter_paired", "MODULE_SUBPATHS"]
