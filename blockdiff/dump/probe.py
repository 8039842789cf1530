"""The hostile-file probe: walk a dump's structure in a subprocess before reading it.

:class:`~blockdiff.dump.reader.DumpReader` runs :func:`probe_file` before opening a file
in-process, so a file that crashes or hangs libhdf5 becomes a
:class:`~blockdiff.errors.DumpError` instead of taking the process down.
"""

from __future__ import annotations

import os

from ..errors import DumpError

# Parses everything libhdf5 parses when blockdiff reads a dump (superblock, object headers,
# attributes, B-trees, chunk indexes) without reading tensor data, which fletcher32 and
# crc32c already guard. Only h5py: no torch import, so it starts in a fraction of a second.
PROBE_SCRIPT = r"""
import sys, h5py
def visit(name, obj):
    for key in obj.attrs.keys():
        obj.attrs[key]
    if isinstance(obj, h5py.Dataset) and obj.chunks:
        for i in range(obj.id.get_num_chunks()):
            obj.id.get_chunk_info(i)
with h5py.File(sys.argv[1], "r") as f:
    for key in f.attrs.keys():
        f.attrs[key]
    f.visititems(visit)
"""
PROBE_SECONDS = 30.0


def probe_file(path: str | os.PathLike, *, timeout: float = PROBE_SECONDS) -> None:
    """Open and walk a dump's structure in a subprocess with a time limit.

    libhdf5 is not hardened against hostile files: a damaged one can crash the process
    (SIGSEGV) or loop forever. The probe takes that risk in a child process; a crash or a
    hang becomes a :class:`DumpError`. A Python-level failure is left to the in-process
    open, which reports it precisely.

    Raises:
        DumpError: the probe was killed by a signal or ran out of time.
    """
    import subprocess
    import sys

    where = str(path)
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE_SCRIPT, where],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise DumpError(
            f"{where}: reading it hung inside libhdf5 (stopped after {timeout:.0f} s): the file is damaged",
            path=where,
        ) from None
    if done.returncode < 0:
        raise DumpError(
            f"{where}: reading it crashed libhdf5 (signal {-done.returncode}): the file is damaged",
            path=where,
        )
