"""HDF5 activation dumps: the on-disk :class:`~blockdiff.store.SiteStore`.

Capture streams sites into a :class:`DumpWriter`; localization (or a person with plain
h5py / h5dump) reads them back with :class:`DumpReader`, one block at a time. The format
is schema v2, documented in ``docs/dump-format.md``:

- file attributes: ``format`` (``"blockdiff.dump"``), ``schema_version``, versions,
  creation time, the capture's ``meta``, a ``metadata_digest`` and ``complete`` (last);
- ``/sites/NNNNNN``: one group per site in execution order, its metadata as attributes,
  its ``args``/``kwargs``/``output`` as a JSON ``structure`` attribute whose tensors are
  the group's datasets ``t0``, ``t1``, ...;
- ``/inputs``: the model inputs of the run, encoded the same way.

Tensors are stored losslessly: dtypes numpy has as themselves, the others (bfloat16,
float8, ...) as raw bits with the torch dtype named in the ``torch_dtype`` attribute.
Every tensor dataset is chunked (compressed ones with HDF5's fletcher32 filter too) and
carries a CRC-32C of its bytes, checked on read. A dump is written under a temporary name and renamed only after a
clean close, so a file at the final path is always complete. Reading never raises
anything but :class:`~blockdiff.errors.DumpError` for a damaged or foreign file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import google_crc32c
import h5py
import numpy as np
import torch

from .dtypes import dtype_name, stored_dtype
from .errors import DumpError
from .site import Opaque, Site, describe_key
from .store import release_freed_memory

__all__ = ["DumpWriter", "DumpReader", "VerifySummary", "FORMAT", "SCHEMA_VERSION", "probe_file"]

FORMAT = "blockdiff.dump"
# 2: CRC-32C checksums (``crc32c``); 1 (blockdiff 0.1): zlib CRC-32 (``crc32``), still read.
SCHEMA_VERSION = 2

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
# Written after everything else, so they are outside what the metadata digest covers.
_UNDIGESTED = ("metadata_digest", "complete")
_COMPRESSIONS = (None, "lzf", "gzip")
# The HDF5 1.10 file format: object headers, B-trees and chunk indexes carry checksums,
# so libhdf5 itself rejects most damage to the file's structure.
_LIBVER = ("v110", "v110")

# torch dtypes numpy holds natively; every other dtype is stored as raw bits.
_NUMPY_NATIVE = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
# Raw bits: a signed torch view (what .numpy() supports everywhere) and the unsigned
# numpy type stored in the file, by element size in bytes.
_RAW_BITS = {
    1: (torch.int8, np.uint8, np.int8),
    2: (torch.int16, np.uint16, np.int16),
    4: (torch.int32, np.uint32, np.int32),
    8: (torch.int64, np.uint64, np.int64),
}


def _blockdiff_version() -> str:
    try:
        from ._version import __version__

        return str(__version__)
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("blockdiff")
    except (ImportError, PackageNotFoundError):
        return "unknown"


def _byte_view(arr: np.ndarray) -> np.ndarray:
    """An array's bytes in C order, little-endian (a view when it already is)."""
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


def _crc32c(arr: np.ndarray) -> str:
    """CRC-32C (Castagnoli) of an array's bytes in C order, little-endian, as 8 hex digits.

    The checksum of every tensor in a schema-2 dump. It catches every flip of up to three
    bits and every burst of up to 32, and runs at 13-28 GB/s (SSE4.2 instructions, through
    google-crc32c) where zlib's CRC-32 runs at 4: checksums cost a dump 2-5% of its write
    and read time instead of 30% (``benchmarks/overhead.py``)."""
    return format(google_crc32c.value(_byte_view(arr)), "08x")


def _crc32(arr: np.ndarray) -> str:
    """zlib's CRC-32 of the same bytes: the checksum of schema-1 dumps (blockdiff 0.1)."""
    return format(zlib.crc32(_byte_view(arr)), "08x")


# Checksum attribute of a tensor dataset -> how to compute it. A dump holds one kind.
_CHECKSUMS = {"crc32c": _crc32c, "crc32": _crc32}


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


def _set_attr(obj: h5py.HLObject | h5py.h5d.DatasetID, name: str, value: Any) -> Any:
    """Write one scalar attribute; strings as fixed-length UTF-8.

    Variable-length strings live in HDF5's global heap, which has no checksum: a flipped
    byte there can hang libhdf5 on read. Fixed-length strings sit inside the (checksummed)
    object header. h5py reads them back as ``bytes``.

    Returns:
        the value as a reader gets it back (``bytes`` for a string, a numpy scalar for a
        number), which is what the metadata digest covers.
    """
    key = name.encode("utf-8")
    oid = obj if isinstance(obj, h5py.h5d.DatasetID) else obj.id
    if isinstance(value, str):
        data = value.encode("utf-8")
        if b"\0" in data:
            raise ValueError(f"attribute {name!r}: strings in a dump cannot contain NUL characters")
        size = max(len(data), 1)
        tid = _string_type(size)
        h5py.h5a.create(oid, key, tid, _SCALAR).write(np.array(data, dtype=f"S{size}"), mtype=tid)
        return data
    if isinstance(value, (bool, np.bool_)):
        arr = np.array(value, dtype=np.bool_)
    elif isinstance(value, (int, np.integer)):
        arr = np.array(value, dtype=np.int64)
    elif isinstance(value, (float, np.floating)):
        arr = np.array(value, dtype=np.float64)
    else:
        raise TypeError(f"attribute {name!r}: cannot store a {type(value).__name__}")
    h5py.h5a.create(oid, key, h5py.h5t.py_create(arr.dtype), _SCALAR).write(arr)
    return arr[()]


_ATTR_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING, h5py.h5t.ENUM)
# bool is an HDF5 enum, complex a compound of two floats.
_DATASET_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.ENUM, h5py.h5t.COMPOUND)


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


def _attr(obj: h5py.HLObject, name: str) -> Any:
    """An attribute as a Python value (str, int, float, bool)."""
    return _decode_attr(_raw_attr(obj, name))


def _decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):  # np.bytes_ too: fixed-length strings
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@dataclass
class _Object:
    """One link of a dump as the metadata digest sees it: a group, or a dataset with its
    dtype and shape, and its attributes as read back (see :func:`_set_attr`)."""

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


def _digest(root: dict[str, Any], objects: dict[str, _Object]) -> str:
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
    for path in sorted(objects):
        obj = objects[path]
        feed(obj.kind.encode(), path.encode("utf-8", "surrogatepass"))
        if obj.kind == "dataset":
            feed(obj.dtype.encode(), repr(obj.shape).encode())
        feed_attrs(obj.attrs)
    return h.hexdigest()


def _attributes(obj: h5py.HLObject) -> dict[str, Any]:
    return {name: _raw_attr(obj, name) for name in obj.attrs.keys()}


def _objects(f: h5py.File) -> dict[str, _Object]:
    """Every link below the file's root: path -> :class:`_Object`, attributes read once."""
    objects: dict[str, _Object] = {}

    def walk(group: h5py.Group, prefix: str) -> None:
        # Every link, not every object: a tensor shared by two sites is one dataset with
        # two names, and both names are covered.
        for name in group.keys():
            path = f"{prefix}{name}"
            obj = group[name]
            if isinstance(obj, h5py.Dataset):
                objects[path] = _Object("dataset", _attributes(obj), obj.dtype.str, obj.shape)
            else:
                objects[path] = _Object("group", _attributes(obj))
                if isinstance(obj, h5py.Group):
                    walk(obj, path + "/")

    walk(f, "")
    return objects


def _metadata_digest(f: h5py.File) -> str:
    """The metadata digest of an open file, read from the file."""
    return _digest(_attributes(f), _objects(f))


# ---------------------------------------------------------------------------------------
# meta values


def _encode_attr(key: str, value: Any) -> tuple[Any, bool]:
    """A meta value as stored: ``(value, is_json)``."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (torch.dtype, torch.device)):
        value = dtype_name(value) if isinstance(value, torch.dtype) else str(value)
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


# ---------------------------------------------------------------------------------------
# structures


# One chunk per tensor up to this size: fewer, larger chunks write and checksum faster.
_CHUNK_BYTES = 256 * 2**20


def _chunks(arr: np.ndarray) -> tuple[int, ...] | bool:
    if arr.size == 0 or arr.nbytes > _CHUNK_BYTES:
        return True  # h5py's automatic chunk shape
    return arr.shape


class _Encoder:
    """Writes the tensors of one structure as datasets of ``group``; returns JSON nodes."""

    def __init__(
        self,
        group: h5py.Group,
        path: str,
        objects: dict[str, _Object],
        compression: dict[str, Any],
        written: dict | None = None,
        *,
        checksums: bool = True,
    ) -> None:
        self.group = group
        self.path = path
        self.objects = objects  # what the metadata digest will cover: the writer's record
        self.compression = compression
        self.checksums = checksums
        # Tensors written by earlier sites of this dump: id -> (weak reference, dataset
        # path). Capture shares one copy between sites (a block's output is the next
        # block's input); such a tensor is stored once and linked from the later site.
        self.written = {} if written is None else written
        # id(tensor) -> dataset name, so a tensor passed twice is stored once and comes
        # back as one object; the tensors are kept alive so their ids stay unique.
        self.refs: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []

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

    def tensor(self, t: torch.Tensor) -> str:
        if id(t) in self.refs:
            return self.refs[id(t)]
        original = t
        name = f"t{len(self.refs)}"
        path = f"{self.path}/{name}"
        earlier = self.written.get(id(original))
        if earlier is not None and earlier[0]() is original:
            # A hard link: the same dataset under a second name.
            self.group.id.links.create_hard(name.encode(), self.group.file.id, earlier[1].encode())
            self.objects[path] = self.objects[earlier[1]]
            self.refs[id(original)] = name
            self._alive.append(original)
            return name
        if t.layout != torch.strided or t.is_quantized:
            raise DumpError(f"cannot store a {t.layout} / {t.dtype} tensor: only dense tensors are supported")
        shape = list(t.shape)
        t = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        if t.dtype in _NUMPY_NATIVE:
            arr = t.numpy()
        elif t.element_size() in _RAW_BITS:
            signed, unsigned, _ = _RAW_BITS[t.element_size()]
            arr = t.view(signed).numpy().view(unsigned)
        else:
            raise DumpError(f"cannot store a {t.dtype} tensor: element size {t.element_size()} bytes")
        if arr.ndim == 0:
            arr = arr.reshape(1)  # HDF5 cannot chunk (or checksum) a scalar dataset
        if not self.compression and 0 < arr.nbytes <= _CHUNK_BYTES:
            # One chunk, no filter: written as it is, past h5py's selection and conversion
            # (and its high-level dataset creation, a third of the cost of a small tensor).
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk(arr.shape)
            dcpl.set_obj_track_times(False)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # the one chunk is written at once
            dset = h5py.h5d.create(
                self.group.id, name.encode(), h5py.h5t.py_create(arr.dtype, logical=1),
                h5py.h5s.create_simple(arr.shape), dcpl=dcpl,
            )
            dset.write_direct_chunk((0,) * arr.ndim, arr)
        else:
            # fletcher32 guards compressed chunks before they reach the decompressor; raw
            # chunks are guarded by the CRC-32C alone (a second pass over the data bought nothing).
            fletcher32 = self.checksums and bool(self.compression)
            dset = self.group.create_dataset(
                name, data=arr, chunks=_chunks(arr), fletcher32=fletcher32, **self.compression
            )
        attrs = {
            "torch_dtype": _set_attr(dset, "torch_dtype", dtype_name(t.dtype)),
            "shape": _set_attr(dset, "shape", json.dumps(shape)),
        }
        if self.checksums:
            attrs["crc32c"] = _set_attr(dset, "crc32c", _crc32c(arr))
        self.objects[path] = _Object("dataset", attrs, arr.dtype.str, arr.shape)
        self.refs[id(original)] = name
        self._alive.append(original)
        written, key = self.written, id(original)
        try:
            # The callback must not hold this encoder: it keeps its tensors alive.
            written[key] = (weakref.ref(original, lambda _: written.pop(key, None)), path)
        except TypeError:
            pass
        return name


class _Decoder:
    """Rebuilds a structure from JSON nodes, reading tensors from ``group``."""

    def __init__(self, group: h5py.Group, path: str, objects: dict[str, _Object], *, verify: bool) -> None:
        self.group = group
        self.path = path
        self.objects = objects  # the reader's index: attributes as read (and digested) at open
        self.verify = verify
        self.tensors: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def node(self, node: Any) -> Any:
        if not isinstance(node, dict) or "type" not in node:
            raise ValueError(f"malformed structure node {node!r:.80}")
        kind = node["type"]
        if kind == "tensor":
            return self.tensor(str(node["ref"]))
        if kind == "none":
            return None
        if kind == "bool":
            return _expect(node["value"], bool)
        if kind == "int":
            return _expect(node["value"], int)
        if kind == "float":
            return float(_expect(node["value"], str))
        if kind == "str":
            return _expect(node["value"], str)
        if kind == "dtype":
            return stored_dtype(node["value"])
        if kind == "device":
            return torch.device(_expect(node["value"], str))
        if kind == "opaque":
            return Opaque(_expect(node["value"], str))
        if kind == "tuple":
            return tuple(self.node(v) for v in _expect(node["items"], list))
        if kind == "list":
            return [self.node(v) for v in _expect(node["items"], list)]
        if kind == "dict":
            return {self.node(k): self.node(v) for k, v in _expect(node["items"], list)}
        raise ValueError(f"unknown structure node type {kind!r:.40}")

    def tensor(self, ref: str) -> torch.Tensor:
        if ref in self.tensors:
            return self.tensors[ref]
        entry = self.objects.get(f"{self.path}/{ref}")
        if entry is None or entry.kind != "dataset":
            raise ValueError(f"{ref!r} is not a dataset")
        dset = self.group[ref]
        attrs = {k: _decode_attr(v) for k, v in entry.attrs.items()}
        dtype = stored_dtype(attrs["torch_dtype"])
        shape = [_expect(n, int) for n in _expect(json.loads(attrs["shape"]), list)]
        if dtype in _NUMPY_NATIVE:
            stored = np.dtype(_NUMPY_NATIVE[dtype])
        else:
            size = torch.empty((), dtype=dtype).element_size()
            if size not in _RAW_BITS:
                raise ValueError(f"dataset {ref}: cannot hold {dtype} as raw bits")
            stored = np.dtype(_RAW_BITS[size][1])
        # Check type and size before reading: libhdf5 may crash converting a damaged type.
        cls = dset.id.get_type().get_class()
        if cls not in _DATASET_CLASSES or dset.dtype != stored:
            raise ValueError(f"dataset {ref} holds {dset.dtype}, expected {stored} for {dtype}")
        if dset.shape != tuple(shape) and not (shape == [] and dset.shape == (1,)):
            raise ValueError(f"dataset {ref} has shape {list(dset.shape)}, its shape attribute says {shape}")
        arr = np.empty(dset.shape, dtype=stored)
        if arr.size:
            dset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, arr)
        if self.verify:
            kind = next((k for k in _CHECKSUMS if k in attrs), None)
            if kind is None:
                raise ValueError(
                    f"dataset {ref} has no checksum (a dump written with checksums off): read it with verify=False"
                )
            if _CHECKSUMS[kind](arr) != attrs[kind]:
                raise _DigestMismatch(ref)
        arr = arr.reshape(shape)
        if dtype in _NUMPY_NATIVE:
            t = torch.from_numpy(arr)
        else:
            t = torch.from_numpy(arr.view(_RAW_BITS[size][2])).view(dtype)
        self.nbytes += arr.nbytes
        self.tensors[ref] = t
        return t


class _DigestMismatch(Exception):
    def __init__(self, ref: str) -> None:
        super().__init__(ref)
        self.ref = ref


def _expect(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__} in structure, found {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------
# writer


class DumpWriter:
    """Streams sites into an HDF5 dump; a :class:`~blockdiff.store.SiteStore` for capture.

    The file is written under a temporary name (``.NAME.tmp-PID``) in the target
    directory. A clean :meth:`close` (or leaving the ``with`` block without an exception)
    writes the ``metadata_digest`` and then ``complete`` last, and renames the file to
    ``path`` atomically. An exception inside the ``with`` block, or :meth:`abort`, removes
    the temporary file and leaves nothing at ``path``. Each site is written as it arrives.

    Args:
        path: where the finished dump goes (replaced if it exists).
        meta: what the capture was (model spec, hook map, device, dtype, input digest, ...):
            str/int/float/bool values stored as attributes, lists/dicts/None as JSON.
        compress: ``None``, ``"lzf"`` or ``"gzip"`` for every tensor dataset.
        checksums: ``False`` writes neither the fletcher32 filter (compressed dumps) nor the crc32c
            attributes, to measure what they cost (``benchmarks/overhead.py``); such a dump
            reads only with ``verify=False``.

    >>> with DumpWriter("ref.h5", meta={"model": "m.py:build", "dtype": "float32"}) as w:
    ...     w.add_inputs(token_ids)                                  # doctest: +SKIP
    ...     w.add(site)                                              # doctest: +SKIP
    """

    # capture.record may hand over the model's own CPU tensors: each site is written before
    # add returns, after a check that none of them changed since its hook.
    records_by_reference = "written"

    def __init__(
        self, path: str | os.PathLike, *, meta: dict[str, Any], compress: str | None = None, checksums: bool = True
    ) -> None:
        self.path = Path(path)
        if compress not in _COMPRESSIONS:
            raise DumpError(
                f"{self.path}: compress must be None, 'lzf' or 'gzip', got {compress!r}", path=str(self.path)
            )
        self.meta: dict[str, Any] = dict(meta)
        self._check_meta()
        self.compress = compress
        self.checksums = checksums
        self._compression: dict[str, Any] = {}
        if compress == "gzip":
            self._compression = {"compression": "gzip", "compression_opts": 4, "shuffle": True}
        elif compress == "lzf":
            self._compression = {"compression": "lzf", "shuffle": True}
        self.tmp_path = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._count = 0
        self._written: dict[int, tuple] = {}
        # What the metadata digest covers, recorded as it is written (not read back).
        self._root: dict[str, Any] = {}
        self._objects: dict[str, _Object] = {}
        self._has_inputs = False
        self._meta_keys: list[str] = []
        self._file: h5py.File | None = None
        # Every libhdf5 call of this writer runs on one worker thread while the caller
        # waits: glibc gives that thread its own heap, so libhdf5's long-lived small
        # allocations do not pin the heap between the model's freed activations (they
        # did, and a streamed capture's resident size grew by ~12 MiB per block).
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="blockdiff-dump")
        self._on_worker(self._create)

    def _on_worker(self, fn: Callable, *args: Any) -> Any:
        if self._worker is None:  # closed: nothing left to hand over
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=False)

    def _create(self) -> None:
        try:
            self._file = h5py.File(self.tmp_path, "w", libver=_LIBVER)
        except Exception as exc:
            self._stop_worker()
            raise DumpError(f"{self.path}: cannot create the dump: {exc}", path=str(self.path)) from exc
        try:
            for key, value in (
                ("format", FORMAT),
                ("schema_version", SCHEMA_VERSION),
                ("blockdiff_version", _blockdiff_version()),
                ("torch_version", str(torch.__version__)),
                ("created", datetime.now(timezone.utc).isoformat(timespec="seconds")),
            ):
                self._root[key] = _set_attr(self._file, key, value)
            self._write_meta()
            self._sites = self._file.create_group("sites")
            self._objects["sites"] = _Object("group", {})
        except BaseException:
            self._abort()
            raise

    # -- SiteStore (write side)

    def add(self, site: Site) -> None:
        """Write one site as group ``/sites/NNNNNN`` (NNNNNN: how many were written before)."""
        self._on_worker(self._add, site)

    def _add(self, site: Site) -> None:
        f = self._open_file()
        order = self._count
        name = f"{order:06d}"
        try:
            group = h5py.Group(h5py.h5g.create(self._sites.id, name.encode()))
        except Exception as exc:
            raise DumpError(f"{self.path}: cannot write site {site.label}: {exc}", path=str(self.path)) from exc
        path = f"sites/{name}"
        try:
            attrs = {
                "stage": str(site.stage),
                "block": -1 if site.block is None else int(site.block),
                "subpath": "" if site.subpath is None else str(site.subpath),
                "module": str(site.module),
                "call": int(site.call),
                "ordinal": int(site.ordinal),
                # Start order of the call (a block starts before its modules); the group
                # name counts completions, the order sites are written in.
                "order": int(site.order),
            }
            attrs = {key: _set_attr(group, key, value) for key, value in attrs.items()}
            self._objects[path] = _Object("group", attrs)
            enc = _Encoder(group, path, self._objects, self._compression, self._written, checksums=self.checksums)
            structure = {
                "args": enc.node(tuple(site.args)),
                "kwargs": enc.node(dict(site.kwargs)),
                "output": enc.node(site.output),
            }
            attrs["structure"] = _set_attr(group, "structure", json.dumps(structure))
        except Exception as exc:
            # Leave no half-written site behind if the caller carries on.
            del f["sites"][name]
            self._forget(path)
            if isinstance(exc, DumpError):
                raise DumpError(f"{self.path}: site {site.label}: {exc}", path=str(self.path), site=site.label) from exc
            raise DumpError(
                f"{self.path}: cannot write site {site.label}: {type(exc).__name__}: {exc}",
                path=str(self.path),
                site=site.label,
            ) from exc
        self._count += 1

    def add_inputs(self, obj: Any) -> None:
        """Record the run's model inputs (a tensor, a tuple or a dict) as group ``/inputs``."""
        self._on_worker(self._add_inputs, obj)

    def _add_inputs(self, obj: Any) -> None:
        f = self._open_file()
        if self._has_inputs:
            raise DumpError(f"{self.path}: inputs were already recorded", path=str(self.path))
        group = f.create_group("inputs")
        attrs: dict[str, Any] = {}
        self._objects["inputs"] = _Object("group", attrs)
        try:
            enc = _Encoder(group, "inputs", self._objects, self._compression, checksums=self.checksums)
            attrs["structure"] = _set_attr(group, "structure", json.dumps(enc.node(obj)))
        except Exception as exc:
            del f["inputs"]
            self._forget("inputs")
            raise DumpError(
                f"{self.path}: cannot write the inputs: {type(exc).__name__}: {exc}", path=str(self.path)
            ) from exc
        self._has_inputs = True

    # -- lifecycle

    def close(self) -> None:
        """Finish the dump: metadata digest, ``complete`` last, atomic rename to ``path``."""
        try:
            self._on_worker(self._close)
        finally:
            self._stop_worker()

    def _close(self) -> None:
        if self._file is None:
            return
        f = self._file
        try:
            self._check_meta()
            self._write_meta()
            _set_attr(f, "metadata_digest", _digest(self._root, self._objects))
            _set_attr(f, "complete", True)
            f.close()
            self._file = None
            _fsync(self.tmp_path)
            os.replace(self.tmp_path, self.path)
            _fsync(self.path.parent)
        except BaseException as exc:
            self._abort()
            if isinstance(exc, Exception) and not isinstance(exc, DumpError):
                raise DumpError(f"{self.path}: cannot finish the dump: {exc}", path=str(self.path)) from exc
            raise

    def abort(self) -> None:
        """Discard the dump: close and remove the temporary file; nothing at ``path``."""
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
        """Number of sites written so far."""
        return self._count

    def __repr__(self) -> str:
        state = "open" if self._file is not None else "closed"
        return f"DumpWriter({str(self.path)!r}, sites={self._count}, {state})"

    # -- helpers

    def _open_file(self) -> h5py.File:
        if self._file is None:
            raise DumpError(f"{self.path}: the dump writer is closed", path=str(self.path))
        return self._file

    def _check_meta(self) -> None:
        for key in self.meta:
            if not isinstance(key, str) or not key:
                raise DumpError(f"{self.path}: meta keys must be non-empty strings, got {key!r}", path=str(self.path))
            if key in STANDARD_ATTRIBUTES:
                raise DumpError(
                    f"{self.path}: meta key {key!r} is reserved for the dump format "
                    f"(reserved: {', '.join(STANDARD_ATTRIBUTES)})",
                    path=str(self.path),
                )
            _encode_attr(key, self.meta[key])

    def _write_meta(self) -> None:
        f = self._open_file()
        for key in [*self._meta_keys, "json_attributes"]:
            if key in f.attrs:
                del f.attrs[key]
                del self._root[key]
        json_keys = []
        for key, value in self.meta.items():
            stored, is_json = _encode_attr(key, value)
            self._root[key] = _set_attr(f, key, stored)
            if is_json:
                json_keys.append(key)
        self._root["json_attributes"] = _set_attr(f, "json_attributes", json.dumps(json_keys))
        self._meta_keys = list(self.meta)

    def _forget(self, path: str) -> None:
        """Drop a deleted group and everything below it from the digest's record, and its
        datasets from those later sites may link to."""
        def inside(key: str) -> bool:
            return key == path or key.startswith(path + "/")

        for key in [k for k in self._objects if inside(k)]:
            del self._objects[key]
        for key in [k for k, (_, where) in self._written.items() if inside(where)]:
            del self._written[key]


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


# ---------------------------------------------------------------------------------------
# reader


@dataclass(frozen=True)
class VerifySummary:
    """What :meth:`DumpReader.verify_all` checked."""

    sites: int
    tensors: int
    bytes: int


@dataclass(frozen=True)
class _Entry:
    """One site group in the index: its name and the site without its tensors."""

    name: str
    site: Site

    @property
    def block(self) -> int | None:
        return self.site.block

    @property
    def label(self) -> str:
        return f"/sites/{self.name} ({describe_key(self.site.key)}, {self.site.module})"


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


class DumpReader:
    """Reads an HDF5 dump: the read side of :class:`~blockdiff.store.SiteStore`.

    Opening validates the file (exists, HDF5, a blockdiff dump, a schema this version
    reads, complete, metadata digest intact) and indexes the sites from their attributes;
    tensors are read only when a site is asked for, so :meth:`block_sites` holds one
    block at a time. Every failure is a :class:`~blockdiff.errors.DumpError` naming the
    file, and the site when there is one.

    Args:
        path: the dump.
        verify: check every tensor's checksum as it is read.
        probe: parse the file's structure in a bounded subprocess first (see
            :func:`probe_file`), so a file that crashes or hangs libhdf5 cannot take this
            process down.

    >>> with DumpReader("ref.h5") as dump:                           # doctest: +SKIP
    ...     for i in dump.block_indices():
    ...         sites = dump.block_sites(i)
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, probe: bool = True) -> None:
        self.path = Path(path)
        self.verify = verify
        self._file: h5py.File | None = None
        self.meta: dict[str, Any] = {}
        self._entries: list[_Entry] = []
        self._objects: dict[str, _Object] = {}  # every link, its attributes read once at open
        where = str(self.path)
        if not self.path.exists():
            raise DumpError(f"{where}: no such file", path=where)
        with self._guard("cannot be opened"):
            is_hdf5 = self.path.is_file() and h5py.is_hdf5(self.path)
        if not is_hdf5:
            raise DumpError(f"{where} is not an HDF5 file", path=where)
        if probe:
            probe_file(self.path)
        with self._guard("is damaged or truncated and cannot be opened as HDF5"):
            self._file = h5py.File(self.path, "r")
        try:
            with self._guard("is damaged"):
                self._validate()
        except BaseException:
            self.close()
            raise
        release_freed_memory()  # what libhdf5 kept from walking every object of the file

    def _validate(self) -> None:
        f = self._file
        where = str(self.path)
        try:
            fmt = _attr(f, "format") if "format" in f.attrs else None
        except Exception:
            fmt = None  # a foreign file's "format" may be anything
        if fmt != FORMAT:
            raise DumpError(f"{where} is an HDF5 file but not a blockdiff dump", path=where)
        root = _attributes(f)
        attrs = {k: _decode_attr(v) for k, v in root.items()}
        version = attrs.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise DumpError(f"{where} has an invalid schema version {version!r}: the file is damaged", path=where)
        if version > SCHEMA_VERSION:
            raise DumpError(
                f"{where} has schema version {version}; this blockdiff reads up to {SCHEMA_VERSION}: "
                "upgrade blockdiff",
                path=where,
            )
        if attrs.get("complete") is not True:
            raise DumpError(f"{where} is incomplete (the capture did not finish)", path=where)
        self._objects = _objects(f)
        if attrs.get("metadata_digest") != _digest(root, self._objects):
            raise DumpError(f"{where} metadata digest mismatch: the file is damaged", path=where)

        meta = {k: v for k, v in attrs.items() if k != "json_attributes"}
        for key in json.loads(attrs["json_attributes"]):
            meta[key] = json.loads(meta[key])
        self.meta = meta

        if self._objects.get("sites", _Object("dataset", {})).kind != "group":
            raise ValueError("/sites is missing or not a group")
        entries = []
        for path, obj in self._objects.items():
            name = path.removeprefix("sites/")
            if name == path or "/" in name:
                continue
            if obj.kind != "group":
                raise ValueError(f"/{path} is not a group")
            group = {k: _decode_attr(v) for k, v in obj.attrs.items()}
            block = int(group["block"])
            subpath = str(group["subpath"])
            site = Site(
                stage=str(group["stage"]),
                block=None if block < 0 else block,
                subpath=subpath or None,
                module=str(group["module"]),
                call=int(group["call"]),
                ordinal=int(group["ordinal"]),
                order=int(group["order"]),
            )
            entries.append(_Entry(name, site))
        # Calls in the order they started (a block before its modules); sites written
        # without an order (all 0) keep the order they were written in.
        entries.sort(key=lambda e: (e.site.order, int(e.name)))
        self._entries = entries

    # -- SiteStore (read side)

    def block_indices(self) -> list[int]:
        """Indices of the blocks that have sites, ascending."""
        return sorted({e.block for e in self._entries if e.block is not None})

    def block_sites(self, block: int) -> list[Site]:
        """The sites of one block in execution order; reads only that block's groups."""
        return [self._read(e) for e in self._entries if e.block == block]

    def outside_sites(self) -> list[Site]:
        """Sites outside the blocks (embed, context, final_norm, head) in execution order."""
        return [self._read(e) for e in self._entries if e.block is None]

    def sites(self) -> list[Site]:
        """Every site in execution order (all tensors in memory: prefer :meth:`iter_sites`)."""
        return list(self.iter_sites())

    def iter_sites(self) -> Iterator[Site]:
        """Every site in execution order, read one at a time."""
        for e in self._entries:
            yield self._read(e)

    def inputs(self) -> Any:
        """The recorded model inputs, or ``None`` if the dump has none."""
        f = self._open_file()
        with self._guard("cannot be read (the file is damaged)", site="/inputs"):
            if "inputs" not in self._objects:
                return None
            return self._decode("inputs", "/inputs", whole=True)[0]

    def verify_all(self) -> VerifySummary:
        """Read every tensor of every site and the inputs, checking each digest.

        Returns:
            how many sites, tensors and bytes were checked.

        Raises:
            DumpError: naming the file and the first damaged site.
        """
        f = self._open_file()
        tensors = nbytes = 0
        for e in self._entries:
            with self._guard("cannot be read (the file is damaged)", site=e.label):
                _, dec = self._decode(f"sites/{e.name}", e.label, verify=True)
                extra = set(dec.group.keys()) - set(dec.tensors)
                if extra:
                    raise ValueError(f"datasets {sorted(extra)} are not referenced by the structure")
            tensors += len(dec.tensors)
            nbytes += dec.nbytes
        with self._guard("cannot be read (the file is damaged)", site="/inputs"):
            if "inputs" in self._objects:
                _, dec = self._decode("inputs", "/inputs", whole=True, verify=True)
                tensors += len(dec.tensors)
                nbytes += dec.nbytes
        return VerifySummary(sites=len(self._entries), tensors=tensors, bytes=nbytes)

    # -- lifecycle

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass  # nothing was written; a failing close of a damaged file changes nothing

    def __enter__(self) -> "DumpReader":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return False

    def __len__(self) -> int:
        """Number of sites."""
        return len(self._entries)

    def __repr__(self) -> str:
        return f"DumpReader({str(self.path)!r}, sites={len(self._entries)})"

    # -- helpers

    def _open_file(self) -> h5py.File:
        if self._file is None:
            raise DumpError(f"{self.path}: the dump reader is closed", path=str(self.path))
        return self._file

    def _read(self, e: _Entry) -> Site:
        self._open_file()
        with self._guard("cannot be read (the file is damaged)", site=e.label):
            decoded, _ = self._decode(f"sites/{e.name}", e.label)
            args, kwargs, output = decoded["args"], decoded["kwargs"], decoded["output"]
            if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                raise TypeError("site args must be a tuple and kwargs a dict")
            return dataclasses.replace(e.site, args=args, kwargs=kwargs, output=output)

    def _decode(
        self, path: str, label: str, *, whole: bool = False, verify: bool | None = None
    ) -> tuple[Any, _Decoder]:
        """Decode the structure of group ``path``: a whole one (``whole``, the inputs) or a
        site's ``{"args", "kwargs", "output"}``."""
        group = self._open_file()[path]
        structure = json.loads(_decode_attr(self._objects[path].attrs["structure"]))
        dec = _Decoder(group, path, self._objects, verify=self.verify if verify is None else verify)
        try:
            if whole:
                return dec.node(structure), dec
            if not isinstance(structure, dict) or set(structure) != {"args", "kwargs", "output"}:
                raise ValueError("a site structure must have exactly 'args', 'kwargs' and 'output'")
            return {k: dec.node(v) for k, v in structure.items()}, dec
        except _DigestMismatch as exc:
            raise DumpError(
                f"{self.path}: site {label}: tensor {exc.ref} digest mismatch: the file is damaged",
                path=str(self.path),
                site=label,
            ) from None

    @contextmanager
    def _guard(self, what: str, *, site: str | None = None) -> Iterator[None]:
        """Turn anything h5py, numpy or json raise on a damaged file into a DumpError."""
        try:
            yield
        except DumpError:
            raise
        except Exception as exc:
            where = f"{self.path}: site {site}" if site else str(self.path)
            raise DumpError(f"{where} {what}: {type(exc).__name__}: {exc}", path=str(self.path), site=site) from exc
