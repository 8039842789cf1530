"""Dump sides: a dump written by ``blockdiff capture`` (or ``--save-dumps``) as a side.

A dump has the sites one run recorded, with the layout, device and dtype it ran with, and
runs nothing (``live`` is false): against it a candidate is replayed, or two dumps are
compared on drift. A candidate's dump written teacher-forced by another runtime
(:class:`blockdiff.dumpfile.TeacherForcedWriter`: its ``teacher_forced`` attribute names
the runs beside it with the reference's values substituted) ``replaces``: its replaced runs
are the stores the teacher-forced mode judges local errors from (:mod:`.replaced`).
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..dtypes import stored_dtype
from ..dump.format import FREE_RUN, TEACHER_FORCED
from ..loading import is_dump
from ..errors import DumpError, PairingError
from ..inputs import check_captured_on, digest
from ..hookmap import layout_from_dict
from ..site import Site
from ..store import SiteStore
from . import Frozen, Hidden, Side, SideDefaults
from .replaced import BLOCKS, EVERY, NotRun


class DumpSide(SideDefaults):
    """A dump written by ``blockdiff capture`` (or ``--save-dumps``): the sites one run
    recorded, with the layout, device and dtype it ran with. It runs nothing."""

    live = False

    def __init__(self, name: str, dump: Any, *, label: str | None = None, runs: dict[str, SiteStore] | None = None) -> None:
        meta = dump.meta
        self.name = name
        self.store = dump
        self.replaces = runs is not None  # a port's free run, its replaced runs beside it
        self._runs = runs or {}
        self.layout = layout_from_dict(meta.get("layout") or {})
        self.meta = {
            "model": label or str(dump.path),
            "class": meta.get("class"),
            "device": meta.get("device"),
            "dtype": meta.get("dtype"),
            "hook_map": meta.get("hook_map"),
            "dump": str(dump.path),
            "captured_model": meta.get("model"),
        }
        if self.replaces:
            self.meta["runtime"] = meta.get("runtime") or meta.get("model") or "the port"
        self._dtype = stored_dtype(str(meta.get("dtype", "float32")))
        self._device = torch.device(str(meta.get("device", "cpu")))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def inputs(self, given: Any) -> tuple[Any, None]:
        """The inputs the dump was captured on (``None`` when it holds none); ``given``
        inputs, when concrete, must be those."""
        stored = self.store.inputs()
        if given is not None and stored is not None:
            check_captured_on(digest(stored), given, what=self.meta["dump"], todo="replay uses the dump's own inputs")
        return stored, None

    @property
    def versions(self) -> dict[str, str]:
        found = self.store.meta.get("versions")
        return found if isinstance(found, dict) else {}

    def replaced_runs(self, inputs: Any, reference: SiteStore) -> tuple[SiteStore, SiteStore]:
        """The port's runs written with the reference's values substituted (every site, the
        block outputs); one it did not write answers nothing (its checks are not judged)."""

        def written(run: str) -> SiteStore:
            judges = "each sub-path's local error and the residual" if run == EVERY else "each whole block"
            found = self._runs.get(run)
            if found is None:
                return NotRun(
                    f"{self.meta['dump']} was written without its run replacing {run}",
                    f"write that run too, TeacherForcedWriter(runs=...), to judge {judges}",
                )
            return Substituted(found, reference)

        return written(EVERY), written(BLOCKS)

    def _cannot(self, what: str) -> PairingError:
        return PairingError(f"the {self.name} is a dump ({self.meta['dump']}): it cannot {what}; give a live model")

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        raise self._cannot(f"run {path}")

    def run_block(self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None) -> Any:
        raise self._cannot(f"run {path}")

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        raise self._cannot(f"run {path}")

    def record(self, inputs: Any, store: SiteStore, *, hold: str | None, progress: Any = None) -> Any:
        raise self._cannot("run the model")


class Substituted:
    """A port's replaced run as the teacher-forced mode reads it: a site's input is the
    reference's (the run handed its module the reference's value) when the site feeding
    it was written in the run, so substituted; after a site the port left out (its runtime
    fuses it away) the next one has no input, its module having run on the port's own
    value, and its check is not judged. What feeds a site: the sub-path before it in its
    block; a block's first sub-path and the block itself, the block's input (the previous
    block's output; the embedding's before the first); after the blocks, the site before
    it there (the last block's output before the first). The embedding and the context
    (token and position ids) are fed the reference's inputs."""

    def __init__(self, run: SiteStore, reference: SiteStore) -> None:
        self.run, self.reference, self.meta = run, reference, run.meta

    def block_indices(self) -> list[int]:
        return self.run.block_indices()

    def floors(self) -> dict[str, Any]:
        return self.run.floors()

    def add(self, site: Site) -> None:
        raise TypeError("a port's written run is read, never added to")

    def _output_written(self, block: int | None) -> bool:
        """Whether the run wrote ``block``'s output (``None``: the embedding's)."""
        if block is None:
            return any(s.stage == "embed" for s in self.run.outside_sites())
        return any(s.subpath is None for s in self.run.block_sites(block))

    def _feeder(self, block: int | None) -> int | None:
        """The block whose output feeds ``block`` (``None``: the blocks' first is fed by
        the embedding; the sites after the blocks by the last block)."""
        blocks = self.reference.block_indices()
        before = blocks if block is None else [b for b in blocks if b < block]
        return before[-1] if before else None

    @staticmethod
    def _given(sites: list[Site], reference: list[Site], fed: bool) -> list[Site]:
        """``sites`` with the reference's inputs where what feeds each was written, each fed
        by the one before it in ``reference`` (``fed``: whether the first one's feeder was)."""
        mine = {s.key: s for s in sites}
        found = []
        for ref in reference:
            site = mine.get(ref.key)
            if site is not None:
                found.append(dataclasses.replace(site, args=ref.args if fed else ()))
            fed = site is not None
        return found

    def block_sites(self, block: int) -> list[Site]:
        sites, reference = self.run.block_sites(block), self.reference.block_sites(block)
        fed = self._output_written(self._feeder(block))
        whole = self._given(sites, [s for s in reference if s.subpath is None], fed)
        parts = self._given(sites, [s for s in reference if s.subpath is not None], fed)
        return sorted(whole + parts, key=lambda s: s.order)

    def outside_sites(self) -> list[Site]:
        sites, reference = self.run.outside_sites(), self.reference.outside_sites()
        ids = self._given(sites, [s for s in reference if s.stage in ("embed", "context")], True)
        after = self._given(sites, [s for s in reference if s.stage not in ("embed", "context")], self._output_written(self._feeder(None)))
        return sorted(ids + after, key=lambda s: s.order)


# -- the kind, as the factory asks for it

NAME = "dump"


def claims(spec: Any) -> bool:
    """Whether ``spec`` names a dump: a path ending in ``.h5``/``.hdf5``, or an HDF5 file."""
    return isinstance(spec, (str, Path)) and is_dump(str(spec))


def opened(role: str, spec: Any, *, opened: ExitStack, like: Side | None, label: str | None) -> DumpSide:
    """The dump ``spec`` as a side, its file open until ``opened`` closes (and, a candidate
    written teacher-forced, the files of its replaced runs)."""
    from ..dump import DumpReader

    dump = opened.enter_context(DumpReader(spec))
    forced = dump.meta.get(TEACHER_FORCED)
    runs = _replaced_runs(Path(spec), forced, opened) if role == "candidate" and isinstance(forced, dict) else None
    return DumpSide(role, dump, label=label, runs=runs)


def _replaced_runs(path: Path, forced: dict[str, Any], opened: ExitStack) -> dict[str, SiteStore]:
    """The replaced runs a port's free run names (its ``teacher_forced`` attribute), each
    opened from beside it and checked to come from the same writing."""
    from ..dump import DumpReader

    names = forced.get("runs", {})
    if forced.get("run") != FREE_RUN:
        raise DumpError(
            f"{path} is the run replacing {forced.get('run')} of a port written teacher-forced: "
            f"diff its free run, {names.get(FREE_RUN, 'the dump beside it')}",
            path=str(path),
        )
    runs: dict[str, SiteStore] = {}
    for run, name in names.items():
        if run == FREE_RUN:
            continue
        beside = path.with_name(name)
        if not beside.exists():
            raise DumpError(
                f"{path} names its run replacing {run}, {name}, which is not beside it: keep a port's runs together",
                path=str(beside),
            )
        companion = opened.enter_context(DumpReader(beside))
        theirs = companion.meta.get(TEACHER_FORCED)
        if not isinstance(theirs, dict) or (theirs.get("id"), theirs.get("run")) != (forced.get("id"), run):
            raise DumpError(
                f"{beside} is not the run replacing {run} written with {path} (another writing's): write the port's runs again",
                path=str(beside),
            )
        runs[run] = companion
    return runs


__all__ = ["DumpSide", "NAME", "claims", "opened"]
