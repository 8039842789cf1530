"""The reference dump as a foreign writer reads it: its sites, inputs, meta and outputs.

What :class:`blockdiff.dumpfile.ForeignDumpWriter` and :class:`~blockdiff.dumpfile.TeacherForcedWriter`
need of the reference's file, read with numpy and h5py only (no torch): the sites a port
must write (:func:`reference_sites`), the inputs it runs on (:func:`reference_inputs`),
the capture's meta (:func:`reference_meta`) and, for a teacher-forced run, each site's
output (:class:`ReferenceValues`), bfloat16 and float8 as ``ml_dtypes`` arrays. Dumps of
schema 4 (one index) and of schemas 1-3 (a group per site) are read alike.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import h5py
import numpy as np

from ..errors import DumpError
from .format import FORMAT, attr, read_index, read_packed

# Dtypes stored as raw bits, by the name numpy (ml_dtypes) and torch both give them.
RAW_BITS_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


@dataclass(frozen=True)
class ReferenceSite:
    """One site of the reference dump: what a foreign writer must write under ``module``.

    Attributes:
        stage, block, subpath, module, call, ordinal, order: as in the dump (``block`` is
            ``-1`` outside the blocks, ``subpath`` ``""`` for a block's own call).
        outputs: the shape of each tensor of the output structure, in order (a module
            returning ``(cos, sin)`` has two).
    """

    stage: str
    block: int
    subpath: str
    module: str
    call: int
    ordinal: int
    order: int
    outputs: tuple[tuple[int, ...], ...]

    @property
    def label(self) -> str:
        where = f"block {self.block} {self.subpath}".rstrip() if self.block >= 0 else self.stage
        return f"{where} ({self.module}{f', call {self.call}' if self.call else ''})"


def _open_reference(path: str | os.PathLike) -> h5py.File:
    path = Path(path)
    if not path.exists():
        raise DumpError(f"{path}: no such file", path=str(path))
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DumpError(f"{path} cannot be opened as HDF5: {exc}", path=str(path)) from exc
    try:
        found = attr(f, "format") if "format" in f.attrs else None
    except (ValueError, OSError):
        found = None
    if found != FORMAT or ("sites" not in f and "index" not in f):
        f.close()
        raise DumpError(f"{path} is not a blockdiff dump", path=str(path))
    return f


def _tensor_refs(node: Any) -> Iterator[Any]:
    """The tensor references a structure node mentions, in order (dataset names before
    schema 4, positions in the index's ``tensors`` after)."""
    if not isinstance(node, dict):
        return
    if node.get("type") == "tensor":
        yield node["ref"]
    for item in node.get("items", ()):
        for part in item if isinstance(item, list) else [item]:
            yield from _tensor_refs(part)


def reference_sites(path: str | os.PathLike) -> list[ReferenceSite]:
    """Every site of the reference dump ``path``, in execution order.

    Read with plain h5py (the file's checksums are checked when ``blockdiff diff`` reads
    it). Raises :class:`~blockdiff.errors.DumpError` for a file that is not a dump.
    """
    found = []
    with _open_reference(path) as f:
        if "index" in f:  # schema 4: the JSON index
            index = read_index(f)
            for record in index["sites"]:
                shapes = tuple(tuple(index["tensors"][ref]["shape"]) for ref in _tensor_refs(record["structure"]["output"]))
                found.append(_reference_site(record, shapes))
        else:  # a group per site
            for group in f["sites"].values():
                structure = json.loads(attr(group, "structure"))
                shapes = tuple(
                    tuple(json.loads(attr(group[ref], "shape"))) for ref in _tensor_refs(structure["output"])
                )
                found.append(_reference_site({key: attr(group, key) for key in group.attrs}, shapes))
    return sorted(found, key=lambda s: s.order)


def _reference_site(record: dict[str, Any], shapes: tuple) -> ReferenceSite:
    text = {key: str(record[key]) for key in ("stage", "subpath", "module")}
    number = {key: int(record[key]) for key in ("block", "call", "ordinal", "order")}
    return ReferenceSite(**text, **number, outputs=shapes)


def reference_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The reference dump's file attributes (its JSON ones parsed: ``layout``, ``versions``)."""
    with _open_reference(path) as f:
        meta = {name: attr(f, name) for name in f.attrs}
    for key in json.loads(meta.get("json_attributes", "[]")):
        meta[key] = json.loads(meta[key])
    return meta


def reference_inputs(path: str | os.PathLike) -> Any:
    """The model inputs the reference ran on (token ids as an int64 array; a tuple or dict
    of them when the model took several), or ``None`` when the dump has none."""
    with _open_reference(path) as f:
        if "index" in f:
            index = read_index(f)
            if index.get("inputs") is None:
                return None
            return _decode(index["inputs"], _index_loader(f, index, typed=False))
        if "inputs" not in f:
            return None
        group = f["inputs"]
        return _decode(json.loads(attr(group, "structure")), _group_loader(group, typed=False))


Loader = Callable[[Any], np.ndarray]


def _index_loader(f: h5py.File, index: dict[str, Any], *, typed: bool) -> Loader:
    """Reads a tensor of a schema-4 dump by its position in the index's ``tensors``."""

    def load(ref: int) -> np.ndarray:
        entry = index["tensors"][ref]
        dset = f["tensors"][entry["data"]]
        return _typed(read_packed(dset, entry, dset.dtype)[0], entry["dtype"], typed).reshape(entry["shape"])

    return load


def _group_loader(group: h5py.Group, *, typed: bool) -> Loader:
    """Reads a tensor of an older dump by its dataset's name in ``group``."""

    def load(ref: str) -> np.ndarray:
        dset = group[ref]
        return _typed(dset[()], attr(dset, "torch_dtype"), typed).reshape(json.loads(attr(dset, "shape")))

    return load


def _typed(stored: np.ndarray, name: str, typed: bool) -> np.ndarray:
    """A tensor's stored elements, raw bits (bfloat16, float8) as their ``ml_dtypes`` type
    when ``typed`` (else as the unsigned integers stored)."""
    return stored.view(numpy_dtype(name)) if typed and name in RAW_BITS_NAMES else stored


def numpy_dtype(name: Any) -> np.dtype:
    """The numpy dtype named ``name`` (a numpy dtype, or a name: ``"bfloat16"`` and the
    float8 names through ``ml_dtypes``)."""
    if isinstance(name, str) and name in RAW_BITS_NAMES:
        try:
            import ml_dtypes
        except ImportError:
            raise DumpError(f"{name} arrays need ml_dtypes: pip install ml_dtypes") from None
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def _decode(node: dict[str, Any], load: Any) -> Any:
    """A structure node as numpy values: ``load(ref)`` reads a tensor (raw-bits dtypes come
    back as their unsigned bits)."""
    kind = node["type"]
    if kind == "tensor":
        return load(node["ref"])
    if kind in ("bool", "int", "str"):
        return node["value"]
    if kind == "float":
        return float(node["value"])
    if kind in ("tuple", "list"):
        items = [_decode(item, load) for item in node["items"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {_decode(k, load): _decode(v, load) for k, v in node["items"]}
    return None  # none, and what only torch knows (dtype, device, opaque)


class ReferenceValues:
    """The reference dump open for its sites' outputs, each read when asked, as numpy
    arrays of the stored dtypes (bfloat16 and float8 as ``ml_dtypes`` arrays)."""

    def __init__(self, path: Path) -> None:
        self.file = _open_reference(path)
        self._outputs: dict[tuple[str, int], tuple[dict[str, Any], Loader]] = {}
        try:
            if "index" in self.file:
                index = read_index(self.file)
                load = _index_loader(self.file, index, typed=True)
                for record in index["sites"]:
                    self._outputs[(str(record["module"]), int(record["call"]))] = (record["structure"]["output"], load)
            else:
                for group in self.file["sites"].values():
                    output = json.loads(attr(group, "structure"))["output"]
                    self._outputs[(attr(group, "module"), int(attr(group, "call")))] = (output, _group_loader(group, typed=True))
        except BaseException:
            self.file.close()
            raise

    def output(self, module: str, call: int) -> Any:
        node, load = self._outputs[(module, call)]
        return _decode(node, load)

    def close(self) -> None:
        self.file.close()
