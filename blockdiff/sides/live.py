"""Live sides: an ``nn.Module`` as it runs, and its code at another precision.

:class:`LiveSide` runs *what its model runs*: eager modules, or — inside a model or module
under ``torch.compile`` — the module compiled with that compile's own context
(:mod:`~blockdiff.sides.compiled`), so an experiment judges generated code.
:class:`PrecisionSide` is a live side's modules copied into another dtype and device
(:mod:`~blockdiff.sides.precision`): the reference's own code at the candidate's precision,
which is how a noise floor is measured.

Every hook, pre-hook and instance ``forward`` an experiment puts on the model goes through
one :class:`~blockdiff.hooking.Hooks` context and is undone in its ``finally``.

What a live side does beyond the forward experiments is a role it holds, each in a file of
its own: its decode steps (:meth:`LiveSide.stepping`, :mod:`~blockdiff.sides.stepping`:
the caches its experiments carry from step to step) and its backward
(:meth:`LiveSide.gradient_runs`, :mod:`~blockdiff.sides.gradients`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..diskweights import disk_weights
from .. import distributed
from ..capture import ChildCalls, Hold, Recording, record_once
from ..errors import PairingError
from ..hooking import BufferCache, Hooks
from ..hookmap import Layout
from ..autodetect import configured_vocab_size, passes_through
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
)
from ..modelinfo import describe, versions
from ..site import (
    Site,
    for_replay,
    hidden_location,
    iter_tensors,
    map_structure,
    primary_tensor,
    recorded_copy,
    replace_primary,
    replayed_copy,
    with_hidden,
)
from ..store import SiteStore
from . import Frozen, Hidden, Side, SideDefaults, received_dtype
from .compiled import compiled_code_limits, compiled_forwards, compiled_runnable
from .gradients import GradientRunner, Gradients
from .precision import cast_copy, floor_backward, twin_copy, twins
from .stepping import DecodeStepper, cache_on
from ..report import Note


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
    decodes = True  # its decode steps: stepping()
    backward_refused: str | None = None  # its backward: gradient_runs()

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
        self._steps = DecodeStepper(self)
        self._gradients = GradientRunner(self)

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.model)

    # Replayed floating arguments are cast to this dtype; None keeps each its own.
    cast: torch.dtype | None = None

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
                Note("compiled-forward", f"the {self.name}'s forward of {names} is a compiled function (torch.compile(module.forward)): its run "
                "(the drift) went through the compiled code, every experiment ran the modules' eager code; to judge the "
                "compiled code, compile the module itself (torch.compile(module) or module.compile())")
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
            side = self._precisions[key] = PrecisionSide(self, dtype, device)
            self._steps.precisions.append(side._steps)
        return self._precisions[key]

    def stepping(self) -> DecodeStepper:
        """Its decode steps: the caches its experiments carry from step to step."""
        return self._steps

    def gradient_runs(self) -> GradientRunner | None:
        """Its backward: its model's free-running backward, and a module's."""
        return self._gradients

    def replayed(self, call: Site, hidden: Hidden | None, cache: Any = None) -> tuple[tuple, dict]:
        """``call``'s arguments on this side's device (floating ones cast to :attr:`cast`),
        its activations replaced by ``hidden`` in the call's own dtypes, a recorded cache
        by ``cache`` (a cache in buffers is swapped in around the run instead:
        :func:`~blockdiff.sides.stepping.cache_on`)."""
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
        return self.module_on(path, call, hidden, self._steps.written(("module", path), call, hidden))

    def module_on(self, path: str, call: Site, hidden: Hidden | None, cache: Any) -> Any:
        """Module ``path`` run on ``call`` (activations ``hidden``) with ``cache``; while its
        gradient runner keeps graphs (the forward diff of a backward), with autograd on and
        its graph kept for the backward's experiment on the same call (the output handed
        back detached). Not a block's: the backward's floor run of a whole block has its
        modules probed (whether it is the residual's floor too), which a kept graph cannot
        be; the candidate's whole block keeps its graph in :meth:`run_block`."""
        if self._gradients.keeping() and cache is None and path not in self._block_paths:
            return self._gradients.kept(path, call, hidden, parameters=True)
        args, kwargs = self.replayed(call, hidden, cache)
        with cache_on(cache, self.module(path)):
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
        leaves = {
            rel: child for rel, child in module.named_modules()
            if rel and rel.count(".") < depth and not passes_through(child)
        }
        children = ChildCalls(path, call)

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
        cache = self._steps.rebuilt(path, call)
        args, kwargs = self.replayed(call, hidden, cache)
        with Hooks() as hooks, cache_on(cache, module):
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
        with the whole recorded routing decision. Nothing frozen, while its gradient runner
        keeps graphs, the block runs with autograd on and its graph is kept for the
        backward's whole-block experiment on the same call
        (:meth:`~blockdiff.sides.gradients.GradientRunner.backward_module`).
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

        stream = self._steps.written(("block", path, frozenset(frozen or ())), call)
        if self._gradients.keeping() and stream is None and not frozen:
            # The whole block on the reference's input: the backward's whole-block
            # experiment on the same call runs its backward alone from this graph.
            out = primary_tensor(self._gradients.kept(path, call, hidden, parameters=False, setup=hooked))
        else:
            with Hooks() as hooks:
                hooked(hooks, block)
                args, kwargs = self.replayed(call, hidden, stream)
                with cache_on(stream, block):
                    out = primary_tensor(self.runnable(path, block)(*args, **kwargs))
        if out is None:
            raise PairingError(f"{call.label}: the block returned no tensor")
        return out, reached


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
        self._steps = DecodeStepper(self)
        self._steps.start(side._steps.stepper)
        self._gradients = _FloorGradients(self)

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
            weights = disk_weights(self.model)
            self._copy = cast_copy(self.model, self.cast, self._device) if weights is None else weights.copy(self.cast, self._device)
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
            and disk_weights(model) is None and disk_weights(self.model) is None  # weights not here to compare
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


class _FloorGradients(GradientRunner):
    """A floor side's backward: its model's free-running backward in :func:`floor_backward`
    too (its modules run there already: :meth:`PrecisionSide.runnable`)."""

    def __init__(self, side: PrecisionSide) -> None:
        super().__init__(side)
        self.floor = side

    def record_gradients(self, *args: Any, **kwargs: Any) -> Gradients:
        with floor_backward(self.floor.dtype, self.floor.device):
            return super().record_gradients(*args, **kwargs)


def _replace_all(output: Any, recorded: Any, device: torch.device) -> Any:
    """``recorded`` in place of ``output``, each floating tensor cast to the dtype of the
    tensor it replaces (a router's whole decision: logits, weights, indices)."""
    own = list(iter_tensors(output))
    position = iter(range(len(own) + 1))

    def cast(t: torch.Tensor) -> torch.Tensor:
        i = next(position)
        return replayed_copy(t, device, own[i].dtype if i < len(own) else None)

    return for_replay(map_structure(recorded, cast), device=device)


__all__ = ["LiveSide", "PrecisionSide", "eval_mode"]
