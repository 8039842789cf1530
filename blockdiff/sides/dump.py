"""Dump sides: a dump written by ``blockdiff capture`` (or ``--save-dumps``) as a side.

A dump has the sites one run recorded, with the layout, device and dtype it ran with, and
runs nothing (``live`` is false): against it a candidate is replayed, or two dumps are
compared on drift.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..dtypes import stored_dtype
from ..loading import is_dump
from ..errors import PairingError
from ..inputs import check_captured_on, digest
from ..hookmap import layout_from_dict
from ..site import Site
from ..store import SiteStore
from . import Frozen, Hidden, Side, SideDefaults


class DumpSide(SideDefaults):
    """A dump written by ``blockdiff capture`` (or ``--save-dumps``): the sites one run
    recorded, with the layout, device and dtype it ran with. It runs nothing."""

    live = False

    def __init__(self, name: str, dump: Any, *, label: str | None = None) -> None:
        meta = dump.meta
        self.name = name
        self.store = dump
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


# -- the kind, as the factory asks for it

NAME = "dump"


def claims(spec: Any) -> bool:
    """Whether ``spec`` names a dump: a path ending in ``.h5``/``.hdf5``, or an HDF5 file."""
    return isinstance(spec, (str, Path)) and is_dump(str(spec))


def opened(role: str, spec: Any, *, opened: ExitStack, like: Side | None, label: str | None) -> DumpSide:
    """The dump ``spec`` as a side, its file open until ``opened`` closes."""
    from ..dump import DumpReader

    return DumpSide(role, opened.enter_context(DumpReader(spec)), label=label)


__all__ = ["DumpSide", "NAME", "claims", "opened"]
