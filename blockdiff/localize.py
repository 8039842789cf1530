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
    iter_tensors,
    map_structure,
    primary_tensor,
    replace_primary,
    snapshot,
    with_hidden,
)
from .moe import Decision, decision, router_checks
from .moe_stats import moe_block_stats
from .store import MemoryStore, SiteStore, release_freed_memory
from .tolerance import Tolerance, working_dtype
from .vocab import EXPERTS, OFFLINE_DRIFT, ROUTING_FLIPS


@dataclass
class Side:
    """One side of a diff: a live model (or none, for a stored dump), its layout and store."""

    name: str  # "reference" or "candidate"
    model: nn.Module | None
    layout: Layout | None
    store: SiteStore
    # Without a live model (a dump), the dtype and device it was captured with.
    captured_dtype: torch.dtype = torch.float32
    captured_device: torch.device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return model_device(self.model) if self.model is not None else self.captured_device

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model) if self.model is not None else self.captured_dtype

    def module(self, path: str) -> nn.Module:
        assert self.model is not None
        return self.model.get_submodule(path)


def _cast_like(tensor: torch.Tensor, like: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` in the dtype of ``like`` (the side's own recorded tensor)."""
    return _cast(tensor, like.dtype if like is not None else None, device)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``, cast to ``dtype`` when both are floating point.

    Always a copy: models change tensors they are handed in place (HF Falcon adds the
    attention output into the MLP output), which must never reach a recorded site.
    """
    if dtype is not None and tensor.is_floating_point() and dtype.is_floating_point:
        return tensor.to(device=device, dtype=dtype, copy=True)
    return tensor.to(device=device, copy=True)


def _aligned(label: str, what: str, ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """``cand`` in ``ref``'s shape when they differ only by leading size-1 dimensions
    (a rotary table of [seq, d] against [1, seq, d]); else a :class:`ShapeMismatchError`."""
    if tuple(ref.shape) == tuple(cand.shape):
        return cand
    if _squeeze_leading(ref.shape) == _squeeze_leading(cand.shape):
        return cand.reshape(ref.shape)
    _check_shapes(label, what, ref, cand)
    return cand


def _squeeze_leading(shape: torch.Size) -> tuple[int, ...]:
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)


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
        capacity_factors: the counterfactual capacity factors of dropless MoE statistics.
    """

    def __init__(
        self,
        reference: Side,
        candidate: Side,
        tolerance: Tolerance,
        *,
        fast_path: bool = False,
        capacity_factors: tuple[float, ...] = (1.0, 1.25),
    ) -> None:
        if candidate.model is None:
            raise PairingError("the candidate needs a live model for localization")
        self.ref = reference
        self.cand = candidate
        self.tolerance = tolerance
        self.fast_path = fast_path
        self.device = candidate.device
        self.dtype = working_dtype(reference.dtype, candidate.dtype)
        self.calibrate = tolerance.calibrated and reference.model is not None
        self.capacity_factors = tuple(capacity_factors)
        self.moe: list[dict[str, Any]] = []  # routing statistics, one entry per MoE block
        self.nonfinite = NonfiniteScan()

    # -- single-module experiments -------------------------------------------------------

    def _call(self, module: nn.Module, call: Site, hidden: dict[str, torch.Tensor] | None, *, cast: torch.dtype | None) -> Any:
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
        return module(*args, **kwargs)

    def _module_output(
        self, module: nn.Module, call: Site, hidden: dict[str, torch.Tensor] | None, *, cast: torch.dtype | None
    ) -> torch.Tensor:
        """The primary output tensor of :meth:`_call`."""
        out = primary_tensor(self._call(module, call, hidden, cast=cast))
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
        hidden = r.hidden_inputs()
        out = c.primary_output()
        if out is None or not same_bits(hidden, c.hidden_inputs()):
            out = self._module_output(self.cand.module(c.module), c, hidden, cast=None)
        out = _aligned(describe_key(c.key), "output", ref_out, out)
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
        frozen: dict[tuple[str, int], tuple[Site, Site]] | None,
        *,
        cast: torch.dtype | None,
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """Run ``block`` on ``hidden`` with the modules in ``frozen`` (keyed by (sub-path,
        ordinal)) not computed but answering with a recorded output: the first site's
        primary tensor in the structure and dtypes of the second (the running side's own
        recorded output), or for a router the whole routing decision. Returns the block
        output and the hidden input that reached each module of ``modules``.

        For this one call, every module of ``modules`` gets a pre-hook and its ``forward``
        is wrapped on the instance; both are undone in ``finally`` (an instance
        ``forward`` the module already had is put back).
        """
        reached: dict[tuple[str, int], torch.Tensor] = {}
        counters: dict[str, int] = {}
        current: dict[str, tuple[str, int]] = {}
        handles = []
        patched: list[tuple[nn.Module, Any]] = []
        missing = object()

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

        def frozen_forward(rel: str, original: Callable) -> Callable:
            def forward(*args: Any, **kwargs: Any) -> Any:
                key = current.get(rel)
                if frozen is None or key not in frozen:
                    return original(*args, **kwargs)
                recorded, template = frozen[key]
                own = for_replay(template.output, device=self.device, dtype=cast)
                if key[0] == "router":
                    return _replace_all(own, recorded.output, self.device)
                return replace_primary(own, _cast_like(recorded.primary_output(), primary_tensor(own), self.device))

            return forward

        try:
            named = dict(block.named_modules())
            for rel, subpath in modules.items():
                module = named[rel]
                handles.append(module.register_forward_pre_hook(pre(rel, subpath), with_kwargs=True))
                if frozen:
                    patched.append((module, module.__dict__.get("forward", missing)))
                    module.forward = frozen_forward(rel, module.forward)
            out = self._module_output(block, call, hidden, cast=cast)
        finally:
            for handle in handles:
                handle.remove()
            for module, previous in reversed(patched):
                if previous is missing:
                    del module.forward
                else:
                    module.forward = previous
        return out, reached

    def _block_checks(
        self,
        r_layout: BlockLayout,
        c_layout: BlockLayout,
        r_block: Site,
        c_block: Site,
        r_sites: dict[tuple, Site],
        c_sites: dict[tuple, Site],
        routers: dict[tuple[str, int], tuple[Site, Site]],
        *,
        frozen: bool,
    ) -> list[Check]:
        """The residual experiment (``frozen``) or the block-level one (nothing frozen but
        MoE routing, fixed at the reference's so that precision flips stay out of it)."""
        target = "residual" if frozen else "block"
        ref_in, ref_out = r_block.hidden_inputs(), r_block.primary_output()
        if "primary" not in ref_in or ref_out is None:
            raise PairingError(f"{r_block.label}: no hidden input or output recorded")
        frozen_c = dict(routers)  # (reference site, candidate site): the candidate's run
        if frozen:
            frozen_c.update({(s.subpath, s.ordinal): (s, c_sites[key]) for key, s in r_sites.items()})
        if not frozen_c and c_block.primary_output() is not None and same_bits(ref_in, c_block.hidden_inputs()):
            out, reached = c_block.primary_output(), {}  # the candidate's own call was this call
        else:
            out, reached = self._run_block(
                self.cand.module(c_block.module), c_block, ref_in, _relative(c_layout), frozen_c, cast=None
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
            frozen_f = {key: (r, r) for key, (r, _) in frozen_c.items()}  # the reference's own copy
            f_out, f_reached = self._run_block(ref_block, r_block, None, _relative(r_layout), frozen_f, cast=self.dtype)
            del ref_block
            for i, (_, _, expected, _, at) in enumerate(compared):
                got = f_out if at is None else f_reached.get(at)
                if got is not None:
                    floors[i] = metrics(expected, got, dtype=self.dtype).rel_l2
        checks = []
        for (what, module, expected, got, _), floor in zip(compared, floors):
            got = _aligned(label, what, expected, got)
            checks.append(
                Check(what, module, metrics(expected, got, dtype=self.dtype), self.tolerance.threshold(target, self.dtype, floor))
            )
        return checks

    # -- MoE blocks ------------------------------------------------------------------------

    def _decision(self, side: Side, layout: BlockLayout, router: Site, output: Any = None) -> Decision:
        assert layout.moe is not None
        output = router.output if output is None else output
        routing = decision(output, layout.moe["format"], what=router.label)
        capacity = _capacity(side, layout.moe.get("capacity"), routing.routing.logits.shape[0])
        routing.routing.capacity = capacity
        return routing

    def _moe_checks(self, r_ffn: Site, c_ffn: Site, r_router: Site, c_router: Site, r_layout: BlockLayout, c_layout: BlockLayout) -> list[Check]:
        """An MoE ffn judged as router (logits, weights where top-k agree, flips by margin)
        and experts (the candidate MoE with routing frozen at the reference's)."""
        ref = self._decision(self.ref, r_layout, r_router)
        out = self._call(self.cand.module(c_router.module), c_router, r_router.hidden_inputs(), cast=None)
        cand = self._decision(self.cand, c_layout, c_router, snapshot(out))
        floor = None
        if self.calibrate:
            copy_ = self._floor_module(self.ref.module(r_router.module))
            floor = self._decision(self.ref, r_layout, r_router, snapshot(self._call(copy_, r_router, None, cast=self.dtype)))
        checks = router_checks(ref, cand, floor, module=c_router.module, tolerance=self.tolerance, dtype=self.dtype)

        ref_out = r_ffn.primary_output()
        assert ref_out is not None
        c_rel = c_router.module[len(c_ffn.module) + 1 :]
        routing = {("router", 0): (r_router, c_router)}
        out, _ = self._run_block(self.cand.module(c_ffn.module), c_ffn, r_ffn.hidden_inputs(), {c_rel: "router"}, routing, cast=None)
        _check_shapes(describe_key(c_ffn.key), "output", ref_out, out)
        experts_floor = None
        if self.calibrate:
            copy_ = self._floor_module(self.ref.module(r_ffn.module))
            r_rel = r_router.module[len(r_ffn.module) + 1 :]
            f_out, _ = self._run_block(copy_, r_ffn, None, {r_rel: "router"}, {("router", 0): (r_router, r_router)}, cast=self.dtype)
            experts_floor = metrics(ref_out, f_out, dtype=self.dtype).rel_l2
        checks.append(
            Check(
                EXPERTS,
                c_ffn.module,
                metrics(ref_out, out, dtype=self.dtype),
                self.tolerance.threshold("ffn", self.dtype, experts_floor),
            )
        )
        return checks

    def _moe_statistics(
        self,
        index: int,
        r_routers: dict[tuple, Site],
        c_routers: dict[tuple, Site],
        r_layout: BlockLayout,
        c_layout: BlockLayout,
        ffn: SubpathResult | None,
    ) -> dict[str, Any]:
        """Routing statistics of one MoE block: both free-running sides and their agreement."""
        key = min(r_routers, key=lambda k: k[3])
        ref = self._decision(self.ref, r_layout, r_routers[key])
        cand = self._decision(self.cand, c_layout, c_routers[key])
        stats = moe_block_stats(ref.routing, cand.routing, capacity_factors=self.capacity_factors)
        local = None
        if ffn is not None:
            flips = next((c for c in ffn.checks if c.what == ROUTING_FLIPS), None)
            local = None if flips is None else flips.details
        return {
            "block": index,
            "router": c_routers[key].module,
            "format": c_layout.moe["format"] if c_layout.moe else None,
            **stats,
            "local_flips": local,
        }

    # -- per stage and per block ----------------------------------------------------------

    def stages(self) -> Iterator[StageResult]:
        """Local errors and drift of the sites outside blocks (embed, context, final norm, head)."""
        ref_sites = {s.key: s for s in self.ref.store.outside_sites()}
        cand_sites = {s.key: s for s in self.cand.store.outside_sites()}
        _check_paired(ref_sites, cand_sites)
        for key, r in sorted(ref_sites.items(), key=lambda kv: kv[1].order):
            c = cand_sites[key]
            self.nonfinite.see(r, c)
            check = self._module_check(r.stage, r, c)
            yield StageResult(r.stage, c.module, check, _drift(r, c, self.dtype), order=r.order)

    def blocks(self) -> Iterator[BlockResult]:
        """One :class:`BlockResult` per block, in order; reads one block's sites at a time."""
        ref_blocks = self.ref.store.block_indices()
        check_block_counts(len(ref_blocks), len(self.cand.store.block_indices()))
        streamed = not (isinstance(self.ref.store, MemoryStore) and isinstance(self.cand.store, MemoryStore))
        for index in ref_blocks:
            yield self.block(index)
            if streamed:
                release_freed_memory()

    def block(self, index: int) -> BlockResult:
        r_all = {s.key: s for s in self.ref.store.block_sites(index)}
        c_all = {s.key: s for s in self.cand.store.block_sites(index)}
        block_key = ("block", index, None, 0)
        if block_key not in r_all or block_key not in c_all:
            raise PairingError(f"block {index}: the block's own call was not recorded on both sides")
        for key in r_all.keys() & c_all.keys():
            self.nonfinite.see(r_all[key], c_all[key])
        r_block, c_block = r_all.pop(block_key), c_all.pop(block_key)
        r_routers = {k: r_all.pop(k) for k in [k for k, s in r_all.items() if s.subpath == "router"]}
        c_routers = {k: c_all.pop(k) for k in [k for k, s in c_all.items() if s.subpath == "router"]}
        r_layout = _layout_block(self.ref.layout, index)
        c_layout = _layout_block(self.cand.layout, index)
        _check_paired(r_all, c_all)
        moe = r_layout is not None and c_layout is not None and r_layout.moe is not None and c_layout.moe is not None
        if moe:
            _check_paired(r_routers, c_routers)
        frozen_routing = {("router", k[3]): (r_routers[k], c_routers[k]) for k in r_routers} if moe else {}
        block_check = None
        if c_layout is not None:
            (block_check,) = self._block_checks(
                r_layout, c_layout, r_block, c_block, r_all, c_all, frozen_routing, frozen=False
            )
        # The whole-block experiment runs with routing frozen, so it cannot clear a router:
        # MoE blocks always get their sub-path experiments.
        skip = self.fast_path and not moe and block_check is not None and not block_check.diverged
        subpaths: dict[str, SubpathResult] = {}
        for key, r in sorted(r_all.items(), key=lambda kv: kv[1].order):
            result = subpaths.setdefault(r.subpath, SubpathResult("not_needed" if skip else "checked", order=r.order))
            if skip:
                continue
            router_key = ("block", index, "router", r.ordinal)
            if moe and r.subpath == "ffn" and router_key in r_routers:
                result.checks.extend(
                    self._moe_checks(r, c_all[key], r_routers[router_key], c_routers[router_key], r_layout, c_layout)
                )
            else:
                result.checks.append(self._module_check(r.subpath, r, c_all[key]))
        last = max((s.order for s in r_all.values()), default=r_block.order)
        residual = SubpathResult("not_needed" if skip else "checked", order=last + 0.5)
        if not skip and c_layout is not None and r_layout is not None:
            residual.checks = self._block_checks(
                r_layout, c_layout, r_block, c_block, r_all, c_all, frozen_routing, frozen=True
            )
        if moe:
            self.moe.append(self._moe_statistics(index, r_routers, c_routers, r_layout, c_layout, subpaths.get("ffn")))
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


def _replace_all(output: Any, recorded: Any, device: torch.device) -> Any:
    """``recorded`` in place of ``output``, each floating tensor cast to the dtype of the
    tensor it replaces (a router's whole decision: logits, weights, indices)."""
    own = list(iter_tensors(output))
    position = iter(range(len(own) + 1))

    def cast(t: torch.Tensor) -> torch.Tensor:
        i = next(position)
        return _cast_like(t, own[i] if i < len(own) else None, device)

    return for_replay(map_structure(recorded, cast), device=device)


def _capacity(side: Side, path: str | None, tokens: int) -> int | None:
    """An MoE's own expert capacity: the attribute ``path`` names (an int, or a callable
    taking the token count), or ``None`` for dropless models."""
    if path is None or side.model is None:
        return None
    owner, _, attr = path.rpartition(".")
    value = getattr(side.model.get_submodule(owner), attr, None)
    if callable(value):
        value = value(tokens)
    return None if value is None else int(value)


def check_block_counts(reference: int, candidate: int) -> None:
    if reference != candidate:
        raise PairingError(
            f"the reference has {reference} blocks and the candidate {candidate}; "
            "blockdiff compares models with the same number of blocks"
        )


def _check_paired(reference: dict[tuple, Site], candidate: dict[tuple, Site]) -> None:
    unpaired = sorted(set(reference) ^ set(candidate), key=str)
    if unpaired:
        side = "candidate" if unpaired[0] in reference else "reference"
        raise PairingError(
            f"{describe_key(unpaired[0])}: recorded on one side only (missing in the {side}); "
            "the two models have different anatomy, or a hook map is wrong (`blockdiff arch`)"
        )


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two sets of activations are the same bit for bit: names, dtypes, shapes,
    devices and every bit (NaN payloads and signed zeros included).

    A module experiment feeds the candidate's module the reference's activations with the
    candidate's own other arguments. When those activations are the ones the candidate's
    module received in its own forward, the experiment is that call again, and its
    recorded output is the answer: until the first difference (a same-dtype port, a fused
    kernel in one place) no module is run a second time.
    """
    if not a or a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device or x.is_complex():
            return False
        if x.is_floating_point():
            if x.element_size() not in _SAME_SIZE_INTS:
                return False
            ints = _SAME_SIZE_INTS[x.element_size()]
            x, y = x.view(ints), y.view(ints)
        if not torch.equal(x, y):
            return False
    return True


def _layout_block(layout: Layout | None, index: int) -> BlockLayout | None:
    if layout is None:
        return None
    return layout.blocks[index] if index < len(layout.blocks) else None


def _relative(layout: BlockLayout) -> dict[str, str]:
    """Sub-path module paths (and an MoE router's) relative to the block → sub-path."""
    prefix = layout.path + "."
    found = {path[len(prefix):]: subpath for subpath, paths in layout.subpaths.items() for path in paths}
    if layout.moe is not None:
        found[layout.moe["router"][len(prefix):]] = "router"
    return found


def _drift(r: Site, c: Site, dtype: torch.dtype) -> Metrics | None:
    ref_out, cand_out = r.primary_output(), c.primary_output()
    if ref_out is None or cand_out is None:
        return None
    return metrics(ref_out, _aligned(describe_key(c.key), "output", ref_out, cand_out), dtype=dtype)


def offline_drift(
    reference: SiteStore, candidate: SiteStore, tolerance: Tolerance, dtype: torch.dtype, nonfinite: NonfiniteScan
) -> tuple[list[StageResult], list[BlockResult]]:
    """Two stored captures and no live model: every site judged on its drift alone.

    Each sub-path's checks are ``drift`` checks (free-running candidate output against the
    reference's), so the first divergence is where the error first *shows*, which may be
    downstream of where it starts; replay against a live candidate tells them apart.
    """

    def check(target: str, r: Site, c: Site) -> Check | None:
        nonfinite.see(r, c)
        drift = _drift(r, c, dtype)
        if drift is None:
            return None
        return Check(OFFLINE_DRIFT, c.module, drift, tolerance.threshold(target, dtype, None))

    ref_out = {s.key: s for s in reference.outside_sites()}
    cand_out = {s.key: s for s in candidate.outside_sites()}
    _check_paired(ref_out, cand_out)
    stages = []
    for key, r in sorted(ref_out.items(), key=lambda kv: kv[1].order):
        c = cand_out[key]
        stages.append(StageResult(r.stage, c.module, check(r.stage, r, c), _drift(r, c, dtype), order=r.order))
    blocks = []
    for index in reference.block_indices():
        r_all = {s.key: s for s in reference.block_sites(index)}
        c_all = {s.key: s for s in candidate.block_sites(index)}
        _check_paired(r_all, c_all)
        r_block, c_block = r_all.pop(("block", index, None, 0)), c_all.pop(("block", index, None, 0))
        subpaths: dict[str, SubpathResult] = {}
        for key, r in sorted(r_all.items(), key=lambda kv: kv[1].order):
            name = "ffn" if r.subpath == "router" else r.subpath
            result = subpaths.setdefault(name, SubpathResult("drift_only", order=r.order))
            found = check(name, r, c_all[key])
            if found is not None:
                result.checks.append(found)
        block_check = check("block", r_block, c_block)
        blocks.append(
            BlockResult(index, c_block.module, "", subpaths, block_check, _drift(r_block, c_block, dtype), order=r_block.order)
        )
    return stages, blocks


def _nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf ``t`` holds; one float64 sum when there are none."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum(dtype=torch.float64))):
        return 0
    return int((~torch.isfinite(t)).sum())


class NonfiniteScan:
    """Where NaN/Inf first appear, found while localization reads each pair of sites (no
    second pass over the activations).

    ``result()["candidate"]``: the first site, in the order outputs are produced, whose
    free-running candidate output holds non-finite values that the reference's does not;
    ``result()["reference"]``: the first whose reference output already holds some (the
    inputs or the trusted model are broken; comparisons there use the finite elements).
    """

    def __init__(self) -> None:
        self._found: dict[str, tuple[tuple, dict[str, Any]]] = {}

    def see(self, r: Site, c: Site) -> None:
        ro, co = r.primary_output(), c.primary_output()
        if ro is None or co is None:
            return
        bad_r, bad_c = _nonfinite(ro), _nonfinite(co)
        if not bad_r and bad_c == bad_r:
            return
        where = {"site": describe_key(c.key), "module": c.module, "nonfinite_cand": bad_c, "nonfinite_ref": bad_r}
        # Outputs are produced embed and context first, then per block its modules before
        # the block itself, then the final norm and the head.
        if r.block is not None:
            position: tuple = (1, r.block, r.subpath is None, r.order)
        else:
            position = (0 if r.stage in ("embed", "context") else 2, 0, False, r.order)
        if bad_r:
            self._keep("reference", position, {**where, "module": r.module})
        if bad_c != bad_r:
            self._keep("candidate", position, where)

    def _keep(self, role: str, position: tuple, where: dict[str, Any]) -> None:
        if role not in self._found or position < self._found[role][0]:
            self._found[role] = (position, where)

    def result(self) -> dict[str, dict[str, Any]]:
        return {role: where for role, (_, where) in self._found.items()}


__all__ = ["Side", "Localizer", "NonfiniteScan", "offline_drift", "MODULE_SUBPATHS"]
