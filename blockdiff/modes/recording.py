"""Recording: each side's run into a store — in memory, or streamed into a dump — and the
one retry loop around it (a model that changes a recorded tensor in place is recorded again
with copies: :func:`~blockdiff.capture.with_copies`). What every mode records with.
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import distributed
from ..capture import Recording, TensorChanged, with_copies
from ..dump import DumpWriter
from ..dump.memory import release_freed_memory
from ..errors import DumpError, InputError, run_model_code
from ..inputs import Inputs, RandomTokens, digest
from ..report import Report
from ..sides import Side
from ..store import MemoryStore

def takes(cand: Side, inputs: Inputs) -> None:
    """The candidate runs on ``inputs`` (the reference's, or a dump's): every rank of a
    launched run was given the same, and they fit the candidate (its vocabulary)."""
    if cand.lockstep:
        digests = distributed.every_rank(digest(inputs))
        if len(set(digests)) > 1:
            raise InputError(f"the ranks were given different inputs (digests {', '.join(digests)}): every rank must run the same")
    cand.inputs(inputs)


def dump_inputs(ref: Side, cand: Side, inputs: Any) -> Inputs:
    """The inputs a reference dump was captured on, for a live candidate to run on:
    ``inputs``, when given, must be those (the dump side checks)."""
    given = None if inputs is None or isinstance(inputs, RandomTokens) else cand.inputs(inputs)[0]
    stored = ref.inputs(given)[0]
    if stored is None:
        raise DumpError(f"{ref.meta['dump']}: the dump holds no model inputs to replay", path=str(ref.meta["dump"]))
    takes(cand, stored)
    return stored


def dump_meta(side: Side, inputs: Inputs) -> dict[str, Any]:
    return {**side.meta, "layout": side.layout.to_dict(), "inputs_digest": digest(inputs), "versions": side.versions}


def record_in_memory(side: Side, inputs: Inputs, *, progress: bool = False) -> MemoryStore:
    """``side``'s run recorded into memory, with copies (the free run of drift floors when
    nothing checks it after: the experiments run that model copy again, and a module that
    reuses a buffer it returned would change what a record holding its tensors holds).
    ``progress``: say how far it is (a capture's)."""
    store = MemoryStore(side.meta)
    run_model_code(side.name, side.record, inputs, store, hold=None, progress=_progress(side) if progress else None)
    return store


def stream(
    side: Side, inputs: Inputs, path: str | Path, *, compress: str | None = None, durable: bool = False,
    release: bool = False,
) -> None:
    """Capture ``side`` into a dump, each site written as its call finishes, from the
    model's own tensors (see :func:`~blockdiff.capture.record_once`); should the model
    change one before its site is written, the dump is thrown away and the capture runs
    again with copies. ``release``: hand freed memory back to the system after each block
    (a streamed diff's: glibc keeps what the forward freed, and the capture's peak grew
    by about a block's activations every block; not for ``capture``, whose time counts)."""
    meta = dump_meta(side, inputs)
    progress = _progress(side)
    if release:
        progress = _releasing(progress)

    def attempt(copy: bool) -> None:
        with DumpWriter(path, meta=meta, compress=compress, durable=durable) as writer:
            writer.add_inputs(inputs)
            run_model_code(side.name, side.record, inputs, writer, hold=None if copy else "written", progress=progress)

    with_copies(attempt, lockstep=side.lockstep)


def in_memory(
    sides: list[Side], inputs: Inputs, localize: Callable[[Callable[[Side], MemoryStore]], Report], *, lockstep: bool,
    record: Callable[..., Recording] | None = None,
) -> Report:
    """Record each side into memory and localize from there: ``localize(free_run)``, where
    ``free_run(side)`` records the reference at the candidate's precision (drift floors).
    ``record(side, inputs, store, hold=, progress=)`` records one side (default
    ``side.record``; a backward diff's records its backward with it: :class:`backward.Recorder`).

    Memory stores hold the models' own CPU tensors, the free run's too. Should a model
    write into one of them while localization runs it again (a module reusing a buffer it
    returned before: the free run's modules are the ones the floor experiments run), the
    run is repeated on copies (from the start, in ``lockstep``).
    """

    recorded = record or (lambda side, *args, **kwargs: side.record(*args, **kwargs))

    def attempt(copy: bool) -> Report:
        hold = None if copy else "kept"
        recordings = [
            run_model_code(side.name, recorded, side, inputs, MemoryStore(side.meta), hold=hold, progress=_progress(side))
            for side in sides
        ]

        def free_run(side: Side) -> MemoryStore:
            store = MemoryStore(side.meta)
            recordings.append(run_model_code(side.name, recorded, side, inputs, store, hold=hold, progress=None))
            return store

        report = localize(free_run)
        if any(recording.changed() for recording in recordings):
            raise TensorChanged("a model changed a recorded tensor in place while it was localized")
        return report

    return with_copies(attempt, lockstep=lockstep)


# Where progress goes: a callable (what, done, total), set by the CLI around a command.
PROGRESS: contextvars.ContextVar[Callable[[str, int, int], None] | None] = contextvars.ContextVar(
    "blockdiff_progress", default=None
)


def _progress(side: Side) -> Callable[[int, int], None] | None:
    report = PROGRESS.get()
    if report is None:
        return None
    what = f"capture {side.name}"
    return lambda done, total: report(what, done, total)


def _releasing(progress: Callable[[int, int], None] | None) -> Callable[[int, int], None]:
    """``progress``, handing freed memory back to the system first (:mod:`blockdiff.dump.memory`)."""

    def each(done: int, total: int) -> None:
        release_freed_memory()
        if progress is not None:
            progress(done, total)

    return each


def counted(items: Iterator, what: str, total: int) -> list:
    report, done = PROGRESS.get(), []
    for item in items:
        done.append(item)
        if report is not None:
            report(what, len(done), total)
    return done




__all__ = ["PROGRESS", "counted", "dump_inputs", "dump_meta", "in_memory", "record_in_memory", "stream", "takes"]
