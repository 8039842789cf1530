"""A candidate dump written by another runtime: the bridge from JAX, ONNX Runtime, llama.cpp...

A script in another framework runs the same model on the reference's inputs and writes
what each of the reference's sites computed, site by site, into a dump of the documented
format (``docs/dump-format.md``, schema 4: the same file :class:`~blockdiff.dump.DumpWriter`
writes, through the same code, :mod:`blockdiff.dump.packing`). ``blockdiff diff ref.h5
foreign.h5`` then compares it offline: drift at every site, against the drift floors the
reference stored (``blockdiff capture --floors``) when there are some for the candidate's
precision, and says where the candidate first diverges.

Only numpy, h5py and crc32c (the dump's own dependencies) are imported: no torch.
Site names come from the reference dump (:func:`reference_sites`), inputs too
(:func:`reference_inputs`), so the foreign script needs nothing but the reference's file:

>>> from blockdiff.dumpfile import ForeignDumpWriter, reference_inputs, reference_sites
>>> ids = reference_inputs("ref.h5")                                  # doctest: +SKIP
>>> with ForeignDumpWriter("jax.h5", reference="ref.h5", runtime="jax 0.10") as w:
...     w.add_inputs(ids)                                            # doctest: +SKIP
...     w.add("embed", embedded)                                     # doctest: +SKIP
...     w.add("blocks.0.attn_norm", normed)                          # doctest: +SKIP
...     ...

Every site of the reference must be written (pairing is by stage, block, sub-path and
ordinal, and the comparison needs both sides of each); :meth:`ForeignDumpWriter.close`
names the ones missing. Arrays are any numpy arrays (``np.asarray`` of a JAX array, an
ONNX Runtime output); ``ml_dtypes`` bfloat16 and float8 arrays are stored as raw bits,
as blockdiff stores them.

Written that way, a dump is the port's free run, judged on drift only. A port can be
judged by local errors instead (teacher-forced, docs/runtimes.md): :class:`TeacherForcedWriter`
writes its three runs — every site's value replaced by the reference's as it is computed,
the block outputs replaced, free — each site passed through
:meth:`ForeignDumpWriter.substitute`, which writes it and hands back what the port goes on
with (the reference's value where the run replaces the site:
:func:`blockdiff.vocab.replaced_in`).
"""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, TypeVar

import numpy as np

from .dump.format import (
    FREE_RUN,
    NUMPY_NATIVE_NAMES,
    RAW_BITS_UNSIGNED,
    FORWARD_SCHEMA,
    STANDARD_ATTRIBUTES,
    TEACHER_FORCED,
    encode_meta,
)
from .dump.packing import PackedFile, StoredTensor, elements, encode_index, one_line, site_record, temporary_path
from .dump.foreign import RAW_BITS_NAMES, ReferenceSite, ReferenceValues, numpy_dtype, reference_inputs, reference_meta, reference_sites
from .errors import DumpError
from .vocab import BLOCK_OUTPUTS, EVERY_SITE, REPLACED_RUNS, replaced_in

# The schema this module writes: the native writer's, whose file code it shares (a reader
# reads every older schema too, foreign dumps of schema 3 included).
WRITES_SCHEMA = FORWARD_SCHEMA


def _stored(arr: np.ndarray) -> StoredTensor:
    """An array as a dump stores it (its elements, or their raw bits, 1-D and little-endian),
    with the torch dtype name it stands for."""
    name = arr.dtype.name
    if name in NUMPY_NATIVE_NAMES:
        stored = arr
    elif name in RAW_BITS_NAMES:
        stored = arr.view(RAW_BITS_UNSIGNED[arr.dtype.itemsize])
    else:
        raise DumpError(
            f"cannot store a {name} array: a dump holds {', '.join(NUMPY_NATIVE_NAMES)} and, as raw bits, "
            f"{', '.join(RAW_BITS_NAMES)} (ml_dtypes)"
        )
    return StoredTensor(elements(stored), name, list(arr.shape))


class _Structure:
    """Encodes one structure into JSON nodes; its arrays become tensors of the index
    (``{"type": "tensor", "ref": N}``, N their position in the index's ``tensors``, the
    first of them ``first``). An array passed twice is stored once."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.tensors: list[StoredTensor] = []
        self._refs: dict[int, int] = {}  # id of an object of the structure (alive as long as it) -> ref
        # Of each array in the order the structure mentions them, repeated ones again.
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[str] = []

    def node(self, obj: Any) -> dict[str, Any]:
        if obj is None:
            return {"type": "none"}
        if isinstance(obj, (bool, np.bool_)):
            return {"type": "bool", "value": bool(obj)}
        if isinstance(obj, (int, np.integer)):
            return {"type": "int", "value": int(obj)}
        if isinstance(obj, (float, np.floating)):
            return {"type": "float", "value": repr(float(obj))}
        if isinstance(obj, str):
            return {"type": "str", "value": obj}
        if isinstance(obj, (tuple, list)):
            return {"type": "tuple" if isinstance(obj, tuple) else "list", "items": [self.node(v) for v in obj]}
        if isinstance(obj, dict):
            return {"type": "dict", "items": [[self.node(k), self.node(v)] for k, v in obj.items()]}
        return {"type": "tensor", "ref": self.array(obj)}

    def array(self, obj: Any) -> int:
        ref = self._refs.get(id(obj))
        if ref is None:
            tensor = _stored(np.asarray(obj))
            ref = self._refs[id(obj)] = self.first + len(self.tensors)
            self.tensors.append(tensor)
        entry = self.tensors[ref - self.first].entry
        self.shapes.append(tuple(entry["shape"]))
        self.dtypes.append(entry["dtype"])
        return ref


def _arrays(obj: Any) -> Iterator[Any]:
    """The arrays of a structure, in the order :class:`_Structure` stores them."""
    if obj is None or isinstance(obj, (bool, int, float, str, np.bool_, np.integer, np.floating)):
        return
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _arrays(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _arrays(item)
    else:
        yield obj


def _cast_like(reference: Any, own: Any, dtype: Any) -> Any:
    """The reference's structure, each array cast to ``dtype`` or, ``None``, to the dtype of
    the port's array it stands for (``own``, shaped alike: :meth:`ForeignDumpWriter.add`
    checked it)."""
    owned = iter(_arrays(own))
    target = None if dtype is None else numpy_dtype(dtype)

    def cast(node: Any) -> Any:
        if isinstance(node, np.ndarray):
            return node.astype(target if target is not None else np.asarray(next(owned)).dtype, copy=False)
        if isinstance(node, (tuple, list)):
            return type(node)(cast(item) for item in node)
        if isinstance(node, dict):
            return {key: cast(item) for key, item in node.items()}
        return node

    return cast(reference)


_Writer = TypeVar("_Writer", bound="_Written")


class _Written:
    """A writer as a context: closed on a clean exit (its files checked and renamed into
    place), discarded on an exception (nothing left)."""

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


class ForeignDumpWriter(_Written):
    """Writes a candidate dump site by site from another runtime's arrays.

    Each :meth:`add` names a module of the reference (its path in the reference's hook
    map, as :func:`reference_sites` lists them) and gives what the foreign runtime
    computed there; the site's stage, block, sub-path and ordering come from the
    reference, and so do the hook map and layout the file records. The file is written
    under a temporary name and renamed on a clean :meth:`close`, which checks that every
    reference site was written. Each call's arrays are written (and their checksums
    taken) before it returns: the writer keeps no reference to them, so a runtime may
    reuse its buffers.

    Args:
        path: where the dump goes (replaced if it exists).
        reference: the reference dump (``blockdiff capture MODEL --out ref.h5``).
        runtime: what produced the arrays, for the report (``"jax 0.10.2 cpu"``).
        dtype: the precision the runtime computed in (``"bfloat16"``): picks the stored
            drift floors the comparison is judged with. Default: the dtype of the first
            floating output written.
        device: the torch name of the device class it ran on (``"cpu"``, ``"cuda"``): with
            ``dtype``, which of the reference's stored floors apply.
        meta: more attributes to record (str, int, float, bool, or JSON-serializable).
        durable: flush the file to disk before the rename (fsync), as
            :class:`~blockdiff.dump.DumpWriter` does with ``durable=True``.
        replacing: the run this dump is, for :meth:`substitute`: ``None`` (free: the
            port's own values go on), or a replaced run (``"every site"``, ``"block
            outputs"``): the reference's values go on where the run replaces them. A
            replaced run may leave out a site the runtime does not expose (its check is then
            not judged); :class:`TeacherForcedWriter` writes the three runs of a port.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        reference: str | os.PathLike,
        runtime: str = "foreign",
        dtype: str | None = None,
        device: str = "cpu",
        meta: dict[str, Any] | None = None,
        durable: bool = False,
        replacing: str | None = None,
    ) -> None:
        if replacing is not None and replacing not in REPLACED_RUNS:
            raise DumpError(f"replacing={replacing!r}: expected None or one of {', '.join(map(repr, REPLACED_RUNS))}")
        self.path = Path(path)
        self.durable = durable
        self.replacing = replacing
        self._values: ReferenceValues | None = None  # opened by the first substitute
        self.reference = Path(reference)
        self.expected = {(s.module, s.call): s for s in reference_sites(self.reference)}
        ref_meta = reference_meta(self.reference)
        self.meta: dict[str, Any] = {
            "model": runtime,
            "class": f"{runtime} (foreign dump)",
            "runtime": runtime,
            "device": device,
            "hook_map": ref_meta.get("hook_map", ""),
            "layout": ref_meta.get("layout", {}),
            "reference_dump": str(self.reference),
            **(meta or {}),
        }
        self.dtype = dtype
        self.written: set[tuple[str, int]] = set()
        self.tmp_path = temporary_path(self.path)
        # The index, built as sites are added: tensor entries, site records, the inputs.
        self._tensors: list[dict[str, Any]] = []
        self._sites: list[dict[str, Any]] = []
        self._structures: dict[str, Any] = {}
        # No torch wrote it (``torch_version`` ""); ``runtime`` says what did.
        self._file: PackedFile | None = PackedFile(self.path, torch_version="", meta=self._encoded_meta(), durable=durable)

    def sites(self) -> list[ReferenceSite]:
        """The reference's sites, in execution order; :attr:`written` says which are done."""
        return sorted(self.expected.values(), key=lambda s: s.order)

    def add(self, module: str, output: Any, *, call: int = 0, args: tuple = ()) -> None:
        """Write what the foreign runtime computed at the reference's site ``module``.

        Args:
            module: the reference's module path (``"blocks.2.ffn"``).
            output: an array, or a tuple/list/dict of them shaped like the reference's
                output (``(cos, sin)``); each array must have the reference's shape.
            call: which call of ``module`` within the forward (modules called once: 0).
            args: the call's inputs, optional (the comparison judges outputs).
        """
        self._open()
        site = self.expected.get((module, call))
        if site is None:
            near = ", ".join(sorted({m for m, _ in self.expected})[:8])
            raise DumpError(f"{self.path}: {module!r} (call {call}) is not a site of {self.reference} (sites: {near}, ...)")
        if (module, call) in self.written:
            raise DumpError(f"{self.path}: {site.label} was already written")
        structure = _Structure(len(self._tensors))
        nodes = {"args": structure.node(tuple(args)), "kwargs": {"type": "dict", "items": []}}
        arguments = len(structure.shapes)
        nodes["output"] = structure.node(output)
        shapes = tuple(structure.shapes[arguments:])
        if shapes != site.outputs:
            raise DumpError(
                f"{self.path}: {site.label}: output has shape{'s' if len(shapes) != 1 else ''} "
                f"{_shapes(shapes)}, the reference's {_shapes(site.outputs)}"
            )
        self._write(structure.tensors, site.label)
        self._sites.append({**site_record(site), "structure": nodes})
        self.written.add((module, call))
        if self.dtype is None:
            self.dtype = next((d for d in structure.dtypes[arguments:] if "float" in d), None)

    def substitute(self, module: str, value: Any, *, call: int | None = None, args: tuple = (), dtype: Any = None) -> Any:
        """Write ``value`` at the reference's site ``module`` (:meth:`add`) and return what
        the port goes on with: in a run that replaces the site, the reference's value there
        (numpy arrays at the reference's shapes, in the structure of its output), else
        ``value`` itself. Pass each site's value through here as the port computes it, in
        execution order, and compute on with what comes back.

        Args:
            module, args: as for :meth:`add`.
            call: which call of ``module`` (default: the next one not written yet).
            dtype: the dtype of the arrays handed back (``"bfloat16"``: ``ml_dtypes``);
                default, each the dtype of the port's own array it stands for.

        >>> h = w.substitute("blocks.0.attn_norm", rms_norm(x, weight))  # doctest: +SKIP
        """
        if call is None:
            call = next(n for n in itertools.count() if (module, n) not in self.written)
        self.add(module, value, call=call, args=args)
        site = self.expected[(module, call)]
        if self.replacing is None or not replaced_in(self.replacing, site.stage, site.subpath):
            return value
        if self._values is None:
            self._values = ReferenceValues(self.reference)
        return _cast_like(self._values.output(module, call), value, dtype)

    def add_inputs(self, inputs: Any) -> None:
        """Record the model inputs the runtime ran on (what :func:`reference_inputs` gave):
        the comparison refuses a dump captured on other inputs."""
        self._open()
        if "inputs" in self._structures:
            raise DumpError(f"{self.path}: the inputs were already recorded")
        structure = _Structure(len(self._tensors))
        node = structure.node(inputs)
        self._write(structure.tensors, "the inputs")
        self._structures["inputs"] = node

    def missing(self) -> list[ReferenceSite]:
        """The reference's sites not written yet, in execution order."""
        return [s for s in self.sites() if (s.module, s.call) not in self.written]

    def close(self) -> None:
        """Check every site was written, write the index, the file attributes, the
        metadata digest and ``complete`` last, and rename the file to its path. Missing
        sites: a :class:`~blockdiff.errors.DumpError` naming them, and no file (a replaced
        run may miss sites: those the runtime does not expose)."""
        file = self._open()
        self._file = None
        self._release()
        try:
            missing = self.missing() if self.replacing is None else []
            if missing:
                names = ", ".join(s.label for s in missing[:6])
                raise DumpError(
                    f"{self.path}: {len(missing)} site{'s' if len(missing) > 1 else ''} of the reference "
                    f"{'were' if len(missing) > 1 else 'was'} not written: {names}{', ...' if len(missing) > 6 else ''} "
                    "(the comparison pairs every site; write each, see reference_sites())",
                    path=str(self.path),
                )
            file.write_meta(self._encoded_meta())  # the dtype, now that the outputs say it
            file.finish(encode_index(self._tensors, self._sites, self._structures))
        except BaseException:
            file.abort()
            raise

    def abort(self) -> None:
        """Discard the dump: nothing is left at ``path``, nor the temporary file."""
        file, self._file = self._file, None
        self._release()
        if file is not None:
            file.abort()

    def _release(self) -> None:
        values, self._values = self._values, None
        if values is not None:
            values.close()

    def _write(self, tensors: list[StoredTensor], what: str) -> None:
        """The tensors of one call, written at once, with their checksums, into the index.
        A failed write discards the dump (its datasets no longer match any index)."""
        file = self._open()
        try:
            for tensor in tensors:
                tensor.take_checksum()
            for name, items in file.place(tensors):
                file.write(name, items)
        except Exception as exc:
            self.abort()
            raise DumpError(
                f"{self.path}: cannot write {what}: {type(exc).__name__}: {one_line(exc)} (the dump was discarded)",
                path=str(self.path),
            ) from exc
        self._tensors.extend(t.entry for t in tensors)

    def _encoded_meta(self) -> list[tuple[str, Any, bool]]:
        """Every file attribute the caller's side decides, as stored, ``(key, value,
        is_json)``: the meta, and the dtype (the default until an output says it)."""
        for key in self.meta:
            if key in STANDARD_ATTRIBUTES or key == "dtype":
                raise DumpError(f"{self.path}: meta key {key!r} is set by the writer", path=str(self.path))
        meta = {**self.meta, "dtype": self.dtype or "float32"}
        return [(key, *encode_meta(key, value)) for key, value in meta.items()]

    def _open(self) -> PackedFile:
        if self._file is None:
            raise DumpError(f"{self.path}: the writer is closed", path=str(self.path))
        return self._file


# The file of each replaced run, beside the free run's: ``port.h5`` → ``port.every.h5``.
_RUN_FILES = {EVERY_SITE: "every", BLOCK_OUTPUTS: "blocks"}


def run_path(path: str | os.PathLike, run: str) -> Path:
    """Where :class:`TeacherForcedWriter` writes ``run`` of the dump ``path``: the free run
    (``"free"``) at ``path``, a replaced run beside it (``port.every.h5``, ``port.blocks.h5``)."""
    path = Path(path)
    if run == FREE_RUN:
        return path
    return path.with_name(f"{path.stem}.{_RUN_FILES[run]}{path.suffix}")


class TeacherForcedWriter(_Written):
    """Writes a port judged teacher-forced: its runs on the reference's inputs, one dump each,
    which ``blockdiff diff ref.h5 port.h5`` judges by local errors, not drift alone.

    The port runs once per writer :meth:`runs` yields, passing each site's value through
    that writer's :meth:`~ForeignDumpWriter.substitute` as it computes it and going on with
    what comes back: in the run replacing **every site** (but the head) the reference's
    value, so each sub-path computes from the reference's inputs and what it recorded is
    its local error; in the run replacing the **block outputs** (and the embedding), each
    block runs whole on the reference's input; in the **free** run, its own values (drift).
    The free run is written last, at ``path``, naming the others (:func:`run_path`) in its
    ``teacher_forced`` attribute; a writing that fails leaves none of them.

    >>> with TeacherForcedWriter("port.h5", reference="ref.h5", runtime="jax 0.10 cpu") as w:  # doctest: +SKIP
    ...     w.add_inputs(ids)
    ...     for run in w.runs():             # every site replaced, block outputs replaced, free
    ...         my_port(ids, at=run.substitute)

    Args:
        path, reference, meta: as for :class:`ForeignDumpWriter`.
        runs: the replaced runs to write (``"every site"``, ``"block outputs"``). Without
            the block outputs' run, the whole-block checks are not judged.
        options: for each run's :class:`ForeignDumpWriter` (``runtime``, ``dtype``,
            ``device``, ``durable``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        reference: str | os.PathLike,
        runs: tuple[str, ...] = REPLACED_RUNS,
        meta: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        unknown = [run for run in runs if run not in REPLACED_RUNS]
        if unknown or not runs:
            raise DumpError(f"runs={runs!r}: expected some of {', '.join(map(repr, REPLACED_RUNS))}")
        self.path = Path(path)
        self.order = (*[run for run in REPLACED_RUNS if run in runs], FREE_RUN)
        self._options = {"reference": reference, **options}  # each run's ForeignDumpWriter's
        self._meta = dict(meta or {})
        # What each run's ``teacher_forced`` attribute says besides the run it is.
        self._linked = {"id": uuid.uuid4().hex, "runs": {run: run_path(self.path, run).name for run in self.order}}
        self._inputs: list[Any] = []
        self._current: ForeignDumpWriter | None = None
        self.written: list[Path] = []

    def add_inputs(self, inputs: Any) -> None:
        """The model inputs the port runs on, recorded in each run's dump."""
        self._inputs = [inputs]

    def runs(self) -> Iterator[ForeignDumpWriter]:
        """A writer per run, in turn (the replaced runs, then the free one): run the port
        once with each. A run's dump is closed, and its sites checked, when the loop goes on."""
        for run in self.order[len(self.written):]:
            self._current = writer = ForeignDumpWriter(
                run_path(self.path, run), **self._options, replacing=None if run == FREE_RUN else run,
                meta={**self._meta, TEACHER_FORCED: {**self._linked, "run": run}},
            )
            for inputs in self._inputs:
                writer.add_inputs(inputs)
            yield writer
            self._current = None
            writer.close()
            self.written.append(writer.path)

    def close(self) -> None:
        """Check every run was written (the free run, written last, is then at ``path``)."""
        if len(self.written) < len(self.order):
            left = ", ".join(self.order[len(self.written):])
            self.abort()
            raise DumpError(f"{self.path}: the port's runs were not all written (left: {left}); loop over runs() to the end")

    def abort(self) -> None:
        """Discard every run: the one being written and those already renamed."""
        current, self._current = self._current, None
        if current is not None:
            current.abort()
        for path in self.written:
            path.unlink(missing_ok=True)
        self.written = []


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join(str(list(s)) for s in shapes) if shapes else "none"


__all__ = [
    "ForeignDumpWriter", "ReferenceSite", "TeacherForcedWriter", "reference_sites", "reference_inputs", "reference_meta",
    "run_path", "WRITES_SCHEMA",
]
