"""The read side of a dump: :class:`DumpReader` hands localization one block at a time.

Opening validates the file (probe, format, schema, ``complete``, metadata digest) and
indexes the sites (:class:`_Entry`): from the JSON index of a packed dump (schema 4), from
the site groups' attributes of an older one; a site's tensors are decoded
(:class:`_Decoder`) and checked against their checksums only when it is asked for.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import h5py
import numpy as np
import torch

from ..dtypes import stored_dtype
from ..errors import DumpError
from ..site import Opaque, Site, describe_key
from .format import (
    CHECKSUMS,
    FORMAT,
    NUMPY_NATIVE,
    PACKED_SCHEMA,
    RAW_BITS,
    DECODE_SCHEMA,
    SCHEMA_VERSION,
    Link,
    attr,
    attributes,
    check_packing,
    decode_attr,
    digest,
    links,
    read_index,
    read_packed,
)
from .memory import release_freed_memory
from .probe import probe_file

# bool is an HDF5 enum, complex a compound of two floats.
_DATASET_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.ENUM, h5py.h5t.COMPOUND)


# ---------------------------------------------------------------------------------------
# structures


class _Decoder:
    """Rebuilds a structure from JSON nodes; ``load(ref, verify)`` reads one tensor (from
    a packed dataset, or from a site group's dataset in dumps before schema 4)."""

    def __init__(self, load: Callable[[Any, bool], torch.Tensor], *, verify: bool) -> None:
        self.load = load
        self.verify = verify
        self.tensors: dict[Any, torch.Tensor] = {}
        self.nbytes = 0

    def node(self, node: Any) -> Any:
        if not isinstance(node, dict) or "type" not in node:
            raise ValueError(f"malformed structure node {node!r:.80}")
        kind = node["type"]
        if kind == "tensor":
            return self.tensor(node["ref"])
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
            name = _expect(node["value"], str)
            return Opaque(name, cache=name.endswith("Cache"))  # the object itself is not kept
        if kind == "tuple":
            return tuple(self.node(v) for v in _expect(node["items"], list))
        if kind == "list":
            return [self.node(v) for v in _expect(node["items"], list)]
        if kind == "dict":
            return {self.node(k): self.node(v) for k, v in _expect(node["items"], list)}
        raise ValueError(f"unknown structure node type {kind!r:.40}")

    def tensor(self, ref: Any) -> torch.Tensor:
        if not isinstance(ref, (str, int)) or isinstance(ref, bool):
            raise ValueError(f"malformed tensor reference {ref!r:.40}")
        if ref not in self.tensors:
            t = self.load(ref, self.verify)
            self.nbytes += t.numel() * t.element_size()
            self.tensors[ref] = t
        return self.tensors[ref]


def _stored_as(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a dump stores a torch dtype as (itself, or its raw bits)."""
    if dtype in NUMPY_NATIVE:
        return np.dtype(NUMPY_NATIVE[dtype])
    size = torch.empty((), dtype=dtype).element_size()
    if size not in RAW_BITS:
        raise ValueError(f"cannot hold {dtype} as raw bits")
    return np.dtype(RAW_BITS[size][1])


def _as_tensor(arr: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Stored elements (its own dtype, or raw bits) as the tensor they stand for."""
    arr = arr.reshape(shape)
    if dtype in NUMPY_NATIVE:
        return torch.from_numpy(arr)
    return torch.from_numpy(arr.view(RAW_BITS[arr.dtype.itemsize][2])).view(dtype)


def _shape(value: Any) -> list[int]:
    shape = [_expect(n, int) for n in _expect(value, list)]
    if any(n < 0 for n in shape):
        raise ValueError(f"negative size in shape {shape}")
    return shape


def _verified(arr: np.ndarray, checksums: dict[str, Any], ref: Any, crc32c: str | None = None) -> None:
    """Check ``arr`` against the first checksum ``checksums`` has (``crc32c``, ``crc32``);
    ``crc32c``: the array's CRC-32C, when it was taken as it was read."""
    kind = next((k for k in CHECKSUMS if k in checksums), None)
    if kind is None:
        raise ValueError(f"tensor {ref} has no checksum (a dump written with checksums off): read it with verify=False")
    found = crc32c if kind == "crc32c" and crc32c is not None else CHECKSUMS[kind](arr)
    if found != checksums[kind]:
        raise _DigestMismatch(ref)


class _GroupTensors:
    """Tensors of one site group of a dump before schema 4: datasets ``t0``, ``t1``, ...
    with their dtype, shape and checksum as attributes."""

    def __init__(self, group: h5py.Group, path: str, objects: dict[str, Link]) -> None:
        self.group = group
        self.path = path
        self.objects = objects  # the reader's index: attributes as read (and digested) at open

    def __call__(self, ref: Any, verify: bool) -> torch.Tensor:
        ref = _expect(ref, str)
        entry = self.objects.get(f"{self.path}/{ref}")
        if entry is None or entry.kind != "dataset":
            raise ValueError(f"{ref!r} is not a dataset")
        dset = self.group[ref]
        attrs = {k: decode_attr(v) for k, v in entry.attrs.items()}
        dtype = stored_dtype(attrs["torch_dtype"])
        shape = _shape(json.loads(attrs["shape"]))
        stored = _stored_as(dtype)
        # Check type and size before reading: libhdf5 may crash converting a damaged type.
        cls = dset.id.get_type().get_class()
        if cls not in _DATASET_CLASSES or dset.dtype != stored:
            raise ValueError(f"dataset {ref} holds {dset.dtype}, expected {stored} for {dtype}")
        if dset.shape != tuple(shape) and not (shape == [] and dset.shape == (1,)):
            raise ValueError(f"dataset {ref} has shape {list(dset.shape)}, its shape attribute says {shape}")
        arr = np.empty(dset.shape, dtype=stored)
        if arr.size:
            dset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, arr)
        if verify:
            _verified(arr, attrs, ref)
        return _as_tensor(arr, dtype, shape)


class _DigestMismatch(Exception):
    def __init__(self, ref: str) -> None:
        super().__init__(ref)
        self.ref = ref


def _tensor_refs(nodes: list[Any]) -> set[Any]:
    """The tensors (index positions) that structures of a packed dump refer to."""
    found, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("type") == "tensor":
                found.add(node.get("ref"))
            else:
                todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return found


def _expect(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__} in structure, found {type(value).__name__}")
    return value

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
    """One site: where it is (its position in a packed dump's index, or its group's name
    in an older dump), the site without its tensors, and, packed, its structure."""

    name: str
    site: Site
    structure: Any = None
    packed: bool = False
    step: int | None = None  # the decode step it ran at (schema 5)

    @property
    def block(self) -> int | None:
        return self.site.block

    @property
    def label(self) -> str:
        where = f"sites[{self.name}]" if self.packed else f"/sites/{self.name}"
        return f"{where} ({describe_key(self.site.key)}, {self.site.module})"


def _site_of(record: dict[str, Any]) -> Site:
    """A site without its tensors, from its record (index entry or group attributes)."""
    block = int(record["block"])
    subpath = str(record["subpath"])
    return Site(
        stage=str(record["stage"]),
        block=None if block < 0 else block,
        subpath=subpath or None,
        module=str(record["module"]),
        call=int(record["call"]),
        ordinal=int(record["ordinal"]),
        order=int(record["order"]),
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
        self._fd: int | None = None
        self.meta: dict[str, Any] = {}
        self._entries: list[_Entry] = []
        self._forgotten: set[int] = set()  # blocks whose records were dropped (forget)
        self._objects: dict[str, Link] = {}  # every link, its attributes read once at open
        self._packed = False  # schema 4: tensors in /tensors, sites in /index
        self._index: dict[str, Any] = {}
        self._data: dict[str, h5py.Dataset] = {}
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
            handle = self._file.id.get_vfd_handle()
        # libhdf5's file descriptor: large tensors of contiguous datasets are read through
        # it, their checksums taken as the pieces arrive (format.read_packed).
        self._fd = handle if isinstance(handle, int) else None
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
            fmt = attr(f, "format") if "format" in f.attrs else None
        except Exception:
            fmt = None  # a foreign file's "format" may be anything
        if fmt != FORMAT:
            raise DumpError(f"{where} is an HDF5 file but not a blockdiff dump", path=where)
        root = attributes(f)
        attrs = {k: decode_attr(v) for k, v in root.items()}
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
        self._objects = links(f)
        if attrs.get("metadata_digest") != digest(root, self._objects):
            raise DumpError(f"{where} metadata digest mismatch: the file is damaged", path=where)

        meta = {k: v for k, v in attrs.items() if k != "json_attributes"}
        for key in json.loads(attrs["json_attributes"]):
            meta[key] = json.loads(meta[key])
        self.meta = meta
        self._packed = version >= PACKED_SCHEMA
        self._decoded = version >= DECODE_SCHEMA  # a decode run: sites by step (see steps())
        self._step: int | None = None  # a view of one step (at_step) reads only its sites
        self._load_entries()

    def _load_entries(self) -> None:
        """Index the sites (again, after :meth:`forget`): from the JSON index of a packed
        dump, from the site groups' attributes of an older one."""
        entries = self._index_entries() if self._packed else self._group_entries()
        # Calls in the order they started (a block before its modules); sites written
        # without an order (all 0) keep the order they were written in.
        entries.sort(key=lambda e: (e.site.order, int(e.name)))
        self._entries = entries
        self._forgotten = set()

    def _index_entries(self) -> list[_Entry]:
        """Schema 4: the sites of the JSON index, after checking that its tensor entries tile
        the packed datasets."""
        f = self._file
        if self._objects.get("tensors", Link("dataset", {})).kind != "group":
            raise ValueError("/tensors is missing or not a group")
        self._data = {}
        for path, obj in self._objects.items():
            name = path.removeprefix("tensors/")
            if name != path:
                if obj.kind != "dataset" or len(obj.shape) != 1:
                    raise ValueError(f"/{path} is not a 1-D dataset")
                self._data[name] = f[path]
        self._index = read_index(f)
        check_packing(self._index, {name: dset.shape[0] for name, dset in self._data.items()})
        entries = []
        for i, record in enumerate(self._index["sites"]):
            if not isinstance(record, dict):
                raise ValueError(f"sites[{i}] is not an object")
            step = record.get("step")
            if (step is None) == self._decoded or step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
                raise ValueError(f"sites[{i}]: step {step!r} in a dump of schema {self.meta['schema_version']}")
            entries.append(_Entry(str(i), _site_of(record), record.get("structure"), packed=True, step=step))
        return entries

    def _group_entries(self) -> list[_Entry]:
        """Before schema 4: a group per site under /sites, its attributes as read at open."""
        if self._objects.get("sites", Link("dataset", {})).kind != "group":
            raise ValueError("/sites is missing or not a group")
        entries = []
        for path, obj in self._objects.items():
            name = path.removeprefix("sites/")
            if name == path or "/" in name:
                continue
            if obj.kind != "group":
                raise ValueError(f"/{path} is not a group")
            entries.append(_Entry(name, _site_of({k: decode_attr(v) for k, v in obj.attrs.items()})))
        return entries

    # -- SiteStore (read side)

    @property
    def _here(self) -> list[_Entry]:
        """The entries this reader reads: every one, or a step view's (:meth:`at_step`);
        the blocks it forgot indexed again."""
        self._remember()
        return self._held

    @property
    def _held(self) -> list[_Entry]:
        """The entries this reader reads that it holds (not those of forgotten blocks)."""
        if self._step is None:
            return self._entries
        return [e for e in self._entries if e.step == self._step]

    def block_indices(self) -> list[int]:
        """Indices of the blocks that have sites, ascending."""
        return sorted({e.block for e in self._held if e.block is not None} | self._forgotten)

    def block_sites(self, block: int) -> list[Site]:
        """The sites of one block in execution order; reads only that block's groups."""
        entries = self._here if block in self._forgotten else self._held
        return [self._read(e) for e in entries if e.block == block]

    def outside_sites(self) -> list[Site]:
        """Sites outside the blocks (embed, context, final_norm, head) in execution order."""
        return [self._read(e) for e in self._held if e.block is None]

    def _remember(self) -> None:
        """Index the blocks :meth:`forget` dropped again, when there are any."""
        if self._forgotten:
            self._load_entries()

    def forget(self, block: int) -> None:
        """Drop what the reader holds for ``block``'s sites — their records of the index,
        and those of the tensors no other site reads — once localization has judged the
        block: a streamed diff then holds one block's records at a time, not every
        block's. Reading the block again indexes the file again. A decode dump (whose
        step views share one index) keeps everything."""
        gone = [e for e in self._entries if e.block == block]
        if self._decoded or not gone:
            return
        self._entries = [e for e in self._entries if e.block != block]
        self._forgotten.add(block)
        if self._packed:
            index = self._index
            read = _tensor_refs([e.structure for e in self._entries] + [index.get("inputs"), index.get("floors")])
            for ref in _tensor_refs([e.structure for e in gone]) - read:
                index["tensors"][ref] = None
            for e in gone:
                index["sites"][int(e.name)] = None

    def steps(self) -> int | None:
        """How many decode steps the run had after its prompt (its sites are steps 0 …
        that number; schema 5), ``None`` for a dump of one forward pass."""
        return max((e.step for e in self._entries if e.step is not None), default=0) if self._decoded else None

    def at_step(self, step: int) -> "DumpReader":
        """A reader of decode step ``step``'s sites only (the same open file: closing the
        dump closes it too)."""
        if not self._decoded:
            raise DumpError(f"{self.path}: the dump holds one forward pass, not decode steps", path=str(self.path))
        view = copy.copy(self)
        view._step = step
        return view

    def decode(self) -> dict[str, Any] | None:
        """What the decode run was beyond its sites (``greedy``, ``cache``: see
        :meth:`~blockdiff.dump.DumpWriter.add_decode`), ``None`` for one forward pass."""
        return self._whole("decode", None)[0] if self._decoded else None

    def sites(self) -> list[Site]:
        """Every site in execution order (all tensors in memory: prefer :meth:`iter_sites`)."""
        return list(self.iter_sites())

    def iter_sites(self) -> Iterator[Site]:
        """Every site in execution order, read one at a time."""
        for e in self._here:
            yield self._read(e)

    def inputs(self) -> Any:
        """The recorded model inputs, or ``None`` if the dump has none."""
        return self._whole("inputs", None)[0]

    def floors(self) -> dict[str, Any]:
        """The noise floors stored at capture, by precision label (``bfloat16@cpu``): each a
        dict with ``dtype``, ``device`` and ``values``; empty when the dump has none."""
        return self._whole("floors", {})[0]

    def verify_all(self) -> VerifySummary:
        """Read every tensor of every site and the inputs, checking each digest.

        Returns:
            how many sites, tensors and bytes were checked.

        Raises:
            DumpError: naming the file and the first damaged site.
        """
        self._open_file()
        self._remember()
        tensors = nbytes = 0
        used: set = set()
        for e in self._entries:
            with self._guard("cannot be read (the file is damaged)", site=e.label):
                _, dec = self._decode(e, verify=True)
                if not self._packed:
                    extra = set(dec.load.group.keys()) - set(dec.tensors)
                    if extra:
                        raise ValueError(f"datasets {sorted(extra)} are not referenced by the structure")
            used.update(dec.tensors)
            tensors += len(dec.tensors)
            nbytes += dec.nbytes
        for name in ("inputs", "floors"):
            _, dec = self._whole(name, None, verify=True)
            if dec is not None:
                used.update(dec.tensors)
                tensors += len(dec.tensors)
                nbytes += dec.nbytes
        if self._packed:
            with self._guard("is damaged"):
                unused = sorted(set(range(len(self._index["tensors"]))) - used)
                if unused:
                    raise ValueError(f"tensors {unused[:8]} of the index are not referenced by any site")
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
        return len(self._here)

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
            decoded, _ = self._decode(e)
            args, kwargs, output = decoded["args"], decoded["kwargs"], decoded["output"]
            if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                raise TypeError("site args must be a tuple and kwargs a dict")
            return dataclasses.replace(e.site, args=args, kwargs=kwargs, output=output)

    def _decode(self, e: _Entry, *, verify: bool | None = None) -> tuple[dict[str, Any], _Decoder]:
        """A site's ``{"args", "kwargs", "output"}``, decoded."""
        if e.packed:
            structure, load = e.structure, self._packed_tensor
        else:
            path = f"sites/{e.name}"
            structure = json.loads(decode_attr(self._objects[path].attrs["structure"]))
            load = _GroupTensors(self._open_file()[path], path, self._objects)
        dec = _Decoder(load, verify=self.verify if verify is None else verify)
        if not isinstance(structure, dict) or set(structure) != {"args", "kwargs", "output"}:
            raise ValueError("a site structure must have exactly 'args', 'kwargs' and 'output'")
        try:
            return {k: dec.node(v) for k, v in structure.items()}, dec
        except _DigestMismatch as exc:
            raise DumpError(
                f"{self.path}: site {e.label}: tensor {exc.ref} digest mismatch: the file is damaged",
                path=str(self.path),
                site=e.label,
            ) from None

    def _structure(self, name: str) -> tuple[Any, Callable[[Any, bool], torch.Tensor]] | None:
        """A whole structure (``inputs``, ``floors``) and how to load its tensors, or ``None``."""
        if self._packed:
            return None if self._index.get(name) is None else (self._index[name], self._packed_tensor)
        if name not in self._objects:
            return None
        structure = json.loads(decode_attr(self._objects[name].attrs["structure"]))
        return structure, _GroupTensors(self._open_file()[name], name, self._objects)

    def _whole(self, name: str, absent: Any, *, verify: bool | None = None) -> tuple[Any, _Decoder | None]:
        """A whole structure (``inputs``, ``floors``), decoded, and its decoder; ``absent``
        and ``None`` when the dump has none."""
        self._open_file()
        with self._guard("cannot be read (the file is damaged)", site=f"/{name}"):
            found = self._structure(name)
            if found is None:
                return absent, None
            dec = _Decoder(found[1], verify=self.verify if verify is None else verify)
            try:
                return dec.node(found[0]), dec
            except _DigestMismatch as exc:
                raise ValueError(f"tensor {exc.ref} digest mismatch: the file is damaged") from None

    def _packed_tensor(self, ref: Any, verify: bool) -> torch.Tensor:
        """Tensor ``ref`` of the index, read from its packed dataset."""
        tensors = self._index["tensors"]
        if not isinstance(ref, int) or isinstance(ref, bool) or not 0 <= ref < len(tensors):
            raise ValueError(f"tensor {ref!r:.40} is not in the index")
        entry = tensors[ref]
        dtype = stored_dtype(_expect(entry.get("dtype"), str))
        shape = _shape(entry.get("shape"))
        if math.prod(shape) != entry["count"]:
            raise ValueError(f"tensor {ref}: shape {shape} does not hold {entry['count']} elements")
        arr, crc = read_packed(self._data[entry["data"]], entry, _stored_as(dtype), self._fd, summed=verify)
        if verify:
            _verified(arr, entry, ref, crc)
        return _as_tensor(arr, dtype, shape)

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
