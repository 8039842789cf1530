"""Site stores: where capture writes sites and where localization reads them, block by block.

A store is a plain sink: the engine only uses the small interface below (``add`` while
capturing; ``meta``, ``outside_sites`` and ``block_sites`` while localizing), so a store
backed by an HDF5 file (:mod:`blockdiff.dump`) can stand in for the in-memory one. What a
store is handed (copies, or the model's own tensors) is :mod:`blockdiff.capture`'s call.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Any, Protocol

from .site import Site


class SiteStore(Protocol):
    """What capture writes to and localization reads from."""

    meta: dict[str, Any]

    def add(self, site: Site) -> None: ...

    def block_indices(self) -> list[int]: ...

    def block_sites(self, block: int) -> list[Site]: ...

    def outside_sites(self) -> list[Site]: ...


class MemoryStore:
    """Sites held in memory, in execution order."""

    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self._outside: list[Site] = []
        self._blocks: dict[int, list[Site]] = {}

    def add(self, site: Site) -> None:
        # Sites arrive as their calls finish (a block after its modules); keep start order.
        target = self._outside if site.block is None else self._blocks.setdefault(site.block, [])
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

    def sites(self) -> list[Site]:
        """Every site: outside sites before the blocks' (embed, context), blocks, then the rest."""
        before = [s for s in self._outside if s.stage in ("embed", "context")]
        after = [s for s in self._outside if s.stage not in ("embed", "context")]
        blocks = [s for i in self.block_indices() for s in self._blocks[i]]
        return before + blocks + after


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


_MALLOC_TRIM = _malloc_trim()


@functools.lru_cache(maxsize=1)
def _hdf5_garbage_collect():
    """``H5garbage_collect`` of the libhdf5 that h5py loaded, or ``None``.

    h5py does not wrap it; the library is found among the process's mappings (Linux).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libhdf5" in line})
    except OSError:
        return None
    for path in paths:
        name = os.path.basename(path)
        if name.startswith(("libhdf5-", "libhdf5.so")):  # not libhdf5_hl
            try:
                return ctypes.CDLL(path).H5garbage_collect
            except (OSError, AttributeError):
                continue
    return None


def release_freed_memory() -> None:
    """Hand memory that was freed back to the operating system, where the libraries allow.

    Streaming frees each block's activations before reading the next block's, but glibc
    keeps freed heap memory (and tensors of up to 32 MB come from the heap once a larger
    one was freed), so the resident size of a streamed run grew with the number of blocks
    (about 4 MiB per block on a 58M model). ``malloc_trim`` after each block keeps it flat;
    it takes about a millisecond. libhdf5 keeps the structures of the objects it closed
    on free lists: after writing or opening a dump of 32 blocks they held ~3 MiB more than
    for 8; ``H5garbage_collect`` (under h5py's lock) gives them back first. Where either
    library is not found, that part does nothing.
    """
    if "h5py" in sys.modules:
        collect = _hdf5_garbage_collect()
        if collect is not None:
            from h5py._objects import phil

            with phil:
                collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
