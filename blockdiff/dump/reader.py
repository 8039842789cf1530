"""The read side of a dump: :class:`DumpReader` hands localization one block at a time.

Opening validates the file (probe, format, schema, ``complete``, metadata digest) and
indexes the sites from their attributes (:class:`_Entry`); a site's tensors are decoded
(:class:`_Decoder`) and checked against their checksums only when it is asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np
import torch

from ..dtypes import stored_dtype
from ..errors import DumpError
from ..site import Opaque, Site, describe_key
from ..store import release_freed_memory
from .format import (
    _CHECKSUMS,
    _NUMPY_NATIVE,
    _RAW_BITS,
    FORMAT,
    SCHEMA_VERSION,
    _attr,
    _attributes,
    _decode_attr,
    _digest,
    _Object,
    _objects,
)
from .probe import probe_file

# bool is an HDF5 enum, complex a compound of two floats.
_DATASET_CLASSES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.ENUM, h5py.h5t.COMPOUND)


# ---------------------------------------------------------------------------------------
# structures


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
            name = _expect(node["value"], str)
            return Opaque(name, cache=name.endswith("Cache"))  # the object itself is not kept
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
        self._open_file()
        with self._guard("cannot be read (the file is damaged)", site="/inputs"):
            if "inputs" not in self._objects:
                return None
            return self._decode("inputs", "/inputs", whole=True)[0]

    def floors(self) -> dict[str, Any]:
        """The noise floors stored at capture, by precision label (``bfloat16@cpu``): each a
        dict with ``dtype``, ``device`` and ``values``; empty when the dump has none."""
        self._open_file()
        with self._guard("cannot be read (the file is damaged)", site="/floors"):
            if "floors" not in self._objects:
                return {}
            return self._decode("floors", "/floors", whole=True)[0]

    def verify_all(self) -> VerifySummary:
        """Read every tensor of every site and the inputs, checking each digest.

        Returns:
            how many sites, tensors and bytes were checked.

        Raises:
            DumpError: naming the file and the first damaged site.
        """
        self._open_file()
        tensors = nbytes = 0
        for e in self._entries:
            with self._guard("cannot be read (the file is damaged)", site=e.label):
                _, dec = self._decode(f"sites/{e.name}", e.label, verify=True)
                extra = set(dec.group.keys()) - set(dec.tensors)
                if extra:
                    raise ValueError(f"datasets {sorted(extra)} are not referenced by the structure")
            tensors += len(dec.tensors)
            nbytes += dec.nbytes
        for name in ("inputs", "floors"):
            with self._guard("cannot be read (the file is damaged)", site=f"/{name}"):
                if name in self._objects:
                    _, dec = self._decode(name, f"/{name}", whole=True, verify=True)
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
