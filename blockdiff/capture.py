"""Capture: forward hooks that record every site of a layout into a store, and the copy policy.

Hooks are global state on someone else's model: :func:`capture` adds them and removes
every one in ``finally``, whatever happens in between. Recording hooks return ``None``
explicitly (anything else would replace the module's output).

This module owns when tensors are copied. A store is a plain sink (``add``); what it is
handed is decided here (:class:`Snapshots`): copies, or the model's own CPU tensors held by
reference and proven unchanged by their version counters. When one did change, the one
retry loop, :func:`with_copies`, runs the whole attempt again with copies.
"""

from __future__ import annotations

import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, TypeVar

import torch
from torch import nn

from .distributed import declared_whole, is_distributed, made_whole
from .hooking import Hooks
from .hookmap import EACH_CALL, Layout
from .inputs import run_model
from .errors import ModelSpecError, TensorChanged
from .site import (
    PLAIN_TYPES, Site, hidden_location, iter_tensors, map_structure, primary_tensor, recorded_copy, replace_primary, snapshot, with_hidden,
)
from .store import MemoryStore, SiteStore


class Snapshots:
    """Copies of live tensors for the record, each live tensor copied once.

    A block's input is the previous block's output and a norm's output is the next
    module's input: the same tensor object reaches several hooks. It is copied (detached,
    to the CPU, in one pass) the first time and the copy is shared after, as long as the
    object is alive and unchanged (its version counter catches in-place updates). The
    cache holds only weak references to live tensors, so it keeps no activation alive.

    With ``by_reference``, a CPU tensor that has a version counter is not copied at all:
    the record holds it (one that requires grad: a detached alias, same storage, same
    version counter) and the version it had. :meth:`changed` says whether any of them was modified in place since it was
    recorded; if none was, the aliases hold exactly what the hooks saw. ``"kept"`` (a
    store in memory) checks once the forward is over; ``"written"`` (a dump) checks each
    site's tensors as it hands them to the store and forgets them after: the dump writer
    checks them again once its thread has copied their bytes (:class:`~blockdiff.dump.DumpWriter`).
    """

    def __init__(
        self, *, by_reference: str | None = None, device_copies: "DeviceCopies | None" = None, lockstep: bool = False
    ) -> None:
        self.by_reference = by_reference
        self._as_they_are = by_reference is not None
        # A run in lockstep with other ranks copies at once: its records are gathered and
        # compared across ranks.
        self.lockstep = lockstep
        self._cache: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        # Tensors held by reference, by id, with the version each had when first met (met
        # again at a later site, it is the same record; held here, its id stays its own).
        self._held: dict[int, tuple[torch.Tensor, int]] = {}
        # Copies of CUDA tensors, queued on a side stream (see DeviceCopies).
        self.device_copies = device_copies or DeviceCopies()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        if self._as_they_are and type(t) is torch.Tensor and self._held_as_is(t):
            # Held as it is (what a detached alias would hold: nothing to detach), checked
            # against the version it had when first recorded (changed): an in-place write
            # to its values or its shape (``unsqueeze_``, ``transpose_``, ``resize_``) bumps
            # that counter alike. A detached alias made for each cost 4-8 us a site more on
            # figure 9's model.
            return t
        version = _version(t)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is t and version is not None and hit[1] == version:
            return hit[2]
        if t.is_meta:
            raise ModelSpecError(
                "the model computed a tensor without values (on the meta device): a weight read from disk is read when "
                "the module holding it runs, and this model uses one outside such a call (its own forward computing "
                "with another module's weight); diff it with the weights in memory"
            )
        t_ = t.detach()
        if self.by_reference and version is not None and t_.device.type == "cpu":
            self._held[id(t_)] = (t_, version)
            copy = t_
        elif self.device_copies.handles(t_) and not self.lockstep and not is_distributed(t_):
            copy = self.device_copies.copy(t_)
        else:
            copy = recorded_copy(t_)
        if version is None:  # an inference tensor has no version counter: no sharing
            return copy
        try:
            cache = self._cache  # the callback must not hold this object
            ref = weakref.ref(t, lambda _, key=key: cache.pop(key, None))
        except TypeError:  # not weak-referenceable: no sharing
            return copy
        self._cache[key] = (ref, version, copy)
        return copy

    def call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments for the record (``self(args), self(kwargs)`` in one walk)."""
        if self._as_they_are and self._held_as_is(args) and self._held_as_is(kwargs):
            return args, dict(kwargs)
        return map_structure(args, self.tensor), map_structure(kwargs, self.tensor)

    def __call__(self, obj: Any) -> Any:
        if self._as_they_are and self._held_as_is(obj):
            return dict(obj) if type(obj) is dict else obj
        return map_structure(obj, self.tensor)

    def _held_as_is(self, obj: Any) -> bool:
        """:meth:`_as_is` at the top of a record; ``False`` for an inference tensor (no
        version counter: copied)."""
        try:
            return self._as_is(obj, top=True)
        except RuntimeError:
            return False

    def _as_is(self, obj: Any, *, top: bool = False) -> bool:
        """Whether ``obj`` is recorded as it is (held by reference): CPU tensors without grad in
        tuples, ``None`` and plain scalars, and at the top a call's keywords (a dict the
        record copies). Each tensor is held with its version as it is met; where this
        says ``False`` (a list, a cache, a parameter, a CUDA tensor), map_structure makes
        the record, and the tensors already held stay held (the same entries). What
        figure 9's sites are made of, walked without a Python call a tensor: through
        map_structure the walk was a third of a site's price there."""
        kind = type(obj)
        if kind is torch.Tensor:
            items: Any = (obj,)
        elif kind is tuple:
            items = obj
        elif kind is dict and top:
            items = obj.values()
        else:
            return obj is None or kind in PLAIN_TYPES
        held = self._held
        for v in items:
            kind = type(v)
            if kind is torch.Tensor:
                key = id(v)
                if key not in held:  # met before: held, checked, its first version kept
                    if v.requires_grad or not v.is_cpu:
                        return False
                    held[key] = (v, v._version)
            elif v is not None and kind not in PLAIN_TYPES and not (kind is tuple and self._as_is(v)):
                return False
        return True

    def changed(self) -> bool:
        """Whether a tensor recorded by reference was modified in place after its hook."""
        return any(alias._version != version for alias, version in self._held.values())

    def adder(self, store: SiteStore, *, written: bool = False) -> Callable[[Site], None]:
        """``add`` for one store: the store's own ``add`` where there is nothing to check
        or wait for (a store that holds: its device copies land at :meth:`finish`)."""
        if not written and self.by_reference != "written":
            return store.add
        return lambda site: self.add(store, site, written=written)

    def add(self, store: SiteStore, site: Site, *, written: bool = False) -> None:
        """``store.add(site)``; for ``"written"``, after checking the site's references.
        A store that writes (``written``, or ``"written"``) gets the site once its device
        copies have landed; one that holds gets them as they are, landed by
        :meth:`finish` at the end of the forward."""
        tensors = None
        if (written or self.by_reference == "written") and self.device_copies.in_flight:
            tensors = list(iter_tensors((site.args, site.kwargs, site.output)))
            self.device_copies.wait_for(tensors)
        if self.by_reference != "written":
            store.add(site)
            return
        if tensors is None:
            tensors = iter_tensors((site.args, site.kwargs, site.output))
        mine = [self._held[id(t)] for t in tensors if id(t) in self._held]
        if any(alias._version != version for alias, version in mine):
            raise TensorChanged(f"{site.label}: a tensor it recorded was changed in place before it was written")
        store.add(site)
        for alias, _ in mine:  # handed over: the dump writer checks them from here
            self._held.pop(id(alias), None)

    def finish(self) -> None:
        """Wait for every device copy still in flight (the forward is over)."""
        self.device_copies.wait_all()


class DeviceCopies:
    """Copies of a CUDA model's activations to the CPU, overlapped with its forward.

    Each tensor is first copied on the forward's own stream (a device-to-device snapshot:
    :meth:`copy`), then that snapshot is queued on a side stream (after the work that made
    it) into a pinned host buffer, and the forward goes on; a CUDA event marks when it
    lands. The snapshot closes a race by construction: the side stream's copy runs later,
    and a model may write the tensor in place after its hook (HF Falcon adds into its MLP's
    output); the snapshot is ordered before any such write by the stream itself, and
    nothing but the side stream reads it. At most
    ``limit`` copies are in flight: one more waits for the oldest, so the forward runs at
    most that far ahead of its copies, and a streamed capture (which frees each buffer once
    its site is written) holds at most that many buffers besides (a store in memory keeps
    every one: they are its record). Copies
    land in the order they were queued (one stream), so waiting for one waits for every
    copy queued before it. The source tensor is marked used on the side stream
    (``record_stream``), so the caching allocator does not hand its memory to the forward
    before the copy has read it.

    A tensor not on a CUDA device is copied as before (:func:`~blockdiff.site.recorded_copy`).
    The bounding, ordering and snapshot logic is tested on the CPU with a stand-in for the
    stream (``events``, whose copy reads its tensor only when it lands); the copies ran on an
    H200 in ``benchmarks/device_check.py`` (docs/performance.md, *The GPU check*), whose
    check 10 captures a model that writes a recorded tensor in place after its hook.

    Args:
        limit: copies in flight at most.
        events: how a copy is queued, ``events(tensor) -> (host tensor, waitable)`` where
            the waitable has ``synchronize()``; the CUDA side stream when ``None``.
    """

    def __init__(self, limit: int = 16, *, events: Callable[[torch.Tensor], tuple[torch.Tensor, Any]] | None = None) -> None:
        self.limit = limit
        self._events = events
        self._streams: dict[torch.device, Any] = {}
        self._in_flight: deque[tuple[Any, int]] = deque()  # (event, id of its host tensor), oldest first
        self._pending: set[int] = set()  # ids of host tensors whose copy may not have landed

    def handles(self, t: torch.Tensor) -> bool:
        """Whether :meth:`copy` queues ``t`` (a CUDA tensor, or any with ``events``)."""
        return self._events is not None or t.device.type == "cuda"

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``t``; for a CUDA tensor, one that lands later (:meth:`wait_for`)."""
        if not self.handles(t):
            return recorded_copy(t)
        # On the forward's stream, before it can write ``t`` again: what the copy reads.
        host, event = (self._events or self._queue)(t.clone())
        self._in_flight.append((event, id(host)))
        self._pending.add(id(host))
        while len(self._in_flight) > self.limit:
            self._land_oldest()
        return host

    def _queue(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        stream = self._streams.get(t.device)
        if stream is None:
            stream = self._streams[t.device] = torch.cuda.Stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # after the work that made t
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return host, event

    def _land_oldest(self) -> None:
        event, host = self._in_flight.popleft()
        event.synchronize()
        self._pending.discard(host)

    def wait_for(self, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> None:
        """Wait until the copies that made ``tensors`` have landed (and every one queued
        before them: they land in order)."""
        wanted = {id(t) for t in tensors} & self._pending
        while wanted and self._in_flight:
            _, host = self._in_flight[0]
            self._land_oldest()
            wanted.discard(host)

    def wait_all(self) -> None:
        while self._in_flight:
            self._land_oldest()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors do not track versions
        return None


class Numbering:
    """Site numbering: which call of a module this is, its ordinal within its (stage,
    block, sub-path), its place in the run's order; a call the map's ``calls`` does not
    select opens no site. A call's arguments are recorded through ``copy(args, kwargs)``."""

    def __init__(self, layout: Layout, whole: bool, copy: Callable[[tuple, dict], tuple[tuple, dict]]) -> None:
        self.layout = layout
        self.whole = whole  # hidden inputs declared local shards are recorded whole
        self.copy = copy
        self.order = 0
        self._ordinals: dict[tuple, list[int]] = {}

    def opener(self, path: str, where: tuple[str, int | None, str | None]) -> Callable[[tuple, dict], Site | None]:
        """``opened(args, kwargs)``: the site of the next call of ``path``, or ``None``.
        One for each path (it counts that path's calls); what it needs is looked up here,
        once, not at each call: on a model bound by dispatch a site's every dictionary
        look-up shows in the forward's time (benchmarks/per_site.py)."""
        options = self.layout.options(path)
        every = options.calls == EACH_CALL
        shard = options.shard_input if self.whole else None  # a declared local shard, made whole
        ordinals = self._ordinals.setdefault(where, [0])  # shared by the paths of one (stage, block, sub-path)
        copy, stage, block, subpath = self.copy, *where
        calls = 0

        def opened(args: tuple, kwargs: dict) -> Site | None:
            nonlocal calls
            call = calls
            calls = call + 1
            if not every and not options.selects(call):
                return None
            args, kwargs = copy(args, kwargs)
            if shard is not None:
                args, kwargs = whole_input(args, kwargs, shard, options.activations)
            ordinal = ordinals[0]
            ordinals[0] = ordinal + 1
            order = self.order
            self.order = order + 1
            return Site(stage, block, subpath, path, call, ordinal, args, kwargs, None, order, options.activations)

        return opened


class ChildCalls:
    """The calls of a module's children during one run of it (a drill-down): one site per
    call, in the order they started, under the parent's stage, block and sub-path."""

    def __init__(self, path: str, call: Site) -> None:
        self.path, self.call = path, call
        self.found: list[Site] = []
        self._open: dict[str, list[Site]] = {}
        self._calls: dict[str, int] = {}

    def opened(self, rel: str, args: tuple, kwargs: dict) -> Site:
        call = self.call
        site = Site(call.stage, call.block, call.subpath, f"{self.path}.{rel}", self._calls.get(rel, 0), len(self.found),
                    snapshot(args), snapshot(kwargs), order=len(self.found))
        self._calls[rel] = site.call + 1
        self.found.append(site)
        self._open.setdefault(rel, []).append(site)
        return site

    def closed(self, rel: str, output: Any) -> Site:
        site = self._open[rel].pop()
        site.output = snapshot(output)
        return site

    def innermost(self) -> list[Site]:
        """The innermost modules that ran: a module whose own children ran is theirs to
        judge (a quantized Linear keeps its weights in a child that is never called: it stays)."""
        ran = {site.module for site in self.found}
        return [s for s in self.found if not any(other.startswith(s.module + ".") for other in ran)]


class Deferred:
    """Calls made inside a compiled graph, in program order. The hook is traced by dynamo,
    so it may only append (no copies, no counters, nothing that breaks the graph): the
    tensors are cloned in the graph (the values as the hook saw them, whatever the graph
    does in place after it, `h += attn(norm(h))`; the clones are extra graph outputs) and
    handed over when the graph finishes, to be recorded in order with the eager calls."""

    def __init__(self, opened: Callable, closed: Callable) -> None:
        self.events: list[tuple] = []
        self.opened, self.closed = opened, closed

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _is_compiling():
            self.events.append(("pre", module, _cloned(args), _cloned(kwargs)))
            return None
        self.drain()
        self.opened(module, args, kwargs)
        return None

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if _is_compiling():
            self.events.append(("post", module, _cloned(output)))
            return None
        self.drain()
        self.closed(module, output)
        return None

    def drain(self) -> None:
        """Record the calls a compiled graph handed over, in their order."""
        for event in self.events:
            (self.opened if event[0] == "pre" else self.closed)(*event[1:])
        self.events.clear()


@contextmanager
def capture(
    model: nn.Module,
    layout: Layout,
    store: SiteStore,
    *,
    snapshot: Snapshots | None = None,
    progress: Callable[[int, int], None] | None = None,
    lockstep: bool = False,
) -> Iterator[SiteStore]:
    """Record every site of ``layout`` that runs inside the ``with`` body into ``store``
    (copies of every tensor, unless ``snapshot`` says otherwise). ``progress(done, total)``
    is called as each block's own call finishes. ``lockstep``: the model runs on every rank
    of a launched run, and a local shard is recorded whole.

    How a call is heard: in a model no compiler runs, each site module's ``forward`` is
    wrapped on the instance (``Hooks.replace_forward``; the wrapper keeps the forward's
    signature for ``inspect``): one Python call a site, and torch calls the module without
    its hook machinery — what the pair of hooks cost was most of a site's price on a model
    bound by dispatch (benchmarks/per_site.py). Where a compiler runs the module or one
    above it (``torch.compile``, ``module.compile()``, a compiled ``forward``), forward
    pre-hooks and hooks that dynamo traces (:class:`Deferred`). Either way the user's own
    hooks run first (theirs before ``forward``, ours inside it: the arguments they pass
    on are recorded) — except that an output a user's forward hook replaces is recorded
    as the module returned it.

    >>> with capture(model, layout, MemoryStore()) as store:   # doctest: +SKIP
    ...     model(ids)
    """
    site_of = layout.site_of()
    modules = _site_modules(model, site_of)
    snapshot = snapshot or Snapshots()
    numbering = Numbering(layout, whole=lockstep, copy=snapshot.call)
    open_sites: dict[str, list[Site | None]] = {}
    blocks_done = [0]
    # One pair of hook functions for every module, which look the module up: a hook that
    # differed per module (a closure over its path) would make dynamo compile one graph
    # per block where the model alone shares one.
    sites: dict[int, tuple[str, Callable[[tuple, dict], Site | None]]] = {}

    def opened(module: nn.Module, args: tuple, kwargs: dict) -> None:
        path, opens = sites[id(module)]
        open_sites.setdefault(path, []).append(opens(args, kwargs))

    written = not isinstance(store, MemoryStore)

    def closed(module: nn.Module, output: Any) -> None:
        site = open_sites[sites[id(module)][0]].pop()
        if site is not None:
            finished(module, site, output)

    add = snapshot.adder(store, written=written)

    def finished(module: nn.Module, site: Site, output: Any) -> None:
        site.output = snapshot(output)
        if lockstep:
            primary = primary_tensor(site.output)
            if primary is not None:  # a local shard: recorded whole
                site.output = replace_primary(site.output, made_whole(primary, module, layout.options(site.module).shard_output))
        add(site)
        if progress is not None and site.stage == "block" and site.subpath is None:
            blocks_done[0] += 1
            progress(blocks_done[0], len(layout.blocks))

    deferred = Deferred(opened, closed)
    # A model no compiler runs records through each site module's own forward, wrapped on
    # the instance (one Python call a site, and torch's call skips its hook machinery);
    # one a compiler traces, through hooks that dynamo can trace (Deferred).
    eager = not any(_compiled(module) for module in modules.values())

    def recording(module: nn.Module, opens: Callable[[tuple, dict], Site | None]) -> Callable:
        forward = module.forward

        def recorded(*args: Any, **kwargs: Any) -> Any:
            site = opens(args, kwargs)
            output = forward(*args, **kwargs)
            if site is not None:
                finished(module, site, output)
            return output

        setattr(recorded, "__wrapped__", forward)  # its signature is forward's, as inspect sees it
        return recorded

    with Hooks() as hooks:
        for path, where in site_of.items():
            module = modules[path]
            if id(module) in sites:  # one module at two paths: recorded under the first
                continue
            sites[id(module)] = (path, numbering.opener(path, where))
            if eager:
                hooks.set_forward(module, recording(module, sites[id(module)][1]))
            else:
                hooks.around(module, deferred.pre, deferred.post)
        yield store
        deferred.drain()
        snapshot.finish()  # every device copy landed before the store is read


def _site_modules(model: nn.Module, site_of: dict[str, Any]) -> dict[str, nn.Module]:
    """Each site's module by path, and every module above one (the model, ``model.layers``,
    ...): what a compiler running any of them would trace. Looked up by path, not by walking
    every module of the model (a capture of a small model paid a tenth of its time for that)."""
    found: dict[str, nn.Module] = {"": model}

    def lookup(path: str) -> nn.Module:
        module = found.get(path)
        if module is None:
            parent, _, name = path.rpartition(".")
            module = found[path] = lookup(parent)._modules[name]  # type: ignore[assignment]
        return module

    for path in site_of:
        lookup(path)
    return found


def _compiled(module: nn.Module) -> bool:
    """Whether a compiler runs ``module``'s code: compiled (``torch.compile(module)``, or
    ``module.compile()``), or its ``forward`` a compiled function."""
    return (
        "_orig_mod" in module._modules or "_compiled_call_impl" in module.__dict__
        or hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")
    )


def whole_input(args: tuple, kwargs: dict, dim: int, names: tuple[str, ...] | None) -> tuple[tuple, dict]:
    """A recorded call whose hidden state is a declared local shard, with the shard made
    whole (:func:`~blockdiff.distributed.declared_whole`)."""
    loc = hidden_location(args, kwargs, names)
    if loc is None:
        return args, kwargs
    local = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
    return with_hidden(args, kwargs, {"primary": declared_whole(local, dim)}, names)


_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _is_compiling() -> bool:
    """Whether dynamo is tracing (``torch.compiler.is_compiling``, torch >= 2.3)."""
    return bool(_COMPILING()) if _COMPILING is not None else False


def _cloned(obj: Any) -> Any:
    """Tensors of a call's arguments or output cloned, one level of tuple, list or dict
    deep: simple enough for dynamo to trace without a graph break."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in obj)
    if isinstance(obj, list):
        return [v.clone() if isinstance(v, torch.Tensor) else v for v in obj]
    if isinstance(obj, dict):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in obj.items()}
    return obj


Hold = Literal["kept", "written"]
T = TypeVar("T")


class Recording:
    """What one forward's record holds by reference.

    ``changed()`` says whether the model has since modified, in place, a tensor the store
    holds by reference: then the store no longer holds what the hooks saw.
    """

    def __init__(self, snapshots: Snapshots) -> None:
        self._snapshots = snapshots

    def changed(self) -> bool:
        return self._snapshots.changed()

    @classmethod
    def checked(cls, snapshots: Snapshots) -> "Recording":
        """The record of a forward that just ended.

        Raises:
            TensorChanged: a tensor held by reference was changed in place after its hook."""
        recording = cls(snapshots)
        if recording.changed():
            raise TensorChanged("a tensor recorded by reference was changed in place after its hook")
        return recording


def record_once(
    model: nn.Module,
    layout: Layout,
    store: SiteStore,
    inputs: Any,
    *,
    hold: Hold | None = None,
    progress: Callable[[int, int], None] | None = None,
    lockstep: bool = False,
) -> Recording:
    """Run ``model`` on ``inputs`` without autograd, recording into ``store``.

    ``torch.no_grad`` rather than ``inference_mode``: the same cost, but tensors keep the
    version counters that make holding and sharing them safe (:class:`Snapshots`).

    Args:
        hold: how CPU tensors reach the store. ``None``: copies. ``"kept"`` (a store in
            memory): the model's own tensors, checked after the forward; a change raises
            :class:`TensorChanged`, and ``Recording.changed()`` checks again later.
            ``"written"`` (a dump): the model's own tensors, each site's checked as it is
            handed to the dump and again once the dump's thread copied it (a change raises
            :class:`TensorChanged`, at the latest when the dump closes). A copy of every
            activation cost a tenth of the forward.
        progress: ``progress(done, total)`` per finished block.
        lockstep: the model runs on every rank of a launched run (see :func:`capture`).

    Raises:
        TensorChanged: a tensor held by reference changed: run again with copies
            (:func:`with_copies`).
    """
    snapshot = Snapshots(by_reference=hold, lockstep=lockstep)
    with capture(model, layout, store, snapshot=snapshot, progress=progress, lockstep=lockstep), torch.no_grad():
        output = run_model(model, inputs)
    del output  # nothing outside holds the model's output: it cannot change the record
    return Recording.checked(snapshot)


def with_copies(attempt: Callable[[bool], T], *, lockstep: bool = False) -> T:
    """The one retry loop of the copy policy: ``attempt(False)`` holds the model's own
    tensors; should it raise :class:`TensorChanged`, ``attempt(True)`` runs on copies.
    ``lockstep`` (sides run on every rank of a launched run): copies from the start, since
    ranks must not retry apart."""
    if lockstep:
        return attempt(True)
    try:
        return attempt(False)
    except TensorChanged:
        return attempt(True)


def record(
    model: nn.Module,
    layout: Layout,
    store: Any,
    inputs: Any,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Recording:
    """Record ``model`` into an in-memory store (one with ``clear``), holding its own CPU
    tensors; if the model changed one in place during the forward, the store is cleared
    and the forward runs again with copies.

    >>> record(model, resolve(model), store := MemoryStore(), ids)   # doctest: +SKIP
    """

    def attempt(copy: bool) -> Recording:
        store.clear()
        return record_once(model, layout, store, inputs, hold=None if copy else "kept", progress=progress)

    return with_copies(attempt)
