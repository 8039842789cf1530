"""The write side of a dump: :class:`DumpWriter` streams captured sites into an HDF5 file.

Capture hands each site to :meth:`DumpWriter.add`, which encodes its structure and hands
its tensors to the writer's thread without waiting for libhdf5. The thread appends each
tensor's bytes to one dataset per stored dtype in whole chunks (:class:`_Packed`); the
JSON index of sites and tensors, the metadata digest and ``complete`` are written at
close, and the file is renamed to its final path only after a clean close (schema 4,
``docs/dump-format.md``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
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
        self.reserved: dict[str, int] = {}  # elements taken per packed dataset, not yet committed
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
        data = stored_name(flat.dtype)
        offset = self.writer._reserved.get(data, 0) + self.reserved.get(data, 0)
        self.reserved[data] = self.reserved.get(data, 0) + flat.size
        entry = {"data": data, "offset": offset, "count": int(flat.size), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
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
    """One stored dtype's dataset, ``tensors/<dtype>``: elements appended in order, written
    in whole chunks as they fill (a staging buffer collects what does not fill one)."""

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
        elif self.fill:
            # The last, partial chunk: stored whole (its tail zeroed, past the extent).
            self.buffer[self.fill :] = 0
            self._write(self.buffer, self.fill)
        self.dset.set_extent((length,))
        self.fill = 0
        return _Object("dataset", {}, self.dtype.str, (length,))

    def _create(self) -> None:
        if self.compression:
            # fletcher32 guards compressed chunks before they reach the decompressor.
            dset = self.group.create_dataset(
                self.name, shape=(0,), maxshape=(None,), chunks=(self.chunk,), dtype=self.dtype,
                fletcher32=self.checksums, track_times=False, **self.compression,
            )
            self.dset = dset.id
            return
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((self.chunk,))
        dcpl.set_obj_track_times(False)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every chunk is written whole, at once
        space = h5py.h5s.create_simple((0,), (h5py.h5s.UNLIMITED,))
        self.dset = h5py.h5d.create(self.group.id, self.name.encode(), h5py.h5t.py_create(self.dtype, logical=1), space, dcpl=dcpl)

    def _write(self, data: np.ndarray, valid: int) -> None:
        """Chunk number ``self.chunks``: ``data`` (a whole chunk's elements), of which the
        first ``valid`` are inside the dataset."""
        if self.dset is None:
            self._create()
        start = self.chunks * self.chunk
        if valid < self.chunk:
            self.dset.set_extent((start + valid,))  # the last chunk: the exact length
        elif start + valid > self.extent:
            # Grown 64 chunks at a time (a dataset's extent is metadata libhdf5 rewrites);
            # the exact length is set by the last chunk, or in finish.
            self.extent = start + 64 * self.chunk
            self.dset.set_extent((self.extent,))
        if self.compression:
            space = self.dset.get_space()
            space.select_hyperslab((start,), (valid,))
            self.dset.write(h5py.h5s.create_simple((valid,)), space, np.ascontiguousarray(data[:valid]))
        else:
            # Handed to libhdf5 as it is: no selection, conversion or chunk cache.
            self.dset.write_direct_chunk((start,), data)
        if valid == self.chunk:
            self.chunks += 1


# ---------------------------------------------------------------------------------------
# writer

# Bytes of tensors handed to the writer's thread and not yet written; ``add`` waits above it
# (a single larger tensor is always accepted).
_IN_FLIGHT_BYTES = 64 * 2**20
# Tensors are handed over once this many bytes were added (or at close).
_BATCH_BYTES = 8 * 2**20
# A durable dump starts writing dirty pages back to disk every this many bytes, so the
# fsync at close waits for the tail only (Linux; elsewhere the fsync does it all).
_WRITEBACK_BYTES = 8 * 2**20


def _sync_file_range() -> Callable | None:
    """Linux's ``sync_file_range`` (Python's ``os`` does not wrap it), or ``None``."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing dirty pages back; do not wait


class DumpWriter:
    """Streams sites into an HDF5 dump; a :class:`~blockdiff.store.SiteStore` for capture.

    The file is written under a temporary name (``.NAME.tmp-PID``) in the target
    directory. A clean :meth:`close` (or leaving the ``with`` block without an exception)
    writes the index, the ``metadata_digest`` and then ``complete`` last, and renames the
    file to ``path`` atomically. An exception inside the ``with`` block, or :meth:`abort`,
    removes the temporary file and leaves nothing at ``path``.

    :meth:`add` encodes a site and hands its tensors to the writer's thread (8 MiB at a
    time), which writes them and takes their checksums while the caller goes on (the
    forward is not held by libhdf5). The thread keeps a reference to each tensor until its
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
        self._reserved: dict[str, int] = {}  # elements given out per packed dataset
        # Tensors stored by earlier sites: id -> (weak reference, ref), see _Encoder.tensor.
        self._written: dict[int, tuple] = {}
        # What the metadata digest covers, recorded as it is written (not read back).
        self._root: dict[str, Any] = {}
        self._objects: dict[str, _Object] = {}
        self._meta_keys: list[str] = []
        self._meta_written: list[tuple[str, Any, bool]] | None = None
        self._file: h5py.File | None = None
        self._created = False
        self._packed: dict[str, _Packed] = {}
        self._failed: BaseException | None = None  # the first failure on the writer's thread
        self._in_flight = 0
        self._room = threading.Condition()
        self._queued: deque[_Pending] = deque()  # handed to the thread, not written yet
        self._batch: list[_Pending] = []  # added, not handed to the thread yet
        self._batch_bytes = 0
        self._unsynced = 0
        self._fd: int | None = None
        # Every libhdf5 call of this writer runs on one thread of its own: glibc gives that
        # thread its own heap, so libhdf5's long-lived small allocations do not pin the heap
        # between the model's freed activations (they did, and a streamed capture's resident
        # size grew by ~12 MiB per block); and the forward does not wait for them.
        problem = _folder_problem(self.path.parent)
        if problem is not None:
            raise DumpError(f"{self.path}: cannot create the dump: {problem}", path=str(self.path))
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="blockdiff-dump")
        # The file is created on the writer's thread while the caller goes on; a failure
        # there is raised by the next add or by close.
        self._worker.submit(self._create, encoded_meta)

    def _on_worker(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn`` on the writer's thread after everything handed to it, and wait."""
        if self._worker is None:  # closed: nothing left to hand over
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _create(self, encoded_meta: list[tuple[str, Any, bool]]) -> None:
        try:
            self._file = h5py.File(self.tmp_path, "w", libver=LIBVER)
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
            if self.durable and _SYNC_FILE_RANGE is not None:
                self._fd = os.open(self.tmp_path, os.O_RDONLY)
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
        for data, count in enc.reserved.items():
            self._reserved[data] = self._reserved.get(data, 0) + count
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
        if self._batch_bytes >= _BATCH_BYTES:
            self._hand_over()

    def _hand_over(self) -> None:
        """Hand the tensors added since the last time to the writer's thread (in batches:
        each hand-over wakes the thread and passes the GIL back and forth)."""
        pending, nbytes = self._batch, self._batch_bytes
        if not pending:
            return
        self._batch, self._batch_bytes = [], 0
        with self._room:
            while self._in_flight and self._in_flight + nbytes > _IN_FLIGHT_BYTES and self._failed is None:
                self._room.wait()
            self._in_flight += nbytes
        self._check_open()
        self._queued.extend(pending)
        self._worker.submit(self._write_tensors, pending, nbytes)

    def _write_tensors(self, pending: list[_Pending], nbytes: int) -> None:
        try:
            if self._failed is None:
                for p in pending:
                    self._write_tensor(p)
                    self._queued.popleft()
        except BaseException as exc:
            self._failed = self._failed or exc
        finally:
            with self._room:
                self._in_flight -= nbytes
                self._room.notify_all()

    def _write_tensor(self, p: _Pending) -> None:
        entry = p.entry
        packed = self._packed.get(entry["data"])
        if packed is None:
            packed = self._packed[entry["data"]] = _Packed(self._group, entry["data"], p.flat.dtype, self._compression, self.checksums)
        if packed.length != entry["offset"]:
            raise DumpError(f"{self.path}: tensors/{entry['data']} out of order", path=str(self.path))
        try:
            packed.append(p.flat)
        except Exception as exc:
            raise DumpError(
                f"{self.path}: cannot write site {p.site}: {type(exc).__name__}: {_one_line(exc)}", path=str(self.path), site=p.site
            ) from exc
        if self.checksums and "crc32c" not in entry:
            # Here, on the writer's thread, without the GIL (_crc32c), after the write:
            # at close the caller takes the last tensors' while they are written.
            entry["crc32c"] = _crc32c(p.flat)
        if p.holder is not None and p.holder._version != p.version:
            raise TensorChanged(f"{p.site}: a tensor it recorded was changed in place before it was written")
        self._unsynced += p.flat.nbytes
        if self._fd is not None and self._unsynced >= _WRITEBACK_BYTES:
            # Dirty pages start going to disk now, while the writer goes on.
            self._unsynced = 0
            _SYNC_FILE_RANGE(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    # -- lifecycle

    def close(self) -> None:
        """Finish the dump: the index, metadata digest, ``complete`` last, atomic rename."""
        if self._worker is not None and self._failed is None:
            self._hand_over()
        if self.checksums and self._failed is None:
            # While the thread writes what is left, take the checksums it has not taken
            # yet, from the last tensor back (the thread goes from the first on).
            for p in reversed(tuple(self._queued)):  # a copy: the thread pops from the left
                if "crc32c" not in p.entry:
                    p.entry["crc32c"] = _crc32c(p.flat)
        try:
            self._on_worker(self._close)
        finally:
            self._stop_worker()

    def _close(self) -> None:
        if self._file is None:  # closed before, or never created
            self._raise_failure()
            return
        f = self._file
        try:
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

    def _write_index(self, f: h5py.File) -> None:
        """``/index``: one fixed-length UTF-8 string of JSON (inside the file's checksummed
        structures, unlike a variable-length one) and its CRC-32C."""
        index = {"tensors": self._tensors, "sites": self._sites, **self._structures}
        data = json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
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
