"""The dump format itself: what writers and reader must agree on.

Format name and schema version, the file attributes the writer owns, how each torch dtype
is stored (as itself or as raw bits), the tensor checksums of each schema (and
:func:`crc32c`, the one function that computes a CRC-32C), how attributes are written and
read back through h5py's low-level API, and the metadata digest over every attribute and
link, and the packed layout's index and datasets (schema 4): how to read the index, check
that it tiles the datasets, and read one tensor's elements. :mod:`.packing` (writing a
schema-4 file), :mod:`.writer` and :mod:`.reader` build on it, and so does
:mod:`blockdiff.dumpfile` (the writer for other runtimes): this module imports no torch
(the tables keyed by torch dtypes are built on first use); the format is documented in
``docs/dump-format.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c_library
import h5py
import numpy as np

from ..errors import DumpError

FORMAT = "blockdiff.dump"
# 4: tensors packed into 1-D datasets per stored dtype, one JSON index (blockdiff 0.4);
# 3: a group per site, a dataset per tensor, optional /floors; 2: CRC-32C checksums
# (``crc32c``); 1 (blockdiff 0.1): zlib CRC-32 (``crc32``). Every one is still read.
# 5: schema 4 with decode steps (each site's ``step``, the index's ``decode``), written only
# for a decode run (blockdiff 0.6): a dump of one forward is still written as 4.
SCHEMA_VERSION = 5  # the newest this blockdiff reads
FORWARD_SCHEMA = 4  # what a dump of one forward pass is written as
DECODE_SCHEMA = 5
# The first schema with the packed layout; older dumps have a group per site.
PACKED_SCHEMA = 4

# File attributes the writer owns; ``meta`` may not use these names.
STANDARD_ATTRIBUTES = (
    "format",
    "schema_version",
    "blockdiff_version",
    "torch_version",
    "created",
    "json_attributes",
    "metadata_digest",
    "complete",
)
# The meta attribute of the dumps of a candidate judged teacher-forced (docs/dump-format.md,
# "Teacher-forced runs"), JSON: ``{"id": ..., "run": RUN, "runs": {RUN: FILE NAME}}``, RUN
# ``"free"`` (the dump a diff is given) or a replaced run (``blockdiff.vocab.REPLACED_RUNS``),
# the others' files beside it; ``id`` the same in every run of one writing.
TEACHER_FORCED = "teacher_forced"
FREE_RUN = "free"
# Written after everything else, so they are outside what the metadata digest covers.
_UNDIGESTED = ("metadata_digest", "complete")

# torch dtype names numpy holds natively (a torch dtype's name is numpy's); every other
# dtype is stored as raw bits, an unsigned integer of its element size.
NUMPY_NATIVE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)
RAW_BITS_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _torch_tables() -> dict[str, Any]:
    """``NUMPY_NATIVE`` (torch dtype → numpy type) and ``RAW_BITS`` (element size →
    a signed torch view, the unsigned numpy type stored, its signed numpy twin)."""
    import torch

    return {
        "NUMPY_NATIVE": {getattr(torch, name): np.dtype(name).type for name in NUMPY_NATIVE_NAMES},
        "RAW_BITS": {
            size: (getattr(torch, f"int{8 * size}"), unsigned, np.dtype(f"int{8 * size}").type)
            for size, unsigned in RAW_BITS_UNSIGNED.items()
        },
    }


def __getattr__(name: str) -> Any:
    # PEP 562: the torch tables exist once the writer or reader (which import torch) asks.
    if name in ("NUMPY_NATIVE", "RAW_BITS"):
        tables = _torch_tables()
        globals().update(tables)
        return tables[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _byte_view(arr: np.ndarray) -> np.ndarray:
    """An array's bytes in C order, little-endian (a view when it already is)."""
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C (Castagnoli) of a buffer's bytes, continuing from the CRC-32C ``value``
    of the bytes before them: the one place blockdiff computes one.

    ``data`` is any C-contiguous buffer (``bytes``, a numpy array, a memoryview), read in
    place: a non-contiguous array is refused (``ValueError``), never copied. The ``crc32c``
    package's call lets go of the GIL for the whole computation (``gil_release_mode=1``):
    a dump writer's thread takes checksums while the forward goes on, and the reader's
    checksum thread while the next piece is read. It runs at 12-16 GB/s on the test
    machine (SSE4.2 instructions), zlib's CRC-32 at about 4.

    >>> crc32c(b"hello world") == crc32c(b" world", crc32c(b"hello")) == 0xC99465AA
    True
    """
    return _crc32c_library.crc32c(data, value=value, gil_release_mode=1)


def tensor_crc32c(arr: np.ndarray) -> str:
    """CRC-32C of an array's bytes in C order, little-endian, as 8 hex digits.

    The checksum of every tensor since schema 2. It catches every flip of up to three bits
    and every burst of up to 32, and is three to four times as fast as zlib's CRC-32
    (:func:`crc32c`): checksums cost a dump 0-6% of its write time and about 15% of its
    read time (``benchmarks/overhead.py``), where zlib's cost about 30%."""
    return format(crc32c(_byte_view(arr)), "08x")


def tensor_crc32(arr: np.ndarray) -> str:
    """zlib's CRC-32 of the same bytes: the checksum of schema-1 dumps (blockdiff 0.1)."""
    return format(zlib.crc32(_byte_view(arr)), "08x")


# Checksum attribute of a tensor dataset -> how to compute it. A dump holds one kind.
CHECKSUMS = {"crc32c": tensor_crc32c, "crc32": tensor_crc32}


# ---------------------------------------------------------------------------------------
# attributes and the metadata digest
#
# Attributes go through h5py's low-level API: h5py's AttributeManager costs about twice as
# much per attribute, and a dump has about ten attributes per site.

_SCALAR = h5py.h5s.create(h5py.h5s.SCALAR)


@functools.lru_cache(maxsize=None)
def _string_type(size: int) -> h5py.h5t.TypeID:
    """Fixed-length, NUL-padded UTF-8: what h5py writes for ``string_dtype("utf-8", size)``."""
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(size)
    tid.set_cset(h5py.h5t.CSET_UTF8)
    tid.set_strpad(h5py.h5t.STR_NULLPAD)
    return tid


def scalar(name: str, value: Any) -> tuple[np.dtype | None, bytes, Any]:
    """How one scalar attribute is stored: its numpy dtype (``None`` for a string: a
    fixed-length UTF-8 string of as many bytes as its data), its bytes, and the value as
    a reader gets it back (``bytes`` for a string, a numpy scalar for a number), which
    is what the metadata digest covers."""
    if isinstance(value, str):
        data = value.encode("utf-8")
        if b"\0" in data:
            raise ValueError(f"attribute {name!r}: strings in a dump cannot contain NUL characters")
        return None, data or b"\0", data
    if isinstance(value, (bool, np.bool_)):
        arr = np.array(value, dtype=np.bool_)
    elif isinstance(value, (int, np.integer)):
        arr = np.array(value, dtype=np.int64)
    elif isinstance(value, (float, np.floating)):
        arr = np.array(value, dtype=np.float64)
    else:
        raise TypeError(f"attribute {name!r}: cannot store a {type(value).__name__}")
    stored = arr.dtype.newbyteorder("<")  # little-endian on every machine, its type saying so
    return stored, arr.astype(stored).tobytes(), arr[()]


def set_attr(obj: h5py.HLObject | h5py.h5d.DatasetID, name: str, value: Any) -> Any:
    """Write one scalar attribute through libhdf5; strings as fixed-length UTF-8
    (:func:`scalar`).

    Variable-length strings live in HDF5's global heap, which has no checksum: a flipped
    byte there can hang libhdf5 on read. Fixed-length strings sit inside the (checksummed)
    object header. h5py reads them back as ``bytes``.

    Returns:
        the value as a reader gets it back, which is what the metadata digest covers.
    """
    key = name.encode("utf-8")
    oid = obj if isinstance(obj, h5py.h5d.DatasetID) else obj.id
    dtype, data, back = scalar(name, value)
    if dtype is None:
        tid = _string_type(len(data))
        h5py.h5a.create(oid, key, tid, _SCALAR).write(np.array(data, dtype=f"S{len(data)}"), mtype=tid)
    else:
        arr = np.array(back, dtype=dtype)
        h5py.h5a.create(oid, key, h5py.h5t.py_create(arr.dtype), _SCALAR).write(arr)
    return back


_ATTR_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING, h5py.h5t.ENUM)



def _raw_attr(obj: h5py.HLObject, name: str) -> Any:
    """An attribute as h5py reads it, after checking that its type is one a dump uses.

    A damaged datatype message can crash libhdf5's type conversion (a segfault, not an
    exception), so the type is inspected through the low-level API before any read.
    """
    aid = h5py.h5a.open(obj.id, name.encode("utf-8", "surrogatepass"))
    tid = aid.get_type()
    cls = tid.get_class()
    if cls not in _ATTR_CLASSES or aid.shape != ():
        raise ValueError(f"attribute {name!r} has an unexpected type (class {cls}, shape {aid.shape})")
    if cls == h5py.h5t.STRING:
        # Dumps hold fixed-length strings; a variable-length one (a heap pointer) is
        # accepted for files written by other tools.
        size, variable = tid.get_size(), tid.is_variable_str()
        if (variable and size != 8) or (not variable and size > 1 << 26):
            raise ValueError(f"attribute {name!r} has a damaged string type")
        if variable:
            return obj.attrs[name]
        out = np.empty((), dtype=f"S{size}")
        aid.read(out, mtype=tid)
        return out[()]
    if cls == h5py.h5t.ENUM:
        if tid.get_size() != 1 or tid.get_nmembers() != 2:
            raise ValueError(f"attribute {name!r} has a damaged boolean type")
    elif tid.get_size() not in (1, 2, 4, 8):
        raise ValueError(f"attribute {name!r} has a damaged numeric type")
    out = np.empty((), dtype=tid.dtype)
    aid.read(out)
    return out[()]


def attr(obj: h5py.HLObject, name: str) -> Any:
    """An attribute as a Python value (str, int, float, bool)."""
    return decode_attr(_raw_attr(obj, name))


def encode_meta(key: str, value: Any) -> tuple[Any, bool]:
    """A meta value as stored: ``(value, is_json)``; str, int (int64), float and bool as
    themselves, anything else JSON-serializable as a JSON string."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str) and "\0" not in value:
        return value, False
    if isinstance(value, (bool, float)):
        return value, False
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return value, False
    try:
        return json.dumps(value, sort_keys=False), True
    except (TypeError, ValueError) as exc:
        raise DumpError(
            f"meta[{key!r}] cannot be stored in a dump: expected str, int, float, bool or "
            f"JSON-serializable lists/dicts, got {type(value).__name__} ({exc})"
        ) from exc


def decode_attr(value: Any) -> Any:
    """An attribute as read (see :func:`set_attr`) as a Python value."""
    if isinstance(value, bytes):  # np.bytes_ too: fixed-length strings
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@dataclass
class Link:
    """One link of a dump as the metadata digest sees it: a group, or a dataset with its
    dtype and shape, and its attributes as read back (see :func:`set_attr`)."""

    kind: str  # "group" or "dataset"
    attrs: dict[str, Any]
    dtype: str = ""
    shape: tuple = ()


def _canonical(value: Any) -> bytes:
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    arr = np.asarray(value)  # _raw_attr only lets scalar numbers through
    return b"n" + arr.dtype.str.encode() + repr(arr.shape).encode() + arr.tobytes()


def digest(root: dict[str, Any], links: dict[str, Link]) -> str:
    """sha256 over the file's attributes (but the two written after it) and every link's
    path, kind and attributes (a dataset's dtype and shape too), in sorted order.

    The writer feeds it what it wrote; a reader what it finds in the file: a flipped byte
    in a name or attribute changes the digest."""
    h = hashlib.sha256()

    def feed(*parts: bytes) -> None:
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)

    def feed_attrs(attrs: dict[str, Any]) -> None:
        for name in sorted(attrs):
            if attrs is not root or name not in _UNDIGESTED:
                feed(b"attr", name.encode("utf-8", "surrogatepass"), _canonical(attrs[name]))

    feed_attrs(root)
    for path in sorted(links):
        obj = links[path]
        feed(obj.kind.encode(), path.encode("utf-8", "surrogatepass"))
        if obj.kind == "dataset":
            feed(obj.dtype.encode(), repr(obj.shape).encode())
        feed_attrs(obj.attrs)
    return h.hexdigest()


def attributes(obj: h5py.HLObject) -> dict[str, Any]:
    """Every attribute of an object, as read (checked, not decoded)."""
    return {name: _raw_attr(obj, name) for name in obj.attrs.keys()}


def links(f: h5py.File) -> dict[str, Link]:
    """Every link below the file's root: path -> :class:`Link`, attributes read once."""
    objects: dict[str, Link] = {}

    def walk(group: h5py.Group, prefix: str) -> None:
        # Every link, not every object: a tensor shared by two sites is one dataset with
        # two names, and both names are covered.
        for name in group.keys():
            path = f"{prefix}{name}"
            obj = group[name]
            if isinstance(obj, h5py.Dataset):
                objects[path] = Link("dataset", attributes(obj), obj.dtype.str, obj.shape)
            else:
                objects[path] = Link("group", attributes(obj))
                if isinstance(obj, h5py.Group):
                    walk(obj, path + "/")

    walk(f, "")
    return objects


def metadata_digest(f: h5py.File) -> str:
    """The metadata digest of an open file, read from the file: the reference
    implementation ``docs/dump-format.md`` names."""
    return digest(attributes(f), links(f))


# The HDF5 1.10 file format: object headers, B-trees and chunk indexes carry checksums,
# so libhdf5 itself rejects most damage to the file's structure.
LIBVER = ("v110", "v110")


# ---------------------------------------------------------------------------------------
# the packed layout (schema 4): 1-D datasets of each stored dtype under /tensors (contiguous,
# one per batch written; compressed dumps: one chunked dataset per dtype), and a JSON index
# (/index) saying where each tensor is and which sites mention it

# Bounds on what a reader accepts before it reads the index (a damaged size must not
# make it allocate without limit).
_INDEX_MAX_BYTES = 1 << 31


@functools.lru_cache(maxsize=None)
def stored_name(dtype: np.dtype) -> str:
    """The packed dataset that holds arrays of this stored numpy dtype: ``tensors/float32``."""
    return np.dtype(dtype).name


def read_index(f: h5py.File) -> dict[str, Any]:
    """The JSON index of a packed dump, checked against its CRC-32C (when the dump has one).
    Raises ``ValueError`` for a damaged one."""
    if "index" not in f:
        raise ValueError("/index is missing")
    dset = f["index"]
    if not isinstance(dset, h5py.Dataset):
        raise ValueError("/index is not a dataset")
    tid = dset.id.get_type()
    if tid.get_class() != h5py.h5t.STRING or tid.is_variable_str() or dset.shape != ():
        raise ValueError("/index is not a fixed-length string")
    size = tid.get_size()
    if not 0 < size <= _INDEX_MAX_BYTES:
        raise ValueError(f"/index has a damaged size ({size})")
    out = np.empty((), dtype=f"S{size}")
    dset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=tid)
    data = out.tobytes().rstrip(b"\0")
    crc = attr(dset, "crc32c") if "crc32c" in dset.attrs else None
    if crc is not None and format(crc32c(data), "08x") != crc:
        raise ValueError("/index digest mismatch")
    index = json.loads(data)
    if not isinstance(index, dict) or not isinstance(index.get("tensors"), list) or not isinstance(index.get("sites"), list):
        raise ValueError("/index is not a blockdiff index")
    return index


def check_packing(index: dict[str, Any], lengths: dict[str, int]) -> None:
    """Every tensor entry in range of its dataset, and the entries of each dataset tiling it
    from 0 without gaps or overlaps (what the writer writes). Raises ``ValueError``."""
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in lengths}
    for i, entry in enumerate(index["tensors"]):
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {i}: malformed entry")
        data, offset, count = entry.get("data"), entry.get("offset"), entry.get("count")
        if data not in spans:
            raise ValueError(f"tensor {i}: no dataset tensors/{data}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, count)):
            raise ValueError(f"tensor {i}: damaged offset or count")
        spans[data].append((offset, count))
    for name, found in spans.items():
        end = 0
        for offset, count in sorted(found):
            if offset != end:
                raise ValueError(f"tensors/{name}: the index does not tile it (at element {end})")
            end += count
        if end != lengths[name]:
            raise ValueError(f"tensors/{name} holds {lengths[name]} elements, the index {end}")


def read_packed(
    dset: h5py.Dataset, entry: dict[str, Any], stored: np.dtype, fd: int | None = None, *, summed: bool = False
) -> tuple[np.ndarray, str | None]:
    """One tensor's elements as stored (1-D, ``stored`` dtype) from its packed dataset,
    after checking the dataset's type (libhdf5 may crash converting a damaged one), and,
    ``summed``, for a large tensor, the CRC-32C of its bytes taken as they arrive (else
    ``None``). A contiguous dataset is read through ``fd`` (libhdf5's file descriptor)
    with ``preadv``, outside libhdf5 and the GIL: the benchmark's 60 MB dump read in
    15.3-15.5 ms verified, 13.4-13.7 unverified, against 15.9-16.6 and 13.9-14.7 through
    libhdf5 (medians of 21, alternating)."""
    offset, count = entry["offset"], entry["count"]
    arr = np.empty(count, dtype=stored)
    if dset.dtype != stored or dset.ndim != 1 or offset + count > dset.shape[0]:
        raise ValueError(f"tensors/{entry['data']} holds {dset.dtype} x {dset.shape}, not {count} {stored} at {offset}")
    if fd is not None and count and hasattr(os, "preadv"):
        start = dset.id.get_offset()
        if start is not None and dset.id.get_storage_size() == dset.shape[0] * arr.itemsize:
            position = start + offset * arr.itemsize
            if summed and arr.nbytes >= 2 * _READ_PIECE:
                return arr, _read_summing(fd, position, arr)
            _read_at(fd, position, memoryview(arr.view(np.uint8)))
            return arr, None
    if count:
        space = dset.id.get_space()
        space.select_hyperslab((offset,), (count,))
        dset.id.read(h5py.h5s.create_simple((count,)), space, arr)
    return arr, None


# A large tensor is read this many bytes at a time, each piece's checksum taken on another
# thread while the next piece is read: unverified / verified reads of the benchmark's dump
# 0.85-0.86, against 0.76 with the checksum taken after the whole tensor was read
# (benchmarks/overhead.py, checksums on / off).
_READ_PIECE = 4 << 20


# (process id, the executor): a forked child does not have its parent's thread (an
# executor taken across fork never ran what it was handed: the read hung), it makes its own.
_SUMMER: list[tuple[int, Any]] = []


def _summer() -> Any:
    """The thread that takes the pieces' checksums, made at first use in each process."""
    from concurrent.futures import ThreadPoolExecutor

    if not _SUMMER or _SUMMER[0][0] != os.getpid():
        _SUMMER[:] = [(os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="blockdiff-crc"))]
    return _SUMMER[0][1]


def _read_at(fd: int, position: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes at ``position`` of the file (outside the GIL)."""
    pos = 0
    while pos < view.nbytes:
        got = os.preadv(fd, [view[pos:]], position + pos)
        if got <= 0:
            raise ValueError(f"the file ends inside a tensor's data (at byte {position + pos})")
        pos += got


def _read_summing(fd: int, position: int, arr: np.ndarray) -> str:
    """Fill ``arr`` with the bytes at ``position`` of the file; returns their CRC-32C."""
    thread = _summer()
    view = memoryview(arr.view(np.uint8))
    crc, taking = 0, None
    try:
        for start in range(0, view.nbytes, _READ_PIECE):
            end = min(start + _READ_PIECE, view.nbytes)
            _read_at(fd, position + start, view[start:end])
            if taking is not None:
                crc, taking = taking.result(), None
            taking = thread.submit(crc32c, view[start:end], crc)
        crc, taking = taking.result(), None
    finally:
        if taking is not None:  # a read failed: the other thread must be done with arr first
            taking.result()
    return format(crc, "08x")
