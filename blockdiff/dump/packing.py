"""Writing a schema-4 dump, without torch: what both writers write through.

:class:`PackedFile` is one dump being written under its temporary name: the file
attributes and meta, the tensors' elements in 1-D datasets of their stored dtype under
``/tensors`` (uncompressed: one contiguous dataset per stored dtype per batch, whose bytes
it writes itself, :class:`_Contiguous`; compressed: one chunked dataset per stored dtype,
appended to through libhdf5's filters, :class:`_Chunked`), the JSON index with its
CRC-32C, the metadata digest, ``complete`` last, and the atomic rename
(``docs/dump-format.md``). It knows a tensor only as a :class:`StoredTensor`: its index
entry and its elements as stored. How a torch tensor (:class:`~.writer.DumpWriter`, on
its own thread) or another runtime's array (:class:`~blockdiff.dumpfile.ForeignDumpWriter`)
becomes one, and the sites' structures, are each writer's own.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import h5py
import numpy as np

from ..errors import DumpError
from . import hdf5
from .format import FORMAT, FORWARD_SCHEMA, LIBVER, Link, crc32c, digest, scalar, set_attr, stored_name, tensor_crc32c

# How each ``compress`` option is stored: the filters of every chunk.
COMPRESSIONS: dict[str | None, dict[str, Any]] = {
    None: {},
    "lzf": {"compression": "lzf", "shuffle": True},
    "gzip": {"compression": "gzip", "compression_opts": 4, "shuffle": True},
}
# Chunk size of compressed dumps' datasets: 1 MiB wrote fastest of 256 KiB, 1 MiB and 4 MiB
# (measured when the layout was chosen: docs/performance.md). A dataset smaller than
# one chunk is one chunk of its size.
PACKED_CHUNK_BYTES = 1 << 20
# Datasets of this many bytes or more start at a multiple of this many bytes in the file.
_ALIGN_ABOVE, _ALIGN = hdf5.ALIGN_ABOVE, hdf5.ALIGN
# A durable dump starts writing dirty pages back to disk every this many bytes, so the
# fsync at close waits for the tail only (Linux; elsewhere the fsync does it all).
_WRITEBACK_BYTES = 8 * 2**20


# ---------------------------------------------------------------------------------------
# what both writers record


def site_record(site: Any) -> dict[str, Any]:
    """A site's place in the run as a dump records it (its index entry): ``block`` ``-1``
    outside the blocks, ``subpath`` ``""`` for a block's own call and outside sites;
    ``order``, the start order of the call (a block starts before its modules)."""
    return {
        "stage": str(site.stage),
        "block": -1 if site.block is None else int(site.block),
        "subpath": site.subpath or "",
        "module": str(site.module),
        "call": int(site.call),
        "ordinal": int(site.ordinal),
        "order": int(site.order),
    }


def file_attributes(torch_version: str, schema: int = FORWARD_SCHEMA) -> dict[str, Any]:
    """The file attributes a writer owns, but the meta digest and ``complete``."""
    from .._version import __version__

    return {
        "format": FORMAT,
        "schema_version": schema,
        "blockdiff_version": str(__version__),
        "torch_version": torch_version,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def elements(arr: np.ndarray) -> np.ndarray:
    """An array's elements as a dump stores them: 1-D, C order, little-endian (a view of
    the array when it already is)."""
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).reshape(-1)


class StoredTensor:
    """One tensor on its way into a dump: its index entry (``count``, ``dtype``, ``shape``;
    ``data`` and ``offset`` once :meth:`PackedFile.place` gave it its place, ``crc32c``
    once :meth:`take_checksum` ran) and ``flat``, its elements as stored (:func:`elements`
    of its own dtype or of its raw bits)."""

    __slots__ = ("entry", "flat")

    def __init__(self, flat: np.ndarray, dtype: str, shape: list[int]) -> None:
        self.flat = flat
        self.entry: dict[str, Any] = {"data": None, "offset": None, "count": int(flat.size), "dtype": dtype, "shape": shape}

    def take_checksum(self) -> None:
        self.entry["crc32c"] = tensor_crc32c(self.flat)


def encode_index(tensors: list[dict[str, Any]], sites: list[dict[str, Any]], structures: dict[str, Any]) -> bytes:
    """The JSON index of a dump: the tensors' entries, the site records (each with its
    ``structure``), and the whole structures (``inputs``, ``floors``) the writer has."""
    index = {"tensors": tensors, "sites": sites, **structures}
    return json.dumps(index, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# ---------------------------------------------------------------------------------------
# the file


T = TypeVar("T", bound=StoredTensor)


class PackedFile:
    """A schema-4 dump being written at ``.NAME.tmp-PID`` beside ``path``.

    Creating it creates the file with the file attributes, the ``meta`` entries and
    ``/tensors``; :meth:`place` gives each tensor of a batch its dataset and offset,
    :meth:`write` writes a dataset's tensors of the batch, :meth:`finish` writes the index
    and renames the file to ``path``, :meth:`abort` removes it. It records what the
    metadata digest covers as it writes it (never reading it back). Not thread-safe:
    :class:`~.writer.DumpWriter` places on the caller's thread and writes on its own, one
    call after the other.

    An uncompressed dump is written without libhdf5 (:class:`~.hdf5.RawFile`: the bytes as
    they come, the HDF5 structures at the end), unless an attribute is too large for an
    object header message (64 KiB; then libhdf5 writes it, as it writes a compressed dump,
    or where the platform has no ``pwrite``). The files read the same.

    Args:
        path: where the finished dump goes.
        torch_version: the ``torch_version`` attribute (``""`` when no torch wrote it).
        meta: the meta entries as stored, ``(key, value, is_json)`` (see
            :func:`~.format.encode_meta`).
        compress: a key of :data:`COMPRESSIONS`.
        checksums: ``False``: no fletcher32 filter (compressed) nor index CRC-32C.
        durable: flushed to disk before the rename, and the folder after it.
        schema: the ``schema_version`` written (:data:`~.format.DECODE_SCHEMA` for decode steps).

    Raises:
        DumpError: the file cannot be created (saying why in the user's words).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        torch_version: str,
        meta: list[tuple[str, Any, bool]],
        compress: str | None = None,
        checksums: bool = True,
        durable: bool = False,
        schema: int = FORWARD_SCHEMA,
    ) -> None:
        self.path = Path(path)
        self.tmp_path = temporary_path(self.path)
        self.checksums = checksums
        self.durable = durable
        self._compression = COMPRESSIONS[compress]
        # What the metadata digest covers, recorded as it is written.
        self._root: dict[str, Any] = {}
        self._links: dict[str, Link] = {}
        self._meta_keys: list[str] = []
        self._meta_written: list[tuple[str, Any, bool]] | None = None
        # Given out per stored dtype: datasets (``float32.N``), or in a compressed dump the
        # elements of its one dataset (``float32``).
        self._given: dict[str, int] = {}
        self._chunked: dict[str, _Chunked] = {}
        self._unsynced = 0
        self._renamed = False
        # Written without libhdf5: each dataset's offset, given by :meth:`place`; the end of
        # the file as :meth:`prepare` encoded it, ``(index, RawFile.encode_end(...))``.
        self._offsets: dict[str, int] = {}
        self._prepared: tuple[bytes, tuple[bytes, bytes]] | None = None
        attributes = file_attributes(torch_version, schema)
        # Written without libhdf5: the file attributes, kept until the end.
        self._raw: hdf5.RawFile | None = None
        self._raw_attrs: dict[str, Any] = {}
        self._file: h5py.File | None = None  # or written by libhdf5 (:meth:`_open_libhdf5`)
        self._libhdf5_fd: int | None = None
        self._contiguous: _Contiguous | None = None
        try:
            if written_raw(compress, [*attributes.items(), *((k, v) for k, v, _ in meta)]):
                self._raw = hdf5.RawFile(self.tmp_path)
            else:
                self._open_libhdf5()
        except Exception as exc:
            problem = folder_problem(self.path.parent) or one_line(exc)
            raise DumpError(f"{self.path}: cannot create the dump: {problem}", path=str(self.path)) from exc
        try:
            for key, value in attributes.items():
                self._set_root(key, value)
            self.write_meta(meta)
            self._links["tensors"] = Link("group", {})
            fd = self._raw.fd if self._raw is not None else self._libhdf5_fd
            self._writeback_fd = fd if durable and _SYNC_FILE_RANGE is not None else None
        except BaseException:
            self.abort()
            raise

    def write_meta(self, meta: list[tuple[str, Any, bool]]) -> None:
        """The meta entries as file attributes, and ``json_attributes`` naming the JSON
        ones; those written before are replaced (a writer's ``meta`` may change until it
        closes), unless they are the same."""
        if meta == self._meta_written:
            return
        self._check_open()
        self._prepared = None  # what :meth:`prepare` encoded holds the meta before
        for key in [*self._meta_keys, "json_attributes"]:
            if key in self._root:
                self._delete_root(key)
        json_keys = []
        for key, stored, is_json in meta:
            self._set_root(key, stored)
            if is_json:
                json_keys.append(key)
        self._set_root("json_attributes", json.dumps(json_keys))
        self._meta_keys = [key for key, _, _ in meta]
        self._meta_written = meta

    def _open_libhdf5(self) -> None:
        """The file created by libhdf5, with ``/tensors`` (and, uncompressed, the
        datasets' writer); ``_libhdf5_fd``: libhdf5's file descriptor, on POSIX."""
        # Tensor data starts on a page boundary (whole pages of the page cache).
        self._file = h5py.File(self.tmp_path, "w", libver=LIBVER, alignment_threshold=_ALIGN_ABOVE, alignment_interval=_ALIGN)
        self._group = self._file.create_group("tensors")
        handle = self._file.id.get_vfd_handle()
        self._libhdf5_fd = handle if isinstance(handle, int) else None
        self._contiguous = None if self._compression else _Contiguous(self._group, self._libhdf5_fd)

    def _set_root(self, key: str, value: Any) -> None:
        """A file attribute: written now through libhdf5, or at the end without it."""
        if self._raw is not None:
            self._raw_attrs[key] = value
            self._root[key] = scalar(key, value)[2]
        else:
            self._root[key] = set_attr(self._file, key, value)

    def _delete_root(self, key: str) -> None:
        if self._raw is not None:
            del self._raw_attrs[key]
        else:
            del self._file.attrs[key]
        del self._root[key]

    def place(self, batch: Sequence[T]) -> list[tuple[str, list[T]]]:
        """Where each tensor of a batch goes (its entry's ``data`` and ``offset``):
        uncompressed, a new dataset per stored dtype (``float32.3``); compressed, the end
        of its dtype's one dataset (``float32``). Returns the tensors by dataset, for
        :meth:`write`, in the order they must be written."""
        groups: dict[str, list[T]] = {}
        for t in batch:
            groups.setdefault(stored_name(t.flat.dtype), []).append(t)
        compressed = bool(self._compression)
        out = []
        for base, items in groups.items():
            given = self._given.get(base, 0)
            name, offset = (base, given) if compressed else (f"{base}.{given}", 0)
            for t in items:
                t.entry["data"], t.entry["offset"] = name, offset
                offset += t.flat.size
            self._given[base] = offset if compressed else given + 1
            self._prepared = None  # what :meth:`prepare` encoded holds the datasets before
            if self._raw is not None:  # its place in the file, here (not where it is written)
                dtype = items[0].flat.dtype
                self._offsets[name] = start = self._raw.place(name, dtype, offset)
                # Its disk blocks too, here: the thread that writes goes back to Python (and
                # waits for the interpreter) once less per batch.
                _allocate(self._raw.fd, start, offset * np.dtype(dtype).itemsize)
                self._links[f"tensors/{name}"] = Link("dataset", {}, np.dtype(dtype).str, (offset,))
            out.append((name, items))
        return out

    def write(self, name: str, tensors: Sequence[StoredTensor]) -> None:
        """The tensors :meth:`place` put in dataset ``name`` in one batch."""
        self._check_open()
        dtype, arrays = tensors[0].flat.dtype, [t.flat for t in tensors]
        if self._raw is not None:
            _write_at(self._raw.fd, self._offsets.pop(name), arrays)  # allocated by :meth:`place`
        elif self._contiguous is not None:
            self._links[f"tensors/{name}"] = self._contiguous.write(name, dtype, arrays)
        else:
            chunked = self._chunked.get(name)
            if chunked is None:
                chunked = self._chunked[name] = _Chunked(self._group, name, dtype, self._compression, self.checksums)
            for flat in arrays:
                chunked.append(flat)
        if self._writeback_fd is not None:
            self._unsynced += sum(a.nbytes for a in arrays)
            if self._unsynced >= _WRITEBACK_BYTES:
                # Dirty pages start going to disk now, while the writer goes on.
                self._unsynced = 0
                _SYNC_FILE_RANGE(self._writeback_fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def prepare(self, index: bytes, meta: list[tuple[str, Any, bool]]) -> bool:
        """Encode, ahead of :meth:`finish` and on another thread than the one writing, the
        end of a file written without libhdf5: ``meta`` (as :meth:`write_meta`), the
        datasets' and groups' headers, ``/index`` (the bytes ``index``), the metadata
        digest, ``complete`` and the superblock; :meth:`finish` with the same ``index``
        then only writes them. Call it after the last :meth:`place`; writes may still be
        under way. ``False`` (nothing done) where libhdf5 writes the file: there the meta
        and the end are written by :meth:`write_meta` and :meth:`finish`, on the thread
        that writes."""
        if self._raw is None:
            return False
        self.write_meta(meta)
        end = self._encode_end(index)
        self._prepared = None if end is None else (index, end)
        return end is not None

    def finish(self, index: bytes) -> None:
        """The end of the dump: what compressed datasets still hold back, ``/index`` (the
        bytes of :func:`encode_index`), the metadata digest, ``complete`` last; the file
        closed and renamed to ``path`` (atomic: the file is there whole, or not at all),
        flushed to disk before the rename and the folder after it when ``durable``. A
        failure removes the temporary file, and raises."""
        try:
            self._check_open()
            prepared, self._prepared = self._prepared, None
            end = prepared[1] if prepared is not None and prepared[0] is index else self._encode_end(index)
            if end is not None:
                raw, self._raw = self._raw, None
                raw.finish(end)
            else:
                if self._raw is not None:  # ``meta`` grew too large since the file was made
                    self._through_libhdf5()
                f = self._file
                for name, chunked in self._chunked.items():
                    self._links[f"tensors/{name}"] = chunked.finish()
                self._write_index(f, index)
                set_attr(f, "metadata_digest", digest(self._root, self._links))
                set_attr(f, "complete", True)
                f.close()
                self._file = None
            if self.durable:
                _fsync(self.tmp_path)
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self._renamed = True  # nothing of this writer's to remove any more
        if self.durable:
            _fsync(self.path.parent)

    def _raw_messages(self) -> list[bytes] | None:
        """The file attributes' messages, written without libhdf5; ``None`` where libhdf5
        writes the file, or an attribute is now too large for a message."""
        if self._raw is None:
            return None
        try:
            return [hdf5.attribute(key, value)[0] for key, value in self._raw_attrs.items()]
        except hdf5.TooLarge:
            return None

    def _encode_end(self, index: bytes) -> tuple[bytes, bytes] | None:
        """:meth:`finish`'s structures without libhdf5, encoded
        (:meth:`~.hdf5.RawFile.encode_end`); ``None`` where libhdf5 writes the file, or an
        attribute is now too large for a message."""
        messages = self._raw_messages()
        if messages is None:
            return None
        crc = self._index_link(index)
        index_attrs = [] if crc is None else [hdf5.attribute("crc32c", crc)[0]]
        messages += [hdf5.attribute("metadata_digest", digest(self._root, self._links))[0], hdf5.attribute("complete", True)[0]]
        return self._raw.encode_end(messages, index, index_attrs)

    def _through_libhdf5(self) -> None:
        """The dump written so far, written again by libhdf5: an attribute too large for
        an object header message (64 KiB) came after the file was made. The bytes written
        are copied from the first file, which is then removed."""
        raw, self._raw = self._raw, None
        raw.close()
        staged = self.tmp_path.with_name(self.tmp_path.name + "-data")
        os.replace(self.tmp_path, staged)
        try:
            self._open_libhdf5()
            for key, value in self._raw_attrs.items():
                set_attr(self._file, key, value)
            for name, dtype, count, offset in raw.datasets:
                data = np.memmap(staged, dtype=dtype, mode="r", offset=offset, shape=(count,)) if count else np.empty(0, dtype)
                self._contiguous.write(name, dtype, [data])
                del data
        finally:
            os.remove(staged)

    def abort(self) -> None:
        """Discard the dump: the file closed and removed; nothing at ``path``."""
        f, self._file = self._file, None
        raw, self._raw = self._raw, None
        if raw is not None:
            raw.close()
        if f is not None:
            try:
                f.close()
            except Exception:
                pass  # the file is being thrown away; its removal below is what matters
        if not self._renamed:
            try:
                os.remove(self.tmp_path)
            except FileNotFoundError:
                pass

    def _check_open(self) -> None:
        if self._file is None and self._raw is None:
            raise DumpError(f"{self.path}: the dump was closed", path=str(self.path))

    def _write_index(self, f: h5py.File, data: bytes) -> None:
        """``/index``: one fixed-length UTF-8 string of JSON (inside the file's checksummed
        structures, unlike a variable-length one) and its CRC-32C."""
        size = max(len(data), 1)
        tid = h5py.h5t.C_S1.copy()
        tid.set_size(size)
        tid.set_cset(h5py.h5t.CSET_UTF8)
        tid.set_strpad(h5py.h5t.STR_NULLPAD)
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_obj_track_times(False)
        dset = h5py.h5d.create(f.id, b"index", tid, h5py.h5s.create(h5py.h5s.SCALAR), dcpl=dcpl)
        dset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(data, dtype=f"S{size}"), mtype=tid)
        crc = self._index_link(data)
        if crc is not None:
            set_attr(dset, "crc32c", crc)

    def _index_link(self, data: bytes) -> str | None:
        """Record ``/index`` (the bytes ``data``) for the metadata digest; returns its
        ``crc32c`` attribute (``None`` without checksums)."""
        crc = format(crc32c(data), "08x") if self.checksums else None
        attrs = {} if crc is None else {"crc32c": scalar("crc32c", crc)[2]}
        self._links["index"] = Link("dataset", attrs, np.dtype(f"S{max(len(data), 1)}").str, ())
        return crc


def written_raw(compress: str | None, attributes: Any) -> bool:
    """Whether a dump with these file attributes ``(name, value)`` (the meta entries as
    stored, at least) is written without libhdf5 (:class:`~.hdf5.RawFile`): uncompressed,
    where the platform has ``pwrite``, every attribute fitting in an object header message."""
    if COMPRESSIONS[compress] or not hasattr(os, "pwrite"):
        return False
    try:
        for key, value in attributes:
            # Numbers (8 bytes), and strings short enough at 4 bytes a character, fit:
            # only long ones are encoded to know (a dump is made on the caller's time).
            size = len(value) if type(value) is str else 2 if type(value) in (bool, int, float) else None
            if size is None or 4 * (len(key) + size) > hdf5.MESSAGE_MAX - 64:
                hdf5.attribute(key, value)
    except hdf5.TooLarge:
        return False
    return True


def temporary_path(path: Path) -> Path:
    """Where a dump is written until it is complete: ``.NAME.tmp-PID`` beside it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def folder_problem(folder: Path) -> str | None:
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


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (libhdf5's carry the time, newline included)."""
    return " ".join(str(exc).split())


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def _sync_file_range() -> Callable | None:
    """Linux's ``sync_file_range`` (Python's ``os`` does not wrap it) through libc, or
    ``None`` elsewhere. ctypes lets go of the GIL during the call."""
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


# ---------------------------------------------------------------------------------------
# the datasets


class _Chunked:
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

    def finish(self) -> Link:
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
        return Link("dataset", {}, self.dtype.str, (length,))

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
    """An uncompressed dump's datasets, ``tensors/<dtype>.<n>``, where libhdf5 writes the
    file (an attribute too large for :class:`~.hdf5.RawFile`, or no ``pwrite``): one per
    stored dtype for each batch, as long as the batch's tensors of that dtype.

    libhdf5 allocates each dataset's space at once (contiguous, never filled, starting on
    a page) and keeps the file's structure; the writer writes the tensors' bytes there
    itself (``pwritev`` on libhdf5's own file descriptor, :func:`_write_at`). Where the
    platform has no ``pwrite`` or libhdf5's file driver gives no descriptor, libhdf5
    writes them."""

    def __init__(self, group: h5py.Group, fd: int | None) -> None:
        self.group = group
        self.dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self.dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        self.dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        self.dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every byte is written, once
        self.dcpl.set_obj_track_times(False)
        self.fd = fd if hasattr(os, "pwrite") else None

    def write(self, name: str, dtype: np.dtype, arrays: list[np.ndarray]) -> Link:
        """A new dataset ``name`` holding ``arrays`` one after the other; returns what the
        metadata digest records of it."""
        count = sum(a.size for a in arrays)
        space = h5py.h5s.create_simple((count,))
        dset = h5py.h5d.create(self.group.id, name.encode(), h5py.h5t.py_create(dtype, logical=1), space, dcpl=self.dcpl)
        offset = dset.get_offset() if count else None
        if offset is not None and self.fd is not None:
            _allocate(self.fd, offset, count * np.dtype(dtype).itemsize)
            _write_at(self.fd, offset, arrays)
        elif count:
            start = 0
            for a in arrays:
                if a.size:
                    space.select_hyperslab((start,), (a.size,))
                    dset.write(h5py.h5s.create_simple((a.size,)), space, a)
                    start += a.size
        return Link("dataset", {}, np.dtype(dtype).str, (count,))


_IOV_MAX = 1024  # buffers per pwritev (POSIX guarantees at least 16; Linux and macOS: 1024)
# Bytes per write call. From the writer's thread, 8 MiB calls ran at a tenth of the speed
# of the same calls from the main thread in most runs on the test machine
# (benchmarks/overhead.py, figure 2: 1.98 against 1.25); 1 MiB calls did not. On a Linux
# 6.18 machine in figure 2's loop, 29 of 93 calls of 8 MiB took 1.4-2.0 ms of the
# kernel's CPU time per MiB (0.26 ms the others; with 4 MiB calls some closes took 55 ms
# instead of 15); no call of 1 or 2 MiB did (0 of 1,853; at most 0.46 ms per MiB).
# 2 MiB against 1 MiB, in one process (docs/performance.md): figure 3 0.949 against 0.907
# and 0.978 against 0.948 (40 rounds each), figure 2 1.182 against 1.192 and 1.197
# against 1.178 (16 pairs each); a writer's thread alone writes 60 MB in 10.0 ms in 2 MiB
# calls, 10.7 in 1 MiB ones (4 and 8 MiB: 9.8 and 10.0, but the slowest tenth 14.6 and
# 56 ms, at most 230 and 213).
_WRITE_BYTES = 2 << 20


# Datasets are allocated on disk before they are written from this size on (not below: a
# system call for nothing).
_ALLOCATE_BYTES = 1 << 20


def _write_at(fd: int, offset: int, arrays: list[np.ndarray]) -> None:
    """``arrays``' bytes one after the other at ``offset`` of the file, :data:`_WRITE_BYTES`
    at most per call (their disk blocks allocated by the caller: :func:`_allocate`)."""
    _pwrite_all(fd, [memoryview(a).cast("B") for a in arrays if a.size], offset, _WRITE_BYTES)


def _allocate(fd: int, offset: int, nbytes: int) -> None:
    """The disk blocks of a dataset's bytes, allocated at once (``os.posix_fallocate``, as
    ``numpy.tofile`` does for arrays of 16 MiB or more): writing into them skips the
    filesystem's delayed allocation page by page (ext4 here: figure 3 of
    ``benchmarks/overhead.py`` 0.70-0.71 against 0.60-0.64 without).

    The range is a dataset's (placed by :class:`~.hdf5.RawFile`, or allocated by libhdf5),
    and every byte of it is written next, so the file's size, should the call extend it,
    is what it would be anyway. Where the platform has no ``posix_fallocate`` (macOS) or the
    filesystem refuses, nothing is allocated and the writes allocate the blocks as they go;
    where the filesystem cannot allocate without writing, glibc writes one byte per block
    instead. Below :data:`_ALLOCATE_BYTES` nothing is done.
    """
    if nbytes < _ALLOCATE_BYTES or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError:
        pass


def _pwrite_all(fd: int, views: list[memoryview], offset: int, per_call: int) -> None:
    """Write ``views`` one after the other at ``offset``, at most ``per_call`` bytes per
    call: ``pwritev``, or ``pwrite`` where there is none; short writes continued."""
    pieces = [v[i : i + per_call] for v in views for i in range(0, len(v), per_call)]
    i = 0
    while i < len(pieces):
        batch, size = [], 0
        for piece in pieces[i : i + _IOV_MAX]:
            if size + len(piece) > per_call and batch:
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
