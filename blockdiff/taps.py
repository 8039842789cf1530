"""Graph taps: a CUDA model's forward captured once as a CUDA graph whose own kernels copy
every site into one buffer (a *slab* per dtype); each record is a replay of the graph and
one device-to-host copy a slab. No Python runs per site when it replays: what a site costs
is the copy of its tensors, as SGLang's in-graph taps cost.

Opt-in, for CUDA (``GraphTaps``; ``docs/performance.md``, *Graph taps*):

>>> taps = GraphTaps(model, resolve(model), ids)     # doctest: +SKIP
>>> store = taps.record(ids)                          # a MemoryStore, as capture.record fills one

How: a warm-up run records the sites as :func:`~blockdiff.capture.capture` does and plans
a slab place for every tensor of every site (its arguments and its output, in the order the
hooks meet them). The graph is then captured with hooks whose snapshot copies each tensor
into its place in the slab (a device-to-device copy the graph keeps); the sites captured then
are the template of every record, their tensors the slab's views, swapped for views of the
host copy.

What it cannot do: the shapes are the graph's (every record runs on inputs of the example's
shape and dtype: another shape is refused, not recaptured); the model must be capturable as
a CUDA graph (no host synchronization, no data-dependent control flow, no CPU tensors made
during the forward); experiments still run eagerly (a diff's checks call modules one by
one). Without CUDA (``graph=False``, the dry run on a CPU), the tapped forward runs eagerly on
each record: the plan, the copies into the slab and the sites rebuilt from it are the same.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from .capture import Snapshots, capture
from .errors import InputError
from .hookmap import Layout
from .inputs import run_model
from .site import Site, map_structure
from .store import MemoryStore


class _Planner(Snapshots):
    """The warm-up's snapshot: each tensor's shape and dtype, in the order the hooks meet them;
    it keeps no site."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[tuple[torch.Size, torch.dtype]] = []

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        self.specs.append((t.shape, t.dtype))
        return t

    def adder(self, store: Any, *, written: bool = False) -> Callable[[Site], None]:
        return lambda site: None


class _Taps(Snapshots):
    """The graph's snapshot: each tensor copied into its planned place in the slab (a copy
    the graph keeps); the site holds that place."""

    def __init__(self, places: list[torch.Tensor]) -> None:
        super().__init__()
        self.places = places
        self.next = 0

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.next >= len(self.places):
            raise InputError("graph taps: the forward met more tensors than its warm-up did (not a static graph)")
        place = self.places[self.next]
        if place.shape != t.shape or place.dtype != t.dtype:
            raise InputError(
                f"graph taps: a tensor of shape {tuple(t.shape)} {t.dtype} where the warm-up met "
                f"{tuple(place.shape)} {place.dtype} (not a static graph)"
            )
        place.copy_(t.detach())
        self.next += 1
        return place


def _to_host(slab: torch.Tensor) -> torch.Tensor:
    """One copy of ``slab`` on the host, a record's own: into pinned memory from a CUDA device
    (pageable memory copies at a fraction of the rate; PyTorch caches pinned buffers, so a
    record of the same size reuses one once the last is freed)."""
    if slab.device.type != "cuda":
        return slab.clone()
    host = torch.empty(slab.shape, dtype=slab.dtype, pin_memory=True)
    host.copy_(slab, non_blocking=True)
    torch.cuda.current_stream(slab.device).synchronize()
    return host


def _places(slabs: dict[torch.dtype, torch.Tensor], specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Each planned tensor's view of its dtype's slab, in plan order."""
    offsets = dict.fromkeys(slabs, 0)
    places = []
    for shape, dtype in specs:
        n = shape.numel()
        places.append(slabs[dtype][offsets[dtype]:offsets[dtype] + n].view(shape))
        offsets[dtype] += n
    return places


class GraphTaps:
    """A model's forward with every site tapped, captured once as a CUDA graph (``graph``:
    on a CUDA model unless told otherwise); :meth:`record` replays it.

    Args:
        model, layout: the model and its resolved hook map.
        example: the inputs the graph is captured with; every record takes inputs of their
            shape and dtype (token ids, or one tensor).
        graph: capture a CUDA graph (default: the model is on a CUDA device); ``False``
            runs the tapped forward eagerly on each record (the dry run on a CPU).
    """

    def __init__(self, model: nn.Module, layout: Layout, example: torch.Tensor, *, graph: bool | None = None) -> None:
        if not isinstance(example, torch.Tensor):
            raise InputError("graph taps take one input tensor (token ids) of a fixed shape")
        self.model, self.layout = model, layout
        device = next(model.parameters()).device
        self.graphed = device.type == "cuda" if graph is None else graph
        self.static = example.detach().to(device).clone()  # the graph's input, written before each replay
        planner = _Planner()
        with self._warm(), capture(model, layout, MemoryStore(), snapshot=planner), torch.no_grad():
            run_model(model, self.static)
        totals: dict[torch.dtype, int] = {}
        for shape, dtype in planner.specs:
            totals[dtype] = totals.get(dtype, 0) + shape.numel()
        self.specs = planner.specs
        self.slabs = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in totals.items()}
        self.places = _places(self.slabs, self.specs)
        self.template = MemoryStore()
        self.graph = None
        if self.graphed:
            with self._warm(), torch.no_grad():  # the allocator's pools settled before capture (torch.cuda.graphs)
                for _ in range(2):
                    run_model(model, self.static)
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with capture(model, layout, self.template, snapshot=_Taps(self.places)), torch.no_grad():
                with torch.cuda.graph(self.graph):
                    run_model(model, self.static)

    def _warm(self) -> Any:
        """Where warm-up runs go: a side stream on CUDA (as ``torch.cuda.graphs`` asks), else
        nowhere in particular."""
        if not self.graphed:
            return torch.no_grad()
        stream = torch.cuda.Stream(self.static.device)
        stream.wait_stream(torch.cuda.current_stream(self.static.device))
        return torch.cuda.stream(stream)

    @property
    def nbytes(self) -> int:
        """The slabs' size: what one record copies to the host."""
        return sum(slab.numel() * slab.element_size() for slab in self.slabs.values())

    def record(self, inputs: torch.Tensor, store: MemoryStore | None = None) -> MemoryStore:
        """The sites of a run on ``inputs`` (the example's shape and dtype) in ``store`` (a
        new :class:`~blockdiff.store.MemoryStore` when not given): one replay of the graph
        and one copy to the host a slab.

        Raises:
            InputError: ``inputs`` of another shape or dtype than the graph's.
        """
        if not isinstance(inputs, torch.Tensor) or inputs.shape != self.static.shape or inputs.dtype != self.static.dtype:
            found = f"{tuple(inputs.shape)} {inputs.dtype}" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise InputError(
                f"graph taps replay inputs of shape {tuple(self.static.shape)} {self.static.dtype} only (the graph's); "
                f"got {found}: make new GraphTaps for another shape"
            )
        self.static.copy_(inputs)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.template.clear()
            with capture(self.model, self.layout, self.template, snapshot=_Taps(self.places)), torch.no_grad():
                run_model(self.model, self.static)
        host = {dtype: _to_host(slab) for dtype, slab in self.slabs.items()}
        on_host = dict(zip(map(id, self.places), _places(host, self.specs)))
        store = store if store is not None else MemoryStore()
        for site in self.template.sites():
            store.add(replace(
                site,
                args=map_structure(site.args, lambda t: on_host[id(t)]),
                kwargs=map_structure(site.kwargs, lambda t: on_host[id(t)]),
                output=map_structure(site.output, lambda t: on_host[id(t)]),
            ))
        return store


__all__ = ["GraphTaps"]
