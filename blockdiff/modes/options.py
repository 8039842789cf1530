"""Options: what a run is asked to do, one dataclass for every execution, and the rules on
combining them, checked in one place (:func:`refuse`).

:class:`Options` is the public keyword set of :func:`blockdiff.diff`, :func:`blockdiff.run`
and the pytest plugin, spelled once. Each execution (a mode, :mod:`blockdiff.modes`) names
the fields it owns and what it refuses in its own file; :func:`refuse` asks them all before
a side is opened. Errors name **parameters** (``decode``, ``save_dumps``), never a front
door's spelling of them: :class:`OptionsError` keeps the names apart from its message, and
the CLI prints them as its flags (``--decode``, ``--save-dumps``).
:class:`~blockdiff.errors.OptionsError` lives with the other errors, so that the CLI reads
it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import OptionsError
from ..hookmap import HookMap
from ..tolerance import Tolerance


@dataclass(frozen=True)
class Options:
    """How a run judges and what it keeps.

    Attributes:
        tolerance: how local errors are judged; calibrated when dtypes or devices differ.
        reference_hooks, candidate_hooks: hook maps; found by class name when ``None``.
        fast_path: skip a block's sub-path experiments when the block as a whole is within
            tolerance.
        capacity_factors: counterfactual capacity factors for the routing statistics of
            dropless MoE blocks.
        labels: how the report names the two sides (e.g. their specs).
        save_dumps: a directory to keep both sides' captures in, as ``reference.h5`` and
            ``candidate.h5``; the captures stream there and localization reads them back
            block by block.
        stream: capture to temporary dumps and localize from them block by block, so
            memory holds one block's activations rather than every block's (implied by
            ``save_dumps``).
        rank: also rank every check, worst first (``report.ranking``, see
            :meth:`Report.rank`), drilling into every module's children.
        baseline_dtype: with ``rank``, judge each check against the reference's own floor
            at this precision ("is the int8 candidate worse than bfloat16 here?") instead
            of its threshold.
        devices, dtypes: where a model spec string is built, per side (reference,
            candidate); ``None``: the CPU, float32 — a candidate's, the reference's.
        decode: after the prompt (the inputs' token ids), this many decode steps of one
            token, each side with its own cache, every step localized
            (:mod:`blockdiff.decoding`); 0: one forward pass without a cache.
        caches: the cache each Hugging Face model decodes with (reference, candidate):
            ``"dynamic"`` or ``"static"``.
        uncached_reference: with ``decode``, the reference runs without a cache (its whole
            sequence at once, paired position by position with the candidate's steps): a
            model against its own cache. :func:`run` sets it when no candidate is given.
        backward: after the forward diff, both sides run forward and backward on the same
            inputs and loss, and the gradients are localized from the head to the
            embedding: ``report.backward`` (:mod:`blockdiff.backward`, docs/backward.md).
        loss: the loss of ``backward``: ``"module:function"`` or ``"path/file.py:function"``
            or a callable ``loss(output, inputs)``; ``None``: next-token cross-entropy on
            the input ids.
        max_memory: bytes the weights of the two sides may take at once: each side built
            without weights and read from its checkpoint a block at a time
            (:mod:`blockdiff.diskweights`; a Hugging Face directory, or a factory's meta
            model naming its checkpoint), the captures streamed (``stream``). ``None``:
            both models whole in memory.
    """

    tolerance: Tolerance | None = None
    reference_hooks: HookMap | None = None
    candidate_hooks: HookMap | None = None
    fast_path: bool = False
    capacity_factors: tuple[float, ...] = (1.0, 1.25)
    labels: tuple[str | None, str | None] = (None, None)
    save_dumps: str | Path | None = None
    stream: bool = False
    rank: bool = False
    baseline_dtype: torch.dtype | None = None
    devices: tuple[torch.device | str | None, torch.device | str | None] = (None, None)
    dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)
    decode: int = 0
    caches: tuple[str, str] = ("dynamic", "dynamic")
    uncached_reference: bool = False
    backward: bool = False
    loss: str | Callable[[Any, Any], Any] | None = None
    max_memory: int | None = None

    @classmethod
    def of(cls, options: "Options | None" = None, **fields_: Any) -> "Options":
        """``options`` (default: the defaults) with ``fields_`` replaced: the keywords of
        :func:`diff`, :func:`replay` and :func:`compare_dumps` are these fields."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(fields_) - known)
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        return replace(options or cls(), **fields_)


# Which side is which in a run's rules: "dump", "onnx" or "model" for each
# (:func:`~blockdiff.sides.factory.kind_of`), read without opening anything.
Kinds = tuple[str, str]


def refuse(options: Options, kinds: Kinds, rules: "list[Callable[[Options, Kinds], OptionsError | None]]") -> None:
    """Raise the first refusal of ``rules`` (each mode's :meth:`~blockdiff.modes.base.Mode.refusal`,
    and the rules of every run) for ``options`` on sides of ``kinds``."""
    for rule in rules:
        found = rule(options, kinds)
        if found is not None:
            raise found


def common_refusal(options: Options, kinds: Kinds) -> OptionsError | None:
    """The rules of every run, whatever the mode."""
    if kinds[1] == "dump" and kinds[0] != "dump":
        return OptionsError("a candidate dump needs a reference dump: blockdiff diff REF.h5 CAND.h5")
    if options.save_dumps is not None and "dump" in kinds:
        return OptionsError("{save_dumps} keeps the captures of a live diff; here a side is already a dump")
    if options.max_memory is not None and options.max_memory <= 0:
        return OptionsError("{max_memory} must be a number of bytes, found {found}", found=options.max_memory)
    if options.max_memory is not None and kinds[0] != "model" and kinds[1] != "model":
        return OptionsError("{max_memory} reads models' weights from disk; here neither side is a model")
    if options.baseline_dtype is not None and not options.rank:
        return OptionsError("{baseline_dtype} sets the baseline of {rank}; give {rank} too")
    return None


__all__ = ["Kinds", "Options", "OptionsError", "common_refusal", "refuse"]
