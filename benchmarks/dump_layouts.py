"""Dump layouts measured side by side: what a dump costs beyond its bytes, and whether the
writer holds the forward.

On the tensors of ``benchmarks/overhead.py`` (58M HF Llama, 8 blocks, batch 1, seq 256,
float32: every site recorded into a MemoryStore, its 54 distinct floating tensors, 60 MB) each layout
is written as a complete, self-describing file with plain h5py / numpy, with a CRC-32C per
tensor, to a temporary name, closed, fsynced, renamed, the directory fsynced (what a dump
does), all variants interleaved run by run (medians):

  A   group per site, one chunked dataset per tensor, 3 attributes each (schema-3's shape)
  B   packed: one 1-D chunked resizable dataset per dtype, whole chunks written with
      ``write_direct_chunk`` from a staging buffer, a JSON index (fixed-length string
      dataset) at close; chunk 256 KiB, 1 MiB, 4 MiB; with writeback started early
      (``sync_file_range`` / ``posix_fadvise(DONTNEED)`` every 8 MiB); and with plain
      slice assignment instead of direct chunk writes
  C   B + per-tensor HDF5 virtual dataset views ``views/<site>/t<k>`` (source ".")
  D   B + a dataset of region references, one per tensor
  E   external raw storage: the bytes ``tofile``'d into a raw file, an HDF5 dataset with
      ``external=`` pointing at it (relative name)
  F   contiguous datasets, one per dtype per 8 MiB batch, allocated by libhdf5 (early, never
      filled, page-aligned) and written with the writer's own ``pwritev`` on libhdf5's file
      descriptor (1 MiB per call), with and without ``fallocate`` of each dataset first;
      a JSON index at close (what blockdiff 0.4.1 writes)
  and the baselines ``numpy.tofile`` (bare) and tofile + fsync + rename.

Each file is read back with plain h5py (every tensor, CRC verified), checked equal to what
was written, and timed. Then the second part: a streamed capture (``blockdiff.capture``
with a store that hands each tensor to a packed writer, by reference) against a plain
forward of the same model, writing (i) inline on the forward's thread, (ii) on a writer
thread fed through a queue, (iii) in a writer process fed through a shared-memory ring
buffer; and whether h5py releases the GIL during ``write_direct_chunk`` (a pure-Python
busy loop's progress on another thread).

    python benchmarks/dump_layouts.py            # about three minutes on 2 cores
    python benchmarks/dump_layouts.py --quick    # smaller model, for a smoke run
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import google_crc32c
import h5py
import numpy as np

from blockdiff.dump.writer import _FALLOCATE  # Linux; None elsewhere

MiB = 2**20
WRITEBACK_EVERY = 8 * MiB
LIBVER = ("v110", "v110")  # what blockdiff's dumps use: checksummed metadata (superblock 3, v2 headers)


def crc(a: np.ndarray) -> int:
    return google_crc32c.value(a.reshape(-1).view(np.uint8))


def durable(path: Path, write) -> None:
    """``write(tmp)`` (which closes what it opened), then fsync, rename, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_index(f: h5py.File, index: list[dict]) -> None:
    text = json.dumps(index, separators=(",", ":")).encode()
    f.create_dataset("index", data=np.array(text, dtype=f"S{len(text)}"))


def entry(site: int, name: str, dataset: str, offset: int, a: np.ndarray, flat: np.ndarray) -> dict:
    """A tensor's index entry: where its elements lie, its shape and dtype, its CRC-32C."""
    return {"site": site, "name": name, "dataset": dataset, "offset": offset, "count": flat.size,
            "shape": list(a.shape), "dtype": a.dtype.name, "crc32c": crc(flat)}


def load_index(f: h5py.File) -> list[dict]:
    return json.loads(f["index"][()].decode())


# --- baselines -----------------------------------------------------------------------------

def write_tofile(path: Path, tensors, writeback: str | None = None) -> None:
    with path.open("wb") as fh:
        wb = Writeback(path, writeback)
        for _, _, a in tensors:
            a.tofile(fh)
            wb.wrote(a.nbytes, fh)
        wb.close()


def sync_file_range(fd: int) -> None:
    """Linux ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)``: start writeback of every
    dirty page of the file, without waiting (Python's os module does not have it)."""
    if _LIBC.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_uint(2)) != 0:
        raise OSError(ctypes.get_errno(), "sync_file_range")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class Writeback:
    """Start the kernel's writeback of a file early, every WRITEBACK_EVERY bytes, on a
    separate descriptor: ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` (asynchronous) or
    ``posix_fadvise(DONTNEED)`` (which starts writeback of dirty pages, drops clean ones)."""

    def __init__(self, path: Path, how: str | None) -> None:
        self.how, self.pending = how, 0
        self.fd = os.open(path, os.O_RDONLY) if how else None

    def wrote(self, n: int, flush=None) -> None:
        if self.fd is None:
            return
        self.pending += n
        if self.pending >= WRITEBACK_EVERY:
            self.pending = 0
            if flush is not None:
                flush.flush()
            if self.how == "sync_file_range":
                sync_file_range(self.fd)
            else:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --- A: group per site, dataset per tensor -------------------------------------------------

def write_groups(path: Path, tensors) -> None:
    with h5py.File(path, "w", libver=LIBVER) as f:
        f.attrs["format"], f.attrs["schema_version"] = np.bytes_("bench.groups"), 3
        for site, name, a in tensors:
            g = f.require_group(f"sites/{site:06d}")
            d = g.create_dataset(name, data=a, chunks=a.shape)
            d.attrs["crc32c"] = crc(a)
            d.attrs["dtype"] = np.bytes_(str(a.dtype))  # fixed-length: no global heap
            d.attrs["role"] = np.bytes_("output")


def read_groups(path: Path) -> list[np.ndarray]:
    out = []
    with h5py.File(path, "r") as f:
        for site in f["sites"].values():
            for d in site.values():
                a = d[()]
                assert crc(a) == d.attrs["crc32c"]
                out.append(a)
    return out


# --- B: packed per dtype, direct chunk writes ------------------------------------------------

class Packed:
    """Tensors appended into ``tensors/<dtype>`` (1-D, chunked, resizable), whole chunks
    written with ``write_direct_chunk`` from a staging buffer (or, ``direct=False``, by
    slice assignment); the JSON index written at close; ``extra(f, index)`` adds views."""

    def __init__(self, path: Path, chunk: int, *, writeback: str | None = None, direct: bool = True,
                 in_place: bool = False, extra=None) -> None:
        self.path, self.tmp, self.chunk, self.direct, self.extra = path, path.with_name(path.name + ".tmp"), chunk, direct, extra
        self.in_place = in_place  # whole chunks of a tensor written from its own memory, not staged
        self.f = h5py.File(self.tmp, "w", libver=LIBVER)
        self.f.attrs["format"], self.f.attrs["schema_version"] = np.bytes_("bench.packed"), 4
        self.wb = Writeback(self.tmp, writeback)
        self.sets: dict[str, dict] = {}
        self.index: list[dict] = []

    def _set(self, dtype: np.dtype) -> dict:
        s = self.sets.get(dtype.str)
        if s is None:
            elems = self.chunk // dtype.itemsize
            ds = self.f.create_dataset(f"tensors/{dtype.name}", shape=(0,), maxshape=(None,), chunks=(elems,), dtype=dtype)
            s = self.sets[dtype.str] = {"ds": ds, "stage": np.empty(self.chunk, np.uint8), "filled": 0, "chunks": 0,
                                        "total": 0, "elems": elems}
        return s

    def add(self, site: int, name: str, a: np.ndarray) -> None:
        s = self._set(a.dtype)
        flat = np.ascontiguousarray(a).reshape(-1)
        self.index.append(entry(site, name, s["ds"].name, s["total"], a, flat))
        if not self.direct:
            s["ds"].resize((s["total"] + flat.size,))
            s["ds"][s["total"]:s["total"] + flat.size] = flat
            s["total"] += flat.size
            self.wb.wrote(flat.nbytes)
            return
        s["total"] += flat.size
        raw, pos, stage = flat.view(np.uint8), 0, s["stage"]
        while pos < raw.size:
            if self.in_place and s["filled"] == 0 and raw.size - pos >= self.chunk:
                self._flush(s, raw[pos:pos + self.chunk])
                pos += self.chunk
                continue
            n = min(self.chunk - s["filled"], raw.size - pos)
            stage[s["filled"]:s["filled"] + n] = raw[pos:pos + n]
            s["filled"] += n
            pos += n
            if s["filled"] == self.chunk:
                self._flush(s)

    def _flush(self, s: dict, data: np.ndarray | None = None) -> None:
        start = s["chunks"] * s["elems"]
        ds = s["ds"]
        if ds.shape[0] < start + s["elems"]:  # grown geometrically, cut to size at close
            ds.resize((max(start + s["elems"], 2 * ds.shape[0]),))
        ds.id.write_direct_chunk((start,), s["stage"] if data is None else data)
        s["chunks"] += 1
        s["filled"] = 0
        self.wb.wrote(self.chunk)

    def close(self) -> None:
        for s in self.sets.values():
            if self.direct and s["filled"]:
                s["stage"][s["filled"]:] = 0
                self._flush(s)
            s["ds"].resize((s["total"],))
        if self.extra is not None:
            self.extra(self.f, self.index)
        save_index(self.f, self.index)
        self.f.close()
        self.wb.close()
        fsync_path(self.tmp)
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)


def write_packed(path: Path, tensors, chunk: int, **options) -> None:
    w = Packed(path, chunk, **options)
    for site, name, a in tensors:
        w.add(site, name, a)
    w.close()


def read_packed(path: Path) -> list[np.ndarray]:
    out = []
    with h5py.File(path, "r") as f:
        for e in load_index(f):
            a = f[e["dataset"]][e["offset"]:e["offset"] + e["count"]].reshape(e["shape"])
            assert crc(a) == e["crc32c"]
            out.append(a)
    return out


# --- C: packed + virtual dataset views ------------------------------------------------------

def add_views(f: h5py.File, index: list[dict]) -> None:
    for e in index:
        ds = f[e["dataset"]]
        layout = h5py.VirtualLayout(shape=tuple(e["shape"]), dtype=ds.dtype)
        layout[...] = h5py.VirtualSource(".", e["dataset"], shape=ds.shape)[e["offset"]:e["offset"] + e["count"]]
        e["view"] = f"views/{e['site']:06d}/{e['name']}"
        f.create_virtual_dataset(e["view"], layout)


def read_views(path: Path) -> list[np.ndarray]:
    out = []
    with h5py.File(path, "r") as f:
        for e in load_index(f):
            a = f[e["view"]][()]  # shape restored by the view
            assert crc(a) == e["crc32c"]
            out.append(a)
    return out


# --- D: packed + region references ----------------------------------------------------------

def add_regions(f: h5py.File, index: list[dict]) -> None:
    refs = f.create_dataset("regions", (len(index),), dtype=h5py.regionref_dtype)
    refs[...] = [f[e["dataset"]].regionref[e["offset"]:e["offset"] + e["count"]] for e in index]


def read_regions(path: Path) -> list[np.ndarray]:
    out = []
    with h5py.File(path, "r") as f:
        index = load_index(f)
        for e, ref in zip(index, f["regions"][()]):
            a = f[ref][ref].reshape(e["shape"])  # 1-D: the shape comes from the index
            assert crc(a) == e["crc32c"]
            out.append(a)
    return out


# --- E: external raw storage ---------------------------------------------------------------

def write_external(path: Path, tensors) -> None:
    """The bytes into ``<name>.<dtype>.raw`` (tofile, fsync, rename), then the HDF5 file
    with a dataset stored externally in it, and the index (fsync, rename: the commit)."""
    index, totals, files = [], {}, {}
    for site, name, a in tensors:
        key = a.dtype.name
        if key not in files:
            files[key] = path.with_name(f"{path.name}.{key}.raw.tmp").open("wb")
            totals[key] = 0
        flat = a.reshape(-1)
        index.append(entry(site, name, f"tensors/{key}", totals[key], a, flat))
        flat.tofile(files[key])
        totals[key] += flat.size
    for key, fh in files.items():
        fh.close()
        raw = path.with_name(f"{path.name}.{key}.raw")
        fsync_path(Path(fh.name))
        os.replace(fh.name, raw)

    def h5(tmp: Path) -> None:
        with h5py.File(tmp, "w", libver=LIBVER) as f:
            f.attrs["format"], f.attrs["schema_version"] = np.bytes_("bench.external"), 4
            for key, total in totals.items():
                dt = np.dtype(key)
                f.create_dataset(f"tensors/{key}", shape=(total,), dtype=dt,
                                 external=[(f"{path.name}.{key}.raw", 0, total * dt.itemsize)])
            save_index(f, index)

    durable(path, h5)


# --- F: contiguous datasets per batch, the bytes written by the writer ---------------------



def write_contiguous(path: Path, tensors, falloc: bool) -> None:
    f = h5py.File(path, "w", libver=LIBVER, alignment_threshold=64 * 1024, alignment_interval=4096)
    fd = f.id.get_vfd_handle()
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    index, batch, size, n = [], [], 0, 0

    def flush() -> None:
        nonlocal batch, size, n
        flats = [a.reshape(-1) for _, _, a in batch]
        name = f"tensors/{flats[0].dtype.name}.{n}"
        dset = h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(flats[0].dtype), h5py.h5s.create_simple((sum(x.size for x in flats),)), dcpl=dcpl)
        offset, pos = dset.get_offset(), 0
        if falloc and _FALLOCATE is not None:
            _FALLOCATE(fd, 1, offset, size)  # FALLOC_FL_KEEP_SIZE
        views = [memoryview(x).cast("B")[i : i + MiB] for x in flats for i in range(0, x.nbytes, MiB)]
        for v in views:  # one MiB a call
            os.pwrite(fd, v, offset + pos)
            pos += len(v)
        start = 0
        for (site, tname, a), flat in zip(batch, flats):
            index.append(entry(site, tname, name, start, a, flat))
            start += flat.size
        batch, size, n = [], 0, n + 1

    f.create_group("tensors")
    for site, name, a in tensors:  # every tensor here is float32: one dtype
        batch.append((site, name, a))
        size += a.nbytes
        if size >= 8 * MiB:
            flush()
    if batch:
        flush()
    save_index(f, index)
    f.close()


def read_external(path: Path) -> list[np.ndarray]:
    # External names resolve against the working directory unless the dataset access
    # property says "${ORIGIN}" (or HDF5_EXTFILE_PREFIX='${ORIGIN}' is set before h5py loads).
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_efile_prefix(b"${ORIGIN}")
    out = []
    with h5py.File(path, "r") as f:
        sets = {}
        for e in load_index(f):
            if e["dataset"] not in sets:
                sets[e["dataset"]] = h5py.Dataset(h5py.h5d.open(f.id, e["dataset"].encode(), dapl))
            a = sets[e["dataset"]][e["offset"]:e["offset"] + e["count"]].reshape(e["shape"])
            assert crc(a) == e["crc32c"]
            out.append(a)
    return out


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


# --- part 1 ---------------------------------------------------------------------------------

def layouts(tensors, folder: Path, rounds: int) -> None:
    total = sum(a.nbytes for _, _, a in tensors)
    variants = {
        "tofile (bare)": (lambda p: write_tofile(p, tensors), None),
        "tofile + fsync + rename": (lambda p: durable(p, lambda t: write_tofile(t, tensors)), None),
        "  + sync_file_range/8MiB": (lambda p: durable(p, lambda t: write_tofile(t, tensors, "sync_file_range")), None),
        "A group/site, dataset/tensor": (lambda p: durable(p, lambda t: write_groups(t, tensors)), read_groups),
    }
    for kib in (256, 1024, 4096):
        variants[f"B packed, chunk {kib} KiB"] = (lambda p, c=kib * 1024: write_packed(p, tensors, c), read_packed)
    variants.update({
        "B 1 MiB + sync_file_range": (lambda p: write_packed(p, tensors, MiB, writeback="sync_file_range"), None),
        "B 1 MiB + sfr, chunks in place": (lambda p: write_packed(p, tensors, MiB, writeback="sync_file_range",
                                                                   in_place=True), read_packed),
        "B 1 MiB + fadvise DONTNEED": (lambda p: write_packed(p, tensors, MiB, writeback="fadvise"), None),
        "B 1 MiB, ds[a:b] = x": (lambda p: write_packed(p, tensors, MiB, direct=False), read_packed),
        "C = B 1 MiB + VDS views": (lambda p: write_packed(p, tensors, MiB, extra=add_views), read_views),
        "D = B 1 MiB + region refs": (lambda p: write_packed(p, tensors, MiB, extra=add_regions), read_regions),
        "E external raw + h5 index": (lambda p: write_external(p, tensors), read_external),
        "F contiguous/batch, own writes": (lambda p: durable(p, lambda t: write_contiguous(t, tensors, True)), read_packed),
        "F without fallocate": (lambda p: durable(p, lambda t: write_contiguous(t, tensors, False)), read_packed),
    })
    paths = {name: folder / f"v{i}.h5" for i, name in enumerate(variants)}
    wtimes: dict[str, list[float]] = {n: [] for n in variants}
    rtimes: dict[str, list[float]] = {n: [] for n in variants}
    originals = [a for _, _, a in tensors]
    for r in range(rounds + 1):  # round 0: warm-up, and every layout checked once
        for name, (write, read) in variants.items():
            for old in folder.glob(paths[name].name + "*"):  # no deletion inside the timing
                old.unlink()
            gc.collect()
            start = time.perf_counter()
            write(paths[name])
            if r:
                wtimes[name].append(time.perf_counter() - start)
            fsync_path(paths[name])  # untimed: no dirty pages left for the next variant's fsync
            if read is None:
                continue
            gc.collect()
            start = time.perf_counter()
            back = read(paths[name])
            if r:
                rtimes[name].append(time.perf_counter() - start)
            else:
                assert len(back) == len(originals) and all(
                    b.shape == a.shape and np.array_equal(b, a) for a, b in zip(originals, back)), name
    bare = statistics.median(wtimes["tofile (bare)"])
    synced = statistics.median(wtimes["tofile + fsync + rename"])
    print(f"\n{len(tensors)} tensors, {len({s for s, _, _ in tensors})} sites, {total / 1e6:.1f} MB; "
          f"median of {rounds} interleaved rounds; read = plain h5py, every tensor, CRC-32C verified")
    print(f"{'layout':32s} {'write ms':>9s} {'bare/w':>7s} {'sync/w':>7s} {'read ms':>8s} {'GB/s rd':>8s} "
          f"{'size MB':>8s} {'+bytes':>8s} {'GCOL':>5s}")
    for name in variants:
        w = statistics.median(wtimes[name])
        rd = f"{statistics.median(rtimes[name]) * 1e3:8.1f} {total / statistics.median(rtimes[name]) / 1e9:8.2f}" \
            if rtimes[name] else f"{'':8s} {'':8s}"
        size = size_of(paths[name])
        gcol = paths[name].read_bytes().count(b"GCOL")  # global heap collections
        print(f"{name:32s} {w * 1e3:9.1f} {bare / w:7.3f} {synced / w:7.3f} {rd} {size / 1e6:8.2f} "
              f"{size - total:8d} {gcol:5d}")
    print("bare/w = tofile time / this write time (goal >= 0.85); sync/w = (tofile + fsync + rename) / this; "
          "GCOL = global heap collections in the file (unchecksummed storage)")


# --- GIL --------------------------------------------------------------------------------------

def gil_probe(folder: Path, rounds: int) -> None:
    """Whether a call releases the GIL: a pure-Python loop on a second thread, its progress
    during one call on 64 MiB (tens of ms), over its progress during a sleep of the same
    length just before; the median over rounds. About 0 while the call holds the GIL for
    its whole length; near 1 when it releases it (and a core is free: the machine is shared)."""
    count, stop = [0], threading.Event()

    def busy():
        n = 0
        while not stop.is_set():
            for _ in range(100):
                n += 1
            count[0] = n

    size = 64 * MiB
    buf = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(buf)
    f = h5py.File(folder / "gil.h5", "w", libver=LIBVER)
    ds = f.create_dataset("x", shape=(size // 4,), chunks=(size // 4,), dtype="f4")
    raw = (folder / "gil.raw").open("wb")

    def tofile():
        raw.seek(0)
        buf.tofile(raw)

    works = {
        "h5py write_direct_chunk": lambda: ds.id.write_direct_chunk((0,), buf),
        "h5py ds[...] = x": lambda: ds.__setitem__(slice(None), buf.view(np.float32)),
        "numpy tofile": tofile,
        "google_crc32c.value": lambda: google_crc32c.value(buf),
        "numpy copyto": lambda: np.copyto(dst, buf),
        "sum(range(n)) (holds it)": lambda: sum(range(300_000)),
    }
    t = threading.Thread(target=busy)
    t.start()
    ratios: dict[str, list[float]] = {name: [] for name in works}
    try:
        for _ in range(rounds):
            for name, work in works.items():
                c0, start = count[0], time.perf_counter()
                work()
                took = time.perf_counter() - start
                during = count[0] - c0
                c0, start = count[0], time.perf_counter()
                time.sleep(took)
                idle = (count[0] - c0) / (time.perf_counter() - start) * took
                ratios[name].append(during / max(idle, 1))
    finally:
        stop.set()
        t.join()
        f.close()
        raw.close()
    print(f"\nGIL: a Python loop's progress on another thread during one call on 64 MiB, over its progress "
          f"during a sleep as long (0: the call holds the GIL; median of {rounds} rounds):")
    print("   " + ", ".join(f"{name} {statistics.median(v):.2f}" for name, v in ratios.items()))


# --- part 2: the writer must not hold the forward --------------------------------------------

class Inline:
    def __init__(self, chunk):
        self.chunk = chunk

    def open(self, path):
        self.w = Packed(path, self.chunk)

    def put(self, site, name, t):
        self.w.add(site, name, t.numpy())

    def close(self):
        self.w.close()


class Threaded(Inline):
    """Tensors handed to a writer thread by reference through a queue."""

    def __init__(self, chunk, nice: int = 0):
        super().__init__(chunk)
        self.nice = nice

    def open(self, path):
        self.q = queue.SimpleQueue()
        self.w = Packed(path, self.chunk)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        if self.nice:  # this thread only (Linux: a thread's own priority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        while (item := self.q.get()) is not None:
            self.w.add(*item)
        self.w.close()

    def put(self, site, name, t):
        self.q.put((site, name, t.numpy()))

    def close(self):
        self.q.put(None)
        self.thread.join()


def _child(conn, shm_name, size, consumed, chunk):
    shm = shared_memory.SharedMemory(name=shm_name)
    ring = np.ndarray((size,), np.uint8, shm.buf)
    w = None
    while True:
        msg = conn.recv()
        if msg[0] == "t":
            _, pos, skip, nbytes, dtype, shape, site, name = msg
            w.add(site, name, ring[pos:pos + nbytes].view(dtype).reshape(shape))
            consumed.value += skip + nbytes
        elif msg[0] == "open":
            w = Packed(Path(msg[1]), chunk)
        elif msg[0] == "close":
            w.close()
            conn.send("done")
        elif msg[0] == "ping":
            conn.send("ready")
        else:
            break
    del ring
    shm.close()


class Process:
    """A writer process: the forward side copies each tensor into a shared-memory ring
    buffer and sends (offset, dtype, shape) through a pipe; the child checksums and writes
    the chunks; it counts the bytes it has consumed, which frees ring space."""

    def __init__(self, chunk, size):
        self.size = size
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.ring = np.ndarray((size,), np.uint8, self.shm.buf)
        ctx = mp.get_context("spawn")
        self.consumed = ctx.RawValue("q", 0)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, self.shm.name, size, self.consumed, chunk), daemon=True)
        self.proc.start()
        self.produced = 0
        self.conn.send(("ping",))
        assert self.conn.recv() == "ready"

    def open(self, path):
        self.conn.send(("open", str(path)))

    def put(self, site, name, t):
        a = t.numpy().reshape(-1).view(np.uint8)
        n = a.size
        pos = self.produced % self.size
        skip = self.size - pos if pos + n > self.size else 0  # tensors stay contiguous
        while self.produced + skip + n - self.consumed.value > self.size:
            time.sleep(0.0002)
        pos = (pos + skip) % self.size
        self.ring[pos:pos + n] = a
        self.produced += skip + n
        self.conn.send(("t", pos, skip, n, t.numpy().dtype.str, tuple(t.shape), site, name))

    def close(self):
        self.conn.send(("close",))
        assert self.conn.recv() == "done"

    def shutdown(self):
        self.conn.send(("quit",))
        self.proc.join()
        del self.ring
        self.shm.close()
        self.shm.unlink()


class Handoff:
    """A store for ``blockdiff.capture.capture``: each distinct floating tensor of each site
    is handed to ``writer`` as the site closes (held until the end, as capture's aliases are)."""

    def __init__(self, writer):
        self.meta: dict = {}
        self.writer, self.seen = writer, {}

    def add(self, site):
        from blockdiff.site import iter_tensors

        k = 0
        for t in iter_tensors((site.args, site.kwargs, site.output)):
            if id(t) not in self.seen and t.is_floating_point():
                self.seen[id(t)] = t
                if self.writer is not None:
                    self.writer.put(site.order, f"t{k}", t)
                k += 1


def overlap(model, layout, ids, folder: Path, rounds: int, ring: int) -> None:
    import torch
    from overhead import forward

    from blockdiff.capture import Snapshots, capture

    writers = {"inline": Inline(MiB), "thread": Threaded(MiB), "thread (nice 10)": Threaded(MiB, nice=10)}
    start = time.perf_counter()
    writers["process"] = Process(MiB, ring)
    spawn = time.perf_counter() - start
    runs = iter(range(10**6))

    def captured(writer):
        def run():
            if writer is not None:
                writer.open(folder / f"cap{next(runs)}.h5")
            with torch.no_grad(), capture(model, layout, Handoff(writer), snapshot=Snapshots(by_reference="kept")):
                forward(model, ids)
            returned = time.perf_counter()
            if writer is not None:
                writer.close()
            return returned
        return run

    variants = {"plain forward": lambda: forward(model, ids), "capture, no writing": captured(None)}
    variants.update({f"{name} writer": captured(w) for name, w in writers.items()})
    # Each capture between two plain forwards; its ratio to the faster of the two (the
    # machine is shared: a neighbour's burst slows both sides of a pair alike or shows).
    plain = variants.pop("plain forward")
    ratios: dict[str, list[float]] = {n: [] for n in variants}
    returned: dict[str, list[float]] = {n: [] for n in variants}
    cpus: dict[str, list[float]] = {n: [] for n in variants}
    fastest: dict[str, list[float]] = {n: [] for n in variants}
    plains = []

    child = writers["process"].proc.pid
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        """CPU seconds of this process (every thread) and of the writer process."""
        with open(f"/proc/{child}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return time.process_time() + (int(fields[11]) + int(fields[12])) / tick

    def timed_run(fn):
        for old in folder.glob("cap*"):
            old.unlink()
        gc.collect()
        c0, start = cpu(), time.perf_counter()
        out = fn()
        end = time.perf_counter()
        return end - start, ((out if isinstance(out, float) else end) - start), cpu() - c0

    try:
        for r in range(rounds + 1):
            before = timed_run(plain)
            for name, fn in variants.items():
                took, back, spent = timed_run(fn)
                after = timed_run(plain)
                if r:
                    base = min(before[0], after[0])
                    plains.append(base)
                    ratios[name].append(took / base)
                    returned[name].append(back / base)
                    cpus[name].append(spent / min(before[2], after[2]))
                    fastest[name].append(took)
                before = after
        # Every writer's dump holds every tensor handed to it, each reading back as it was.
        for name, w in writers.items():
            for old in folder.glob("cap*"):
                old.unlink()
            handoff = Handoff(w)
            w.open(folder / "cap.h5")
            with torch.no_grad(), capture(model, layout, handoff, snapshot=Snapshots(by_reference="kept")):
                forward(model, ids)
            w.close()
            back = read_packed(folder / "cap.h5")
            count = len(handoff.seen)
            assert len(back) == count and all(
                np.array_equal(a, t.numpy()) for a, t in zip(back, handoff.seen.values())), name
    finally:
        writers["process"].shutdown()
    print(f"\nstreamed capture (packed, 1 MiB chunks, {count} tensors) / plain forward on {torch.get_num_threads()} "
          f"torch thread(s) "
          f"({statistics.median(plains) * 1e3:.0f} ms), median of {rounds} interleaved rounds "
          f"[range], each between two plain forwards; writer process spawned once ({spawn:.1f} s, not counted), ring {ring // MiB} MiB:")
    print(f"{'wall / plain forward':24s} {'dump durable':>20s} {'forward returned':>20s} {'CPU s / forward CPU s':>22s} "
          f"{'fastest / fastest':>17s}")
    for name in variants:
        v, b, c = ratios[name], returned[name], cpus[name]
        print(f"{name:24s} {statistics.median(v):7.3f} [{min(v):.2f}-{max(v):.2f}] "
              f"{statistics.median(b):7.3f} [{min(b):.2f}-{max(b):.2f}] "
              f"{statistics.median(c):7.3f} [{min(c):.2f}-{max(c):.2f}]  {min(fastest[name]) / min(plains):13.3f}")
    print("fastest / fastest: the variant's fastest durable capture over the fastest plain forward (the runs least "
          "disturbed by other load)")


def main() -> None:
    from overhead import build, setup

    from blockdiff import resolve
    from blockdiff.capture import record
    from blockdiff.site import iter_tensors
    from blockdiff.store import MemoryStore

    sizes, seq, _, ids, quick = setup(__doc__, repeat=7)
    model = build(8, **sizes)
    layout = resolve(model)
    store = MemoryStore()
    record(model, layout, store, ids)
    tensors, seen = [], set()
    for i, site in enumerate(store.sites()):
        k = 0
        for t in iter_tensors((site.args, site.kwargs, site.output)):
            if id(t) not in seen and t.is_floating_point():
                seen.add(id(t))
                tensors.append((i, f"t{k}", t.numpy()))
                k += 1
    print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"8 blocks, seq {seq}, float32, {torch_threads()} threads; h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}")
    folder = Path(tempfile.mkdtemp(prefix="dump_layouts_", dir=os.environ.get("BENCH_DIR")))
    try:
        layouts(tensors, folder, 3 if quick else 11)
        gil_probe(folder, 3 if quick else 9)
        largest = max(a.nbytes for _, _, a in tensors)
        import torch

        # Two threads (overhead.py's setting: no core is free for a writer) and one (a core
        # is free: what overlapping can win at best).
        for threads in (2, 1):
            torch.set_num_threads(threads)
            overlap(model, layout, ids, folder, 3 if quick else 5, ring=max(64 * MiB, 2 * largest))
    finally:
        shutil.rmtree(folder)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
