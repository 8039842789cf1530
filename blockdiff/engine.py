"""Engine: the whole diff — open both sides, choose the mode, record, localize, build the report.

:func:`run` is the one entry point the CLI, the pytest plugin and golden files call. Each
side is opened by :func:`~blockdiff.sides.factory.open_side` (a model, a factory, a model
spec, an ``.h5`` dump, an ``.onnx`` graph), and what the two sides can do picks the mode:

=============  =============  ==================================================================
reference      candidate      mode
=============  =============  ==================================================================
live           live           live diff: full localization, calibrated floors (any live kind:
                              eager, compiled, sharded, pipeline, ONNX Runtime)
dump           live           replay: the candidate runs on the dump's inputs
dump           dump           offline comparison: drift at every site
=============  =============  ==================================================================

:func:`diff`, :func:`replay` and :func:`compare_dumps` are those modes for callers that
know which one they want (public API); :func:`capture` writes a dump.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from . import backward, conversion, decoding, distributed
from ._version import __version__
from .capture import Recording, TensorChanged, with_copies
from .dump import DumpReader, DumpWriter
from .dump.memory import release_freed_memory
from .dtypes import dtype_name, precision_label
from .errors import DumpError, InputError, run_model_code
from .experiments import StoredFloors
from .hookmap import HookMap
from .inputs import Inputs, InputsFile, RandomTokens, check_inputs, digest
from .localize import Localizer, NonfiniteScan
from .pairing import check_block_counts
from .report import Report
from .sides import Side
from .sides.factory import kind_of, open_side
from .site import describe_key
from .store import MemoryStore
from .tolerance import Tolerance, working_dtype
from .vocab import DRIFT

# -- choosing the mode ----------------------------------------------------------------------


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

    @classmethod
    def of(cls, options: "Options | None" = None, **fields_: Any) -> "Options":
        """``options`` (default: the defaults) with ``fields_`` replaced: the keywords of
        :func:`diff`, :func:`replay` and :func:`compare_dumps` are these fields."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(fields_) - known)
        if unknown:
            raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
        return replace(options or cls(), **fields_)


# A side as run() takes it: a model, a callable returning one, a model spec, a dump's path,
# an ONNX graph (see blockdiff.sides.factory).
SideSpec = Union[nn.Module, Callable[[], Any], str, Path]


def run(
    reference: SideSpec,
    candidate: SideSpec | None = None,
    inputs: Inputs | RandomTokens | InputsFile | str | Path | None = None,
    *,
    options: Options | None = None,
) -> Report:
    """Diff, replay or compare, as the two sides ask (see the module's table).

    Args:
        reference: a model, a factory (a callable returning a model), a model spec
            string (built as ``options.devices``/``dtypes`` say) or a dump's path.
        candidate: the same kinds, or an ONNX graph (``.onnx``, an ``OnnxModel``);
            ``None`` builds the reference's factory or spec again (so ``--cand-dtype``
            alone compares precisions: each side is built apart).
        inputs: model inputs (token ids, a tuple of positional arguments, a dict of
            keyword arguments), a token file (``.json`` or ``.safetensors``), named inputs
            (:class:`InputsFile`), or :class:`RandomTokens` (the default) drawn within the
            reference's vocabulary. A dump reference brings its own inputs: concrete
            inputs must be the same.
        options: tolerance, hook maps, fast path, labels, dumps to keep (:class:`Options`).

    Raises:
        InputError: a pairing of sides that has no mode (a candidate dump against a live
            reference, a reference dump alone), or inputs that do not fit.

    Inside an initialised process group of several ranks (``torchrun``), every rank calls
    it with the same arguments: the candidate may be split across the ranks
    (:mod:`blockdiff.distributed`), and every rank gets the same report.

    >>> run("ref.h5", bugs.gelu_for_silu).first_divergence.subpath   # doctest: +SKIP
    'ffn'
    """
    options = options or Options()
    if candidate is None and options.decode and not isinstance(reference, nn.Module):
        options = replace(options, uncached_reference=True)  # the model against its own cache
    candidate = _candidate_spec(reference, candidate)
    ref_kind, cand_kind = kind_of(reference), kind_of(candidate)
    if cand_kind == "dump" and ref_kind != "dump":
        raise InputError("a candidate dump needs a reference dump: blockdiff diff REF.h5 CAND.h5")
    if options.save_dumps is not None and "dump" in (ref_kind, cand_kind):
        raise InputError("--save-dumps keeps the captures of a live diff; here a side is already a dump")
    if options.decode and cand_kind == "dump":
        raise InputError(
            "--decode replays a live candidate against a reference dump of a decode (blockdiff capture MODEL "
            "--decode N): two dumps of decodes are not compared"
        )
    if options.backward and ("dump" in (ref_kind, cand_kind) or options.decode):  # --backward (blockdiff.backward)
        raise InputError("--backward runs both models live, one forward pass: not with a dump, nor with --decode")
    with distributed.lockstep(), ExitStack() as opened:
        ref = open_side(
            "reference", reference, opened=opened, hooks=options.reference_hooks, label=options.labels[0],
            device=options.devices[0], dtype=options.dtypes[0],
        )
        cand = open_side(
            "candidate", candidate, opened=opened, hooks=options.candidate_hooks, label=options.labels[1],
            device=options.devices[1] or options.devices[0], dtype=options.dtypes[1] or options.dtypes[0], like=ref,
        )
        check_block_counts(len(ref.layout.blocks), len(cand.layout.blocks))
        if not ref.live:
            stored_steps = decoding.stored_steps(ref)
            if stored_steps is not None or options.decode:
                return _replayed_decode(ref, cand, inputs, options, stored_steps)
            if not cand.live:
                return _offline(ref, cand, options)
            return _replayed(ref, cand, inputs, options)
        concrete, made = ref.inputs(inputs)
        report = _live(ref, cand, concrete, options)
        if made is not None:
            report.notes.insert(0, f"inputs: {made}")
        return report


def _candidate_spec(reference: SideSpec, candidate: SideSpec | None) -> SideSpec:
    """The candidate's spec: the one given, else the reference's factory or spec again
    (built apart, in the candidate's device and dtype). The one place this rule lives."""
    if candidate is not None:
        return candidate
    if kind_of(reference) == "dump":
        raise InputError("a reference dump needs a CANDIDATE (a model to replay, or a second dump)")
    if isinstance(reference, nn.Module):
        raise InputError("a reference model alone cannot be diffed: give a candidate, or a factory to build both sides")
    return reference


# -- the modes --------------------------------------------------------------------------------


def diff(reference: nn.Module, candidate: nn.Module, inputs: Inputs, **options: Any) -> Report:
    """Find where ``candidate`` first diverges from ``reference`` on ``inputs``.

    Both models run as they are (device, dtype); neither is changed: hooks are removed
    and training flags restored on every path.

    Args:
        reference: the trusted model.
        candidate: the model under test (another object, possibly another codebase; a
            factory, a model spec or an ONNX graph as :func:`run` takes them).
        inputs: token ids, a tuple of positional arguments or a dict of keyword arguments;
            moved to each model's device.
        **options: the fields of :class:`Options` (``tolerance``, ``reference_hooks``,
            ``candidate_hooks``, ``fast_path``, ``capacity_factors``, ``labels``,
            ``save_dumps``, ``stream``, ``rank``, ``baseline_dtype``).

    Returns:
        The :class:`~blockdiff.report.Report`; ``report.first_divergence`` is ``None``
        when nothing diverged.

    >>> report = diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids)   # doctest: +SKIP
    >>> (report.first_divergence.block, report.first_divergence.subpath)  # doctest: +SKIP
    (2, 'ffn')
    """
    if reference is candidate:
        raise InputError("reference and candidate are the same object; pass two separate models")
    return run(reference, candidate, check_inputs(inputs), options=Options.of(**options))


def replay(reference: str | Path, candidate: nn.Module, *, inputs: Inputs | None = None, **options: Any) -> Report:
    """Run a live ``candidate`` on a reference dump's inputs and localize against it.

    The reference is read block by block from the dump. Calibrated floors come from the
    dump when it stores them for the candidate's precision (``capture --floors``); else the
    fixed thresholds judge, and the report says why. ``inputs``, when given, must be the
    ones the dump was captured on. ``**options``: the fields of :class:`Options`.
    """
    if kind_of(reference) != "dump":
        raise InputError(f"{reference}: not a dump (.h5); replay runs a candidate against a reference dump")
    return run(reference, candidate, inputs, options=Options.of(**options))


def compare_dumps(reference: str | Path, candidate: str | Path, **options: Any) -> Report:
    """Compare two dumps offline: drift at every site, judged against the reference's
    stored drift floors, else fixed thresholds. ``**options``: ``tolerance``, ``labels``.

    Local errors need a live candidate module (replay); two dumps hold only what each
    side computed on its own inputs, so the report judges drift and says so.
    """
    for spec in (reference, candidate):
        if kind_of(spec) != "dump":
            raise InputError(f"{spec}: not a dump (.h5); compare_dumps compares two dumps")
    return run(reference, candidate, options=Options.of(**options))


def _live(ref: Side, cand: Side, inputs: Inputs, options: Options) -> Report:
    """Both sides live: record each (in memory, or streamed into dumps) and localize."""
    _takes(cand, check_inputs(inputs))
    refused = next((side.not_streamed for side in (ref, cand) if side.not_streamed), None)
    if refused and (options.save_dumps is not None or options.stream):
        raise InputError(
            f"--stream and --save-dumps do not take {refused}; "
            "diff in memory, or capture the reference alone (blockdiff capture) and replay against it"
        )
    if options.decode:
        return _decoded(ref, cand, inputs, options)
    lockstep = ref.lockstep or cand.lockstep
    localize = lambda free_run: _localize(ref, cand, inputs, options, free_run=free_run)  # noqa: E731
    record = None
    # -- --backward: the gradients localized after the forward (blockdiff.backward) --
    if options.backward:
        if options.save_dumps is not None or options.stream or options.rank:
            raise InputError("--backward runs in memory: not with --stream, --save-dumps or --rank")
        backward.refuse_backward(ref, cand)
        forward, recorder = localize, backward.Recorder(ref, options.loss)
        record = recorder.record  # the forward recorded in the run its backward differentiates
        localize = lambda free_run: backward.judge(  # noqa: E731
            ref, cand, inputs, forward(free_run), tolerance=options.tolerance, loss=options.loss, recorded=recorder
        )
    # -- end of --backward --
    with ExitStack() as stack:
        stack.enter_context(ref.running())
        stack.enter_context(cand.running())
        if options.save_dumps is None and not options.stream:
            return _in_memory([ref, cand], inputs, localize, lockstep=lockstep, record=record)
        if options.save_dumps is not None and distributed.rank() == 0:
            folder = Path(options.save_dumps)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DumpError(f"cannot create {folder}: {exc.strerror or exc}", path=str(folder)) from None
        for side in (ref, cand):
            path = folder / f"{side.name}.h5"
            _stream(side, inputs, path, release=True)
            # The dumps were just written by this process: no need to probe them.
            side.store = stack.enter_context(DumpReader(path, probe=False))

        def streamed_free_run(side: Side) -> DumpReader:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
            _stream(side, inputs, scratch / "free-run.h5", release=True)
            return stack.enter_context(DumpReader(scratch / "free-run.h5", probe=False))

        return localize(streamed_free_run)


def _takes(cand: Side, inputs: Inputs) -> None:
    """The candidate runs on ``inputs`` (the reference's, or a dump's): every rank of a
    launched run was given the same, and they fit the candidate (its vocabulary)."""
    if cand.lockstep:
        digests = distributed.every_rank(digest(inputs))
        if len(set(digests)) > 1:
            raise InputError(f"the ranks were given different inputs (digests {', '.join(digests)}): every rank must run the same")
    cand.inputs(inputs)


def _replayed_decode(ref: Side, cand: Side, inputs: Any, options: Options, stored_steps: int | None) -> Report:
    """A reference dump of a decode and a live candidate: the candidate decodes the dump's
    prompt fed the dump's greedy tokens, every step localized against the dump's step."""
    where = ref.meta["dump"]
    if stored_steps is None:
        raise InputError(
            f"{where} holds one forward pass, not decode steps: capture the reference's decode "
            "(blockdiff capture MODEL --out REF.h5 --decode N) to replay --decode against it"
        )
    if not cand.live:
        raise InputError(f"{where} holds decode steps: replay a live candidate against it (two dumps of decodes are not compared)")
    steps = options.decode or stored_steps
    if steps > stored_steps:
        raise InputError(f"{where} holds {stored_steps} decode steps; --decode {steps} asks for more")
    given = None if inputs is None or isinstance(inputs, RandomTokens) else cand.inputs(inputs)[0]
    prompt = ref.inputs(given)[0]
    if prompt is None:
        raise DumpError(f"{where}: the dump holds no model inputs to replay", path=str(where))
    _takes(cand, prompt)
    captured = (ref.store.meta.get("decode") or {}).get("cache", options.caches[0])  # type: ignore[union-attr]
    report = _decoded(ref, cand, prompt, replace(options, decode=steps, caches=(captured, options.caches[1])))
    report.notes.insert(1, f"replay: the reference is the decode dump {where} ({stored_steps} steps, {steps} replayed)")
    return report


def _decoded(ref: Side, cand: Side, prompt: Inputs, options: Options) -> Report:
    """Both sides live, decoding: the prompt prefilled (step 0), then ``options.decode``
    steps of one token fed to both (the reference's greedy choice), each side with its own
    cache; every step localized, its modules' experiments with caches of their own carried
    from step to step (:mod:`blockdiff.decoding`)."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise InputError("decode steps need token ids [batch, tokens] as the prompt")
    if options.save_dumps is not None or options.stream or options.rank or ref.lockstep or cand.lockstep:
        raise InputError("--decode runs in memory, on one process: not with --stream, --save-dumps, --rank or torchrun")
    if options.decode < 0:
        raise InputError(f"--decode must be a number of steps, found {options.decode}")
    length = prompt.shape[1] + options.decode + 1
    for side in (ref, cand) if ref.live else (cand,):
        if not side.decodes:
            raise InputError(f"the {side.name} cannot decode: decode steps need live PyTorch models")
    steppers = [
        decoding.stepper_for(side.module(""), kind=kind, length=length) if side.live else None  # type: ignore[attr-defined]
        for side, kind in zip((ref, cand), options.caches)
    ]
    steps = options.decode
    if options.uncached_reference and (ref.dtype != cand.dtype or ref.device != cand.device):
        raise InputError("a model against its own cache runs in one precision: give a CANDIDATE to compare precisions")
    tolerance = (options.tolerance or Tolerance()).resolved(same_dtype=ref.dtype == cand.dtype, same_device=ref.device == cand.device)

    def attempt(copy: bool) -> tuple[list[Report], Any, Any]:
        """The decode and its localization; the records hold the models' own tensors unless
        ``copy`` (:func:`~blockdiff.capture.with_copies`: should a model change one of them
        in place meanwhile, the whole attempt runs again on copies)."""
        hold = None if copy else "kept"
        for side, stepper in zip((ref, cand), steppers):
            if side.live:
                side.start_decode(stepper)  # type: ignore[attr-defined]  # fresh experiment caches
        if not ref.live:
            ref_run = decoding.stored(ref, steps)
        elif options.uncached_reference:
            ref_run = run_model_code("reference", decoding.uncached, ref, prompt, steps)
        else:
            ref_run = run_model_code("reference", decoding.decode, ref, prompt, steps, steppers[0], hold=hold, contents=True)
        # Each side's own cache contents too: an experiment cache that shadows its side's own
        # run holds those (decoding.kv_checks).
        cand_run = run_model_code("candidate", decoding.decode, cand, prompt, steps, steppers[1], ref_run.greedy, hold=hold, contents=True)
        live_floors = tolerance.calibrated and ref.live
        floor = ref.in_precision(working_dtype(ref.dtype, cand.dtype), cand.device) if live_floors else None
        floor_run = None
        if floor is not None and not floor.runs_as(cand):
            floor_run = run_model_code(
                "reference", decoding.decode, floor, prompt, steps, steppers[0], ref_run.greedy, hold=hold, contents=True
            )
        layers = decoding.attention_layers(ref, cand)
        reports = []
        for step in range(steps + 1):
            for side in (ref, cand, floor):
                if side is not None and side.live:
                    side.begin_step()  # type: ignore[attr-defined]
            # The reference as this step: itself, or the step of its uncached run (decoding.uncached).
            ref_step = ref_run.sides[step] if ref_run.sides else ref
            ref_step.store, cand.store = ref_run.stores[step], cand_run.stores[step]
            free = floor_run.stores[step] if floor_run is not None else cand.store
            length = prompt.shape[1] + step

            def complete(localizer: Localizer, blocks: list, step: int = step, length: int = length) -> None:
                own = cand_run.caches.at(step), (floor_run or cand_run).caches.at(step)
                found = decoding.kv_checks(localizer.experiments, cand, layers, ref_run.caches.at(step) or [], length, step, own)
                decoding.add_kv_checks(blocks, found)

            reports.append(
                _localize(ref_step, cand, prompt, replace(options, tolerance=tolerance), free_run=lambda side, free=free: free,
                          stateful=True, complete=complete)
            )
            # The reference's own calls, for the next steps' drill-downs (they replay its
            # modules' children on the cache its run held then).
            if ref_step is ref and ref.live:
                decoding.remember(ref, ref.store)
        runs = [ref_run, cand_run, *([floor_run] if floor_run is not None else [])]
        if any(recording.changed() for run in runs for recording in run.recordings):
            raise TensorChanged("a model changed a recorded tensor in place while its decode was localized")
        return reports, ref_run, cand_run

    with ref.running(), cand.running():
        reports, ref_run, cand_run = with_copies(attempt)
    report = _steps_report(reports, prompt, options, decoding.first_difference(ref_run.greedy, cand_run.greedy))
    if options.uncached_reference:
        report.notes.insert(1, (
            "a model against its own cache: the reference is the same model without a cache, its whole sequence "
            "in one forward, each position paired with the cached step that computed it (the cache's contents are "
            "not compared: the uncached run keeps none)"
        ))
    return report


def _steps_report(reports: list[Report], prompt: torch.Tensor, options: Options, tokens_differ: int | None) -> Report:
    """One report of a decode: the stages and blocks of the first step that diverges (the
    last step when none does), every step summed up in ``steps``."""
    shown = next((step for step, report in enumerate(reports) if report.diverged), len(reports) - 1)
    report = reports[shown]
    report.decode = {
        "steps": options.decode,
        "prompt_length": int(prompt.shape[1]),
        "caches": {"reference": options.caches[0], "candidate": options.caches[1]},
        "step": shown,
        "tokens_differ_at": tokens_differ,
    }
    report.steps = []
    for step, found in enumerate(reports):
        first = found.first_divergence
        report.steps.append({
            "step": step,
            "position": int(prompt.shape[1]) - 1 + step if step else None,
            "first_divergence": None if first is None else {**first.to_dict(), "step": step},
            "diverged": {str(b.index): sorted(n for n, r in b.subpaths.items() if r.diverged) for b in found.blocks},
        })
    where = "no step diverges" if not report.diverged else f"step {shown} is the first that diverges"
    report.decode["uncached_reference"] = options.uncached_reference
    report.notes.insert(0, (
        f"decode: the prompt ({int(prompt.shape[1])} tokens) prefilled as step 0, then {options.decode} steps of one "
        f"token fed to both sides (the reference's greedy choice), each with its own cache ({' and '.join(dict.fromkeys(options.caches))}); {where}"
        + ("" if tokens_differ is None else f"; the two sides' greedy tokens first differ after step {tokens_differ}")
    ))
    return report


def _replayed(ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
    """A reference dump and a live candidate: the candidate runs on the dump's inputs."""
    given = None if inputs is None or isinstance(inputs, RandomTokens) else cand.inputs(inputs)[0]
    stored = ref.inputs(given)[0]
    if stored is None:
        raise DumpError(f"{ref.meta['dump']}: the dump holds no model inputs to replay", path=str(ref.meta["dump"]))
    _takes(cand, stored)
    with cand.running():
        report = _in_memory(
            [cand], stored, lambda free_run: _localize(ref, cand, stored, options, free_run=free_run), lockstep=cand.lockstep
        )
    report.notes.insert(0, f"replay: the reference is the dump {ref.meta['dump']}")
    changed = _version_changes(ref.versions, cand.versions)
    if changed:
        report.notes.insert(1, f"the dump was captured under other package versions ({changed}): code may have moved between modules")
    return report


def _version_changes(stored: Any, current: dict[str, str]) -> str:
    """``transformers 4.57.0 → 5.23.0, ...`` for the packages both record with different versions."""
    if not isinstance(stored, dict):
        return ""
    return ", ".join(f"{name} {stored[name]} → {version}" for name, version in current.items() if name in stored and stored[name] != version)


def _offline(ref: Side, cand: Side, options: Options) -> Report:
    """Two dumps: drift at every site, against the reference's stored drift floors for the
    candidate's precision, else fixed thresholds."""
    ref_inputs, cand_inputs = ref.inputs(None)[0], cand.inputs(None)[0]
    if ref_inputs is not None and cand_inputs is not None and digest(ref_inputs) != digest(cand_inputs):
        raise InputError(
            f"the dumps were captured on different inputs ({ref.meta['dump']}: {digest(ref_inputs)}, "
            f"{cand.meta['dump']}: {digest(cand_inputs)}); capture both on the same token ids"
        )
    floors = ref.store.floors()
    stored = StoredFloors.of(floors, ref, cand) is not None
    tolerance = options.tolerance or Tolerance()
    if tolerance.policy is None:  # the user's choice stands; blockdiff's follows the floors
        tolerance = replace(tolerance, policy="calibrated" if stored else "fixed")
    report = _localize(ref, cand, ref_inputs, replace(options, tolerance=tolerance, fast_path=False, capacity_factors=()))
    basis = "its stored drift floors" if stored else "fixed thresholds"
    report.notes.append(
        "offline comparison of two dumps: only drift could be computed, judged against "
        f"{basis}; local errors (which sub-path is wrong rather than where the error shows) "
        f"need a live candidate: blockdiff diff {ref.meta['dump']} CANDIDATE_MODEL"
    )
    return report


def capture(
    model: SideSpec,
    inputs: Inputs | RandomTokens | InputsFile | str | Path | None,
    out: str | Path,
    *,
    hooks: HookMap | None = None,
    compress: str | None = None,
    label: str | None = None,
    floors: Sequence[tuple[torch.dtype, torch.device | str]] = (),
    durable: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    decode: int = 0,
    cache: str = "dynamic",
) -> str | None:
    """Run ``model`` once on ``inputs`` and stream every site into the dump ``out``.

    Sites are written as the forward produces them, so memory does not grow with the
    number of blocks. The dump is complete, or absent (written under a temporary name and
    renamed at the end).

    Args:
        model: a model, a factory or a model spec (built on ``device`` in ``dtype``).
        inputs: as :func:`run` takes them.
        floors: precisions (dtype, device) to measure noise floors at and store in the dump
            (schema 3), so that a replay of a candidate in one of them is calibrated as a
            live diff is: every check's floor, the reference's own code at that precision
            on the reference's inputs. Measuring them holds the run in memory (like a live
            diff) and runs the model's modules again at each precision.
        durable: flush the dump to disk before it is renamed into place (see
            :class:`~blockdiff.dump.DumpWriter`).
        decode: after the prompt (the inputs' token ids), this many decode steps with a KV
            cache (``cache``: ``"dynamic"`` or ``"static"`` for a Hugging Face model, else the
            model's own step adapter), every step's sites, tokens and cache contents
            written (schema 5), for ``blockdiff diff OUT CANDIDATE`` to replay a candidate's
            decode against (docs/decode.md). Held in memory until written.

    Returns:
        A note on what blockdiff made up of the inputs (random token ids), or ``None``.
    """
    with ExitStack() as opened:
        side = open_side("captured", model, opened=opened, hooks=hooks, label=label, device=device, dtype=dtype)
        if not side.live:
            raise InputError(f"{model}: a dump cannot be captured again; capture a model")
        concrete, made = side.inputs(inputs)
        check_inputs(concrete)
        if decode:
            _capture_decode(side, concrete, out, steps=decode, cache=cache, floors=floors, compress=compress, durable=durable)
            return made
        with side.running(), _rank_zero_writes(out) as out:
            if not floors:
                _stream(side, concrete, out, compress=compress, durable=durable)
                return made
            # Copies: the floor pass runs the model's modules again, which must not change the record.
            store = _recorded(side, concrete)
            measured = {
                precision_label(dtype_, device_): {
                    "dtype": dtype_name(dtype_),
                    "device": precision_label(dtype_, device_).partition("@")[2],
                    "values": run_model_code(side.name, measure_floors, side, store, concrete, dtype_, torch.device(device_)),
                }
                for dtype_, device_ in floors
            }
            with DumpWriter(out, meta=_dump_meta(side, concrete), compress=compress, durable=durable) as writer:
                writer.add_inputs(concrete)
                for site in store.sites():
                    writer.add(site)
                writer.add_floors(measured)
        return made


def _capture_decode(
    side: Side, prompt: Inputs, out: str | Path, *, steps: int, cache: str, floors: Sequence, compress: str | None, durable: bool
) -> None:
    """A decode of ``steps`` steps on ``side`` (its own greedy tokens), written as a dump of
    schema 5: every step's sites with their step, the tokens fed, the cache's contents."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise InputError("decode steps need token ids [batch, tokens] as the prompt")
    if floors:
        raise InputError("--floors with --decode: noise floors are not stored for decode steps; a replay judges with fixed thresholds")
    if side.lockstep:
        raise InputError("--decode captures on one process: not under torchrun")
    stepper = decoding.stepper_for(side.module(""), kind=cache, length=prompt.shape[1] + steps + 1)  # type: ignore[attr-defined]
    with side.running():
        side.start_decode(stepper)  # type: ignore[attr-defined]
        found = run_model_code(side.name, decoding.decode, side, prompt, steps, stepper, hold=None, contents=True)
    meta = {**_dump_meta(side, prompt), "decode": {"steps": steps, "prompt_length": int(prompt.shape[1]), "cache": cache}}
    with DumpWriter(out, meta=meta, compress=compress, durable=durable, decode=True) as writer:
        writer.add_inputs(prompt)
        for step, store in enumerate(found.stores):
            for site in store.sites():
                writer.add(site, step=step)
        writer.add_decode({"greedy": found.greedy, "cache": found.caches.to_structure()})


@contextmanager
def _rank_zero_writes(out: str | Path) -> Iterator[str | Path]:
    """Where a capture writes: ``out``, but on the ranks other than 0 of a sharded run,
    which record the same whole tensors in lockstep, a scratch file thrown away after."""
    if distributed.rank() == 0:
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="blockdiff-rank-") as scratch:
        yield Path(scratch) / Path(out).name


def _recorded(side: Side, inputs: Inputs) -> MemoryStore:
    store = MemoryStore(side.meta)
    run_model_code(side.name, side.record, inputs, store, hold=None, progress=_progress(side))
    return store


def measure_floors(
    side: Side, store: Any, inputs: Inputs, dtype: torch.dtype, device: torch.device, *, drill_all: bool = False
) -> dict[str, Any]:
    """Every check's noise floor at one precision, by check key: the experiments of a
    calibrated diff of the model against itself (``side``, recorded into ``store``),
    keeping what each floor measured (``drill_all``: every module's children's too)."""
    side.store = store
    localizer = Localizer(side, side, Tolerance("calibrated"), precision=(dtype, device), drill_all=drill_all)
    experiments = localizer.experiments
    experiments.measured = {}
    assert experiments.floor_side is not None
    experiments.free_run = _record_in_memory(experiments.floor_side, inputs)
    with torch.inference_mode():
        list(localizer.stages())
        list(localizer.blocks())
        # Drift floors of every site, for offline comparisons (a diff judges block outputs').
        for site in [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]:
            experiments.with_floor(f"drift:{describe_key(site.key)}", lambda side, site=site: experiments.free_run_floor(site))
    return experiments.measured


# -- recording and localizing ---------------------------------------------------------------


def localize(ref: Side, cand: Side, inputs: Inputs | None, options: Options) -> Report:
    """Localize two sides whose stores are filled already: the engine's one path, for a
    mode that records its sides itself (:mod:`blockdiff.invariance`)."""
    return _localize(ref, cand, inputs, options)


def _localize(
    ref: Side, cand: Side, inputs: Inputs | None, options: Options, *, free_run: Callable[[Side], Any] | None = None,
    stateful: bool = False, complete: Callable[[Localizer, list], None] | None = None,
) -> Report:
    """Localize two recorded sides into a report. ``free_run(side)`` records the reference
    at the candidate's precision for drift floors, into a store it returns (in memory
    when not given). Floors a reference dump stored serve where it has them."""
    rank, baseline_dtype = options.rank, options.baseline_dtype
    floors = None if ref.live else ref.store.floors()
    tolerance = (options.tolerance or Tolerance()).resolved(
        same_dtype=ref.dtype == cand.dtype,
        same_device=ref.device == cand.device,
    )
    stored = StoredFloors.of(floors, ref, cand)
    label = precision_label(working_dtype(ref.dtype, cand.dtype), cand.device)
    localizer = Localizer(
        ref, cand, tolerance, fast_path=options.fast_path, capacity_factors=options.capacity_factors, stored=stored,
        drill_all=rank,
    )
    localizer.experiments.stateful = stateful
    floor = localizer.experiments.floor_side
    if floor is not None and cand.live and inputs is not None:
        # Drift floors: the reference's own free run at the candidate's precision. When the
        # candidate is that very code (a model against its own cast: the same classes,
        # settings and weights at that precision), its own record is the free run.
        if cand.store is not None and floor.runs_as(cand):
            localizer.experiments.free_run = cand.store
        else:
            record = free_run or (lambda side: _record_in_memory(side, inputs))
            localizer.experiments.free_run = record(floor)
    def judge() -> tuple[list, list]:
        stages = run_model_code("candidate", lambda: list(localizer.stages()))
        blocks = run_model_code("candidate", lambda: _counted(_block_by_block(localizer), "localize", len(cand.layout.blocks)))
        if complete is not None:
            run_model_code("candidate", complete, localizer, blocks)
        return stages, blocks

    with torch.inference_mode():
        # The candidate's kind completes what was judged (a pipeline's ranks share theirs).
        stages, blocks = cand.localized(localizer, judge)
    report = Report(
        reference=dict(ref.meta),
        candidate=dict(cand.meta),
        inputs=describe_inputs(inputs),
        tolerance=tolerance.to_dict(localizer.experiments.dtype),
        stages=stages,
        blocks=blocks,
        moe=localizer.moe,
        created=_now(),
        version=__version__,
    )
    _nonfinite_notes(report, localizer.nonfinite)
    report.notes.extend(localizer.notes)
    if rank:
        baseline = None
        if baseline_dtype is not None:
            if not ref.live:
                raise InputError("a baseline precision (--baseline-dtype) needs a live reference, not a dump")
            with torch.inference_mode():
                baseline = run_model_code("reference", measure_floors, ref, ref.store, inputs, baseline_dtype, cand.device, drill_all=True)
            report.tolerance["baseline"] = precision_label(baseline_dtype, cand.device)
        report.ranking = report.rank(baseline)
    first = report.first_divergence
    if first is not None and first.subpath == DRIFT:
        basis = (
            "calibrated against the reference's own free run at the candidate's precision"
            if first.check.threshold.basis == "calibrated"
            else f"{first.check.threshold.basis} threshold"
        )
        report.notes.append(
            f"unexplained drift: the free-running candidate drifts past its tolerance ({basis}) at "
            f"{first.where.removesuffix(' unexplained drift')} ({first.module}) while every local check "
            "before it passes: the candidate runs something its modules "
            "do not compute when called alone (a compiled graph, a fused kernel, code the hook map does "
            "not see: `blockdiff arch MODEL`), or precision accumulates more than in the reference's own "
            "code (compare precisions with --tolerance calibrated; accept it with --tol drift=VALUE)"
        )
    if localizer.experiments.stored is not None:
        report.tolerance["floors"] = f"stored {label}"
        report.notes.append(f"calibrated (stored floors): the dump's noise floors measured at {label}")
    elif tolerance.calibrated and not localizer.experiments.calibrated:
        if floors:
            why = f"it stores floors for {', '.join(floors)}, not for the candidate's {label}"
        elif options.decode:
            why = "floors are not stored for decode steps; diff the live reference to calibrate"
        else:
            why = f"it stores none: capture it with --floors {label}"
        report.notes.append(
            "calibrated tolerance needs the live reference modules or floors stored in the dump "
            f"({why}): fixed thresholds were used"
        )
        report.tolerance["policy"] = "fixed"
    if report.diverged:  # a converted weight that explains a divergence is named (blockdiff.conversion)
        conversion.diagnose(ref, cand, report)
    return report


def _dump_meta(side: Side, inputs: Inputs) -> dict[str, Any]:
    return {**side.meta, "layout": side.layout.to_dict(), "inputs_digest": digest(inputs), "versions": side.versions}


def _record_in_memory(side: Side, inputs: Inputs) -> MemoryStore:
    """``side``'s run recorded into memory, with copies (the free run of drift floors when
    nothing checks it after: the experiments run that model copy again, and a module that
    reuses a buffer it returned would change what a record holding its tensors holds)."""
    store = MemoryStore(side.meta)
    run_model_code(side.name, side.record, inputs, store, hold=None, progress=None)
    return store


def _stream(
    side: Side, inputs: Inputs, path: str | Path, *, compress: str | None = None, durable: bool = False,
    release: bool = False,
) -> None:
    """Capture ``side`` into a dump, each site written as its call finishes, from the
    model's own tensors (see :func:`~blockdiff.capture.record_once`); should the model
    change one before its site is written, the dump is thrown away and the capture runs
    again with copies. ``release``: hand freed memory back to the system after each block
    (a streamed diff's: glibc keeps what the forward freed, and the capture's peak grew
    by about a block's activations every block; not for ``capture``, whose time counts)."""
    meta = _dump_meta(side, inputs)
    progress = _progress(side)
    if release:
        progress = _releasing(progress)

    def attempt(copy: bool) -> None:
        with DumpWriter(path, meta=meta, compress=compress, durable=durable) as writer:
            writer.add_inputs(inputs)
            run_model_code(side.name, side.record, inputs, writer, hold=None if copy else "written", progress=progress)

    with_copies(attempt, lockstep=side.lockstep)


def _in_memory(
    sides: list[Side], inputs: Inputs, localize: Callable[[Callable[[Side], MemoryStore]], Report], *, lockstep: bool,
    record: Callable[..., Recording] | None = None,
) -> Report:
    """Record each side into memory and localize from there: ``localize(free_run)``, where
    ``free_run(side)`` records the reference at the candidate's precision (drift floors).
    ``record(side, inputs, store, hold=, progress=)`` records one side (default
    ``side.record``; a backward diff's records its backward with it: :class:`backward.Recorder`).

    Memory stores hold the models' own CPU tensors, the free run's too. Should a model
    write into one of them while localization runs it again (a module reusing a buffer it
    returned before: the free run's modules are the ones the floor experiments run), the
    run is repeated on copies (from the start, in ``lockstep``).
    """

    recorded = record or (lambda side, *args, **kwargs: side.record(*args, **kwargs))

    def attempt(copy: bool) -> Report:
        hold = None if copy else "kept"
        recordings = [
            run_model_code(side.name, recorded, side, inputs, MemoryStore(side.meta), hold=hold, progress=_progress(side))
            for side in sides
        ]

        def free_run(side: Side) -> MemoryStore:
            store = MemoryStore(side.meta)
            recordings.append(run_model_code(side.name, recorded, side, inputs, store, hold=hold, progress=None))
            return store

        report = localize(free_run)
        if any(recording.changed() for recording in recordings):
            raise TensorChanged("a model changed a recorded tensor in place while it was localized")
        return report

    return with_copies(attempt, lockstep=lockstep)


# Where progress goes: a callable (what, done, total), set by the CLI around a command.
PROGRESS: contextvars.ContextVar[Callable[[str, int, int], None] | None] = contextvars.ContextVar(
    "blockdiff_progress", default=None
)


def _progress(side: Side) -> Callable[[int, int], None] | None:
    report = PROGRESS.get()
    if report is None:
        return None
    what = f"capture {side.name}"
    return lambda done, total: report(what, done, total)


def _releasing(progress: Callable[[int, int], None] | None) -> Callable[[int, int], None]:
    """``progress``, handing freed memory back to the system first (:mod:`blockdiff.dump.memory`)."""

    def each(done: int, total: int) -> None:
        release_freed_memory()
        if progress is not None:
            progress(done, total)

    return each


def _block_by_block(localizer: Localizer) -> Iterator:
    """The localizer's blocks. Read from dumps: what the stages left (the logits) handed
    back to the system first, and each block's records dropped from the dumps once it is
    judged (:meth:`DumpReader.forget`): a streamed diff holds one block's, not every
    block's."""
    stores = (localizer.ref.store, localizer.cand.store, localizer.experiments.free_run)
    dumps = {id(store): store for store in stores if isinstance(store, DumpReader)}
    if dumps:
        release_freed_memory()
    for result in localizer.blocks():
        yield result
        for dump in dumps.values():
            dump.forget(result.index)


def _counted(items: Iterator, what: str, total: int) -> list:
    report, done = PROGRESS.get(), []
    for item in items:
        done.append(item)
        if report is not None:
            report(what, len(done), total)
    return done


def _nonfinite_notes(report: Report, scan: NonfiniteScan) -> None:
    found = scan.result()
    report.first_nonfinite = found.get("candidate")
    report.reference_nonfinite = found.get("reference")
    if report.reference_nonfinite is not None:
        nf = report.reference_nonfinite
        report.notes.append(
            f"the reference itself holds {nf['nonfinite_ref']} NaN/Inf values from {nf['site']} "
            f"({nf['module']}) on: check the inputs and the reference; comparisons there use the "
            "finite elements"
        )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def describe_inputs(inputs: Inputs | None) -> dict[str, Any]:
    if inputs is None:
        return {"kind": None, "shape": None, "digest": None}
    if isinstance(inputs, torch.Tensor):
        kind, shape = "token_ids", list(inputs.shape)
    else:
        kind, shape = ("args" if isinstance(inputs, tuple) else "kwargs"), None
    return {"kind": kind, "shape": shape, "digest": digest(inputs)}
