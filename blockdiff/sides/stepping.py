"""Decode steps of a live side: the caches its experiments carry from step to step.

At a decode step (docs/decode.md) an experiment on a module runs it with a cache of the
side's own kind holding what that module computed from the reference's inputs at every
earlier step: one cache — a *stream* — per kind of experiment and module, made by the
model's step adapter (a *stepper*, :mod:`blockdiff.decoding`) and carried on, so that the
cost stays linear in the steps. :class:`DecodeStepper` keeps a live side's streams and
the calls its drill-downs replay; the side reaches it through ``Side.stepping()``, and
outside ``sides/`` only what :class:`~blockdiff.sides.Stepping` declares is used.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

from torch import nn

from ..hooking import BufferCache
from ..site import Site, holds_cache
from . import Hidden


class Runs(Protocol):
    """What decode steps run on the live side they belong to."""

    def module(self, path: str) -> nn.Module: ...

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable: ...

    def replayed(self, call: Site, hidden: Hidden | None, cache: Any = None) -> tuple[tuple, dict]: ...

    def module_on(self, path: str, call: Site, hidden: Hidden | None, cache: Any) -> Any: ...


class DecodeStepper:
    """A live side's decode steps: the stepper its model runs with, the stream of each
    experiment (:meth:`stream`), the calls a stream has not run yet (:meth:`shadow`) and
    the calls a drill-down replays (:meth:`remember`, :meth:`rebuilt`). The side's
    experiments ask it for the cache they run with (:meth:`written`, :meth:`rebuilt`);
    outside decode steps (no stepper) there is none."""

    def __init__(self, side: Runs) -> None:
        self.side = side
        self.precisions: list[DecodeStepper] = []  # its side's precisions' steps, started with it
        self.start(None)

    @property
    def model(self) -> nn.Module:
        return self.side.module("")

    def start(self, stepper: Any) -> None:
        """Decode steps start with ``stepper`` (``None``: none do): every experiment cache
        (:meth:`stream`), remembered call (:meth:`remember`) and step count of this side
        and of its precisions anew."""
        # How this model runs a step and makes a cache (blockdiff.decoding), and the caches
        # its experiments carry from step to step.
        self.stepper: Any = stepper
        self._streams: dict[tuple, Any] = {}
        self._lagging: dict[tuple, list[tuple[Site, Hidden | None]]] = {}  # shadow(): the calls a stream has not run
        self._step = 0
        self._history: dict[str, list[tuple[int, Site, Hidden | None]]] = {}
        for steps in self.precisions:
            steps.start(stepper)

    def begin_step(self) -> None:
        """A decode step starts (the calls of the steps before are history: :meth:`remember`)."""
        self._step += 1

    def stream(self, key: tuple) -> Any:
        """The cache an experiment stream replays with at decode steps (``None`` outside
        them): one per kind of experiment and module (``key``), made by the :attr:`stepper`
        the first time and carried from step to step — what this side's module holds having
        run on the reference's inputs at every earlier position."""
        if self.stepper is None:
            return None
        if key not in self._streams:
            cache = self._streams[key] = self._new_cache(key[1])
            # The steps it shadowed the side's own run (shadow()): run now, in order.
            for call, hidden in self._lagging.pop(key, []):
                self.side.module_on(key[1], call, hidden, cache)
        return self._streams[key]

    def shadow(self, key: tuple, call: Site, hidden: Hidden | None = None) -> bool:
        """At a decode step, whether experiment ``key`` on this side's ``call`` (its
        activations ``hidden``, which the caller found bit for bit those the call received)
        may be answered by the call's recorded output, as outside decode steps: yes for a
        call handed no cache; for one that is, while the stream has not been made — it has
        shadowed the side's own run at every step before, so its cache would hold what the
        side's own held. The call is kept, and run when the stream is made (:meth:`stream`),
        should a later step need it; a clean decode makes none, which is most of its cost."""
        if self.stepper is None or key in self._streams:
            return False
        if not self.keeps_cache(key[1], call):
            return True
        if key[0] == "module":
            self.remember(key[1], call, hidden)
        self._lagging.setdefault(key, []).append((call, hidden))
        return True

    def made_stream(self, key: tuple) -> Any:
        """The stream ``key`` if made, ``None`` while it shadows the side's own run (its
        contents are then the side's own cache's)."""
        return self._streams.get(key) if self.stepper is not None else None

    def _new_cache(self, path: str) -> Any:
        """An empty cache for an experiment on module ``path``: the stepper's own kind, or —
        a model that keeps its cache in buffers — buffers of that module's own
        (:class:`~blockdiff.hooking.BufferCache`)."""
        names = cache_buffers(self.stepper)
        if names:
            return BufferCache(self.side.module(path), names)
        return self.stepper.new_cache(self.model)

    def keeps_cache(self, path: str, call: Site) -> bool:
        """Whether module ``path``'s ``call`` at a decode step reads and writes a cache: it
        was handed one, or the module holds the stepper's ``cache_buffers``."""
        if self.stepper is None:
            return False
        names = cache_buffers(self.stepper)
        return holds_cache(call) or bool(names) and BufferCache.held_by(self.side.module(path), names)

    def remember(self, path: str, call: Site, hidden: Hidden | None) -> None:
        """At a decode step, module ``path`` ran (or, for the reference, its own run ran it)
        on ``call`` with ``hidden``: what a later step's drill-down replays to rebuild the
        cache that module held (:meth:`rebuilt`). References only: no copies."""
        self._history.setdefault(path, []).append((self._step, call, hidden))

    def written(self, key: tuple, call: Site, hidden: Hidden | None = None) -> Any:
        """The stream ``key`` for a call that writes into it (``None`` for a call handed no
        cache); a module's call is remembered for drill-downs."""
        if not self.keeps_cache(key[1], call):
            return None
        if key[0] == "module":
            self.remember(key[1], call, hidden)
        return self.stream(key)

    def rebuilt(self, path: str, call: Site) -> Any:
        """A fresh cache holding what module ``path`` wrote at the steps before this one,
        replayed from its remembered calls: a drill-down at a decode step must not write the
        step into the stream the module check carries on, and a copy of it per step would
        cost every clean step; this costs only the steps that drill down."""
        if not self.keeps_cache(path, call):
            return None
        cache = self._new_cache(path)
        module = self.side.runnable(path)
        for step, earlier, hidden in self._history.get(path, []):
            if step < self._step:
                args, kwargs = self.side.replayed(earlier, hidden, cache)
                with cache_on(cache, self.side.module(path)):
                    module(*args, **kwargs)
        return cache


def cache_buffers(stepper: Any) -> tuple[str, ...]:
    """The buffers a step adapter says hold its model's cache (``cache_buffers``, keys
    first), ``()`` for a cache handed to the modules as an argument."""
    return tuple(getattr(stepper, "cache_buffers", None) or ())


def cache_on(cache: Any, module: nn.Module) -> contextlib.AbstractContextManager:
    """The run of ``module`` on ``cache``: a cache in buffers swapped in for it, or nothing
    to do (a cache handed as an argument is in the call's arguments already)."""
    return cache.into(module) if isinstance(cache, BufferCache) else contextlib.nullcontext()


__all__ = ["DecodeStepper", "cache_buffers", "cache_on"]
