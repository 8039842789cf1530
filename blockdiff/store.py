"""Site stores: where capture writes sites and where localization reads them, block by block.

A store is a plain sink: the engine only uses the small interface below (``add`` while
capturing; ``meta``, ``outside_sites``, ``block_sites`` and ``floors`` while localizing),
so a store backed by an HDF5 file (:mod:`blockdiff.dump`) can stand in for the in-memory
one. What a store is handed (copies, or the model's own tensors) is
:mod:`blockdiff.capture`'s call.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

from .site import Site


class SiteStore(Protocol):
    """What capture writes to and localization reads from."""

    meta: dict[str, Any]

    def add(self, site: Site) -> None: ...

    def block_indices(self) -> list[int]: ...

    def block_sites(self, block: int) -> list[Site]: ...

    def outside_sites(self) -> list[Site]: ...

    def floors(self) -> dict[str, Any]:
        """The noise floors stored with the sites at capture, by precision label
        (``bfloat16@cpu``): each a dict with ``dtype``, ``device`` and ``values``; empty
        when there are none (a store in memory never holds any)."""
        ...


class MemoryStore:
    """Sites held in memory, in execution order."""

    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self._outside: list[Site] = []
        self._blocks: dict[int, list[Site]] = {}

    def add(self, site: Site) -> None:
        # Sites arrive as their calls finish (a block after its modules); keep start order.
        block = site.block
        if block is None:
            target = self._outside
        else:
            target = self._blocks.get(block)
            if target is None:
                target = self._blocks[block] = []
        if not target or target[-1].order < site.order:
            target.append(site)
        else:
            bisect.insort(target, site, key=lambda s: s.order)

    def clear(self) -> None:
        """Forget every site (the meta stays)."""
        self._outside.clear()
        self._blocks.clear()

    def block_indices(self) -> list[int]:
        return sorted(self._blocks)

    def block_sites(self, block: int) -> list[Site]:
        return list(self._blocks.get(block, []))

    def outside_sites(self) -> list[Site]:
        return list(self._outside)

    def floors(self) -> dict[str, Any]:
        """Empty: floors are stored in a dump (:meth:`~blockdiff.dump.DumpReader.floors`), never in memory."""
        return {}

    def sites(self) -> list[Site]:
        """Every site: outside sites before the blocks' (embed, context), blocks, then the rest."""
        before = [s for s in self._outside if s.stage in ("embed", "context")]
        after = [s for s in self._outside if s.stage not in ("embed", "context")]
        blocks = [s for i in self.block_indices() for s in self._blocks[i]]
        return before + blocks + after
