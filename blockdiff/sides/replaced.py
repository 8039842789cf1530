"""A side run in another runtime, judged by teacher-forced replacement.

Where blockdiff cannot call a candidate's modules one at a time — llama.cpp (``gguf.py``),
MLX (``mlx.py``), a C++ or Rust engine — the same local errors come from runs in which, at
each site, in execution order, the runtime's value is recorded and then overwritten with
the reference's value for that site before the runtime goes on (docs/design.md,
"Teacher-forced replacement"):

* a run replacing **every site**: each sub-path computes from the reference's inputs, so
  its recorded output's error is its local error; a block output recorded after its
  sub-paths' outputs were replaced is the residual glue's error;
* a run replacing only the **block outputs** (and the embedding): each block runs whole on
  the reference's input — the block-level check;
* the free run (the runtime side's own ``record``): drift.

A runtime side says which values it exposes as :class:`Tap` s (a site's key, the
runtime's name for its output and for its hidden input) and runs with
``replaced(inputs, values)``; :class:`TeacherForced` wraps it, holding the two replaced
runs, and answers the localizer's experiments from them — the localizer only ever hands a
candidate's module the reference's recorded inputs, which is what those runs computed on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Protocol

import torch

from ..errors import InputError, PairingError
from ..hookmap import BlockLayout, Layout
from ..site import NotReplayable, Site, SiteKey
from ..store import MemoryStore, SiteStore
from ..vocab import BLOCK_OUTPUTS, EVERY_SITE, replaced_in
from . import Frozen, Hidden, Judged, Judging, Side, SideDefaults

# What a replaced run substitutes: every site, or the block outputs (and the embedding).
EVERY, BLOCKS = EVERY_SITE, BLOCK_OUTPUTS


@dataclass(frozen=True)
class Tap:
    """One site as a runtime names it.

    Attributes:
        key: the reference's anatomy of the site (stage, block, sub-path, ordinal).
        module: how the report names the candidate's module (``attn_out-2``).
        output: the runtime's name for the value that is the site's output.
        input: the runtime's name for the value that is its hidden input (``None``: the
            runtime exposes none; the input is then the reference's own).
    """

    key: SiteKey
    module: str
    output: str
    input: str | None

    def replaced_in(self, which: str) -> bool:
        """Whether a run replacing ``which`` overwrites this site's output (the rule:
        :func:`blockdiff.vocab.replaced_in`)."""
        return replaced_in(which, self.key.stage, self.key.subpath)


# The reference's value for a runtime's output name, or None (the runtime keeps its own).
Values = Callable[[str], "torch.Tensor | None"]


class Unchanged:
    """What a runtime side's ``record`` returns: its values are its own copies, never
    changed after the run."""

    def changed(self) -> bool:
        return False


class Replacing(Protocol):
    """What a side that ``replaces`` has besides the :class:`~blockdiff.sides.Side`
    protocol: its taps, and runs with replacement."""

    taps: list[Tap]

    def replaced(self, inputs: Any, values: Values) -> dict[str, torch.Tensor]:
        """One run of the runtime on ``inputs`` in which each value named by a tap's
        ``output`` is recorded and then, where ``values(name)`` gives one, overwritten
        with it before the runtime goes on. Returns every tap's recorded values (outputs
        as computed, before they were overwritten, and inputs), by the runtime's name,
        shaped as the reference's."""


def sites(
    taps: Iterable[Tap], values: dict[str, torch.Tensor], reference: dict[SiteKey, Site], received: Values | None = None
) -> list[Site]:
    """The sites of one run of a runtime from the values it recorded, in the reference's
    order and with the reference's call numbering. A tap's input is what its module
    received: a value the run overwrote (``received``) is the reference's; a tap with no
    input of its own (the embedding's token ids) takes the reference's. A value the runtime
    never handed over (fused into another operation) leaves the site without it: an output
    missing makes the site's checks not judged (:class:`NotExposed`), an input missing keeps
    it out of the comparisons that read it."""
    found = []
    for tap in taps:
        ref = reference.get(tap.key)
        if ref is None:
            continue
        out = values.get(tap.output)
        args: tuple = (ref.hidden_input(),)
        if tap.input is not None:
            given = values.get(tap.input)
            if given is not None and received is not None:
                substituted = received(tap.input)
                given = given if substituted is None else substituted
            args = () if given is None else (given,)
        key = tap.key
        found.append(Site(key.stage, key.block, key.subpath, tap.module, ref.call, key.ordinal, args=args, output=out, order=ref.order))
    return found


def reference_sites(store: SiteStore) -> dict[SiteKey, Site]:
    """Every site of a recorded reference, by key."""
    found = {s.key: s for s in store.outside_sites()}
    for block in store.block_indices():
        found.update({s.key: s for s in store.block_sites(block)})
    return found


def record_taps(side: Any, inputs: Any, reference: dict[SiteKey, Site], which: str | None) -> MemoryStore:
    """One run of ``side`` (a :class:`Replacing` side) into a store: free (``which`` None)
    or replacing ``which`` with the reference's outputs."""
    by_output = {tap.output: tap for tap in side.taps}

    def values(name: str) -> torch.Tensor | None:
        tap = by_output.get(name)
        if which is None or tap is None or not tap.replaced_in(which) or tap.key not in reference:
            return None
        return reference[tap.key].primary_output()

    store = MemoryStore(side.meta)
    for site in sites(side.taps, side.replaced(inputs, values), reference, values):
        store.add(site)
    return store


class RuntimeSide(SideDefaults):
    """What the sides run in another runtime share: opened beside a reference whose anatomy
    they take (``like``), a tap per site the runtime exposes, token ids within the
    vocabulary, the free run recorded through :meth:`replaced` with nothing replaced.

    A kind sets ``taps``, ``meta`` (with ``runtime``: ``"llama.cpp 0.3.36"``), ``_dtype``
    and ``vocab_size``, and implements :meth:`replaced`; it runs nothing else (``live``
    false: the teacher-forced mode, :mod:`blockdiff.modes.teacher`, judges it).
    """

    live = False
    replaces = True
    drills = False
    taps: list[Tap]
    layout: Layout
    meta: dict[str, Any]
    vocab_size: int
    _dtype = torch.float32

    def __init__(self, name: str, reference: Side) -> None:
        self.name = name
        self.reference = reference
        self.store: SiteStore | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def replaced(self, inputs: Any, values: Values) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def inputs(self, given: Any) -> tuple[Any, str | None]:
        """Token ids (a ``[batch, tokens]`` integer tensor) within the runtime's vocabulary."""
        if given is None or not isinstance(given, torch.Tensor) or given.dtype not in (torch.int64, torch.int32):
            if given is None or hasattr(given, "draw"):
                return given, None  # random tokens: the reference draws them
            raise InputError(f"the {self.name} ({self.meta['runtime']}) takes token ids: a [batch, tokens] integer tensor")
        if given.numel() and int(given.max()) >= self.vocab_size:
            raise InputError(
                f"token id {int(given.max())} is outside the {self.name}'s vocabulary of {self.vocab_size} ({self.meta['model']})"
            )
        return given, None

    def record(self, inputs: Any, store: SiteStore, *, hold: Any = None, progress: Callable[[int, int], None] | None = None) -> Unchanged:
        """The free run: every tap's value as the runtime computed it, nothing replaced."""
        assert self.reference.store is not None, "the reference is recorded first"
        self.store = store
        for site in sites(self.taps, self.replaced(inputs, lambda name: None), reference_sites(self.reference.store)):
            store.add(site)
        return Unchanged()

    def replaced_runs(self, inputs: Any, reference: SiteStore) -> tuple[SiteStore, SiteStore]:
        """Two more runs: every site's value replaced by ``reference``'s, and the block
        outputs' (and the embedding's) only."""
        ref = reference_sites(reference)
        return record_taps(self, inputs, ref, EVERY), record_taps(self, inputs, ref, BLOCKS)

    def _cannot(self) -> PairingError:
        return PairingError(f"the {self.name} runs in {self.meta['runtime']}: its modules cannot be run one at a time")

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        raise self._cannot()

    def run_block(self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None) -> Any:
        raise self._cannot()

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        raise self._cannot()


def mirrored(reference: Layout, exposed: Callable[[str, SiteKey], Tap | None], name: str) -> tuple[Layout, list[Tap]]:
    """A runtime's layout and taps from the reference's layout: each reference site the
    runtime exposes (``exposed(path, key)``: the tap for the reference's module ``path`` at
    ``key``, or ``None``). A block's own output must be exposed."""
    taps: list[Tap] = []
    outside = []
    for stage, path in reference.outside:
        tap = exposed(path, SiteKey(stage, None, None, 0))
        if tap is not None:
            outside.append((stage, tap.module))
            taps.append(tap)
    blocks = []
    for block in reference.blocks:
        own = exposed(block.path, SiteKey.of_block(block.index))
        if own is None:
            raise InputError(f"{name} exposes no output for block {block.index} ({block.path}): it cannot be localized")
        taps.append(own)
        subpaths: dict[str, list[str]] = {}
        for subpath, paths in block.subpaths.items():
            for ordinal, path in enumerate(paths):
                tap = exposed(path, SiteKey("block", block.index, subpath, ordinal))
                if tap is not None:
                    subpaths.setdefault(subpath, []).append(tap.module)
                    taps.append(tap)
        blocks.append(BlockLayout(block.index, own.module, block.stack, subpaths))
    hook_map = replace(reference.hook_map, name=name, source=name)
    return Layout(hook_map, outside, blocks), taps


def config_value(config: Any, name: str) -> float | None:
    """A number of a Hugging Face config; ``rope_theta`` also where transformers 5 keeps it
    (``rope_parameters``)."""
    found = getattr(config, name, None)
    if found is None and name == "rope_theta":
        found = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return float(found) if isinstance(found, (int, float)) and not isinstance(found, bool) else None


def settings_notes(own: dict[str, tuple[str, float]], config: Any, whose: str) -> list[str]:
    """A note for each number a runtime computes with (``own``: the reference config's name
    → (where the runtime keeps it, its value)) that is not the reference config's: a
    conversion can get one wrong without changing a weight."""
    notes = []
    for name, (where, value) in own.items():
        theirs = config_value(config, name)
        if theirs is None or abs(value - theirs) <= 1e-6 * abs(theirs):
            continue
        notes.append(
            f"{whose} {where} = {value:g}, the reference's config {name} = {theirs:g}: the candidate computes with its own"
            + (" (the rotary embedding inside every attention)" if name == "rope_theta" else "")
        )
    return notes


class NotExposed(NotReplayable):
    """A site the runtime computes but does not expose (fused into another operation), or
    a run it did not make (:class:`NotRun`): its check cannot be run, and is not judged."""

    def __init__(self, what: str, runtime: str, *, run: "NotRun | None" = None) -> None:
        super(NotReplayable, self).__init__(f"{runtime} exposes no value for {what}" if run is None else run.why)
        self.type_name = what
        self.advice = (
            "the runtime fuses it into another operation; the checks around it still judge it" if run is None else run.advice
        )


class NotRun(MemoryStore):
    """A replaced run the candidate did not make (a dump written without it): every check it
    would answer is not judged, its note saying ``why`` and what to do (``advice``)."""

    def __init__(self, why: str, advice: str) -> None:
        super().__init__()
        self.why, self.advice = why, advice


class TeacherForced(SideDefaults):
    """A runtime side with its replaced runs: a candidate the localizer can run experiments
    on, each answered by what the runtime computed from the reference's inputs.

    ``store`` is the runtime's free run (drift); :meth:`call_module` answers with the
    every-site run's output of the module's site, :meth:`run_block` with a block's output
    from the block-outputs run (the whole block on the reference's input) or, its
    sub-paths frozen at the reference's outputs, from the every-site run (the residual),
    with what reached each sub-path there. There is no drill-down (``drills`` false): a
    runtime's operations are not modules blockdiff can pair.
    """

    live = True
    drills = False

    def __init__(self, runtime: Side, every: SiteStore, blocks: SiteStore, runtime_name: str) -> None:
        self.runtime = runtime
        self.name, self.layout, self.meta = runtime.name, runtime.layout, runtime.meta
        self.store = runtime.store
        self._runs = {EVERY: every, BLOCKS: blocks}
        self._runtime_name = runtime_name

    @classmethod
    def judged(cls, runtime: Side, inputs: Any, reference: SiteStore, runtime_name: str) -> "TeacherForced":
        """``runtime`` (its free run recorded) with its replaced runs on ``inputs``."""
        every, blocks = runtime.replaced_runs(inputs, reference)
        return cls(runtime, every, blocks, runtime_name)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.dtype

    @property
    def versions(self) -> dict[str, str]:
        return self.runtime.versions

    def _site(self, which: str, key: SiteKey, what: str) -> Site:
        store = self._runs[which]
        if isinstance(store, NotRun):
            raise NotExposed(what, self._runtime_name, run=store)
        sites = store.outside_sites() if key.block is None else store.block_sites(key.block)
        found = next((s for s in sites if s.key == key), None)
        if found is None:
            raise NotExposed(what, self._runtime_name)
        return found

    def record(self, inputs: Any, store: SiteStore, *, hold: Any = None, progress: Callable[[int, int], None] | None = None) -> Any:
        return self.runtime.record(inputs, store, hold=hold, progress=progress)

    def call_module(self, path: str, call: Site, hidden: Hidden | None = None) -> Any:
        found = self._site(EVERY, call.key, call.label)
        if found.primary_output() is None:
            raise NotExposed(call.label, self._runtime_name)
        if not found.args:  # its input was never handed over, so never replaced: not the reference's
            raise NotExposed(f"the input of {call.label}", self._runtime_name)
        return found.output

    def run_block(
        self, path: str, call: Site, hidden: Hidden | None, modules: dict[str, str], frozen: Frozen | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        if not frozen:
            out = self._site(BLOCKS, call.key, call.label).primary_output()
            if out is None:
                raise NotExposed(call.label, self._runtime_name)
            return out, {}
        assert call.block is not None
        out = self._site(EVERY, call.key, call.label).primary_output()
        if out is None:
            raise NotExposed(call.label, self._runtime_name)
        reached = {}
        for site in self._runs[EVERY].block_sites(call.block):
            given = site.hidden_input()
            if site.subpath is not None and given is not None:
                reached[(site.subpath, site.ordinal)] = given
        return out, reached

    def child_calls(self, path: str, call: Site, hidden: Hidden | None = None) -> list[Site]:
        return []

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        return self.runtime.localized(judging, judge)


__all__ = [
    "BLOCKS", "EVERY", "NotExposed", "NotRun", "Replacing", "RuntimeSide", "TeacherForced", "Tap", "Unchanged",
    "Values", "config_value", "mirrored", "record_taps", "reference_sites", "settings_notes", "sites",
]
