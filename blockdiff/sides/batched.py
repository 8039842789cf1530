"""Part of a bigger run, as a side: one row inside a batch (the candidate of a
batch-invariance diff), or some positions of a whole sequence (the reference of a model
against its own cache).

The reference of ``blockdiff invariance`` is a row of token ids run alone (batch 1, its own
length); the candidate is the same model with that row inside a batch (other rows, maybe
padding). :class:`RowSide` runs the whole batch and shows the localizer only the row — each
tensor of the batch cut to it (:class:`RowCut`) — so that every site pairs with the row
alone. An experiment on it runs the module **on the whole batch**: the row's activations
replaced by the reference's (the row alone's), the other rows' its own, and the answer cut
back to the row. So a module whose output for a row depends on what else is in its batch
(statistics taken over the batch, a reduction split by the number of rows, a capacity
shared by all tokens) diverges there, and only there (docs/invariance.md).

The same side over a :class:`PositionCut` is a decode step of a model run without a cache:
the whole sequence's record cut to the step's positions, and an experiment on it runs the
module on the whole sequence (a module at one position attends to every position before
it) and cuts the answer back. Calling a module on the cut call alone would give it one
position with no history (docs/decode.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from ..capture import Hold
from ..inputs import Inputs
from ..site import Site, iter_tensors, map_structure, replace_primary
from ..store import MemoryStore, SiteStore
from . import Frozen, Hidden, SideDefaults
from .live import LiveSide


@dataclass(frozen=True)
class RowCut:
    """Where one row is in a batch: ``row`` of ``batch`` rows of ``length`` positions
    (padded), its tokens at ``real`` (a slice of the positions).

    A batch tensor is ``[batch, positions, ...]`` (the row is one index of its first
    dimension, its positions ``real`` of the second), or ``[batch * length, ...]`` (tokens
    flattened, as MoE routers take them); any other tensor is the same for every row
    (rotary tables ``[1, positions, dim]`` without padding) and is kept whole. Other
    dimensions of ``length`` (an attention mask's last two) are not cut: such tensors are
    never compared, and experiments replay the batch's own."""

    row: int
    batch: int
    length: int
    real: slice

    @property
    def padded(self) -> bool:
        return (self.real.stop - self.real.start) != self.length

    def _index(self, t: torch.Tensor) -> tuple | None:
        """How ``t`` (batch-major) is cut to the row, or ``None`` for a tensor of no row."""
        if t.dim() == 0 or t.shape[0] != self.batch:
            return None
        if self.padded and t.dim() >= 2 and t.shape[1] == self.length:
            return (slice(self.row, self.row + 1), self.real)
        return (slice(self.row, self.row + 1),)

    def _flat(self, t: torch.Tensor) -> bool:
        return self.batch > 1 and t.dim() >= 1 and t.shape[0] == self.batch * self.length

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        """The row's part of a batch tensor (a copy-free view where it can be)."""
        if self._flat(t):
            rows = t.reshape(self.batch, self.length, *t.shape[1:])
            return rows[self.row, self.real].reshape(-1, *t.shape[1:])
        index = self._index(t)
        return t if index is None else t[index]

    def put(self, batch: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """A copy of ``batch`` with the row's part replaced by ``row`` (what :meth:`cut` takes
        out, in the batch's dtype and device)."""
        row = row.to(device=batch.device, dtype=batch.dtype)
        if self._flat(batch):
            out = batch.clone()
            rows = out.view(self.batch, self.length, *batch.shape[1:])
            rows[self.row, self.real] = row.reshape(-1, *batch.shape[1:])
            return out
        index = self._index(batch)
        if index is None:
            return row if row.shape == batch.shape else batch
        out = batch.clone()
        out[index] = row
        return out


@dataclass(frozen=True)
class PositionCut:
    """Positions ``real`` of a whole sequence of ``length`` positions, every row: a
    ``[batch, positions, ...]`` tensor cut on its second dimension, a ``[batch * length,
    ...]`` one (tokens flattened, as MoE routers take them) on its first; any other tensor
    (a mask ``[batch, 1, length, length]``) is kept whole."""

    batch: int
    length: int
    real: slice

    def _flat(self, t: torch.Tensor) -> bool:
        return self.length > 1 and t.dim() >= 1 and t.shape[0] == self.batch * self.length and (t.dim() < 2 or t.shape[1] != self.length)

    def _cuts(self, t: torch.Tensor) -> bool:
        return t.dim() >= 2 and t.shape[1] == self.length

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        if self._flat(t):
            return t.reshape(self.batch, self.length, *t.shape[1:])[:, self.real].reshape(-1, *t.shape[1:])
        return t[:, self.real] if self._cuts(t) else t

    def put(self, whole: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """A copy of ``whole`` with the positions' part replaced by ``part``."""
        part = part.to(device=whole.device, dtype=whole.dtype)
        if self._flat(whole):
            out = whole.clone()
            out.view(self.batch, self.length, *whole.shape[1:])[:, self.real] = part.reshape(self.batch, -1, *whole.shape[1:])
            return out
        if not self._cuts(whole):
            return part if part.shape == whole.shape else whole
        out = whole.clone()
        out[:, self.real] = part
        return out


def _put_all(batch: Any, row: Any, cut: RowCut | PositionCut) -> Any:
    """``batch`` (a recorded structure) with each of its tensors' row part replaced by the
    tensor of ``row`` in the same place (a router's whole decision: logits, weights, indices)."""
    rows = iter(list(iter_tensors(row)))
    return map_structure(batch, lambda t: cut.put(t, next(rows, cut.cut(t))))


class RowSide(SideDefaults):
    """Row ``cut.row`` of a batch (or the positions of a :class:`PositionCut`), run as part
    of the whole batch on ``inner``'s model.

    Its store holds the batch's sites cut to the row; the batch's own are kept beside them,
    for the experiments, which always run the whole batch (see the module docstring)."""

    live = True

    def __init__(self, inner: LiveSide, cut: RowCut | PositionCut, *, label: str, name: str = "candidate") -> None:
        self.inner = inner
        self.cut = cut
        self.name = name
        self.layout = inner.layout
        self.meta = {**inner.meta, "model": label}
        self.store: SiteStore | None = None
        self._batch: dict[int, tuple[Site, Site]] = {}  # id(row site) -> (row site, batch site)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def running(self) -> ContextManager[Any]:
        return self.inner.running()

    def attribute(self, path: str) -> Any:
        return self.inner.attribute(path)

    def _row_site(self, site: Site) -> Site:
        cut = self.cut.cut
        row = dataclasses.replace(
            site, args=map_structure(site.args, cut), kwargs=map_structure(site.kwargs, cut), output=map_structure(site.output, cut)
        )
        self._batch[id(row)] = (row, site)
        return row

    def _of(self, call: Site) -> Site:
        found = self._batch.get(id(call))
        if found is None or found[0] is not call:
            raise KeyError(f"{call.label}: not a site of this row")
        return found[1]

    def _hidden(self, batch: Site, hidden: Hidden | None) -> Hidden | None:
        """The batch call's activations with the row's replaced by ``hidden`` (the
        reference's, the row alone's)."""
        if not hidden:
            return None
        own = batch.hidden_inputs()
        return {role: self.cut.put(own[role], t) if role in own else t for role, t in hidden.items()}

    @classmethod
    def of(cls, inner: LiveSide, cut: RowCut | PositionCut, batch: MemoryStore, *, label: str, name: str = "candidate") -> "RowSide":
        """The row of a batch ``inner`` has recorded into ``batch`` already (one record
        serves every row)."""
        side = cls(inner, cut, label=label, name=name)
        side._fill(MemoryStore(side.meta), batch)
        return side

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: Hold | None, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """Run the whole batch (``inputs``), keep its sites, and fill ``store`` with each
        one cut to the row."""
        batch = MemoryStore(self.inner.meta)
        recording = self.inner.record(inputs, batch, hold=hold, progress=progress)
        self._fill(store, batch)
        return recording

    def _fill(self, store: SiteStore, batch: MemoryStore) -> None:
        """``store`` made this row's: each of the batch's sites cut to it."""
        for site in batch.sites():
            store.add(self._row_site(site))
        self.store = store

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        batch = self._of(call)
        return map_structure(self.inner.call_module(path, batch, self._hidden(batch, hidden)), self.cut.cut)

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """The whole batch through the block, its row's input the reference's; a frozen
        module answers, for the row, the reference's recorded output, for the other rows
        its own."""
        batch = self._of(call)
        batch_frozen: Frozen | None = None
        if frozen:
            batch_frozen = {}
            for key, (recorded, template) in frozen.items():
                own = self._of(template)
                if key[0] == "router":
                    merged = dataclasses.replace(own, output=_put_all(own.output, recorded.output, self.cut))
                else:
                    primary, given = own.primary_output(), recorded.primary_output()
                    assert primary is not None and given is not None
                    merged = dataclasses.replace(own, output=replace_primary(own.output, self.cut.put(primary, given)))
                batch_frozen[key] = (merged, own)
        out, reached = self.inner.run_block(path, batch, self._hidden(batch, hidden), modules, batch_frozen)
        return self.cut.cut(out), {key: self.cut.cut(t) for key, t in reached.items()}

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        batch = self._of(call)
        return [self._row_site(site) for site in self.inner.child_calls(path, batch, self._hidden(batch, hidden))]


def rows_of(batch: int, lengths: list[int], padding: str | None) -> Iterator[RowCut]:
    """Each row's place in a batch whose rows hold ``lengths`` tokens, padded on the
    ``padding`` side (``"left"``/``"right"``) to the longest."""
    length = max(lengths)
    for row, n in enumerate(lengths):
        real = slice(length - n, length) if padding == "left" else slice(0, n)
        yield RowCut(row, batch, length, real)


__all__ = ["PositionCut", "RowCut", "RowSide", "rows_of"]
