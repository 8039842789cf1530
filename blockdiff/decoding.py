"""Decode steps: localize a divergence that only appears with a KV cache.

A prompt (the usual inputs) is prefilled — step 0 — and then ``N`` steps run one token
at a time, each side with its **own** cache, both fed the same tokens (teacher forcing:
the reference's greedy choice at each step), so positions stay aligned. Every step is
recorded and localized like a forward pass (docs/decode.md):

- a module experiment at step t runs the candidate's module on the reference's inputs
  with a cache of the candidate's own kind that holds what that module computed from the
  reference's inputs at every earlier step: one cache per kind of experiment and module
  (a side's :class:`~blockdiff.sides.Stepping`), carried from step to step, so the
  cost stays linear in ``N``;
- the cache is a site: after each step, what each attention's experiment cache holds
  (keys and values apart, by position) is compared with the reference's own cache, and a
  wrong write is blamed on that block's attention ("kv cache: keys"), at the first step it
  shows; a state-space or convolution mixer's states likewise ("conv state", "ssm state":
  a Hugging Face linear-attention cache layer, as Mamba, Mamba2, Jamba and LFM2 keep);
- noise floors come from the reference's own code at the candidate's precision, run the
  same way (its own caches), and drift floors from its own cached free run.

How a model runs a step is a *stepper*: :class:`HFStepper` for Hugging Face models
(``DynamicCache`` or ``StaticCache`` through ``cache=``/``past_key_values=``); a model with a
cache of its own provides one as its ``blockdiff_stepper`` attribute (an object with
``new_cache(model)`` and ``run(model, ids, cache)`` returning the logits, and — for a cache
kept in the modules' buffers — ``cache_buffers``, the buffers' names, so that every
experiment gets buffers of its own: :class:`~blockdiff.hooking.BufferCache`).

A reference's decode can be captured into a dump (schema 5: :func:`stored` reads it back),
and a candidate's decode replayed against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .compare import metrics
from .errors import InputError, OptionsError, run_model_code
from .experiments import aligned
from .inputs import accepts, run_model
from .hooking import BufferCache
from .report import Check
from .sides import Side, Stepping
from .sides.batched import PositionCut, RowSide
from .sides.stepping import cache_buffers
from .store import MemoryStore
from .vocab import CONV_STATE, KV_KEYS, KV_VALUES, SSM_STATE

# What the CLI's --cache names, for Hugging Face models.
CACHE_KINDS = ("dynamic", "static")


class Stepper(Protocol):
    """How a model runs one decode step with its own cache."""

    def new_cache(self, model: nn.Module) -> Any:
        """An empty cache of this model's kind."""

    def run(self, model: nn.Module, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The logits of ``ids`` (``[batch, tokens]``, on the model's device) run with
        ``cache``, which the call updates."""


@dataclass
class HFStepper:
    """A Hugging Face causal LM's step: ``model(input_ids, cache=..., use_cache=True)``.

    Args:
        kind: ``"dynamic"`` (``DynamicCache``) or ``"static"`` (``StaticCache`` of
            ``length`` positions).
        length: the static cache's length (prompt and every step).
    """

    kind: str = "dynamic"
    length: int = 0

    def new_cache(self, model: nn.Module) -> Any:
        import transformers

        config = model.config
        if self.kind == "static":
            return transformers.StaticCache(config=config, max_cache_len=self.length)
        return transformers.DynamicCache(config=config)

    def run(self, model: nn.Module, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        name = "cache" if accepts(model, "cache") else "past_key_values"
        return logits_of(model(input_ids=ids, use_cache=True, **{name: cache}))


def logits_of(output: Any) -> torch.Tensor:
    """A causal LM's logits: the output itself, its ``logits``, or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    return output.logits if hasattr(output, "logits") else output[0]


def stepping(side: Side) -> Stepping:
    """``side``'s decode steps (``Side.stepping``).

    Raises:
        OptionsError: the one refusal of a side that runs no decode steps (a dump, an ONNX
            graph), naming the capability.
    """
    found = side.stepping() if side.decodes else None
    if found is None:
        raise OptionsError("the {side} cannot run {decode}: decode steps need live PyTorch models", side=side.name)
    return found


def stepper_for(model: nn.Module, *, kind: str, length: int) -> Stepper:
    """The model's own ``blockdiff_stepper``, else :class:`HFStepper` for a Hugging Face
    model (one with a ``config``)."""
    own = getattr(model, "blockdiff_stepper", None)
    if own is not None:
        layout = getattr(own, "kv_layout", None)
        if layout is not None and sorted(layout) != sorted(KV_LAYOUT):
            raise InputError(
                f"{type(model).__name__}'s blockdiff_stepper.kv_layout {tuple(layout)} must name each of "
                f"{', '.join(KV_LAYOUT)} once (how its cache tensors are laid out)"
            )
        return own
    if getattr(model, "config", None) is None or not (accepts(model, "cache") or accepts(model, "past_key_values")):
        raise InputError(
            f"{type(model).__name__} has no decode step blockdiff knows: give the model a blockdiff_stepper "
            "(new_cache(model), run(model, ids, cache); docs/decode.md), or decode a Hugging Face causal LM"
        )
    if kind not in CACHE_KINDS:
        raise InputError(f"unknown cache kind {kind!r}; expected one of {', '.join(CACHE_KINDS)}")
    return HFStepper(kind, length)


@dataclass
class StepCall:
    """One step's inputs, as :func:`~blockdiff.inputs.run_model` runs them: the tokens
    and the cache they run with (``run_on``), the logits kept."""

    ids: torch.Tensor
    cache: Any
    stepper: Stepper
    logits: torch.Tensor | None = None

    def run_on(self, model: nn.Module) -> torch.Tensor:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.logits = self.stepper.run(model, self.ids.to(device), self.cache)
        return self.logits


Layer = tuple[torch.Tensor, torch.Tensor]  # a cache layer's keys and values, [batch, kv_heads, positions, head_dim]
States = dict[str, torch.Tensor]  # a cache layer's states (conv, ssm) by the name their checks carry
Held = dict[str, torch.Tensor]  # what a cache layer holds, by the name its checks carry (keys, values, states)


class CacheLog:
    """What a side's cache held after each step, kept as what each step wrote: per step and
    cache layer, the keys and values of the positions it fed and how many positions the
    layer held (a sliding window holds its last ones), so the memory is linear in the steps
    (a copy of the whole cache per step would be quadratic). A step whose cache is not the
    one before with its new positions appended (a cache that writes to the wrong slot) is
    kept whole, so what is read back is always what the cache held."""

    def __init__(self, pieces: list[list[tuple[torch.Tensor, torch.Tensor, int, bool] | None] | None] | None = None) -> None:
        self.pieces = list(pieces or [])
        self._last: list[Layer | None] = []  # each layer after the step before, to check appending

    def add(self, contents: list[Layer | None] | None, length: int, fed: int) -> None:
        """The cache after a step that fed ``fed`` tokens, ``length`` in all so far."""
        if contents is None:
            self.pieces.append(None)
            return
        step: list[tuple[torch.Tensor, torch.Tensor, int, bool] | None] = []
        self._last += [None] * (len(contents) - len(self._last))
        for index, layer in enumerate(contents):
            if layer is None:
                step.append(None)
                continue
            keys, values = (filled(t, length).detach().to("cpu", copy=True) for t in layer)
            held, n = int(keys.shape[2]), min(fed, int(keys.shape[2]))
            before = self._last[index]
            appended = n == held if before is None else all(
                torch.equal(torch.cat([b, t[:, :, held - n:]], dim=2)[:, :, -held:], t) for b, t in zip(before, (keys, values))
            )
            step.append((keys[:, :, held - n:], values[:, :, held - n:], held, False) if appended else (keys, values, held, True))
            self._last[index] = (keys, values)
        self.pieces.append(step)

    def at(self, step: int) -> list[Layer | None] | None:
        """Per layer, the keys and values held after ``step`` (``None``: a layer not written;
        the whole ``None``: a cache blockdiff could not read, or no step recorded)."""
        if step >= len(self.pieces) or self.pieces[step] is None:
            return None
        found: list[Layer | None] = []
        for layer, last in enumerate(self.pieces[step]):  # type: ignore[arg-type]
            if last is None:
                found.append(None)
                continue
            written = []
            for earlier in reversed(self.pieces[: step + 1]):
                piece = None if earlier is None or layer >= len(earlier) else earlier[layer]
                if piece is None:
                    continue
                written.insert(0, piece)
                if piece[3]:  # kept whole: nothing before it counts
                    break
            held = last[2]
            keys = torch.cat([w[0] for w in written], dim=2)[:, :, -held:]
            values = torch.cat([w[1] for w in written], dim=2)[:, :, -held:]
            found.append((keys, values))
        return found

    def to_structure(self) -> list:
        """As a dump stores it (:meth:`~blockdiff.dump.DumpWriter.add_decode`)."""
        return [
            None if step is None else [
                None if piece is None else {"keys": piece[0], "values": piece[1], "held": piece[2], "whole": piece[3]}
                for piece in step
            ]
            for step in self.pieces
        ]

    @classmethod
    def from_structure(cls, stored: Any) -> "CacheLog":
        """What :meth:`to_structure` gave, read back from a dump."""
        return cls([
            None if step is None else [
                None if p is None else (p["keys"], p["values"], int(p["held"]), bool(p.get("whole", False))) for p in step
            ]
            for step in stored or []
        ])


@dataclass
class Decoded:
    """One side's decode: each step's record, the greedy token it chose after each step
    (``[batch]``), and what its cache held after each step (kept for the reference only;
    empty otherwise)."""

    stores: list[Any] = field(default_factory=list)
    recordings: list[Any] = field(default_factory=list)  # what each step's record holds by reference
    greedy: list[torch.Tensor] = field(default_factory=list)
    caches: CacheLog = field(default_factory=CacheLog)
    # Per step, per cache layer, its states (:func:`state_contents`): whole, since a state
    # is rewritten at every step and its size does not grow.
    states: list[list[States | None] | None] = field(default_factory=list)
    # Each step as a side of its own, where a step's experiments cannot run on the side
    # itself (a model without a cache: the whole sequence cut to the step, :func:`uncached`).
    sides: list[Any] = field(default_factory=list)

    def held(self, step: int) -> list[Held | None] | None:
        """Per cache layer, what the cache held after ``step``: its keys and values and its
        states by the names their checks carry (``None``: a layer holding nothing); the
        whole ``None``: nothing recorded or readable."""
        kv = self.caches.at(step)
        states = self.states[step] if step < len(self.states) else None
        if kv is None and states is None:
            return None
        return [layer_held(None if kv is None or i >= len(kv) else kv[i], None if states is None or i >= len(states) else states[i])
                for i in range(max(len(kv or []), len(states or [])))]


def decode(
    side: Side, prompt: torch.Tensor, steps: int, stepper: Stepper, tokens: list[torch.Tensor] | None = None,
    *, hold: str | None = None, contents: bool = False,
) -> Decoded:
    """Prefill ``prompt`` and run ``steps`` decode steps on ``side``, each recorded; the
    token fed after step t is ``tokens[t]`` (teacher forcing) or the side's own greedy
    choice. ``hold`` as for :func:`~blockdiff.capture.record_once` (``"kept"``: the
    model's own tensors, which ``Decoded.recordings`` can be asked about later).
    ``contents``: keep what the cache holds after each step (the reference's: the cache
    checks compare against it), copied, since a static cache is written in place."""
    model = stepping(side).model
    cache = stepper.new_cache(model)
    found, ids, length = Decoded(), prompt, 0
    for step in range(steps + 1):
        store = MemoryStore(side.meta)
        call = StepCall(ids, cache, stepper)
        found.recordings.append(run_model_code(side.name, side.record, call, store, hold=hold))
        assert call.logits is not None
        found.stores.append(store)
        found.greedy.append(call.logits[:, -1].argmax(-1).cpu())
        length += ids.shape[1]
        if contents:
            found.caches.add(contents_of(model, stepper, cache), length, ids.shape[1])
            found.states.append(state_contents(cache))
        ids = (tokens[step] if tokens is not None else found.greedy[-1])[:, None]
    return found


def uncached(side: Side, prompt: torch.Tensor, steps: int) -> Decoded:
    """A model against its own cache: its greedy tokens without a cache (each one a whole
    forward of the sequence so far), then one recorded forward of the whole sequence, cut
    into steps — the prompt's positions as step 0, position ``len(prompt) - 1 + t`` as step
    t — so that each of the cached run's steps pairs with the same position run uncached."""
    model = stepping(side).model
    found, ids = Decoded(), prompt
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = logits_of(run_model(model, ids))
            found.greedy.append(logits[:, -1].argmax(-1).cpu())
            ids = torch.cat([ids, found.greedy[-1][:, None]], dim=1)
    whole = MemoryStore(side.meta)
    sequence = ids[:, : prompt.shape[1] + steps]
    run_model_code(side.name, side.record, sequence, whole, hold=None)
    length, start = sequence.shape[1], prompt.shape[1]
    for step in range(steps + 1):
        lo, hi = (0, start) if step == 0 else (start + step - 1, start + step)
        # An experiment on a step runs the whole sequence and is cut back (RowSide).
        cut = RowSide.of(
            side, PositionCut(sequence.shape[0], length, slice(lo, hi)), whole, label=side.meta.get("model", side.name),  # type: ignore[arg-type]
            name=side.name,
        )
        found.sides.append(cut)
        found.stores.append(cut.store)
    return found


def stored_steps(side: Side) -> int | None:
    """How many decode steps a dump side holds after its prompt, ``None`` for a side that
    is not a dump of a decode (schema 5)."""
    steps = getattr(getattr(side, "store", None), "steps", None)
    return steps() if callable(steps) else None


def stored(side: Side, steps: int) -> Decoded:
    """A dump's decode, as :func:`decode` gives a live one: each step's sites (read from the
    file when localized), the greedy tokens it fed, what its cache held."""
    dump = side.store
    found = Decoded(stores=[dump.at_step(step) for step in range(steps + 1)])  # type: ignore[union-attr]
    held = dump.decode() or {}  # type: ignore[union-attr]
    found.greedy = [t.cpu() for t in held.get("greedy", [])][: steps + 1]
    found.caches = CacheLog.from_structure(held.get("cache"))
    found.states = list(held.get("states") or [])  # a dump written before states were: none compared
    if len(found.greedy) < steps + 1:
        raise InputError(f"{side.meta.get('dump')}: the dump's decode holds {len(found.greedy)} steps' tokens, {steps + 1} needed")
    return found


def remember(side: Side, store: MemoryStore) -> None:
    """The reference's own calls of this step, for the later steps' drill-downs (which
    replay its modules' children on the cache its run held): remembered, not run."""
    steps = stepping(side)
    for site in store.sites():
        if site.subpath is not None and steps.keeps_cache(site.module, site):
            steps.remember(site.module, site, None)


# How blockdiff reads a cache layer's keys and values; a stepper's ``kv_layout`` says how
# its model lays them out when it does otherwise.
KV_LAYOUT = ("batch", "kv_heads", "positions", "head_dim")


def canonical(layer: Layer | None, stepper: Any) -> Layer | None:
    """A layer's (keys, values) as :data:`KV_LAYOUT` lays them out, from the stepper's
    ``kv_layout`` (the same when it declares none)."""
    layout = tuple(getattr(stepper, "kv_layout", None) or KV_LAYOUT)
    if layer is None or layout == KV_LAYOUT:
        return layer
    order = [layout.index(name) for name in KV_LAYOUT]
    return layer[0].permute(*order), layer[1].permute(*order)


def contents_of(model: nn.Module, stepper: Stepper, cache: Any) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
    """What a side's own cache holds after a step (its own tensors, read at once), per
    layer: a cache handed to the modules (:func:`cache_contents`), or the buffers the
    stepper names (``cache_buffers``), one layer per module holding both, in the model's
    module order; laid out as :data:`KV_LAYOUT` (:func:`canonical`)."""
    names = cache_buffers(stepper)
    if not names:
        held = cache_contents(cache, copy=False)
        return None if held is None else [canonical(layer, stepper) for layer in held]
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for module in model.modules():
        if len(names) >= 2 and names[0] in module._buffers and names[1] in module._buffers:
            keys, values = module._buffers[names[0]], module._buffers[names[1]]
            ok = isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.numel()
            found.append(canonical((keys.detach(), values.detach()), stepper) if ok else None)
    return found


def layer_of(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) that an experiment's cache holds for cache layer ``layer``, read at
    once (no copies): a cache in buffers holds one module's, whatever its layer."""
    if isinstance(cache, BufferCache):
        found = cache.layer()
        return None if found is None else (found[0].detach().cpu(), found[1].detach().cpu())
    held = cache_contents(cache, copy=False)
    return None if held is None or layer >= len(held) else held[layer]


def layer_held(kv: Layer | None, states: States | None) -> Held | None:
    """What a cache layer holds, by the names its checks carry: keys and values, states."""
    found = {} if kv is None else {KV_KEYS: kv[0], KV_VALUES: kv[1]}
    found.update(states or {})
    return found or None


# A Hugging Face linear-attention cache layer's states (``LinearAttentionLayer``), by the
# name their checks carry: the attribute holding them (per state index; the first compared).
STATES = ((CONV_STATE, "conv_states"), (SSM_STATE, "recurrent_states"))


def state_contents(cache: Any, *, copy: bool = True) -> list[States | None] | None:
    """A cache's states, per layer: a Hugging Face linear-attention layer's conv state
    (``[batch, channels, kernel]``) and recurrent (ssm) state, as :data:`STATES` names
    them (copies on the CPU, or — ``copy`` false, read at once — the cache's own tensors),
    ``None`` for a layer holding none (an attention layer, a state not written yet);
    ``None`` for a cache blockdiff cannot read."""
    layers = getattr(cache, "layers", None)
    return None if layers is None else [_layer_states(layer, copy=copy) for layer in layers]


def _layer_states(layer: Any, *, copy: bool) -> States | None:
    """One cache layer's states, as :func:`state_contents` gives each."""
    held = {}
    for what, name in STATES:
        states = getattr(layer, name, None)
        state = states.get(0) if isinstance(states, dict) else None
        if isinstance(state, torch.Tensor) and state.numel():
            held[what] = state.detach().to("cpu", copy=copy)
    return held or None


def cache_contents(cache: Any, *, copy: bool = True) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
    """What a cache holds, per layer: (keys, values), each ``[batch, kv_heads, positions,
    head_dim]`` (copies on the CPU, or — ``copy`` false, read at once — the cache's own
    tensors), ``None`` for a layer nothing was written to; ``None`` for a cache blockdiff
    cannot read (the cache is then not compared)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for layer in layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or not keys.numel():
            found.append(None)
            continue
        found.append((keys.detach().to("cpu", copy=copy), values.detach().to("cpu", copy=copy)))
    return found


def filled(t: torch.Tensor, length: int) -> torch.Tensor:
    """The positions a cache layer's tensor holds for a sequence of ``length`` tokens: the
    first ``length`` (a dynamic cache holds exactly those; a static cache's later slots are
    unfilled), or — a layer shorter than that, a sliding window — all it holds."""
    return t[:, :, :length] if t.shape[2] >= length else t


def cache_checks(
    experiments: Any, cand: Side, pair_blocks: list[Any], reference: list[Held | None], length: int, step: int,
    own: tuple[list | None, list | None] = (None, None),
) -> dict[int, list[Check]]:
    """The cache as a site: per block whose token mixer keeps a cache layer, what the
    candidate's experiment on it holds after this step (its module on the reference's
    inputs at every step so far) against the reference's own cache — keys and values apart,
    the positions filled so far; a state-space or convolution mixer's conv and ssm states
    whole — judged as the mixer's output is (its floor: the reference's own code at the
    candidate's precision, run the same way). An experiment whose cache has shadowed its
    side's own run (never made: :meth:`~blockdiff.sides.Stepping.shadow`) holds what
    that side's own cache held after this step: ``own`` (the candidate's, the floor run's;
    per layer, as :meth:`Decoded.held` gives them)."""
    found: dict[int, list[Check]] = {}
    floors = experiments.floor_side
    for index, ref_path, cand_path, layer in pair_blocks:
        expected_layer = reference[layer] if layer < len(reference) else None
        mine = None if not expected_layer else _held(cand, ("module", cand_path), layer, own[0])
        if not expected_layer or not mine:
            continue
        floor_layer = (None if floors is None else _held(floors, ("module", ref_path), layer, own[1])) or {}
        checks = []
        for what, expected in expected_layer.items():
            got, f = mine.get(what), floor_layer.get(what)
            if got is None:
                continue
            if what in (KV_KEYS, KV_VALUES):  # the positions filled so far, those both hold
                expected, got = filled(expected, length), filled(got, length)
                f = None if f is None else filled(f, length)
                if expected.shape != got.shape:
                    n = min(expected.shape[2], got.shape[2])
                    expected, got = expected[:, :, -n:], got[:, :, -n:]
            else:  # a state in another layout is said so (ShapeMismatchError), not compared
                got = aligned(f"step {step} block {index} attention", what, expected, got)
            floor = None if f is None or f.shape != expected.shape else metrics(expected, f, dtype=experiments.dtype).rel_l2
            check = experiments.check("attention", what, cand_path, expected, got, floor)
            check.key = f"{what}:step {step} block {index}"
            checks.append(check)
        if checks:
            found[index] = checks
    return found


def _held(side: Side, key: tuple, layer: int, own: list | None) -> Held | None:
    """What experiment ``key``'s cache holds for ``layer``: its stream's, or — a stream
    still shadowing the side's own run — the side's own cache's (``own``, per layer)."""
    steps = stepping(side)
    made = steps.made_stream(key)
    if made is not None:
        layers = None if isinstance(made, BufferCache) else getattr(made, "layers", None)
        states = _layer_states(layers[layer], copy=False) if layers is not None and layer < len(layers) else None
        return layer_held(canonical(layer_of(made, layer), steps.stepper), states)
    return own[layer] if own is not None and layer < len(own) else None


def attention_layers(ref: Side, cand: Side) -> list[tuple[int, str, str, int]]:
    """(block index, reference attention path, candidate attention path, cache layer) for
    every block with one attention module on both sides; the layer is the module's own
    ``layer_idx`` where it has one, else its block's position."""
    found = []
    for position, (rb, cb) in enumerate(zip(ref.layout.blocks, cand.layout.blocks)):
        r_attn, c_attn = rb.subpaths.get("attention", []), cb.subpaths.get("attention", [])
        if len(r_attn) != 1 or len(c_attn) != 1:
            continue
        layer = getattr(cand.attribute(c_attn[0]), "layer_idx", None)
        found.append((rb.index, r_attn[0], c_attn[0], layer if isinstance(layer, int) else position))
    return found


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> int | None:
    """The first step whose greedy tokens differ on some row, or ``None``."""
    return next((step for step, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y.to(x.device))), None)


__all__ = [
    "CACHE_KINDS", "CacheLog", "Decoded", "KV_LAYOUT", "STATES", "canonical", "HFStepper", "StepCall", "Stepper",
    "attention_layers", "cache_checks", "cache_contents", "contents_of", "decode", "first_difference", "layer_held", "layer_of", "remember",
    "state_contents", "stepping", "stored", "stored_steps", "stepper_for",
]
