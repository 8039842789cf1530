"""The backward of a live side: its model's free-running backward, and a module's.

A backward diff (``--backward``, docs/backward.md) runs each side's whole model forward
and backward once (:meth:`GradientRunner.record_gradients`, in the run its forward diff
records: :meth:`~GradientRunner.record_with_gradients`), then each module's backward on
the reference's activations (:meth:`~GradientRunner.backward_module`) and, drilling down,
its children's (:meth:`~GradientRunner.child_gradients`). :class:`GradientRunner` wraps a
live side for that; the side reaches it through ``Side.gradient_runs()`` (``None`` for a
side that runs no backward), and outside ``sides/`` only what
:class:`~blockdiff.sides.GradientRuns` declares is used. While the forward diff runs,
the side's module experiments keep their graphs here (:class:`Graphs`), for the
backward's experiments on the same calls.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
from torch import nn

from .. import distributed
from ..capture import ChildCalls, Hold, Recording, Snapshots, capture
from ..errors import PairingError
from ..hooking import Hooks
from ..hookmap import Layout
from ..inputs import Inputs, run_model
from ..site import Site, hidden_location, primary_tensor, recorded_copy, replace_primary, replayed_copy, with_hidden
from ..store import SiteStore
from . import ChildGradients, Hidden, Replaced
from .compiled import compile_context, compiled_forwards


class Runs(Protocol):
    """What a gradient runner runs on the live side it wraps."""

    layout: Layout
    store: SiteStore | None
    lockstep: bool
    cast: torch.dtype | None

    def module(self, path: str) -> nn.Module: ...

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable: ...

    def replayed(self, call: Site, hidden: Hidden | None, cache: Any = None) -> tuple[tuple, dict]: ...

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]: ...

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: Hold | None, progress: Callable[[int, int], None] | None = None
    ) -> Recording: ...


class GradientRunner:
    """A live side's backward (:mod:`blockdiff.backward`): the side runs its model's
    backward, and a module's. It wraps the side as a row of a batch wraps a live side
    (:class:`~blockdiff.sides.batched.RowSide`), running the side's modules as its
    experiments do (:meth:`~blockdiff.sides.live.LiveSide.runnable`, its replayed
    arguments); a kind whose gradients are made whole or cast another way overrides
    :meth:`record_gradients`, :meth:`_seed` and :meth:`_whole_gradients`."""

    def __init__(self, side: Runs) -> None:
        self.side = side
        # The module experiments' graphs kept for a backward diff (Graphs), else None.
        self.graphs: Graphs | None = None

    @property
    def cast(self) -> torch.dtype | None:
        return self.side.cast

    def module(self, path: str) -> nn.Module:
        return self.side.module(path)

    # -- the graphs of the forward diff's experiments --------------------------------------

    def keep_graphs(self) -> None:
        self.graphs = Graphs()

    def close_graphs(self) -> None:
        assert self.graphs is not None, "graphs are closed once kept"
        self.graphs.open = False

    def drop_graphs(self) -> None:
        self.graphs = None

    def keeping(self) -> bool:
        """Whether the side's module experiments keep their graphs now (:attr:`graphs` open)."""
        return self.graphs is not None and self.graphs.open

    def kept(
        self, path: str, call: Site, hidden: Hidden | None, *, parameters: bool,
        setup: Callable[[Hooks, nn.Module], None] | None = None,
    ) -> Any:
        """Module ``path`` run on ``call`` (activations ``hidden``, else its own) with
        autograd on — with ``parameters``, its floating parameters requiring grad — its
        graph kept for the backward's experiment on the same call; its output handed back
        detached. ``setup`` as for :meth:`_graph`."""
        assert self.graphs is not None
        given = call.hidden_inputs() if hidden is None else hidden
        params: list[torch.Tensor] = [p for p in self.module(path).parameters() if p.is_floating_point()] if parameters else []
        with self._graph(path, call, given, params, setup) as (leaves, out):
            self.graphs.keep(path, call, given, leaves, out)
        return _detached(out)

    # -- the model's backward, and a module's ----------------------------------------------

    def record_with_gradients(
        self, inputs: Inputs, store: SiteStore, loss: Callable[[Any, Inputs], torch.Tensor], *,
        hold: Hold | None, progress: Callable[[int, int], None] | None = None, parameters: bool = True,
    ) -> tuple[Recording, Gradients | None]:
        """The side's ``record`` and :meth:`record_gradients` in one run: the forward that
        the backward differentiates is the one recorded (with autograd on, which computes
        the same bits as without it for a model run eagerly). ``hold`` as for
        :func:`~blockdiff.capture.record_once`: aliases of the model's own tensors are
        checked once the backward is over too. A side that cannot (a compiled model, whose
        graphs differ with autograd on; a side in lockstep across ranks, which records its
        own way) only records: no gradients (``None``), recorded apart later.

        Raises:
            TensorChanged: a tensor recorded by reference was changed in place."""
        side = self.side
        model = self.module("")
        if side.lockstep or compiled_forwards(model) or any(compile_context(m) is not None for m in model.modules()):
            return side.record(inputs, store, hold=hold, progress=progress), None
        side.store = store
        snapshot = Snapshots(by_reference=hold)
        found = self.record_gradients(
            inputs, loss, parameters=parameters,
            recorded=lambda: capture(model, side.layout, store, snapshot=snapshot, progress=progress),
        )
        return Recording.checked(snapshot), found

    def record_gradients(
        self, inputs: Inputs, loss: Callable[[Any, Inputs], torch.Tensor], *, parameters: bool = True,
        recorded: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> Gradients:
        """The whole model run forward and backward on ``inputs`` (autograd on, in the mode
        the diff holds it: eval), ``loss(output, inputs)`` its scalar: the gradient of every
        site's primary output and of its hidden input — this call's own share, what flows
        back through it alone — by (module path, call), and (``parameters``) of every
        floating parameter, by name; without, the backward computes no weight gradient.
        The parameters' ``.grad`` stay as they were (``torch.autograd.grad``); their
        ``requires_grad`` flags are restored; the hooks (on the model: global state) are
        removed on every path. A call that a recomputation makes during the backward
        (activation checkpointing) records nothing: the forward's calls are the sites.
        ``recorded``: a context (a capture) the forward alone runs in."""
        layout = self.side.layout
        model = self.module("")
        found = Gradients()
        calls: dict[str, int] = {}
        over = [False]  # the forward finished: calls from here on are recomputations

        heard: list[torch.Tensor] = []  # every tensor whose gradient is recorded

        def keep(into: dict, key: tuple[str, int]) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                into[key] = recorded_copy(grad)
                return None

            return hook

        def pre(path: str) -> Callable:
            options = layout.options(path)

            def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
                if not over[0]:
                    calls[path] = calls.get(path, -1) + 1
                    found.order.append((path, calls[path]))
                loc = hidden_location(args, kwargs, options.activations)
                tensor = None if loc is None else (args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]])
                if tensor is None or not tensor.requires_grad:
                    return None
                # A view of its own: its gradient is what flows back through this call alone.
                # A recomputation gets one too (its saved tensors must be the forward's), unheard.
                own = tensor.view_as(tensor)
                if not over[0]:
                    own.register_hook(keep(found.inputs, (path, calls[path])))
                    heard.append(own)
                return with_hidden(args, kwargs, {"primary": own}, options.activations)

            return hook

        def post(path: str) -> Callable:
            def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                out = primary_tensor(output)
                if not over[0] and out is not None and out.requires_grad:
                    out.register_hook(keep(found.outputs, (path, calls[path])))
                    heard.append(out)
                return None

            return hook

        modules = dict(model.named_modules())
        params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
        seen: set[int] = set()
        with Hooks() as hooks, _requiring_grad([p for _, p in params]), torch.inference_mode(False), torch.enable_grad():
            for path in layout.site_of():
                if id(modules[path]) in seen:  # one module at two paths: recorded under the first
                    continue
                seen.add(id(modules[path]))
                hooks.before(modules[path], pre(path))
                hooks.after(modules[path], post(path))
            with recorded() if recorded is not None else contextlib.nullcontext():
                output = run_model(model, inputs)
            over[0] = True
            value = loss(output, inputs)
            # Gradients of what the hooks hear (so that the backward reaches every site), and
            # of the parameters when asked for (else no weight gradient is computed).
            wanted = [p for _, p in params] if parameters else []
            grads = torch.autograd.grad(value, [*wanted, *heard], allow_unused=True)[: len(wanted)]
        found.loss = float(value.detach())
        found.calls = dict(calls)
        found.parameters = {
            name: recorded_copy(g) if g is not None else torch.zeros(p.shape, dtype=p.dtype)
            for (name, p), g in zip(params if parameters else [], grads)
        }
        return found

    def backward_module(
        self, path: str, call: Site, hidden: Hidden, grad: torch.Tensor, *,
        replaced: Replaced | None = None, parameters: bool = True,
    ) -> tuple[Hidden, dict[str, torch.Tensor]]:
        """The vector-Jacobian product of module ``path`` at ``call`` with its activations
        replaced by ``hidden``, for the gradient ``grad`` of its primary output (cast to the
        output's dtype): the gradient of each floating activation, by role (in the dtype of
        ``hidden``), and, with ``parameters``, of each floating parameter of the module, by
        name relative to it (zeros for one the output does not depend on: all zeros for a
        module whose output depends on none of them, a ``detach()`` in its code). ``replaced``:
        modules under ``path`` (relative paths) whose ``forward`` is ``make(original)`` for
        this one run (undone when it ends)."""
        module = self.module(path)
        params = [(name, p) for name, p in module.named_parameters() if p.is_floating_point()] if parameters else []

        def replacing(hooks: Hooks, module: nn.Module) -> None:
            named = dict(module.named_modules())
            for rel, make in (replaced or {}).items():
                hooks.replace_forward(named[rel], make)

        # The forward diff's run of this very forward, autograd on, when it kept its graph.
        kept = self.graphs.take(path, call, hidden) if self.graphs is not None and not replaced else None
        graph = contextlib.nullcontext(kept) if kept else self._graph(path, call, hidden, [p for _, p in params], replacing)
        with graph as (leaves, output), _requiring_grad([p for _, p in params]), torch.inference_mode(False), torch.enable_grad():
            out = primary_tensor(output)
            if out is None:
                raise PairingError(f"{call.label}: the module returned no tensor")
            wrt = [*leaves.values(), *(p for _, p in params)]
            grads: tuple[torch.Tensor | None, ...]
            if out.requires_grad:
                grads = torch.autograd.grad(out, wrt, self._seed(path, call, out, grad), allow_unused=True)
            else:  # its output depends on none of them (a detach(), a no-grad region): no gradient flows
                self._seed(path, call, out, grad)  # (its shape still has to be the gradient's)
                grads = (None,) * len(wrt)
        found = [g.detach() if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt)]
        inputs = dict(zip(leaves, found[: len(leaves)]))
        return self._whole_gradients(call, inputs, {name: g for (name, _), g in zip(params, found[len(leaves):])})

    @contextlib.contextmanager
    def _graph(
        self, path: str, call: Site, hidden: Hidden, params: list[torch.Tensor],
        setup: Callable[[Hooks, nn.Module], None] | None = None,
    ) -> Iterator[tuple[dict[str, torch.Tensor], Any]]:
        """Module ``path`` run on ``call``, autograd on: its floating activations ``hidden``
        as leaves, ``params`` requiring grad, ``setup(hooks, module)`` adding hooks or
        replaced forwards first. Yields (the leaves, the output); the hooks stay for the
        body (a backward recomputing checkpointed code runs them again) and are removed
        when it ends, on every path."""
        module = self.module(path)
        leaves = {role: t.detach().requires_grad_() for role, t in hidden.items() if t.is_floating_point()}
        with Hooks() as hooks, _requiring_grad(params), torch.inference_mode(False), torch.enable_grad():
            if setup is not None:
                setup(hooks, module)
            args, kwargs = self.side.replayed(call, leaves)
            yield leaves, self.side.runnable(path, module)(*args, **kwargs)

    def _seed(self, path: str, call: Site, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient ``grad`` of module ``path``'s whole primary output, shaped, placed and
        typed as that output ``out`` is: what its backward starts from.

        Raises:
            PairingError: ``grad`` has another number of elements than ``out``.
        """
        if out.numel() != grad.numel():
            raise PairingError(
                f"{call.label}: the gradient of its output has shape {list(grad.shape)}, its output {list(out.shape)}"
            )
        return replayed_copy(grad, out.device, out.dtype).reshape(out.shape)

    def _whole_gradients(
        self, call: Site, inputs: Hidden, params: dict[str, torch.Tensor]
    ) -> tuple[Hidden, dict[str, torch.Tensor]]:
        """A module backward's gradients as the record compares them: its activations' as
        they are, its parameters' on the CPU (a sharded side makes both whole)."""
        return inputs, {name: g.to("cpu") for name, g in params.items()}

    # -- a module's children ---------------------------------------------------------------

    def backward_child_calls(self, path: str, call: Site, hidden: Hidden | None) -> list[Site]:
        """The side's ``child_calls`` of module ``path`` on ``call`` with its activations
        replaced by ``hidden``, for a backward's pairing of children (what its drill-down
        runs, whose parameters pair with the reference's): run without autograd, and on a
        side split across ranks each child's primary output made whole (a column-parallel
        projection's local shard gathered, as its gradient is compared), so that children
        pair by the shapes the reference's have."""
        side = self.side
        with torch.no_grad():
            found = side.child_calls(path, call, hidden)
        if not side.lockstep:
            return found
        for site in found:  # the same children in the same order on every rank: collectives
            out = site.primary_output()
            if out is not None:
                whole = distributed.made_whole(out, self.module(site.module), side.layout.options(site.module).shard_output)
                site.output = replace_primary(site.output, whole)
        return found

    def child_gradients(self, path: str, call: Site, hidden: Hidden, grad: torch.Tensor, *, depth: int = 2) -> ChildGradients:
        """Module ``path``'s backward as :meth:`backward_module` runs it, with every call of
        its innermost children (up to ``depth`` levels down) recorded, in the order they
        started: the call (a site under the parent's stage, block and sub-path, as the
        side's ``child_calls`` records it), the gradient of its hidden input (that call's
        own share) and of its primary output (``None`` where no gradient flows). The hooks
        are added for this one run and removed in ``finally``."""
        module = self.module(path)
        children = {rel: child for rel, child in module.named_modules() if rel and rel.count(".") < depth}
        recorded = ChildCalls(path, call)
        into: dict[int, torch.Tensor] = {}
        out_of: dict[int, torch.Tensor] = {}

        def keep(where: dict, at: int) -> Callable[[torch.Tensor], None]:
            def hook(g: torch.Tensor) -> None:
                where[at] = recorded_copy(g)
                return None

            return hook

        def pre(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict) -> Any:
                site = recorded.opened(rel, args, kwargs)
                loc = hidden_location(args, kwargs)
                tensor = None if loc is None else (args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]])
                if tensor is None or not tensor.requires_grad:
                    return None
                own = tensor.view_as(tensor)
                own.register_hook(keep(into, site.order))
                return with_hidden(args, kwargs, {"primary": own})

            return hook

        def post(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                site = recorded.closed(rel, output)
                out = primary_tensor(output)
                if out is not None and out.requires_grad:
                    out.register_hook(keep(out_of, site.order))
                return None

            return hook

        def hooked(hooks: Hooks, module: nn.Module) -> None:
            for rel, child in children.items():
                hooks.before(child, pre(rel))
                hooks.after(child, post(rel))

        params: list[torch.Tensor] = [p for p in module.parameters() if p.is_floating_point()]
        with self._graph(path, call, hidden, params, hooked) as (leaves, output):
            out = primary_tensor(output)
            if out is not None and out.requires_grad and out.numel() == grad.numel():
                torch.autograd.grad(out, [*leaves.values(), *params], self._seed(path, call, out, grad), allow_unused=True)
        return [(s, into.get(s.order), out_of.get(s.order)) for s in recorded.innermost()]


class _Kept(NamedTuple):
    """One graph :class:`Graphs` keeps: the call and activations it was run on (held, so
    that their ids stay theirs), its activation leaves and its output."""

    call: Site
    hidden: Hidden
    leaves: dict[str, torch.Tensor]
    out: Any


class Graphs:
    """The graphs of a side's module experiments in a forward diff, kept for the backward
    diff that follows (:mod:`blockdiff.backward`): the backward's experiment on a module is
    the forward's — the same module on the same call with the same activations — run again
    with autograd on; kept, it runs its backward alone. While :attr:`open` (the forward
    diff), the side's ``call_module`` runs each module with autograd on (every floating
    parameter requiring grad, the activations leaves) — the same bits as without it, in
    eager code — and keeps its graph here (:meth:`GradientRunner.kept`); :meth:`take`
    hands each over once."""

    def __init__(self) -> None:
        self.open = True
        self._kept: dict[tuple, _Kept] = {}

    @staticmethod
    def _key(path: str, call: Site, hidden: Hidden) -> tuple:
        return path, id(call), tuple(sorted((role, id(t)) for role, t in hidden.items()))

    def keep(self, path: str, call: Site, hidden: Hidden, leaves: dict[str, torch.Tensor], out: Any) -> None:
        """Module ``path``'s run on ``call`` with the activations ``hidden`` (the very
        tensors): its activation leaves and its output, graph attached. The call and the
        activations are held with it: while it is kept, no other object can have their
        ids (an activation made for the experiment and dropped after would otherwise hand
        its id, and this graph, to another tensor)."""
        self._kept[self._key(path, call, hidden)] = _Kept(call, dict(hidden), leaves, out)

    def take(self, path: str, call: Site, hidden: Hidden) -> tuple[dict[str, torch.Tensor], Any] | None:
        """What :meth:`keep` kept of that run (its leaves and output), once; ``None`` when
        nothing was."""
        found = self._kept.pop(self._key(path, call, hidden), None)
        return None if found is None else (found.leaves, found.out)


class Gradients:
    """One side's free-running backward (:meth:`GradientRunner.record_gradients`).

    Attributes:
        inputs: (module path, call) → the gradient of that call's hidden input: its own share.
        outputs: (module path, call) → the gradient of that call's primary output.
        parameters: parameter name (``named_parameters()``) → its whole gradient (zeros for
            one the loss does not depend on).
        loss: the loss's value.
        calls: module path → how many times the forward called it.
        order: every (module path, call) in the order the forward started them.
        replicas: for a side split across ranks, the first gradient in backward order
            whose replicas differ across ranks (:class:`ReplicaSplit`), else ``None``.
    """

    def __init__(self) -> None:
        self.inputs: dict[tuple[str, int], torch.Tensor] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        self.parameters: dict[str, torch.Tensor] = {}
        self.loss = float("nan")
        self.calls: dict[str, int] = {}
        self.order: list[tuple[str, int]] = []
        self.replicas: ReplicaSplit | None = None


@dataclass
class ReplicaSplit:
    """A gradient every rank holds whole whose replicas differ: at ``key`` (module path,
    call), ``which`` one in words (``input gradient``, ``output gradient``, ``parameter
    gradient: q_norm.weight``); ``ranks`` differ from rank 0, ``measured`` the worst of
    them against rank 0's."""

    key: tuple[str, int]
    which: str
    ranks: list[int]
    measured: Any


def _detached(obj: Any) -> Any:
    """``obj`` with each tensor detached, in tuples, lists and plain dicts too (named
    tuples kept); any other object as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_detached(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detached(v) for v in obj)
    if type(obj) is dict:
        return {k: _detached(v) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def _requiring_grad(params: list[torch.Tensor]) -> Iterator[None]:
    """Every tensor of ``params`` requiring grad for the body; each flag restored after."""
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


__all__ = ["GradientRunner", "Gradients", "Graphs", "ReplicaSplit"]
