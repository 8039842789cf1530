"""The write side of a dump: :class:`DumpWriter` streams captured sites into an HDF5 file.

Capture hands each site to :meth:`DumpWriter.add`, which encodes its structure (torch
tensors, dtypes, devices, namedtuples: :class:`_Encoder`) and hands its tensors to the
writer's thread, about 8 MiB at a time, without waiting for libhdf5. The thread writes
each batch into the file, one dataset per stored dtype, and takes the tensors' checksums
when it has nothing to write; the JSON index of sites and tensors, the metadata digest
and ``complete`` are written at close, and the file is renamed to its final path only
after a clean close (schema 4, ``docs/dump-format.md``). The file itself — datasets,
index, attributes, rename — is :class:`~.packing.PackedFile`'s, which the writer for
other runtimes (:mod:`blockdiff.dumpfile`) writes through too.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..dtypes import dtype_name
from ..errors import DumpError, TensorChanged
from ..site import Opaque, Site, describe_site
from .format import DECODE_SCHEMA, FORWARD_SCHEMA, NUMPY_NATIVE, RAW_BITS, STANDARD_ATTRIBUTES, encode_meta
from .packing import (
    COMPRESSIONS,
    PackedFile,
    StoredTensor,
    elements,
    encode_index,
    one_line,
    site_record,
    temporary_path,
    written_raw,
)

if TYPE_CHECKING:
    import numpy as np


# ---------------------------------------------------------------------------------------
# meta values


def _encode_attr(key: str, value: Any) -> tuple[Any, bool]:
    """A meta value as stored: ``(value, is_json)``."""
    if isinstance(value, (torch.dtype, torch.device)):
        value = dtype_name(value) if isinstance(value, torch.dtype) else str(value)
    return encode_meta(key, value)


# ---------------------------------------------------------------------------------------
# structures


class _Pending(StoredTensor):
    """One tensor of a site on its way to the writer's thread: its index entry (the thread
    adds its checksum) and its bytes as stored, the site that recorded it, and, for a
    tensor the capture holds by reference, the tensor and the version counter it had when
    handed over."""

    __slots__ = ("holder", "version", "site")

    def __init__(
        self, flat: np.ndarray, dtype: str, shape: list[int], holder: torch.Tensor | None, version: int | None,
        site: "str | _SiteName",
    ) -> None:
        super().__init__(flat, dtype, shape)
        self.holder, self.version, self.site = holder, version, site


class _SiteName:
    """How the writer's messages name a site: ``sites[3] (block 0 ffn (model.layers.0.mlp))``,
    made only when a message shows it (every tensor handed over carries one)."""

    __slots__ = ("index", "key", "module")

    def __init__(self, index: int, site: Site) -> None:
        # Not the site itself: that would keep all its tensors alive until the last is written.
        self.index, self.key, self.module = index, site.key, site.module

    def __str__(self) -> str:
        return f"sites[{self.index}] ({describe_site(self.key, self.module)})"


class _Encoder:
    """Encodes one structure into JSON nodes; its tensors become entries of the index
    (``{"type": "tensor", "ref": N}``, N their position in the index's ``tensors``)."""

    def __init__(self, writer: "DumpWriter", label: "str | _SiteName") -> None:
        self.writer = writer
        self.label = label
        # id(tensor) -> ref, so a tensor passed twice is stored once and comes back as one
        # object; the tensors are kept alive so their ids stay unique.
        self.refs: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []
        self.pending: list[_Pending] = []
        self.shared: dict[int, tuple] = {}  # new entries for the writer's table of written tensors

    def node(self, obj: Any) -> Any:
        # The kinds a forward passes most by their exact type (a site's structure is encoded
        # on the caller's thread, beside the writer's: a dump of 54 sites spent 1.2 ms
        # here), others by what they are: subclasses (parameters, enums, namedtuples) and
        # containers that act as dicts.
        encode = _BY_TYPE.get(type(obj)) or _kind(obj)
        return encode(self, obj)

    def _tensor(self, obj: torch.Tensor) -> dict[str, Any]:
        return {"type": "tensor", "ref": self.tensor(obj)}

    def _tuple(self, obj: tuple) -> dict[str, Any]:
        if hasattr(obj, "_fields"):
            return {
                "type": "tuple",
                "items": [self.node(v) for v in obj],
                "namedtuple": type(obj).__name__,
                "fields": list(obj._fields),
            }
        return {"type": "tuple", "items": [self.node(v) for v in obj]}

    def _list(self, obj: list) -> dict[str, Any]:
        return {"type": "list", "items": [self.node(v) for v in obj]}

    def _dict(self, obj: dict) -> dict[str, Any]:
        return {"type": "dict", "items": [[self.node(k), self.node(v)] for k, v in obj.items()]}

    def _mapping(self, obj: Any) -> dict[str, Any]:
        # HF ModelOutput and similar containers behave as ordered dicts (as in site.py).
        return {"type": "dict", "items": [[self.node(k), self.node(obj[k])] for k in obj.keys()]}

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
        on_cpu = t.is_cpu
        if t.requires_grad:
            t = t.detach()
        if not on_cpu or not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
        if t.dtype in NUMPY_NATIVE:
            arr = t.numpy()
        elif t.element_size() in RAW_BITS:
            signed, unsigned, _ = RAW_BITS[t.element_size()]
            arr = t.view(signed).numpy().view(unsigned)
        else:
            raise DumpError(f"cannot store a {t.dtype} tensor: element size {t.element_size()} bytes")
        flat = elements(arr)
        ref = len(self.writer._tensors) + len(self.pending)
        # A tensor the model still owns may be written to in place before the thread has
        # copied it: its version counter, checked after the copy, says so.
        shares = flat.size and on_cpu and t.data_ptr() == original.data_ptr()
        version = getattr(original, "_version", None) if shares and not original.is_inference() else None
        # Its dataset and offset are given when the tensor is handed to the writer's thread.
        self.pending.append(
            _Pending(flat, dtype_name(t.dtype), list(t.shape), original if version is not None else None, version, self.label)
        )
        self.refs[key] = ref
        self.shared[key] = (original, ref)
        return ref


def _leaf(kind: str, value: Callable[[Any], Any]) -> Callable[[_Encoder, Any], dict[str, Any]]:
    return lambda _, obj: {"type": kind, "value": value(obj)}


def _none(_: _Encoder, obj: None) -> dict[str, Any]:
    return {"type": "none"}


def _unknown(_: _Encoder, obj: Any) -> dict[str, Any]:
    return {"type": "opaque", "value": type(obj).__name__}


_bool = _leaf("bool", bool)
_int = _leaf("int", int)
_float = _leaf("float", lambda obj: repr(float(obj)))  # repr round-trips every float, inf and nan included
_str = _leaf("str", str)
_dtype = _leaf("dtype", dtype_name)
_device = _leaf("device", str)
_opaque = _leaf("opaque", lambda obj: obj.type_name)
# The kinds in the order an object is matched against them (a bool is an int; an object
# that is none of them may still act as a dict, :func:`_kind`).
_KINDS: tuple[tuple[type, Callable[[_Encoder, Any], Any]], ...] = (
    (torch.Tensor, _Encoder._tensor), (int, _int), (float, _float), (str, _str), (torch.dtype, _dtype),
    (torch.device, _device), (Opaque, _opaque), (tuple, _Encoder._tuple), (list, _Encoder._list), (dict, _Encoder._dict),
)
# By exact type, first: the kinds themselves, None and bool.
_BY_TYPE: dict[type, Callable[[_Encoder, Any], Any]] = {type(None): _none, bool: _bool, **dict(_KINDS)}


def _kind(obj: Any) -> Callable[[_Encoder, Any], Any]:
    """How :meth:`_Encoder.node` encodes an object whose exact type is not in
    :data:`_BY_TYPE`: by the first of :data:`_KINDS` it is."""
    for kind, encode in _KINDS:
        if isinstance(obj, kind):
            return encode
    if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):
        return _Encoder._mapping
    return _unknown


# ---------------------------------------------------------------------------------------
# writer

# Writer threads kept between dumps (starting one, and joining it, cost a dump 0.2-0.5 ms):
# (process id, a one-thread executor with nothing left to do). A forked child does not
# have its parent's threads: it starts its own.
_IDLE: list[tuple[int, ThreadPoolExecutor]] = []
_IDLE_LOCK = threading.Lock()
_KEEP_THREADS = 2


def _take_thread() -> ThreadPoolExecutor:
    """A writer thread: a kept one, or a new one."""
    with _IDLE_LOCK:
        while _IDLE:
            pid, worker = _IDLE.pop()
            if pid == os.getpid():
                return worker
    return ThreadPoolExecutor(1, thread_name_prefix="blockdiff-dump")


def _give_back(worker: ThreadPoolExecutor, *, idle: bool = False) -> None:
    """Wait until everything handed to ``worker`` is done (``idle``: it is), then keep it
    for the next dump (up to :data:`_KEEP_THREADS`), or stop it."""
    if not idle:
        worker.submit(int).result()  # one thread: every task before this one has ended
    with _IDLE_LOCK:
        if len(_IDLE) < _KEEP_THREADS:
            _IDLE.append((os.getpid(), worker))
            return
    worker.shutdown(wait=True)


# Bytes of tensors handed to the writer's thread and not yet written; ``add`` waits above it
# (a single larger tensor is always accepted).
_IN_FLIGHT_BYTES = 64 * 2**20
# Tensors are handed over once this many bytes were added (or at close).
_BATCH_BYTES = 8 * 2**20
# ... the first time once this many were: the thread starts writing sooner.
_FIRST_BATCH_BYTES = 1 * 2**20


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
        decode: the dump holds a decode run (schema 5): every site is added with its step
            (``add(site, step=t)``), and :meth:`add_decode` records the steps' tokens and
            caches.
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
        decode: bool = False,
    ) -> None:
        self.path = Path(path)
        self.durable = durable
        self.decode = decode
        if compress not in COMPRESSIONS:
            raise DumpError(
                f"{self.path}: compress must be None, 'lzf' or 'gzip', got {compress!r}", path=str(self.path)
            )
        self.meta: dict[str, Any] = dict(meta)
        encoded_meta = self._check_meta()
        self.compress = compress
        self.checksums = checksums
        # The index, built as sites arrive: tensor entries and site records.
        self._tensors: list[dict[str, Any]] = []
        self._sites: list[dict[str, Any]] = []
        self._structures: dict[str, Any] = {}  # inputs, floors
        # Tensors stored by earlier sites: id -> (weak reference, ref), see _Encoder.tensor.
        self._written: dict[int, tuple] = {}
        self._file: PackedFile | None = None  # created, and written, on the writer's thread
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
        # Every libhdf5 call of this writer runs on one thread of its own: glibc gives that
        # thread its own heap, so libhdf5's long-lived small allocations do not pin the heap
        # between the model's freed activations (they did, and a streamed capture's resident
        # size grew by ~12 MiB per block); and the forward does not wait for them. A folder
        # that is not there or not writable fails as the file is made (:class:`PackedFile`
        # says which).
        self._worker: ThreadPoolExecutor | None = _take_thread()
        if written_raw(compress, ((key, value) for key, value, _ in encoded_meta)):
            self._create(encoded_meta)  # no libhdf5 in it: here, without waiting for the thread
        else:
            # libhdf5 creates the file on the writer's thread, the caller waiting (outside
            # the GIL: with both running Python, the thread would wait for it, up to the
            # interpreter's switch interval of 5 ms at a time).
            self._worker.submit(self._create, encoded_meta).result()
        if self._failed is not None:
            self._stop_worker()
            self._raise_failure()

    @property
    def tmp_path(self) -> Path:
        """Where the dump is written until it is complete (``.NAME.tmp-PID`` beside ``path``)."""
        return temporary_path(self.path)

    def _on_worker(self, fn: Callable, *args: Any) -> Any:
        """Run ``fn`` on the writer's thread after everything handed to it, and wait."""
        if self._worker is None:  # closed: nothing left to hand over
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def _stop_worker(self, *, idle: bool = False) -> None:
        """Done with the writer's thread (``idle``: its last task has ended)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            _give_back(worker, idle=idle)

    def _create(self, encoded_meta: list[tuple[str, Any, bool]]) -> None:
        try:
            # The meta was encoded by the caller: it may change ``meta`` while this thread works.
            self._file = PackedFile(
                self.path, torch_version=str(torch.__version__), meta=encoded_meta,
                compress=self.compress, checksums=self.checksums, durable=self.durable,
                schema=DECODE_SCHEMA if self.decode else FORWARD_SCHEMA,
            )
        except BaseException as exc:  # the file is removed, if it was made
            self._failed = exc

    # -- SiteStore (write side)

    def add(self, site: Site, *, step: int | None = None) -> None:
        """Record one site (the index's ``sites[N]``, N: how many were added before); its
        tensors are written by the writer's thread. ``step``: the decode step it ran at (a
        ``decode`` writer only, where every site has one)."""
        self._check_open()
        if (step is None) == self.decode:
            raise DumpError(
                f"{self.path}: a site {'without' if step is None else 'with'} a decode step, in a dump "
                f"{'of decode steps' if self.decode else 'of one forward pass'}", path=str(self.path)
            )
        enc = _Encoder(self, _SiteName(len(self._sites), site))
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
        record = site_record(site)
        if step is not None:
            record["step"] = int(step)
        record["structure"] = structure
        self._sites.append(record)
        self._commit(enc)

    def add_inputs(self, obj: Any) -> None:
        """Record the run's model inputs (a tensor, a tuple or a dict): the index's ``inputs``."""
        self._add_structure("inputs", obj)

    def add_floors(self, floors: dict[str, Any]) -> None:
        """Record noise floors measured at capture: the index's ``floors``, by precision
        label (``bfloat16@cpu``) a dict with ``dtype``, ``device`` and ``values`` (check key
        → a number, a list of numbers, or a router's output). Schema 3 and later."""
        self._add_structure("floors", floors)

    def add_decode(self, decode: dict[str, Any]) -> None:
        """Record what a decode run is beyond its sites (the index's ``decode``, schema 5):
        ``greedy`` (per step, the token chosen after it, ``[batch]``) and ``cache`` (per
        step, per cache layer, the keys and values it wrote and how many positions the
        layer held, or ``None``), as :class:`~blockdiff.decoding.CacheLog` keeps them."""
        if not self.decode:
            raise DumpError(f"{self.path}: decode steps in a dump of one forward pass (DumpWriter(decode=True))", path=str(self.path))
        self._add_structure("decode", decode)

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
        # Placed here, in the order handed over; the thread writes them in the same order.
        groups = self._file.place(pending)
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
            self._file.write(name, items)
        except Exception as exc:
            site = str(items[0].site)
            raise DumpError(
                f"{self.path}: cannot write site {site}: {type(exc).__name__}: {one_line(exc)}", path=str(self.path), site=site
            ) from exc
        for p in items:
            _check_unchanged(p)

    def _sum_one(self, pop: Callable[[], _Pending]) -> bool:
        """Take the checksum of one tensor of ``_unsummed`` (``pop`` says which end);
        ``False`` when there is none. Run on the writer's thread and, at close, on the
        caller's too: each tensor's by one of them, outside the GIL (``format.crc32c``)."""
        try:
            p = pop()
        except IndexError:
            return False
        p.take_checksum()
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
        file = self._file
        done = self._worker.submit(self._close)
        try:
            while self._failed is None and self._sum_one(self._unsummed.pop):
                pass
            if self._failed is None and (not self.checksums or all("crc32c" in t for t in self._tensors)):
                # Every checksum is in: the index, encoded here while the thread writes, and
                # the file's end with it where it is written without libhdf5.
                self._index_bytes = encode_index(self._tensors, self._sites, self._structures)
                if file is not None:
                    file.prepare(self._index_bytes, self._check_meta())
        except BaseException as exc:
            self._failed = self._failed or exc
        finally:
            self._summing_done.set()
            try:
                done.result()
            finally:
                self._stop_worker(idle=done.done())  # the last task handed to it

    def _close(self) -> None:
        if self._file is None:  # closed before, or never created
            self._raise_failure()
            return
        file, self._file = self._file, None
        try:
            while self._failed is None and self._sum_one(self._unsummed.popleft):
                pass
            if self._worker is not None:
                self._summing_done.wait()  # the caller's share
            self._raise_failure()
            file.write_meta(self._check_meta())  # ``meta`` may have changed since the start (as prepared: nothing to do)
            index = self._index_bytes
            if index is None:
                index = encode_index(self._tensors, self._sites, self._structures)
            file.finish(index)
        except BaseException as exc:
            file.abort()
            if isinstance(exc, Exception) and not isinstance(exc, (DumpError, TensorChanged)):
                raise DumpError(f"{self.path}: cannot finish the dump: {one_line(exc)}", path=str(self.path)) from exc
            raise

    def abort(self) -> None:
        """Discard the dump: close and remove the temporary file; nothing at ``path``."""
        if self._failed is None:  # what waits for the thread is not written any more
            self._failed = DumpError(f"{self.path}: the dump was discarded", path=str(self.path))
        try:
            self._on_worker(self._abort)
        finally:
            self._stop_worker()

    def _abort(self) -> None:
        file, self._file = self._file, None
        if file is not None:  # only a file this writer made
            file.abort()

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
            f"{self.path}: cannot write the dump: {type(failed).__name__}: {one_line(failed)}", path=str(self.path)
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


def _check_unchanged(p: _Pending) -> None:
    """Fail the dump if the model changed a tensor in place after it was handed over."""
    if p.holder is not None and p.holder._version != p.version:
        raise TensorChanged(f"{p.site}: a tensor it recorded was changed in place before it was written")
