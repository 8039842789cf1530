"""The write side of a dump: :class:`DumpWriter` streams captured sites into an HDF5 file.

Capture hands each site to :meth:`DumpWriter.add`; its tensors are encoded into datasets
(:class:`_Encoder`), the metadata digest is recorded as it is written, and the file is
renamed to its final path only after a clean close.
"""

from __future__ import annotations

import json
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import DumpError
from ..site import Opaque, Site
from .format import (
    _NUMPY_NATIVE,
    _RAW_BITS,
    FORMAT,
    SCHEMA_VERSION,
    STANDARD_ATTRIBUTES,
    LIBVER,
    _encode_meta,
    _Object,
    _set_attr,
    finish_file,
    write_array,
)

_COMPRESSIONS = (None, "lzf", "gzip")


def _blockdiff_version() -> str:
    try:
        from .._version import __version__

        return str(__version__)
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("blockdiff")
    except (ImportError, PackageNotFoundError):
        return "unknown"


# ---------------------------------------------------------------------------------------
# meta values


def _encode_attr(key: str, value: Any) -> tuple[Any, bool]:
    """A meta value as stored: ``(value, is_json)``."""
    if isinstance(value, (torch.dtype, torch.device)):
        value = dtype_name(value) if isinstance(value, torch.dtype) else str(value)
    return _encode_meta(key, value)


# ---------------------------------------------------------------------------------------
# structures


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
        self.objects[path] = write_array(
            self.group, name, arr, dtype_name(t.dtype), shape, compression=self.compression, checksums=self.checksums
        )
        self.refs[id(original)] = name
        self._alive.append(original)
        written, key = self.written, id(original)
        try:
            # The callback must not hold this encoder: it keeps its tensors alive.
            written[key] = (weakref.ref(original, lambda _: written.pop(key, None)), path)
        except TypeError:
            pass
        return name


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

    # Capture may hand over the model's own CPU tensors (capture.record_once, hold="written"):
    # each site is written before add returns, after a check that none changed since its hook.

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
            self._file = h5py.File(self.tmp_path, "w", libver=LIBVER)
        except Exception as exc:
            self._stop_worker()
            raise DumpError(
                f"{self.path}: cannot create the dump: {_why_not_created(self.path.parent, exc)}", path=str(self.path)
            ) from exc
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
        self._on_worker(self._add_structure, "inputs", obj)

    def add_floors(self, floors: dict[str, Any]) -> None:
        """Record noise floors measured at capture as group ``/floors``: by precision label
        (``bfloat16@cpu``) a dict with ``dtype``, ``device`` and ``values`` (check key →
        a number, a list of numbers, or a router's output). Schema 3."""
        self._on_worker(self._add_structure, "floors", floors)

    def _add_structure(self, name: str, obj: Any) -> None:
        """Group ``/<name>``: one nested structure of tensors and plain values."""
        f = self._open_file()
        if name in self._objects:
            raise DumpError(f"{self.path}: {name} were already recorded", path=str(self.path))
        group = f.create_group(name)
        attrs: dict[str, Any] = {}
        self._objects[name] = _Object("group", attrs)
        try:
            enc = _Encoder(group, name, self._objects, self._compression, checksums=self.checksums)
            attrs["structure"] = _set_attr(group, "structure", json.dumps(enc.node(obj)))
        except Exception as exc:
            del f[name]
            self._forget(name)
            raise DumpError(
                f"{self.path}: cannot write the {name}: {type(exc).__name__}: {exc}", path=str(self.path)
            ) from exc

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
            self._file = None
            finish_file(f, self._root, self._objects, self.tmp_path, self.path)
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


def _why_not_created(folder: Path, exc: Exception) -> str:
    """Why a file could not be created in ``folder``, in the user's words where the folder
    explains it (libhdf5's own message names the temporary file and its internals)."""
    if not folder.exists():
        return f"the folder {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return str(exc)
