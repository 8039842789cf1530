"""Live sides: an ``nn.Module`` as it runs, and its code at another precision.

:class:`LiveSide` runs *what its model runs*: eager modules, or — inside a model or module
under ``torch.compile`` — the module compiled with that compile's own context
(:mod:`~blockdiff.sides.compiled`), so an experiment judges generated code.
:class:`PrecisionSide` is a live side's modules copied into another dtype and device
(:mod:`~blockdiff.sides.precision`): the reference's own code at the candidate's precision,
which is how a noise floor is measured.

Every hook, pre-hook and instance ``forward`` an experiment puts on the model goes through
one :class:`~blockdiff.hooking.Hooks` context and is undone in its ``finally``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn

from .. import distributed
from ..capture import Hold, Recording, Snapshots, capture, record_once
from ..errors import PairingError
from ..hooking import BufferCache, Hooks
from ..hookmap import Layout
from ..autodetect import configured_vocab_size
from ..errors import InputError
from ..inputs import (
    Inputs,
    InputsFile,
    RandomTokens,
    check_vocab,
    complete_inputs,
    load_inputs,
    load_tokens,
    model_device,
    model_dtype,
    pixel_input,
    random_pixels,
    random_tokens,
    run_model,
)
from ..modelinfo import describe, versions
from ..site import (
    Site,
    for_replay,
    hidden_location,
    holds_cache,
    iter_tensors,
    map_structure,
    primary_tensor,
    recorded_copy,
    replace_primary,
    replayed_copy,
    snapshot,
    with_hidden,
)
from ..store import SiteStore
from . import Frozen, Hidden, Side, SideDefaults, received_dtype
from .compiled import compile_context, compiled_code_limits, compiled_forwards, compiled_runnable
from .precision import cast_copy, floor_backward, twin_copy, twins


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the body and restore every module's flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


class LiveSide(SideDefaults):
    """An ``nn.Module`` (eager or compiled) with its layout; :meth:`record` fills its store."""

    live = True
    decodes = True  # start_decode, begin_step, stream, shadow, made_stream, remember, keeps_cache
    backward_refused: str | None = None  # record_gradients, backward_module, child_gradients

    def __init__(
        self, name: str, model: nn.Module, layout: Layout, *, label: str | None = None, lockstep: bool = False
    ) -> None:
        self.name = name
        self.lockstep = lockstep
        self.model = model
        self.layout = layout
        self.meta = describe(model, layout, label)
        self.store: SiteStore | None = None  # set by record()
        self._compiled: dict[str, Callable] = {}  # runnable(): modules compiled like their model
        self._precisions: dict[tuple, PrecisionSide] = {}  # in_precision(): one per precision
        self.start_decode(None)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model)

    # Replayed floating arguments are cast to this dtype; None keeps each its own.
    cast: torch.dtype | None = None
    # The module experiments' graphs kept for a backward diff (Graphs), else None.
    graphs: "Graphs | None" = None

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: Hold | None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """Run the whole model once, recording every site into ``store`` (see
        :func:`~blockdiff.capture.record_once` for ``hold``)."""
        self.store = store
        return record_once(self.model, self.layout, store, inputs, hold=hold, progress=progress, lockstep=self.lockstep)

    def module(self, path: str) -> nn.Module:
        return self.model.get_submodule(path)

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable:
        """What runs module ``path`` (``module``, when the caller holds it already) the way
        the side's own forward runs it: the module itself, or inside a compiled model the
        module compiled like it (:func:`~blockdiff.sides.compiled.compiled_runnable`)."""
        module = self.module(path) if module is None else module
        return compiled_runnable(self.model, path, module, self._compiled)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Eval mode, and compiled code kept from falling back to eager code
        (:func:`~blockdiff.sides.compiled.compiled_code_limits`), for the whole diff."""
        with eval_mode(self.model), compiled_code_limits(self.model):
            yield

    def localized(self, judging: Any, judge: Callable[[], Any]) -> Any:
        """``judge()``, and a note when the model's run went through a compiled function its
        experiments do not (:func:`~blockdiff.sides.compiled.compiled_forwards`)."""
        judged = judge()
        around = compiled_forwards(self.model)
        if around:
            names = ", ".join(f"{path or 'the model'}" for path in around)
            judging.notes.append(
                f"the {self.name}'s forward of {names} is a compiled function (torch.compile(module.forward)): its run "
                "(the drift) went through the compiled code, every experiment ran the modules' eager code; to judge the "
                "compiled code, compile the module itself (torch.compile(module) or module.compile())"
            )
        return judged

    def inputs(self, given: Any) -> tuple[Inputs, str | None]:
        """Concrete inputs for this model, and a note when blockdiff made up part of them:
        inputs as given, named inputs from a file (:class:`~blockdiff.inputs.InputsFile`),
        token ids from a token file, or random ones (:class:`~blockdiff.inputs.RandomTokens`,
        the default) — token ids within the model's vocabulary, or pixels for a vision
        encoder; token ids completed for an encoder-decoder
        (:func:`~blockdiff.inputs.complete_inputs`). Token ids must lie in its vocabulary."""
        model = self.model
        if isinstance(given, InputsFile):
            found, made = load_inputs(given.path), None
        elif given is not None and not isinstance(given, RandomTokens):
            found, made = complete_inputs(model, load_tokens(given) if isinstance(given, (str, Path)) else given)
        else:
            spec = given or RandomTokens()
            pixels = pixel_input(model)
            if pixels is not None:
                name, shape = pixels
                made_pixels = random_pixels(shape, batch=spec.batch, seed=spec.seed)
                return {name: made_pixels}, f"random {name} of shape {list(made_pixels.shape)} (seed {spec.seed})"
            vocab = self.vocab_size()
            if vocab is None:
                raise InputError(
                    "cannot tell the model's vocabulary size; give token ids (--tokens FILE) or inputs (--inputs FILE)"
                )
            found, made = complete_inputs(model, random_tokens(batch=spec.batch, seq=spec.seq, vocab=vocab, seed=spec.seed))
        if isinstance(found, torch.Tensor):
            check_vocab(found, self.vocab_size(), side=self.name if self.name != "captured" else "model")
        return found, made

    def vocab_size(self) -> int | None:
        """The vocabulary of the model's embedding when it is an ``nn.Embedding``, else the
        one its configuration states (Hugging Face ``config.vocab_size``, TransformerLens
        ``cfg.d_vocab``)."""
        for stage, path in self.own_layout.outside:
            if stage == "embed":
                module = self.model.get_submodule(path)
                if isinstance(module, nn.Embedding):
                    return module.num_embeddings
        return configured_vocab_size(self.model)

    @property
    def own_layout(self) -> Layout:
        """The layout of the modules this process holds (a pipeline stage: its own)."""
        return self.layout

    @property
    def versions(self) -> dict[str, str]:
        return versions(self.model)

    def attribute(self, path: str) -> Any:
        owner, _, attr = path.rpartition(".")
        return getattr(self.model.get_submodule(owner), attr, None)

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "PrecisionSide":
        """This side's code at ``dtype`` on ``device``: one per precision for the side's life
        (each weight cast once; at decode steps, its experiments' caches carried on)."""
        key = (dtype, torch.device(device))
        if key not in self._precisions:
            self._precisions[key] = PrecisionSide(self, dtype, device)
        return self._precisions[key]

    def stream(self, key: tuple) -> Any:
        """The cache an experiment stream replays with at decode steps (``None`` outside
        them): one per kind of experiment and module (``key``), made by the side's
        :attr:`stepper` the first time and carried from step to step — what this side's
        module holds having run on the reference's inputs at every earlier position."""
        if self.stepper is None:
            return None
        if key not in self._streams:
            cache = self._streams[key] = self._new_cache(key[1])
            # The steps it shadowed the side's own run (shadow()): run now, in order.
            for call, hidden in self._lagging.pop(key, []):
                self._module_on(key[1], call, hidden, cache)
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
            return BufferCache(self.module(path), names)
        return self.stepper.new_cache(self.module(""))

    def keeps_cache(self, path: str, call: Site) -> bool:
        """Whether module ``path``'s ``call`` at a decode step reads and writes a cache: it
        was handed one, or the module holds the stepper's ``cache_buffers``."""
        if self.stepper is None:
            return False
        names = cache_buffers(self.stepper)
        return holds_cache(call) or bool(names) and BufferCache.held_by(self.module(path), names)

    def start_decode(self, stepper: Any) -> None:
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
        for side in self._precisions.values():
            side.start_decode(stepper)

    def begin_step(self) -> None:
        """A decode step starts (the calls of the steps before are history: :meth:`remember`)."""
        self._step += 1

    def remember(self, path: str, call: Site, hidden: Hidden | None) -> None:
        """At a decode step, module ``path`` ran (or, for the reference, its own run ran it)
        on ``call`` with ``hidden``: what a later step's drill-down replays to rebuild the
        cache that module held (:meth:`_rebuilt`). References only: no copies."""
        self._history.setdefault(path, []).append((self._step, call, hidden))

    def _written_stream(self, key: tuple, call: Site, hidden: Hidden | None = None) -> Any:
        """The stream ``key`` for a call that writes into it (``None`` for a call handed no
        cache); a module's call is remembered for drill-downs."""
        if not self.keeps_cache(key[1], call):
            return None
        if key[0] == "module":
            self.remember(key[1], call, hidden)
        return self.stream(key)

    def _rebuilt(self, path: str, call: Site) -> Any:
        """A fresh cache holding what module ``path`` wrote at the steps before this one,
        replayed from its remembered calls: a drill-down at a decode step must not write the
        step into the stream the module check carries on, and a copy of it per step would
        cost every clean step; this costs only the steps that drill down."""
        if not self.keeps_cache(path, call):
            return None
        cache = self._new_cache(path)
        module = self.runnable(path)
        for step, earlier, hidden in self._history.get(path, []):
            if step < self._step:
                args, kwargs = self._replay(earlier, hidden, cache)
                with _on(cache, self.module(path)):
                    module(*args, **kwargs)
        return cache

    def _replay(self, call: Site, hidden: Hidden | None, cache: Any = None) -> tuple[tuple, dict]:
        """``call``'s arguments on this side's device (floating ones cast to :attr:`cast`),
        its activations replaced by ``hidden`` in the call's own dtypes, a recorded cache
        by ``cache`` (a cache in buffers is swapped in around the run instead: :func:`_on`)."""
        device = self.device
        cache = None if isinstance(cache, BufferCache) else cache
        args, kwargs, fresh = call.args, call.kwargs, set()
        if hidden:
            own = call.hidden_inputs()
            hidden = {
                role: replayed_copy(t, device, received_dtype(role, own, self.cast), layout=own.get(role))
                for role, t in hidden.items()
            }
            # Replaced before the rest is copied: each tensor of the call is copied (and cast) once.
            args, kwargs = with_hidden(args, kwargs, hidden, call.activations)
            fresh = {id(t) for t in hidden.values()}
        return (
            for_replay(args, device=device, dtype=self.cast, keep=fresh, cache=cache),
            for_replay(kwargs, device=device, dtype=self.cast, keep=fresh, cache=cache),
        )

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        return self._module_on(path, call, hidden, self._written_stream(("module", path), call, hidden))

    def _module_on(self, path: str, call: Site, hidden: Hidden | None, cache: Any) -> Any:
        """Module ``path`` run on ``call`` (activations ``hidden``) with ``cache``; while
        :attr:`graphs` is open, with autograd on and its graph kept for the backward's
        experiment on the same call (the output handed back detached). Not a block's: the
        backward's floor run of a whole block has its modules probed (whether it is the
        residual's floor too), which a kept graph cannot be; the candidate's whole block
        keeps its graph in :meth:`run_block`."""
        if self.graphs is not None and self.graphs.open and cache is None and path not in self._block_paths:
            given = call.hidden_inputs() if hidden is None else hidden
            params: list[torch.Tensor] = [p for p in self.module(path).parameters() if p.is_floating_point()]
            with self._graph(path, call, given, params) as (leaves, out):
                self.graphs.keep(path, call, given, leaves, out)
            return _detached(out)
        args, kwargs = self._replay(call, hidden, cache)
        with _on(cache, self.module(path)):
            return self.runnable(path)(*args, **kwargs)

    @functools.cached_property
    def _block_paths(self) -> frozenset[str]:
        """The blocks' own module paths (a side's layout does not change)."""
        return frozenset(block.path for block in self.layout.blocks)

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None, *, depth: int = 2) -> list[Site]:
        """Module ``path`` run on ``call`` (its activations replaced by ``hidden``), with
        every call of its innermost children (up to ``depth`` levels down) recorded: one site
        per call, in the order they started, under the parent's stage, block and sub-path.
        The hooks are added for this one run and removed in ``finally``."""
        module = self.module(path)
        leaves = {rel: child for rel, child in module.named_modules() if rel and rel.count(".") < depth}
        children = _Children(path, call)

        def pre(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict) -> None:
                children.opened(rel, args, kwargs)
                return None

            return hook

        def post(rel: str) -> Callable:
            def hook(child: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                children.closed(rel, output)
                return None

            return hook

        # A decode step's drill-down runs on a cache rebuilt from the steps before (rebuilt
        # before the hooks are on: only this call's children are recorded).
        cache = self._rebuilt(path, call)
        args, kwargs = self._replay(call, hidden, cache)
        with Hooks() as hooks, _on(cache, module):
            for rel, child in leaves.items():
                hooks.before(child, pre(rel))
                hooks.after(child, post(rel))
            self.runnable(path, module)(*args, **kwargs)
        innermost = children.innermost()
        for ordinal, site in enumerate(innermost):
            site.ordinal = site.order = ordinal
        return innermost

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """For this one call, every module of ``modules`` gets a pre-hook (what reached it)
        and, when something is frozen, its ``forward`` wrapped on the instance; both are
        undone when the :class:`~blockdiff.hooking.Hooks` context closes.

        A frozen module answers with the first site's primary tensor in the structure and
        dtypes of the second (the running side's own recorded output); a router answers
        with the whole recorded routing decision. Nothing frozen, while :attr:`graphs` is
        open, the block runs with autograd on and its graph is kept for the backward's
        whole-block experiment on the same call (:meth:`backward_module`).
        """
        block = self.module(path)
        device, cast = self.device, self.cast
        reached: dict[tuple[str, int], torch.Tensor] = {}
        counters: dict[str, int] = {}
        seen: dict[str, int] = {}  # calls of each module so far
        current: dict[str, tuple[str, int] | None] = {}

        def pre(rel: str, subpath: str) -> Callable:
            options = self.layout.options(f"{path}.{rel}")

            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                call = seen[rel] = seen.get(rel, -1) + 1
                if not options.selects(call):  # not a site (the map's `calls`): it computes
                    current[rel] = None
                    return None
                ordinal = counters.get(subpath, 0)
                counters[subpath] = ordinal + 1
                current[rel] = (subpath, ordinal)
                loc = hidden_location(args, kwargs, options.activations)
                if loc is not None:
                    tensor = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
                    if options.shard_input is not None and self.lockstep:
                        reached[(subpath, ordinal)] = distributed.declared_whole(tensor, options.shard_input)
                    else:
                        reached[(subpath, ordinal)] = recorded_copy(tensor)
                return None

            return hook

        def frozen_forward(rel: str, original: Callable) -> Callable:
            def forward(*args: Any, **kwargs: Any) -> Any:
                key = current.get(rel)
                if frozen is None or key not in frozen:
                    return original(*args, **kwargs)
                recorded, template = frozen[key]
                own = for_replay(template.output, device=device, dtype=cast)
                if key[0] == "router":
                    return _replace_all(own, recorded.output, device)
                like = primary_tensor(template.output)
                dtype = cast or (like.dtype if like is not None else None)
                given = recorded.primary_output()
                assert given is not None, f"{recorded.label}: a frozen module's record holds no output tensor"
                return replace_primary(own, replayed_copy(given, device, dtype, layout=like))

            return forward

        def hooked(hooks: Hooks, block: nn.Module) -> None:
            named = dict(block.named_modules())
            for rel, subpath in modules.items():
                hooks.before(named[rel], pre(rel, subpath))
                if frozen:
                    hooks.replace_forward(named[rel], functools.partial(frozen_forward, rel))

        stream = self._written_stream(("block", path, frozenset(frozen or ())), call)
        if self.graphs is not None and self.graphs.open and stream is None and not frozen:
            # The whole block on the reference's input: the backward's whole-block
            # experiment on the same call runs its backward alone from this graph.
            given = call.hidden_inputs() if hidden is None else hidden
            with self._graph(path, call, given, [], hooked) as (leaves, output):
                self.graphs.keep(path, call, given, leaves, output)
            out = primary_tensor(_detached(output))
        else:
            with Hooks() as hooks:
                hooked(hooks, block)
                args, kwargs = self._replay(call, hidden, stream)
                with _on(stream, block):
                    out = primary_tensor(self.runnable(path, block)(*args, **kwargs))
        if out is None:
            raise PairingError(f"{call.label}: the block returned no tensor")
        return out, reached


    # -- backward (blockdiff.backward): the side runs its model's backward, and a module's ---

    def record_with_gradients(
        self, inputs: Inputs, store: SiteStore, loss: Callable[[Any, Inputs], torch.Tensor], *,
        hold: Hold | None, progress: Callable[[int, int], None] | None = None, parameters: bool = True,
    ) -> tuple[Recording, "Gradients | None"]:
        """:meth:`record` and :meth:`record_gradients` in one run: the forward that the
        backward differentiates is the one recorded (with autograd on, which computes the
        same bits as without it for a model run eagerly). ``hold`` as for
        :func:`~blockdiff.capture.record_once`: aliases of the model's own tensors are
        checked once the backward is over too. A side that cannot (a compiled model, whose
        graphs differ with autograd on; a side in lockstep across ranks, which records its
        own way) only records: no gradients (``None``), recorded apart later.

        Raises:
            TensorChanged: a tensor recorded by reference was changed in place."""
        model = self.module("")
        if self.lockstep or compiled_forwards(model) or any(compile_context(m) is not None for m in model.modules()):
            return self.record(inputs, store, hold=hold, progress=progress), None
        self.store = store
        snapshot = Snapshots(by_reference=hold)
        found = self.record_gradients(
            inputs, loss, parameters=parameters,
            recorded=lambda: capture(model, self.layout, store, snapshot=snapshot, progress=progress),
        )
        return Recording.checked(snapshot), found

    def record_gradients(
        self, inputs: Inputs, loss: Callable[[Any, Inputs], torch.Tensor], *, parameters: bool = True,
        recorded: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> "Gradients":
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
            options = self.layout.options(path)

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
            for path in self.layout.site_of():
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
        replaced: dict[str, Callable[[Callable], Callable]] | None = None, parameters: bool = True,
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
            args, kwargs = self._replay(call, leaves)
            yield leaves, self.runnable(path, module)(*args, **kwargs)

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

    def backward_child_calls(self, path: str, call: Site, hidden: Hidden | None) -> list[Site]:
        """:meth:`child_calls` of module ``path`` on ``call`` with its activations replaced by
        ``hidden``, for a backward's pairing of children (what its drill-down runs, whose
        parameters pair with the reference's): run without autograd, and on a side split
        across ranks each child's primary output made whole (a column-parallel projection's
        local shard gathered, as its gradient is compared), so that children pair by the
        shapes the reference's have."""
        with torch.no_grad():
            found = self.child_calls(path, call, hidden)
        if not self.lockstep:
            return found
        for site in found:  # the same children in the same order on every rank: collectives
            out = site.primary_output()
            if out is not None:
                whole = distributed.made_whole(out, self.module(site.module), self.layout.options(site.module).shard_output)
                site.output = replace_primary(site.output, whole)
        return found

    def child_gradients(
        self, path: str, call: Site, hidden: Hidden, grad: torch.Tensor, *, depth: int = 2
    ) -> list[tuple[Site, torch.Tensor | None, torch.Tensor | None]]:
        """Module ``path``'s backward as :meth:`backward_module` runs it, with every call of
        its innermost children (up to ``depth`` levels down) recorded, in the order they
        started: the call (a site under the parent's stage, block and sub-path, as
        :meth:`child_calls` records it), the gradient of its hidden input (that call's own
        share) and of its primary output (``None`` where no gradient flows). The hooks are
        added for this one run and removed in ``finally``."""
        module = self.module(path)
        children = {rel: child for rel, child in module.named_modules() if rel and rel.count(".") < depth}
        recorded = _Children(path, call)
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
    diff), :meth:`LiveSide.call_module` runs each module with autograd on (every floating
    parameter requiring grad, the activations leaves) — the same bits as without it, in
    eager code — and keeps its graph here; :meth:`take` hands each over once."""

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


class PrecisionSide(LiveSide):
    """A live side's code in another dtype and device: the modules it runs are one copy of
    the side's model, cast (the user's model is never changed), and every recorded floating
    argument is cast too. The noise floor of a check is this side's error.

    The copy is made on first use and kept while the side lives: the free run and every
    floor experiment run it, so each weight is cast once (a copy per experiment cast the
    whole model twice over). It costs the model's weights at this precision in memory, as
    long as the diff runs; against a candidate that is its twin (:meth:`runs_as`), the
    copy holds the candidate's own parameters and costs nothing more."""

    def __init__(self, side: LiveSide, dtype: torch.dtype, device: torch.device) -> None:
        self.name, self.layout, self.meta, self.store = side.name, side.layout, side.meta, side.store
        self.model = side.model
        self.cast = dtype
        self._device = device
        self._copy: nn.Module | None = None
        self._compiled, self._precisions, self.lockstep = {}, {}, side.lockstep
        self.start_decode(side.stepper)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        assert self.cast is not None
        return self.cast

    def module(self, path: str) -> nn.Module:
        if self._copy is None:
            assert self.cast is not None
            self._copy = cast_copy(self.model, self.cast, self._device)
        return self._copy.get_submodule(path)

    def runnable(self, path: str, module: nn.Module | None = None) -> Callable:
        """The copy's module, run eagerly; with autograd on, in :func:`floor_backward`."""
        run = self.module(path) if module is None else module

        def call(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return run(*args, **kwargs)
            with floor_backward(self.dtype, self.device):
                return run(*args, **kwargs)

        return call

    def record_gradients(self, *args: Any, **kwargs: Any) -> "Gradients":
        """:meth:`LiveSide.record_gradients` in :func:`floor_backward`."""
        with floor_backward(self.dtype, self.device):
            return super().record_gradients(*args, **kwargs)

    def record(
        self, inputs: Inputs, store: SiteStore, *, hold: Hold | None = None, progress: Callable[[int, int], None] | None = None
    ) -> Recording:
        """The whole model's free run at this precision (the drift floors); ``hold`` as for
        :func:`~blockdiff.capture.record_once`. The experiments run the same modules again:
        a store that holds their own tensors (``"kept"``) must be checked after them
        (``Recording.changed()``), as :func:`~blockdiff.engine._in_memory` does, since a
        module that reuses its output buffer would change what the free run holds."""
        self.store = store
        return record_once(self.module(""), self.layout, store, inputs, hold=hold, progress=progress, lockstep=self.lockstep)

    def in_precision(self, dtype: torch.dtype, device: torch.device) -> "PrecisionSide":
        return PrecisionSide(self, dtype, device)

    def runs_as(self, other: Side) -> bool:
        """Whether ``other`` is this side's code at this precision: a live side on this
        device whose model is the copy's twin (:func:`twins`) under the same layout. Its own
        record then is this side's free run (same inputs, same computation). Asked before
        the copy exists, :func:`twin_copy` answers without casting the weights; a twin's
        copy, made of its own parameters, is kept as this side's (what a backward diff's
        residual experiments run costs no second copy of the weights). A candidate that is
        not the twin gets the real copy, for its floors."""
        model = getattr(other, "model", None)
        if not (
            isinstance(model, nn.Module)
            and type(other) is LiveSide
            and other.device == self.device
            and other.layout.to_dict() == self.layout.to_dict()
        ):
            return False
        if self._copy is not None:
            return twins(self._copy, model)
        twin = twin_copy(self.model, model, self.dtype, self.device, made=lambda: self.module(""))
        if twin is not None:
            self._copy = twin
        return twin is not None


class _Children:
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


def cache_buffers(stepper: Any) -> tuple[str, ...]:
    """The buffers a step adapter says hold its model's cache (``cache_buffers``, keys
    first), ``()`` for a cache handed to the modules as an argument."""
    return tuple(getattr(stepper, "cache_buffers", None) or ())


def _on(cache: Any, module: nn.Module) -> contextlib.AbstractContextManager:
    """The run of ``module`` on ``cache``: a cache in buffers swapped in for it, or nothing
    to do (a cache handed as an argument is in the call's arguments already)."""
    return cache.into(module) if isinstance(cache, BufferCache) else contextlib.nullcontext()


def _replace_all(output: Any, recorded: Any, device: torch.device) -> Any:
    """``recorded`` in place of ``output``, each floating tensor cast to the dtype of the
    tensor it replaces (a router's whole decision: logits, weights, indices)."""
    own = list(iter_tensors(output))
    position = iter(range(len(own) + 1))

    def cast(t: torch.Tensor) -> torch.Tensor:
        i = next(position)
        return replayed_copy(t, device, own[i].dtype if i < len(own) else None)

    return for_replay(map_structure(recorded, cast), device=device)


class Gradients:
    """One side's free-running backward (:meth:`LiveSide.record_gradients`).

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


__all__ = ["LiveSide", "PrecisionSide", "cache_buffers", "eval_mode", "Gradients", "Graphs", "ReplicaSplit"]
