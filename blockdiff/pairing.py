"""Pairing: which reference site goes with which candidate site.

Sites pair by :class:`~blockdiff.site.SiteKey` — (stage, block, sub-path, ordinal) — not
by module path, which may differ between two codebases. A block's sites are read from
both stores at once (:func:`pair_block`), so localization holds one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from .errors import PairingError
from .hookmap import BlockLayout, Layout
from .site import Site, SiteKey, describe_key
from .store import SiteStore
from .vocab import BEFORE_BLOCKS
from .report import Note


def check_block_counts(reference: int, candidate: int) -> None:
    if reference != candidate:
        raise PairingError(
            f"the reference has {reference} blocks and the candidate {candidate}; "
            "blockdiff compares models with the same number of blocks"
        )


def check_paired(
    reference: dict[SiteKey, Site], candidate: dict[SiteKey, Site], layouts: tuple[Layout | None, Layout | None] = (None, None)
) -> None:
    """Every key on both sides, or a :class:`PairingError` naming the first that is not:
    the side it is missing on, the module that recorded it and the hook-map key to change."""
    unpaired = sorted(set(reference) ^ set(candidate), key=str)
    if unpaired:
        key = unpaired[0]
        here, missing = ("reference", "candidate") if key in reference else ("candidate", "reference")
        site = (reference if key in reference else candidate)[key]
        layout = layouts[0] if here == "reference" else layouts[1]
        where = f"the {here}'s `{site.module}`"
        if layout is not None:
            where += f" (hook map {layout.hook_map.name!r}, key {_map_key(site)})"
        raise PairingError(
            f"{describe_key(key)}: recorded on one side only, by {where}, and missing in the {missing}; "
            f"the two models have different anatomy, or a hook map is wrong: drop that key from the {here}'s map "
            f"or add the module to the {missing}'s (`blockdiff arch`, docs/hook-maps.md)"
        )


def _map_key(site: Site) -> str:
    """The hook-map key that made ``site`` a site: ``[outside] STAGE`` or ``[blocks.subpaths] SUBPATH``."""
    if site.block is None:
        return f"[outside] {site.stage}"
    if site.subpath is None:
        return "[blocks] path"
    return f"[blocks.subpaths] {site.subpath}"


# Stages a model may do without: rotary tables kept as a tensor have no module.
OPTIONAL_STAGES = ("context",)


def one_sided_stages(
    reference: dict[SiteKey, Site], candidate: dict[SiteKey, Site], layouts: tuple[Layout | None, Layout | None]
) -> list[str]:
    """Drop from both the optional stages — :data:`OPTIONAL_STAGES`, and those a side's
    hook map marks ``optional`` — that only one side recorded; a note for each."""
    optional = set(OPTIONAL_STAGES)
    for layout in layouts:
        if layout is not None:
            optional.update(layout.hook_map.optional)
    notes = []
    for stage in sorted(optional):
        ref_keys = [k for k, s in reference.items() if s.stage == stage]
        cand_keys = [k for k, s in candidate.items() if s.stage == stage]
        if bool(ref_keys) == bool(cand_keys):
            continue
        here, keys, sites = ("reference", ref_keys, reference) if ref_keys else ("candidate", cand_keys, candidate)
        modules = ", ".join(sites[k].module for k in keys)
        for k in keys:
            del sites[k]
        notes.append(
            Note("stage-one-side", f"{stage}: only the {here} has this stage ({modules}); the {'candidate' if here == 'reference' else 'reference'} "
            f"has no module for it (it computes it inside other modules, or keeps it as a constant), so it is left out "
            f"of the pairing: its errors show in the blocks that use it")
        )
    return notes


def in_order(sites: dict[SiteKey, Site]) -> list[tuple[SiteKey, Site]]:
    """``sites`` in the order their calls started."""
    return sorted(sites.items(), key=lambda kv: kv[1].order)


def with_activations(sites: list[Site], layout: Layout | None) -> dict[SiteKey, Site]:
    """``sites`` by key, each knowing the activation keywords its hook map names for its
    module (``[modules."PATH"] activations``). Capture records them; a site read from a
    dump does not, and gets them from the layout the dump stores."""
    found = {}
    for site in sites:
        if site.activations is None and layout is not None:
            names = layout.options(site.module).activations
            if names is not None:
                site = replace(site, activations=names)
        found[site.key] = site
    return found


def pair_outside(
    reference: SiteStore,
    candidate: SiteStore,
    ref_layout: Layout | None = None,
    cand_layout: Layout | None = None,
    notes: list[str] | None = None,
) -> list[tuple[Site, Site]]:
    """The (reference, candidate) sites outside blocks — embed, context, final norm,
    head — in execution order; an optional stage only one side has is left out, with a
    note in ``notes`` (:func:`one_sided_stages`)."""
    ref = with_activations(reference.outside_sites(), ref_layout)
    cand = with_activations(candidate.outside_sites(), cand_layout)
    left_out = one_sided_stages(ref, cand, (ref_layout, cand_layout))
    if notes is not None:
        notes.extend(n for n in left_out if n not in notes)
    check_paired(ref, cand, (ref_layout, cand_layout))
    return [(r, cand[key]) for key, r in in_order(ref)]


@dataclass
class BlockPair:
    """One block's sites on both sides.

    Attributes:
        index: the block's index.
        ref_block, cand_block: the block's own call on each side.
        ref, cand: the sub-path modules' sites (attention, ffn, norms), by key.
        ref_routers, cand_routers: an MoE block's router sites, by key.
        ref_layout, cand_layout: the block's layout on each side (``None`` for a dump
            that does not record one).
    """

    index: int
    ref_block: Site
    cand_block: Site
    ref: dict[SiteKey, Site]
    cand: dict[SiteKey, Site]
    ref_routers: dict[SiteKey, Site] = field(default_factory=dict)
    cand_routers: dict[SiteKey, Site] = field(default_factory=dict)
    ref_layout: BlockLayout | None = None
    cand_layout: BlockLayout | None = None
    # Whether the two sides route to another number of experts or experts per token: a
    # routing of one shape cannot be frozen into the other (set by the localizer).
    routing_differs: bool = False

    @property
    def moe(self) -> bool:
        """Whether both sides' layouts describe this block's MoE router."""
        return (
            self.ref_layout is not None
            and self.cand_layout is not None
            and self.ref_layout.moe is not None
            and self.cand_layout.moe is not None
        )

    def sites(self) -> Iterator[tuple[Site, Site]]:
        """(reference, candidate) sub-path module sites in execution order."""
        for key, r in in_order(self.ref):
            yield r, self.cand[key]

    def router_of(self, site: Site) -> tuple[Site, Site] | None:
        """The (reference, candidate) router sites of an MoE block's ffn ``site``."""
        key = SiteKey("block", self.index, "router", site.ordinal)
        if not self.moe or site.subpath != "ffn" or key not in self.ref_routers:
            return None
        return self.ref_routers[key], self.cand_routers[key]

    def routing(self) -> dict[tuple[str, int], tuple[Site, Site]]:
        """Every router of an MoE block, frozen at the reference's decision: (reference
        router site, candidate router site) by ("router", ordinal)."""
        if not self.moe or self.routing_differs:
            return {}
        return {("router", k.ordinal): (r, self.cand_routers[k]) for k, r in self.ref_routers.items()}

    def last_order(self) -> int:
        """Where the block's last sub-path module started (the residual is reported after it)."""
        return max((s.order for s in self.ref.values()), default=self.ref_block.order)


def layout_block(layout: Layout | None, index: int) -> BlockLayout | None:
    if layout is None:
        return None
    return next((block for block in layout.blocks if block.index == index), None)


def pair_block(
    reference: SiteStore,
    candidate: SiteStore,
    index: int,
    ref_layout: Layout | None = None,
    cand_layout: Layout | None = None,
) -> BlockPair:
    """Block ``index``'s sites read from both stores and paired.

    Raises:
        PairingError: the block's own call, or a sub-path's site, is on one side only.
    """
    ref = with_activations(reference.block_sites(index), ref_layout)
    cand = with_activations(candidate.block_sites(index), cand_layout)
    block_key = SiteKey.of_block(index)
    if block_key not in ref or block_key not in cand:
        raise PairingError(f"block {index}: the block's own call was not recorded on both sides")
    ref_block, cand_block = ref.pop(block_key), cand.pop(block_key)
    ref_routers = {k: ref.pop(k) for k in [k for k, s in ref.items() if s.subpath == "router"]}
    cand_routers = {k: cand.pop(k) for k in [k for k, s in cand.items() if s.subpath == "router"]}
    pair = BlockPair(
        index,
        ref_block,
        cand_block,
        ref,
        cand,
        ref_routers,
        cand_routers,
        layout_block(ref_layout, index),
        layout_block(cand_layout, index),
    )
    check_paired(ref, cand, (ref_layout, cand_layout))
    if pair.moe:
        check_paired(ref_routers, cand_routers, (ref_layout, cand_layout))
    return pair


def outside_position(site: Site) -> int:
    """0 for stages that run before the blocks, 2 for those after (blocks are 1)."""
    return 0 if site.stage in BEFORE_BLOCKS else 2


def output_position(site: Site) -> tuple:
    """Where ``site``'s output was produced in its run, as a sort key: the stages before
    the blocks, then per block its modules before the block itself (whose output comes
    last), then the stages after."""
    if site.block is not None:
        return (1, site.block, site.subpath is None, site.order)
    return (outside_position(site), 0, False, site.order)


__all__ = [
    "BlockPair",
    "check_block_counts",
    "OPTIONAL_STAGES",
    "check_paired",
    "in_order",
    "layout_block",
    "output_position",
    "outside_position",
    "pair_block",
    "one_sided_stages",
    "pair_outside",
    "with_activations",
]
