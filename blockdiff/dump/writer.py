"""The write side of a dump: :class:`DumpWriter` streams captured sites into an HDF5 file.

Capture hands each site to :meth:`DumpWriter.add`, which encodes its structure and hands
its tensors to the writer's thread, about 8 MiB at a time, without waiting for libhdf5.
For each such batch the thread has libhdf5 allocate one contiguous dataset per stored
dtype and writes the tensors' bytes into it with its own ``pwritev`` (libhdf5 keeps
the file's structure, the writer the bytes: :class:`_Contiguous`); compressed dumps
append to one chunked dataset per dtype through libhdf5 instead (:class:`_Packed`). The
JSON index of sites and tensors, the metadata digest and ``complete`` are written at
close, and the file is renamed to its final path only after a clean close (schema 4,
``docs/dump-format.md``).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import google_crc32c
import h5py
import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import DumpError, TensorChanged
from ..site import Opaque, Site
from .format import (
    _NUMPY_NATIVE,
    _RAW_BITS,
    LIBVER,
    PACKED_CHUNK_BYTES,
    SCHEMA_VERSION,
    STANDARD_ATTRIBUTES,
    _encode_meta,
    _Object,
    _set_attr,
    _crc32c,
    file_attributes,
    finish_file,
    site_record,
    stored_name,
)

_COMPRESSIONS = (None, "lzf", "gzip")
_BIG_ENDIAN = sys.byteorder == "big"  # a dump's bytes are little-endian


# ---------------------------------------------------------------------------------------
# meta values


def _encode_attr(key: str, value: Any) -> tuple[Any, bool]:
    """A meta value as stored: ``(value, is_json)``."""
    if isinstance(value, (torch.dtype, torch.device)):
        value = dtype_name(value) if isinstance(value, torch.dtype) else str(value)
    return _encode_meta(key, value)


# ---------------------------------------------------------------------------------------
# structures


class _Pending:
    """One tensor of a site on its way to the writer's thread: its index entry (the thread
    adds its checksum), its bytes as stored, and, for a tensor the capture holds by
    reference, the tensor and the version counter it had when handed over."""

    __slots__ = ("entry", "flat", "holder", "version", "site")

    def __init__(self, entry: dict, flat: np.ndarray, holder: torch.Tensor | None, version: int | None, site: str) -> None:
        self.entry, self.flat, self.holder, self.version, self.site = entry, flat, holder, version, site


class _Encoder:
    """Encodes one structure into JSON nodes; its tensors become entries of the index
    (``{"type": "tensor", "ref": N}``, N their position in the index's ``tensors``)."""

    def __init__(self, writer: "DumpWriter", label: str) -> None:
        self.writer = writer
        self.label = label
        # id(tensor) -> ref, so a tensor passed twice is stored once and comes back as one
        # object; the tensors are kept alive so their ids stay unique.
        self.refs: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []
        self.pending: list[_Pending] = []
        self.shared: dict[int, tuple] = {}  # new entries for the writer's table of written tensors

    def node(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return {"type": "tensor", "ref": self.tensor(obj)}
        if obj is None:
            return {"type": "none"}
        if isinstance(obj, bool):
            return {"type": "bool", "value": obj}
        if isinstance(obj, int):
            return {"type": "int", "value": int(obj)}
        if isinstance(obj, float):
            # repr round-trips every float exactly, inf and nan included.
            return {"type": "float", "value": repr(float(obj))}
        if isinstance(obj, str):
            return {"type": "str", "value": str(obj)}
        if isinstance(obj, torch.dtype):
            return {"type": "dtype", "value": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"type": "device", "value": str(obj)}
        if isinstance(obj, Opaque):
            return {"type": "opaque", "value": obj.type_name}
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return {
                "type": "tuple",
                "items": [self.node(v) for v in obj],
                "namedtuple": type(obj).__name__,
                "fields": list(obj._fields),
            }
        if isinstance(obj, tuple):
            return {"type": "tuple", "items": [self.node(v) for v in obj]}
        if isinstance(obj, list):
            return {"type": "list", "items": [self.node(v) for v in obj]}
        if isinstance(obj, dict):
            return {"type": "dict", "items": [[self.node(k), self.node(v)] for k, v in obj.items()]}
        # HF ModelOutput and similar containers behave as ordered dicts (as in site.py).
        if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):
            return {"type": "dict", "items": [[self.node(k), self.node(obj[k])] for k in obj.keys()]}
        return {"type": "opaque", "value": type(obj).__name__}

    def tensor(self, t: torch.Tensor) -> int:
        key = id(t)
        if key in self.refs:
            return self.refs[key]
        self._alive.append(t)
        earlier = self.writer._written.get(key)
        if earlier is not None and earlier[0]() is t:
            # Capture shares one copy between sites (a block's output is the next block's
            # input): stored once, both sites refer to the same entry.
            self.refs[key] = earlier[1]
            return earlier[1]
        if t.layout != torch.strided or t.is_quantized:
            raise DumpError(f"cannot store a {t.layout} / {t.dtype} tensor: only dense tensors are supported")
        original = t
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
        if t.dtype in _NUMPY_NATIVE:
            arr = t.numpy()
        elif t.element_size() in _RAW_BITS:
            signed, unsigned, _ = _RAW_BITS[t.element_size()]
            arr = t.view(signed).numpy().view(unsigned)
        else:
            raise DumpError(f"cannot store a {t.dtype} tensor: element size {t.element_size()} bytes")
        flat = arr.reshape(-1)
        if _BIG_ENDIAN:
            flat = np.ascontiguousarray(flat, dtype=flat.dtype.newbyteorder("<"))
        # Its dataset and offset are given when the tensor is handed to the writer's thread.
        entry = {"data": None, "offset": None, "count": int(flat.size), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        ref = len(self.writer._tensors) + len(self.pending)
        # A tensor the model still owns may be written to in place before the thread has
        # copied it: its version counter, checked after the copy, says so.
        shares = flat.size and t.data_ptr() == original.data_ptr() and original.device.type == "cpu"
        version = getattr(original, "_version", None) if shares and not original.is_inference() else None
        self.pending.append(_Pending(entry, flat, original if version is not None else None, version, self.label))
        self.refs[key] = ref
        self.shared[key] = (original, ref)
        return ref


class _Packed:
    """A compressed dump's dataset of one stored dtype, ``tensors/<dtype>``: elements
    appended in order through libhdf5's filters, in whole 1 MiB chunks as they fill (a
    staging buffer collects what does not fill one)."""

    def __init__(self, group: h5py.Group, name: str, dtype: np.dtype, compression: dict[str, Any], checksums: bool) -> None:
        self.group = group
        self.name = name
        self.dtype = np.dtype(dtype)
        self.chunk = max(1, PACKED_CHUNK_BYTES // self.dtype.itemsize)
        self.compression = compression
        self.checksums = checksums
        self.buffer: np.ndarray | None = None
        self.fill = 0  # elements in the staging buffer
        self.chunks = 0  # whole chunks written
        self.dset: h5py.h5d.DatasetID | None = None
        self.extent = 0  # the dataset's extent: whole chunks written, and room for more

    @property
    def length(self) -> int:
        return self.chunks * self.chunk + self.fill

    def append(self, flat: np.ndarray) -> None:
        pos, n = 0, flat.size
        while pos < n:
            if self.fill == 0 and n - pos >= self.chunk:  # a whole chunk straight from the tensor
                self._write(flat[pos : pos + self.chunk], self.chunk)
                pos += self.chunk
                continue
            if self.buffer is None:
                self.buffer = np.empty(self.chunk, dtype=self.dtype)
            take = min(self.chunk - self.fill, n - pos)
            self.buffer[self.fill : self.fill + take] = flat[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == self.chunk:
                self.fill = 0
                self._write(self.buffer, self.chunk)

    def finish(self) -> _Object:
        """Write what is left; returns what the metadata digest records of the dataset."""
        length = self.length
        if self.dset is None:
            # Smaller than one chunk: one chunk of exactly its size.
            self.chunk = max(self.fill, 1)
            self._create()
        if self.fill:
            self._write(self.buffer[: self.fill], self.fill)
        self.dset.set_extent((length,))
        self.fill = 0
        return _Object("dataset", {}, self.dtype.str, (length,))

    def _create(self) -> None:
        # fletcher32 guards compressed chunks before they reach the decompressor.
        dset = self.group.create_dataset(
            self.name, shape=(0,), maxshape=(None,), chunks=(self.chunk,), dtype=self.dtype,
            fletcher32=self.checksums, track_times=False, **self.compression,
        )
        self.dset = dset.id

    def _write(self, data: np.ndarray, valid: int) -> None:
        """Chunk number ``self.chunks``: its first ``valid`` elements, ``data``."""
        if self.dset is None:
            self._create()
        start = self.chunks * self.chunk
        if start + valid > self.extent:
            # Grown 64 chunks at a time (a dataset's extent is metadata libhdf5 rewrites);
            # the exact length is set in finish.
            self.extent = start + 64 * self.chunk
            self.dset.set_extent((self.extent,))
        space = self.dset.get_space()
        space.select_hyperslab((start,), (valid,))
        self.dset.write(h5py.h5s.create_simple((valid,)), space, np.ascontiguousarray(data[:valid]))
        if valid == self.chunk:
            self.chunks += 1


class _Contiguous:
    """An uncompressed dump's datasets, ``tensors/<dtype>.<n>``: one per stored dtype for
    each batch handed to the writer's thread, as long as the batch's tensors of that dtype.

    libhdf5 allocates each dataset's space at once (contiguous, never filled, starting on
    a page) and keeps the file's structure; the writer writes the tensors' bytes there
    itself (``pwritev`` on libhdf5's own file descriptor, after ``fallocate``), so that
    what a dump costs is the bytes: chunks written through libhdf5 reached 0.71-0.80 of
    ``numpy.tofile`` (``benchmarks/overhead.py``, figure 3). Where the platform has no
    ``pwrite`` or libhdf5's file driver gives no descriptor, libhdf5 writes them."""

    def __init__(self, group: h5py.Group, fd: int | None) -> None:
        self.group = group
        self.dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self.dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        self.dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        self.dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every byte is written, once
        self.dcpl.set_obj_track_times(False)
        self.fd = fd if hasattr(os, "pwrite") else None

    def write(self, name: str, dtype: np.dtype, arrays: list[np.ndarray]) -> _Object:
        """A new dataset ``name`` holding ``arrays`` one after the other; returns what the
        metadata digest records of it."""
        count = sum(a.size for a in arrays)
        space = h5py.h5s.create_simple((count,))
        dset = h5py.h5d.create(self.group.id, name.encode(), h5py.h5t.py_create(dtype, logical=1), space, dcpl=self.dcpl)
        offset = dset.get_offset() if count else None
        if offset is not None and self.fd is not None:
            views = [memoryview(a).cast("B") for a in arrays if a.size]
            nbytes = sum(len(v) for v in views)
            if _FALLOCATE is not None and nbytes >= _FALLOCATE_BYTES:
                # The dataset's blocks, allocated at once (as numpy.tofile does for
                # arrays of 16 MiB or more): writing into them skips the filesystem's
                # delayed allocation page by page (ext4 here: figure 3 of
                # benchmarks/overhead.py 0.70-0.71 against 0.60-0.64).
                _FALLOCATE(self.fd, _FALLOC_FL_KEEP_SIZE, offset, nbytes)
            _pwrite_all(self.fd, views, offset)
        elif count:
            start = 0
            for a in arrays:
                if a.size:
                    space.select_hyperslab((start,), (a.size,))
                    dset.write(h5py.h5s.create_simple((a.size,)), space, a)
                    start += a.size
        return _Object("dataset", {}, np.dtype(dtype).str, (count,))


_IOV_MAX = 1024  # buffers per pwritev (POSIX guarantees at least 16; Linux and macOS: 1024)
# Bytes per write call. From the writer's thread, 8 MiB calls ran at a tenth of the speed
# of the same calls from the main thread in most runs on the test machine
# (benchmarks/overhead.py, figure 2: 1.98 against 1.25); 1 MiB calls did not.
_WRITE_BYTES = 1 << 20


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` one after the other at ``offset``, at most ``_WRITE_BYTES`` per
    call: ``pwritev``, or ``pwrite`` where there is none; short writes continued."""
    pieces = [v[i : i + _WRITE_BYTES] for v in views for i in range(0, len(v), _WRITE_BYTES)]
    i = 0
    while i < len(pieces):
        batch, size = [], 0
        for piece in pieces[i : i + _IOV_MAX]:
            if size + len(piece) > _WRITE_BYTES and batch:
                break
            batch.append(piece)
            size += len(piece)
        done = os.pwritev(fd, batch, offset) if hasattr(os, "pwritev") else os.pwrite(fd, batch[0], offset)
        if done <= 0:
            raise OSError(f"write returned {done}")
        offset += done
        while i < len(pieces) and done >= len(pieces[i]):
            done -= len(pieces[i])
            i += 1
        if done:
            pieces[i] = pieces[i][done:]


# ---------------------------------------------------------------------------------------
# writer

# Bytes of tensors handed to the writer's thread and not yet written; ``add`` waits above it
# (a single larger tensor is always accepted).
_IN_FLIGHT_BYTES = 64 * 2**20
# Tensors are handed over once this many bytes were added (or at close).
_BATCH_BYTES = 8 * 2**20
# ... the first time once this many were: the thread starts writing sooner.
_FIRST_BATCH_BYTES = 1 * 2**20
# A durable dump starts writing dirty pages back to disk every this many bytes, so the
# fsync at close waits for the tail only (Linux; elsewhere the fsync does it all).
_WRITEBACK_BYTES = 8 * 2**20
# Datasets of this many bytes or more start at a multiple of this many bytes in the file.
_ALIGN_ABOVE, _ALIGN = 64 * 2**10, 4096


def _linux_call(name: str, *argtypes: Any) -> Callable | None:
    """A Linux system call Python's ``os`` does not wrap (``sync_file_range``,
    ``fallocate``), through libc, or ``None`` elsewhere. ctypes lets go of the GIL."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _linux_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
# Failures are harmless (a filesystem without it): the write allocates the blocks itself.
_FALLOCATE = _linux_call("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_FALLOC_FL_KEEP_SIZE = 1  # the file's size is what is written
# Not below this (a system call for nothing).
_FALLOCATE_BYTES = 1 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages back; do not wait


class DumpWriter:
    """Streams sites into an HDF5 dump; a :class:`~blockdiff.store.SiteStore` for capture.

    The file is written under a temporary name (``.NAME.tmp-PID``) in the target
    directory. A clean :meth:`close` (or leaving the ``with`` block without an exception)
    writes the index, the ``metadata_digest`` and then ``complete`` last, and renames the
    file to ``path`` atomically. An exception inside the ``with`` block, or :meth:`abort`,
    removes the temporary file and leaves nothing at ``path``.

    :meth:`add` encodes a site and hands its tensors to the writer's thread (the first
    time after 1 MiB, then every 8 MiB), which writes them, and takes their checksums when
    it has nothing to write, while the caller goes on (the forward is not held by libhdf5);
    at close the caller takes the checksums left. The thread keeps a reference to each tensor until its
    bytes are written, at most 64 MiB of them at a time;
    a tensor changed in place before then (its version counter moved) fails the dump with
    :class:`~blockdiff.errors.TensorChanged`, at the next :meth:`add` or at :meth:`close`.

    Args:
        path: where the finished dump goes (replaced if it exists).
        meta: what the capture was (model spec, hook map, device, dtype, input digest, ...):
            str/int/float/bool values stored as attributes, lists/dicts/None as JSON.
        compress: ``None``, ``"lzf"`` or ``"gzip"`` for the tensor datasets.
        checksums: ``False`` writes neither the fletcher32 filter (compressed dumps) nor the
            CRC-32C of each tensor, to measure what they cost (``benchmarks/overhead.py``);
            such a dump reads only with ``verify=False``.
        durable: flush the file to disk (fsync) before the rename and the folder after, so
            that the dump survives a power loss too. Without it (the default, as for
            ``torch.save`` or h5py) the dump is still atomic for every process (the rename),
            and a file an operating-system crash left torn is refused by the reader
            (``complete``, checksums), never misread.

    >>> with DumpWriter("ref.h5", meta={"model": "m.py:build", "dtype": "float32"}) as w:
    ...     w.add_inputs(token_ids)                                  # doctest: +SKIP
    ...     w.add(site)                                              # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        meta: dict[str, Any],
        compress: str | None = None,
        checksums: bool = True,
        durable: bool = False,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        if compress not in _COMPRESSIONS:
            raise DumpError(
                f"{self.path}: compress must be None, 'lzf' or 'gzip', got {compress!r}", path=str(self.path)
            )
        self.meta: dict[str, Any] = dict(meta)
        encoded_meta = self._check_meta()
        self.compress = compress
        self.checksums = checksums
        self._compression: dict[str, Any] = {}
        if compress == "gzip":
            self._compression = {"compression": "gzip", "compression_opts": 4, "shuffle": True}
        elif compress == "lzf":
            self._compression = {"compression": "lzf", "shuffle": True}
        self.tmp_path = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        # The index, built as sites arrive: tensor entries and site records.
        self._tensors: list[dict[str, Any]] = []
        self._sites: list[dict[str, Any]] = []
        self._structures: dict[str, Any] = {}  # inputs, floors
        # Given out to tensors per stored dtype: datasets (``float32.N``), or in a compressed
        # dump the elements of its one dataset (``float32``).
        self._given: dict[str, int] = {}
        # Tensors stored by earlier sites: id -> (weak reference, ref), see _Encoder.tensor.
        self._written: dict[int, tuple] = {}
        # What the metadata digest covers, recorded as it is written (not read back).
        self._root: dict[str, Any] = {}
        self._objects: dict[str, _Object] = {}
        self._meta_keys: list[str] = []
        self._meta_written: list[tuple[str, Any, bool]] | None = None
        self._file: h5py.File | None = None
        self._created = False
        self._packed: dict[str, _Packed] = {}  # compressed
        self._contiguous: _Contiguous | None = None  # uncompressed
        self._failed: BaseException | None = None  # the first failure on the writer's thread
        self._in_flight = 0
        self._room = threading.Condition()
        # Handed to the thread, checksum not taken yet: the thread takes them from the
        # left when it has nothing to write, the caller from the right at close.
        self._unsummed: deque[_Pending] = deque()
        self._handed = self._started = 0  # batches handed to the thread (by the caller), started (by the thread)
        self._summing_done = threading.Event()  # set when the caller's share is done, at close
        self._index_bytes: bytes | None = None  # the index, when the caller could encode it
        self._batch: list[_Pending] = []  # added, not handed to the thread yet
        self._batch_bytes = 0
        self._unsynced = 0
        self._fd: int | None = None  # libhdf5's file descriptor, for a durable dump's writeback
        # Every libhdf5 call of this writer runs on one thread of its own: glibc gives that
        # thread its own heap, so libhdf5's long-lived small allocations do not pin the heap
        # between the model's freed activations (they did, and a streamed capture's resident
        # size grew by ~12 MiB per block); and the forward does not wait for them.
        problem = _folder_problem(self.path.parent)
        if problem is not None:
            raise DumpError(f"{self.path}: cannot create the dump: {problem}", path=str(self.path))
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="blockdiff-dump")
        # The file is created on the writer's thread, the caller waiting (outside the GIL:
        # with both running Python, the thread would wait for it, up to the interpreter's
        # switch interval of 5 ms at a time).
        self._worker.submit(self._create, encoded_meta).result()
        if self._failed is not None:
            self._stop_worker()
            self._raise_failure()

    def _on_worker(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn`` on the writer's thread after everything handed to it, and wait."""
        if self._worker is None:  # closed: nothing left to hand over
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    def _create(self, encoded_meta: list[tuple[str, Any, bool]]) -> None:
        try:
            # Tensor data starts on a page boundary (whole pages of the page cache).
            self._file = h5py.File(self.tmp_path, "w", libver=LIBVER, alignment_threshold=_ALIGN_ABOVE, alignment_interval=_ALIGN)
            self._created = True
        except Exception as exc:
            problem = _folder_problem(self.path.parent) or _one_line(exc)
            self._failed = DumpError(f"{self.path}: cannot create the dump: {problem}", path=str(self.path))
            return
        try:
            for key, value in file_attributes(SCHEMA_VERSION, str(torch.__version__)).items():
                self._root[key] = _set_attr(self._file, key, value)
            # Encoded by the caller: it may change ``meta`` while this thread works.
            self._write_meta(encoded_meta)
            self._group = self._file.create_group("tensors")
            self._objects["tensors"] = _Object("group", {})
            handle = self._file.id.get_vfd_handle()
            fd = handle if isinstance(handle, int) else None  # libhdf5's, on POSIX
            if not self._compression:
                self._contiguous = _Contiguous(self._group, fd)
            if self.durable and _SYNC_FILE_RANGE is not None:
                self._fd = fd
        except BaseException as exc:
            self._abort()
            self._failed = exc

    # -- SiteStore (write side)

    def add(self, site: Site) -> None:
        """Record one site (the index's ``sites[N]``, N: how many were added before); its
        tensors are written by the writer's thread."""
        self._check_open()
        label = f"sites[{len(self._sites)}] ({site.label})"
        enc = _Encoder(self, label)
        try:
            structure = {
                "args": enc.node(tuple(site.args)),
                "kwargs": enc.node(dict(site.kwargs)),
                "output": enc.node(site.output),
            }
        except Exception as exc:
            # Nothing of the site was kept: the index and the packed datasets are as before.
            if isinstance(exc, DumpError):
                raise DumpError(f"{self.path}: site {site.label}: {exc}", path=str(self.path), site=site.label) from exc
            raise DumpError(
                f"{self.path}: cannot write site {site.label}: {type(exc).__name__}: {exc}",
                path=str(self.path),
                site=site.label,
            ) from exc
        # The index lists sites in the order they were added (calls finishing, when streamed).
        self._sites.append({**site_record(site), "structure": structure})
        self._commit(enc)

    def add_inputs(self, obj: Any) -> None:
        """Record the run's model inputs (a tensor, a tuple or a dict): the index's ``inputs``."""
        self._add_structure("inputs", obj)

    def add_floors(self, floors: dict[str, Any]) -> None:
        """Record noise floors measured at capture: the index's ``floors``, by precision
        label (``bfloat16@cpu``) a dict with ``dtype``, ``device`` and ``values`` (check key
        → a number, a list of numbers, or a router's output). Schema 3 and later."""
        self._add_structure("floors", floors)

    def _add_structure(self, name: str, obj: Any) -> None:
        self._check_open()
        if name in self._structures:
            raise DumpError(f"{self.path}: {name} were already recorded", path=str(self.path))
        enc = _Encoder(self, f"/{name}")
        try:
            node = enc.node(obj)
        except Exception as exc:
            raise DumpError(
                f"{self.path}: cannot write the {name}: {type(exc).__name__}: {exc}", path=str(self.path)
            ) from exc
        self._structures[name] = node
        self._commit(enc)

    def _commit(self, enc: _Encoder) -> None:
        """Take an encoded structure's tensors into the index and hand them to the thread."""
        self._tensors.extend(p.entry for p in enc.pending)
        written = self._written
        for key, (tensor, ref) in enc.shared.items():
            try:
                # The callback must not hold this writer's encoder: it keeps tensors alive.
                written[key] = (weakref.ref(tensor, lambda _, key=key: written.pop(key, None)), ref)
            except TypeError:
                pass
        if not enc.pending:
            return
        self._batch.extend(enc.pending)
        self._batch_bytes += sum(p.flat.nbytes for p in enc.pending)
        if self._batch_bytes >= (_BATCH_BYTES if self._handed else _FIRST_BATCH_BYTES):
            self._hand_over()

    def _hand_over(self) -> None:
        """Hand the tensors added since the last time to the writer's thread (in batches:
        each hand-over wakes the thread and passes the GIL back and forth)."""
        pending, nbytes = self._batch, self._batch_bytes
        if not pending:
            return
        self._batch, self._batch_bytes = [], 0
        groups = self._place(pending)
        with self._room:
            while self._in_flight and self._in_flight + nbytes > _IN_FLIGHT_BYTES and self._failed is None:
                self._room.wait()
            self._in_flight += nbytes
        self._check_open()
        if self.checksums:
            self._unsummed.extend(pending)
        self._handed += 1
        self._worker.submit(self._write_tensors, groups, nbytes)
        time.sleep(0)  # the GIL, to the thread now: it starts writing, then lets go of it

    def _place(self, pending: list[_Pending]) -> list[tuple[str, list[_Pending]]]:
        """Where each tensor of a batch goes (its index entry's ``data`` and ``offset``):
        uncompressed, a new dataset per stored dtype (``float32.3``); compressed, the end
        of its dtype's one dataset (``float32``). Returns the tensors by dataset."""
        groups: dict[str, list[_Pending]] = {}
        for p in pending:
            groups.setdefault(stored_name(p.flat.dtype), []).append(p)
        out = []
        for base, items in groups.items():
            given = self._given.get(base, 0)
            name, offset = (base, given) if self.compress else (f"{base}.{given}", 0)
            for p in items:
                p.entry["data"], p.entry["offset"] = name, offset
                offset += p.flat.size
            self._given[base] = offset if self.compress else given + 1
            out.append((name, items))
        return out

    def _write_tensors(self, groups: list[tuple[str, list[_Pending]]], nbytes: int) -> None:
        self._started += 1
        try:
            for name, items in groups:
                if self._failed is not None:
                    break
                self._write_dataset(name, items)
            # Checksums while there is nothing to write (writing comes first: the file is
            # the slower of the two).
            while self._started == self._handed and self._failed is None and self._sum_one(self._unsummed.popleft):
                pass
        except BaseException as exc:
            self._failed = self._failed or exc
        finally:
            with self._room:
                self._in_flight -= nbytes
                self._room.notify_all()

    def _write_dataset(self, name: str, items: list[_Pending]) -> None:
        """One dataset's tensors of a batch: written, then their version counters checked."""
        try:
            if self._contiguous is not None:
                self._objects[f"tensors/{name}"] = self._contiguous.write(name, items[0].flat.dtype, [p.flat for p in items])
            else:
                packed = self._packed.get(name)
                if packed is None:
                    packed = self._packed[name] = _Packed(self._group, name, items[0].flat.dtype, self._compression, self.checksums)
                for p in items:
                    packed.append(p.flat)
        except Exception as exc:
            site = items[0].site
            raise DumpError(
                f"{self.path}: cannot write site {site}: {type(exc).__name__}: {_one_line(exc)}", path=str(self.path), site=site
            ) from exc
        for p in items:
            _check_unchanged(p)
        self._unsynced += sum(p.flat.nbytes for p in items)
        if self._fd is not None and self._unsynced >= _WRITEBACK_BYTES:
            # Dirty pages start going to disk now, while the writer goes on.
            self._unsynced = 0
            _SYNC_FILE_RANGE(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def _sum_one(self, pop: Callable[[], _Pending]) -> bool:
        """Take the checksum of one tensor of ``_unsummed`` (``pop`` says which end);
        ``False`` when there is none. Run on the writer's thread and, at close, on the
        caller's too: each tensor's by one of them, outside the GIL (``_crc32c``)."""
        try:
            p = pop()
        except IndexError:
            return False
        p.entry["crc32c"] = _crc32c(p.flat)
        _check_unchanged(p)  # its bytes written may be the ones summed only if it is
        return True

    # -- lifecycle

    def close(self) -> None:
        """Finish the dump: the index, metadata digest, ``complete`` last, atomic rename."""
        try:
            if self._worker is not None and self._failed is None:
                self._hand_over()
        except BaseException as exc:  # finished below: the dump is removed, this raised
            self._failed = self._failed or exc
        if self._worker is None:
            self._close()
            return
        # While the thread writes what is left (then takes checksums from the first tensor
        # on), the caller takes the checksums from the last tensor back.
        done = self._worker.submit(self._close)
        try:
            while self._failed is None and self._sum_one(self._unsummed.pop):
                pass
            if self._failed is None and all("crc32c" in t for t in self._tensors):
                # Every checksum is in: the index, encoded here while the thread writes.
                self._index_bytes = self._encode_index()
        except BaseException as exc:
            self._failed = self._failed or exc
        finally:
            self._summing_done.set()
            try:
                done.result()
            finally:
                self._stop_worker()

    def _close(self) -> None:
        if self._file is None:  # closed before, or never created
            self._raise_failure()
            return
        f = self._file
        try:
            while self._failed is None and self._sum_one(self._unsummed.popleft):
                pass
            if self._worker is not None:
                self._summing_done.wait()  # the caller's share
            self._raise_failure()
            self._write_meta()
            for name, packed in self._packed.items():
                self._objects[f"tensors/{name}"] = packed.finish()
            self._write_index(f)
            self._file = None
            finish_file(f, self._root, self._objects, self.tmp_path, self.path, durable=self.durable)
        except BaseException as exc:
            self._abort()
            if isinstance(exc, Exception) and not isinstance(exc, (DumpError, TensorChanged)):
                raise DumpError(f"{self.path}: cannot finish the dump: {_one_line(exc)}", path=str(self.path)) from exc
            raise

    def _encode_index(self) -> bytes:
        index = {"tensors": self._tensors, "sites": self._sites, **self._structures}
        return json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def _write_index(self, f: h5py.File) -> None:
        """``/index``: one fixed-length UTF-8 string of JSON (inside the file's checksummed
        structures, unlike a variable-length one) and its CRC-32C."""
        data = self._index_bytes if self._index_bytes is not None else self._encode_index()
        size = max(len(data), 1)
        tid = h5py.h5t.C_S1.copy()
        tid.set_size(size)
        tid.set_cset(h5py.h5t.CSET_UTF8)
        tid.set_strpad(h5py.h5t.STR_NULLPAD)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_obj_track_times(False)
        dset = h5py.h5d.create(f.id, b"index", tid, h5py.h5s.create(h5py.h5s.SCALAR), dcpl=dcpl)
        dset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(data, dtype=f"S{size}"), mtype=tid)
        attrs = {}
        if self.checksums:
            attrs["crc32c"] = _set_attr(dset, "crc32c", format(google_crc32c.value(data), "08x"))
        self._objects["index"] = _Object("dataset", attrs, np.dtype(f"S{size}").str, ())

    def abort(self) -> None:
        """Discard the dump: close and remove the temporary file; nothing at ``path``."""
        if self._failed is None:  # what waits for the thread is not written any more
            self._failed = DumpError(f"{self.path}: the dump was discarded", path=str(self.path))
        try:
            self._on_worker(self._abort)
        finally:
            self._stop_worker()

    def _abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass  # the file is being thrown away; its removal below is what matters
        if self._created:  # only a file this writer made
            try:
                os.remove(self.tmp_path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "DumpWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def __len__(self) -> int:
        """Number of sites added so far."""
        return len(self._sites)

    def __repr__(self) -> str:
        state = "open" if self._worker is not None else "closed"
        return f"DumpWriter({str(self.path)!r}, sites={len(self._sites)}, {state})"

    # -- helpers

    def _check_open(self) -> None:
        if self._worker is None:
            raise DumpError(f"{self.path}: the dump writer is closed", path=str(self.path))
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raise what failed on the writer's thread (the dump cannot be finished)."""
        failed = self._failed
        if failed is None:
            return
        if isinstance(failed, (DumpError, TensorChanged)):
            raise failed
        raise DumpError(
            f"{self.path}: cannot write the dump: {type(failed).__name__}: {_one_line(failed)}", path=str(self.path)
        ) from failed

    def _check_meta(self) -> list[tuple[str, Any, bool]]:
        """Every meta entry as stored, ``(key, value, is_json)``, after checking the keys."""
        encoded = []
        for key in self.meta:
            if not isinstance(key, str) or not key:
                raise DumpError(f"{self.path}: meta keys must be non-empty strings, got {key!r}", path=str(self.path))
            if key in STANDARD_ATTRIBUTES:
                raise DumpError(
                    f"{self.path}: meta key {key!r} is reserved for the dump format "
                    f"(reserved: {', '.join(STANDARD_ATTRIBUTES)})",
                    path=str(self.path),
                )
            encoded.append((key, *_encode_attr(key, self.meta[key])))
        return encoded

    def _write_meta(self, encoded: list[tuple[str, Any, bool]] | None = None) -> None:
        """The meta entries as file attributes (again at close, should ``meta`` have
        changed since the dump was created)."""
        if encoded is None:
            encoded = self._check_meta()
        if encoded == self._meta_written:
            return
        f = self._file
        for key in [*self._meta_keys, "json_attributes"]:
            if key in f.attrs:
                del f.attrs[key]
                del self._root[key]
        json_keys = []
        for key, stored, is_json in encoded:
            self._root[key] = _set_attr(f, key, stored)
            if is_json:
                json_keys.append(key)
        self._root["json_attributes"] = _set_attr(f, "json_attributes", json.dumps(json_keys))
        self._meta_keys = list(self.meta)
        self._meta_written = encoded


def _check_unchanged(p: _Pending) -> None:
    """Fail the dump if the model changed a tensor in place after it was handed over."""
    if p.holder is not None and p.holder._version != p.version:
        raise TensorChanged(f"{p.site}: a tensor it recorded was changed in place before it was written")


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (libhdf5's carry the time, newline included)."""
    return " ".join(str(exc).split())


def _folder_problem(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder``, in the user's words, or ``None`` when
    the folder looks fine (libhdf5's own message names the temporary file and its
    internals)."""
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None
