"""Handing freed memory back to the operating system between the blocks of a streamed run.

Streaming frees each block's activations before reading the next block's, but the C
libraries underneath keep what was freed: glibc its heap, libhdf5 the structures of the
objects it closed. :func:`release_freed_memory` asks both to give it back; the reader
calls it after opening a dump, localization after each block.

Both are found once, the plain way: ``malloc_trim`` among the process's own symbols
(``ctypes.CDLL(None)``: the C library the interpreter runs on); ``H5garbage_collect``
through h5py's own extension module (``h5py.h5``), whose dependencies are the libhdf5
h5py loaded — never another copy of libhdf5 found on the system. Where one is not found
(a C library without ``malloc_trim``, such as macOS's; Windows; an h5py whose extension
cannot be opened this way) that part does nothing: the memory is still freed, only kept
by the process for its own reuse.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc; TypeError: Windows has no CDLL(None)
        return None


_MALLOC_TRIM = _malloc_trim()


@functools.lru_cache(maxsize=1)
def _hdf5_library() -> ctypes.CDLL | None:
    """The libhdf5 h5py loaded, or ``None`` where it cannot be reached.

    h5py exposes no handle on it: it is opened through h5py's extension module
    ``h5py.h5``, whose symbol lookup covers the libhdf5 it was linked against and loaded
    (the copy whose state h5py's objects live in), not another one on the system.
    """
    try:
        import h5py.h5

        return ctypes.CDLL(h5py.h5.__file__)
    except (ImportError, OSError):
        return None


def _hdf5_garbage_collect() -> Callable[[], int] | None:
    """``H5garbage_collect`` of that libhdf5 (h5py does not wrap it), or ``None``."""
    return getattr(_hdf5_library(), "H5garbage_collect", None)


def release_freed_memory() -> None:
    """Hand memory that was freed back to the operating system, where the libraries allow.

    Streaming frees each block's activations before reading the next block's, but glibc
    keeps freed heap memory (and tensors of up to 32 MB come from the heap once a larger
    one was freed), so the resident size of a streamed run grew with the number of blocks
    (about 4 MiB per block on a 58M model). ``malloc_trim`` after each block keeps it flat;
    it takes about a millisecond. libhdf5 keeps the structures of the objects it closed
    on free lists: after writing or opening a dump of 32 blocks they held ~3 MiB more than
    for 8; ``H5garbage_collect`` (under h5py's lock) gives them back first. Where either
    library is not found, that part does nothing; h5py is not imported for it (a run
    without h5py has no libhdf5 free lists).
    """
    if "h5py" in sys.modules:
        collect = _hdf5_garbage_collect()
        if collect is not None:
            from h5py._objects import phil

            with phil:
                collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
