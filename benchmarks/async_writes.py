"""Writes that go on without Python: a writer thread against the C library's asynchronous I/O.

On the tensors of ``benchmarks/overhead.py``'s figure 3 (every floating tensor a capture of
the 58M Llama records, 60 MB), measured side by side, all variants interleaved run by run
(paired medians against a ``numpy.tofile`` of the same bytes in the same round):

  1. the bytes into one file, ``fallocate``d, in 1 MiB writes: from a Python thread, and
     through glibc's asynchronous I/O (``lio_listio`` through ctypes: the C library's
     threads write, without the GIL); each with the main thread idle, and with it running
     pure Python for 8 ms meanwhile (as a caller encoding sites does): a Python writer
     thread takes the GIL back after every write, and waits up to the interpreter's
     switch interval (5 ms) each time;
  2. a stripped-down dump on one thread: libhdf5 allocates a contiguous dataset per
     batch (the first after 1 MiB, then 8 MiB, as blockdiff's writer), the bytes go
     through the asynchronous I/O, the thread takes each tensor's CRC-32C meanwhile, then
     writes a JSON index and attributes, closes and renames; no sites, no version checks:
     how far from ``tofile`` a writer is whose only work beside the bytes is that.

Linux with glibc only (the ``struct aiocb`` layout is glibc's on 64-bit platforms).

    python benchmarks/async_writes.py            # about a minute
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import build, dump_arrays  # noqa: E402

from blockdiff.dump.format import _crc32c  # noqa: E402
from blockdiff.dump.writer import _FALLOCATE as fallocate  # noqa: E402  (Linux; None elsewhere)

PIECE = 1 << 20


class Aiocb(ctypes.Structure):
    _fields_ = [
        ("aio_fildes", ctypes.c_int), ("aio_lio_opcode", ctypes.c_int), ("aio_reqprio", ctypes.c_int),
        ("aio_buf", ctypes.c_void_p), ("aio_nbytes", ctypes.c_size_t), ("aio_sigevent", ctypes.c_byte * 64),
        ("next_prio", ctypes.c_void_p), ("abs_prio", ctypes.c_int), ("policy", ctypes.c_int),
        ("error_code", ctypes.c_int), ("return_value", ctypes.c_ssize_t), ("aio_offset", ctypes.c_int64),
        ("reserved", ctypes.c_byte * 32),
    ]


def glibc_aio():
    if not sys.platform.startswith("linux") or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        return None
    for name in (None, "librt.so.1"):
        try:
            holding, releasing = ctypes.PyDLL(name, use_errno=True), ctypes.CDLL(name, use_errno=True)
            fns = (holding.lio_listio64, holding.aio_error64, holding.aio_return64, releasing.aio_suspend64)
        except (OSError, AttributeError):
            continue
        lio_listio, aio_error, aio_return, aio_suspend = fns
        lio_listio.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        aio_error.argtypes = aio_return.argtypes = (ctypes.c_void_p,)
        aio_return.restype = ctypes.c_ssize_t
        aio_suspend.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
        return fns
    return None


AIO = glibc_aio()


class Writes:
    """The bytes of ``arrays`` from ``offset`` on, handed to glibc in requests of 1 MiB."""

    def __init__(self, fd: int, arrays: list[np.ndarray], offset: int) -> None:
        self.arrays = arrays  # alive until written
        pieces = []
        for a in arrays:
            for i in range(0, a.nbytes, PIECE):
                pieces.append((a.ctypes.data + i, min(PIECE, a.nbytes - i), offset + i))
            offset += a.nbytes
        self.blocks = (Aiocb * len(pieces))()
        for block, (buf, n, at) in zip(self.blocks, pieces):
            block.aio_fildes, block.aio_lio_opcode, block.aio_buf, block.aio_nbytes, block.aio_offset = fd, 1, buf, n, at
            ctypes.c_int.from_address(ctypes.addressof(block.aio_sigevent) + 12).value = 1  # SIGEV_NONE
        self.pointers = np.array([ctypes.addressof(b) for b in self.blocks], dtype=np.uint64)
        if AIO[0](1, self.pointers.ctypes.data, len(pieces), None) != 0:  # LIO_NOWAIT
            raise OSError(ctypes.get_errno(), "lio_listio")

    def wait(self) -> None:
        for i, block in enumerate(self.blocks):
            while AIO[1](int(self.pointers[i])) == errno.EINPROGRESS:
                AIO[3](self.pointers[i:].ctypes.data, 1, None)
            if AIO[1](int(self.pointers[i])) or AIO[2](int(self.pointers[i])) != block.aio_nbytes:
                raise OSError("asynchronous write failed or was short")


def busy_python(seconds: float) -> None:
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for i in range(2000):
            x += i


def main() -> None:
    if AIO is None:
        print("no glibc asynchronous I/O here")
        return
    import h5py
    import torch

    torch.set_num_threads(2)
    sizes = dict(hidden=512, intermediate=1376, vocab=32000)
    model = build(8, **sizes)
    ids = torch.randint(0, sizes["vocab"], (1, 256), generator=torch.Generator().manual_seed(0))
    arrays = dump_arrays(model, ids)
    total = sum(a.nbytes for a in arrays)
    folder = Path(tempfile.mkdtemp())
    raw, out = folder / "raw.bin", folder / "out.h5"

    def tofile():
        with raw.open("wb") as f:
            for a in arrays:
                a.tofile(f)

    def fresh_fd() -> int:
        fd = os.open(raw, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fallocate(fd, 1, 0, total)  # KEEP_SIZE
        return fd

    def thread_writes(busy: bool):
        def run():
            fd, offset = fresh_fd(), 0
            def write():
                at = offset
                for a in arrays:
                    view = memoryview(a).cast("B")
                    for i in range(0, len(view), PIECE):
                        os.pwrite(fd, view[i : i + PIECE], at + i)
                    at += a.nbytes
            t = threading.Thread(target=write)
            t.start()
            if busy:
                busy_python(0.008)
            t.join()
            os.close(fd)
        return run

    def async_writes(busy: bool):
        def run():
            fd = fresh_fd()
            writes = Writes(fd, arrays, 0)
            if busy:
                busy_python(0.008)
            writes.wait()
            os.close(fd)
        return run

    batches, batch, size = [], [], 0
    for a in arrays:
        batch.append(a)
        size += a.nbytes
        if size >= (8 << 20 if batches else 1 << 20):
            batches.append(batch)
            batch, size = [], 0
    if batch:
        batches.append(batch)

    def stripped_down_dump():
        tmp = out.with_name(".out.h5.tmp")
        f = h5py.File(tmp, "w", libver=("v110", "v110"), alignment_threshold=65536, alignment_interval=4096)
        for key in ("format", "schema_version", "blockdiff_version", "torch_version", "created", "model"):
            f.attrs[key] = np.bytes_(key)
        group = f.create_group("tensors")
        fd = os.dup(f.id.get_vfd_handle())
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        writes, entries = [], []
        for i, batch in enumerate(batches):
            count = sum(a.size for a in batch)
            dset = h5py.h5d.create(group.id, f"float32.{i}".encode(), h5py.h5t.py_create(np.dtype("<f4")), h5py.h5s.create_simple((count,)), dcpl=dcpl)
            offset = dset.get_offset()
            fallocate(fd, 1, offset, count * 4)
            writes.append(Writes(fd, batch, offset))
            entries += [{"data": f"float32.{i}", "crc32c": _crc32c(a)} for a in batch]
        index = json.dumps({"tensors": entries}).encode()
        f.create_dataset("index", data=np.frombuffer(index, dtype="u1"))
        f.attrs["metadata_digest"] = np.bytes_("0" * 64)
        f.attrs["complete"] = True
        f.close()
        for w in writes:
            w.wait()
        os.close(fd)
        os.replace(tmp, out)

    variants = {
        "tofile": tofile,
        "writer thread, caller idle": thread_writes(False),
        "writer thread, caller runs Python 8 ms": thread_writes(True),
        "asynchronous I/O, caller idle": async_writes(False),
        "asynchronous I/O, caller runs Python 8 ms": async_writes(True),
        "stripped-down dump (asynchronous I/O)": stripped_down_dump,
    }
    rounds = 31
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants)
        random.Random(r).shuffle(order)
        for name in order:
            for path in (raw, out):
                path.unlink(missing_ok=True)
            gc.collect()
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    print(f"{total / 1e6:.0f} MB in {len(arrays)} tensors; medians of {rounds} rounds; tofile / variant paired per round")
    for name, values in times.items():
        paired = sorted(times["tofile"][i] / values[i] for i in range(rounds))
        print(f"  {name:44s} {statistics.median(values) * 1e3:7.2f} ms   tofile / it {statistics.median(paired):.3f}"
              f"  (quartiles {paired[rounds // 4]:.3f}-{paired[3 * rounds // 4]:.3f})")
    for path in (raw, out):
        path.unlink(missing_ok=True)
    folder.rmdir()


if __name__ == "__main__":
    main()
