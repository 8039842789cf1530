"""Engine: the whole diff — choose the mode, record both sides, localize, build the report.

:func:`run` is the one entry point the CLI and the pytest plugin call: each side may be a
model, a factory returning one, or a dump, and the pairing picks the mode:

=============  =============  ==================================================================
reference      candidate      mode
=============  =============  ==================================================================
model          model          live diff (:func:`diff`): full localization, calibrated floors
dump           model          replay (:func:`replay`): the candidate runs on the dump's inputs
dump           dump           offline comparison (:func:`compare_dumps`): drift at every site
model          ``.onnx``      ONNX Runtime candidate (:func:`~blockdiff.onnxside.diff_onnx`):
                              full localization, experiments run as sub-graphs of the graph
=============  =============  ==================================================================

:func:`diff`, :func:`replay` and :func:`compare_dumps` are the modes themselves (public API);
:func:`capture` writes a dump.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from . import distributed
from ._version import __version__
from .autodetect import configured_vocab_size
from .capture import TensorChanged, with_copies
from .dump import DumpReader, DumpWriter
from .dtypes import dtype_name, precision_label
from .errors import BlockdiffError, DumpError, InputError, ModelRunError
from .hookmap import HookMap, Layout, layout_from_dict, resolve
from .inputs import (
    Inputs,
    check_inputs,
    check_vocab,
    complete_inputs,
    digest,
    load_inputs,
    load_tokens,
    pixel_input,
    random_pixels,
    random_tokens,
)
from .loading import is_dump
from .localize import Localizer, NonfiniteScan
from .onnxside import OnnxModel, diff_onnx, is_onnx
from .pairing import check_block_counts
from .report import Report
from .site import describe_key
from .sides import DumpSide, LiveSide, PipelineSide, ShardedSide, Side, compiled_code_limits, versions
from .store import MemoryStore
from .experiments import StoredFloors
from .tolerance import Tolerance, working_dtype
from .vocab import DRIFT


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode for the body and restore every module's flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def vocab_size(model: nn.Module, layout: Layout) -> int | None:
    """The vocabulary of the model's embedding when it is an ``nn.Embedding``, else the one
    its configuration states (Hugging Face ``config.vocab_size``, TransformerLens
    ``cfg.d_vocab``)."""
    for stage, path in layout.outside:
        if stage == "embed":
            module = model.get_submodule(path)
            if isinstance(module, nn.Embedding):
                return module.num_embeddings
    return configured_vocab_size(model)


# -- choosing the mode ----------------------------------------------------------------------


@dataclass(frozen=True)
class RandomTokens:
    """Random token ids within the reference's vocabulary (the CLI's ``--batch/--seq/--seed``)."""

    batch: int = 2
    seq: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Options:
    """How a run judges and what it keeps; every field as for :func:`diff`."""

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


# A side as run() takes it: a model, a callable returning one, or a dump's path.
SideSpec = Union[nn.Module, Callable[[], nn.Module], str, Path]


def _dump_path(spec: SideSpec | None) -> Path | None:
    if isinstance(spec, (str, Path)) and not is_onnx(spec):
        if not is_dump(str(spec)):
            raise InputError(f"{spec}: not a dump (.h5); give a model or a factory returning one")
        return Path(spec)
    return None


def _build(name: str, spec: SideSpec) -> nn.Module | OnnxModel:
    """The model a side spec stands for: the model itself, or what its factory returns; an
    ONNX Runtime model for a ``.onnx`` path (a candidate only, see :func:`run`)."""
    if isinstance(spec, (nn.Module, OnnxModel)):
        return spec
    if is_onnx(spec):
        return OnnxModel(spec)
    model = _run(name, spec)
    if not isinstance(model, (nn.Module, OnnxModel)):
        raise InputError(
            f"the {name} factory returned a {type(model).__name__}, expected a torch nn.Module "
            "(or, for a candidate, a blockdiff.onnxside.OnnxModel)"
        )
    return model


def run(
    reference: SideSpec,
    candidate: SideSpec | None = None,
    inputs: Inputs | RandomTokens | str | Path | None = None,
    *,
    options: Options | None = None,
) -> Report:
    """Diff, replay or compare, as the two sides ask (see the module's table).

    Args:
        reference: a model, a factory (a callable returning a model) or a dump's path.
        candidate: the same kinds; ``None`` calls the reference's factory again (so
            ``--cand-dtype`` alone compares precisions: the factory builds each side).
        inputs: model inputs (token ids, a tuple of positional arguments, a dict of
            keyword arguments), a token file (``.json`` or ``.safetensors``), or
            :class:`RandomTokens` (the default) drawn within the reference's vocabulary.
            A dump reference brings its own inputs: concrete inputs must be the same.
        options: tolerance, hook maps, fast path, labels, dumps to keep.

    Raises:
        InputError: a pairing of sides that has no mode (a candidate dump against a live
            reference, a reference dump alone), or inputs that do not fit.

    Inside an initialised process group of several ranks (``torchrun``), every rank calls
    it with the same arguments: the candidate may be split across the ranks
    (:mod:`blockdiff.distributed`), and every rank gets the same report.

    >>> run("ref.h5", bugs.gelu_for_silu).first_divergence.subpath   # doctest: +SKIP
    'ffn'
    """
    with distributed.lockstep():
        return _run_mode(reference, candidate, inputs, options or Options())


def _run_mode(reference: SideSpec, candidate: SideSpec | None, inputs: Any, options: Options) -> Report:
    ref_dump = _dump_path(reference)
    if candidate is None:
        if ref_dump is not None:
            raise InputError("a reference dump needs a CANDIDATE (a model to replay, or a second dump)")
        if isinstance(reference, nn.Module):
            raise InputError("a reference model alone cannot be diffed: give a candidate, or a factory to build both sides")
        candidate = reference
    cand_dump = _dump_path(candidate)
    if cand_dump is not None and ref_dump is None:
        raise InputError("a candidate dump needs a reference dump: blockdiff diff REF.h5 CAND.h5")
    if options.save_dumps is not None and (ref_dump or cand_dump):
        raise InputError("--save-dumps keeps the captures of a live diff; here a side is already a dump")
    common = dict(tolerance=options.tolerance, labels=options.labels)
    if ref_dump is not None and cand_dump is not None:
        return compare_dumps(ref_dump, cand_dump, **common)
    if ref_dump is not None:
        cand_model = _build("candidate", candidate)
        if isinstance(cand_model, OnnxModel):
            raise InputError("an ONNX Runtime candidate is localized against a live reference model, not a dump")
        if isinstance(inputs, InputsFile):
            given = load_inputs(inputs.path)
        elif inputs is None or isinstance(inputs, RandomTokens):
            given = None
        else:  # completed as the capture completed them (an encoder-decoder's decoder ids)
            given = complete_inputs(cand_model, _concrete(inputs))[0]
        return replay(
            ref_dump,
            cand_model,
            inputs=given,
            candidate_hooks=options.candidate_hooks,
            fast_path=options.fast_path,
            capacity_factors=options.capacity_factors,
            **common,
        )
    ref_model = _build("reference", reference)
    cand_model = _build("candidate", candidate)
    if isinstance(ref_model, OnnxModel):
        raise InputError("the reference must be a PyTorch model; an ONNX Runtime model can only be the candidate")
    concrete, made = inputs_for(ref_model, options.reference_hooks, inputs)
    if isinstance(cand_model, OnnxModel):
        return _onnx_report(ref_model, cand_model, concrete, made, options)
    report = diff(
        ref_model,
        cand_model,
        concrete,
        reference_hooks=options.reference_hooks,
        candidate_hooks=options.candidate_hooks,
        fast_path=options.fast_path,
        capacity_factors=options.capacity_factors,
        save_dumps=options.save_dumps,
        stream=options.stream,
        rank=options.rank,
        baseline_dtype=options.baseline_dtype,
        **common,
    )
    if made is not None:
        report.notes.insert(0, f"inputs: {made}")
    return report


def _onnx_report(ref_model: nn.Module, cand_model: OnnxModel, inputs: Inputs, made: str | None, options: Options) -> Report:
    """:func:`run` for an ONNX Runtime candidate (:func:`~blockdiff.onnxside.diff_onnx`)."""
    if options.save_dumps is not None or options.stream or options.rank:
        raise InputError("--save-dumps, --stream and --rank are not supported with an ONNX Runtime candidate")
    report = diff_onnx(ref_model, cand_model, inputs, tolerance=options.tolerance,
                       reference_hooks=options.reference_hooks, fast_path=options.fast_path, labels=options.labels)
    if made is not None:
        report.notes.insert(0, f"inputs: {made}")
    return report


def _concrete(inputs: Inputs | str | Path) -> Inputs:
    return load_tokens(inputs) if isinstance(inputs, (str, Path)) else inputs


@dataclass(frozen=True)
class InputsFile:
    """Named model inputs from a file (the CLI's ``--inputs``): see :func:`~blockdiff.inputs.load_inputs`."""

    path: str | Path


def inputs_for(
    model: nn.Module, hooks: HookMap | None, inputs: Inputs | RandomTokens | InputsFile | str | Path | None
) -> tuple[Inputs, str | None]:
    """Concrete inputs, and a note when blockdiff made up part of them: inputs as given,
    named inputs from a file, token ids from a token file, or random ones — token ids
    within the model's vocabulary, or pixels for a vision encoder; token ids completed for
    an encoder-decoder (:func:`~blockdiff.inputs.complete_inputs`)."""
    if isinstance(inputs, InputsFile):
        return load_inputs(inputs.path), None
    if inputs is not None and not isinstance(inputs, RandomTokens):
        return complete_inputs(model, _concrete(inputs))
    spec = inputs or RandomTokens()
    pixels = pixel_input(model)
    if pixels is not None:
        name, shape = pixels
        made = random_pixels(shape, batch=spec.batch, seed=spec.seed)
        return {name: made}, f"random {name} of shape {list(made.shape)} (seed {spec.seed})"
    vocab = vocab_size(model, resolve(model, hooks))
    if vocab is None:
        raise InputError("cannot tell the model's vocabulary size; give token ids (--tokens FILE) or inputs (--inputs FILE)")
    return complete_inputs(model, random_tokens(batch=spec.batch, seq=spec.seq, vocab=vocab, seed=spec.seed))


# -- the modes --------------------------------------------------------------------------------


def _live_side(name: str, model: nn.Module, hooks: HookMap | None, inputs: Inputs, label: str | None) -> LiveSide:
    layout = resolve(model, hooks)
    if distributed.in_lockstep() and name != "reference":
        digests = distributed.every_rank(digest(inputs))
        if len(set(digests)) > 1:
            raise InputError(f"the ranks were given different inputs (digests {', '.join(digests)}): every rank must run the same")
    if not distributed.in_lockstep() or name == "reference":  # a reference: one device's model on every rank
        side: LiveSide = LiveSide(name, model, layout, label=label)
    else:
        layouts = [layout_from_dict(found) for found in distributed.every_rank(layout.to_dict())]
        held = [{block.index for block in theirs.blocks} for theirs in layouts]
        if all(blocks == held[0] for blocks in held):
            side = ShardedSide(name, model, layout, label=label)  # tensor, sequence, expert parallel
        elif all(not (a & b) for i, a in enumerate(held) for b in held[i + 1 :]):
            side = PipelineSide(name, model, layout, layouts, label=label)  # one stage per rank
        else:
            raise InputError(
                f"the {name}'s ranks hold overlapping sets of blocks ({held}): a pipeline stage per rank, or "
                "every block on every rank (tensor or expert parallel), is what blockdiff localizes"
            )
    if isinstance(inputs, torch.Tensor):
        check_vocab(inputs, vocab_size(model, layout), side=name if name != "captured" else "model")
    return side


def diff(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Inputs,
    *,
    tolerance: Tolerance | None = None,
    reference_hooks: HookMap | None = None,
    candidate_hooks: HookMap | None = None,
    fast_path: bool = False,
    capacity_factors: tuple[float, ...] = (1.0, 1.25),
    labels: tuple[str | None, str | None] = (None, None),
    save_dumps: str | Path | None = None,
    stream: bool = False,
    rank: bool = False,
    baseline_dtype: torch.dtype | None = None,
) -> Report:
    """Find where ``candidate`` first diverges from ``reference`` on ``inputs``.

    Both models run as they are (device, dtype); neither is changed: hooks are removed
    and training flags restored on every path.

    Args:
        reference: the trusted model.
        candidate: the model under test (another object, possibly another codebase).
        inputs: token ids, a tuple of positional arguments or a dict of keyword arguments;
            moved to each model's device.
        tolerance: how local errors are judged; calibrated when dtypes or devices differ.
        reference_hooks, candidate_hooks: hook maps; found by class name when ``None``.
        fast_path: skip a block's sub-path experiments when the block as a whole is within
            tolerance.
        capacity_factors: counterfactual capacity factors for the routing statistics of
            dropless MoE blocks.
        labels: how the report names the two models (e.g. their specs).
        save_dumps: a directory to keep both sides' captures in, as ``reference.h5`` and
            ``candidate.h5``; the captures stream there and localization reads them
            back block by block.
        stream: capture to temporary dumps and localize from them block by block, so
            memory holds one block's activations rather than every block's (implied by
            ``save_dumps``).
        rank: also rank every check, worst first (``report.ranking``, see
            :meth:`Report.rank`), drilling into every module's children.
        baseline_dtype: with ``rank``, judge each check against the reference's own floor
            at this precision ("is the int8 candidate worse than bfloat16 here?") instead
            of its threshold.

    Returns:
        The :class:`~blockdiff.report.Report`; ``report.first_divergence`` is ``None``
        when nothing diverged.

    >>> report = diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids)   # doctest: +SKIP
    >>> (report.first_divergence.block, report.first_divergence.subpath)  # doctest: +SKIP
    (2, 'ffn')
    """
    if reference is candidate:
        raise InputError("reference and candidate are the same object; pass two separate models")
    check_inputs(inputs)
    ref = _live_side("reference", reference, reference_hooks, inputs, labels[0])
    cand = _live_side("candidate", candidate, candidate_hooks, inputs, labels[1])
    check_block_counts(len(ref.layout.blocks), len(cand.layout.blocks))
    refused = next((side.not_streamed for side in (ref, cand) if side.not_streamed), None)
    if refused and (save_dumps is not None or stream):
        raise InputError(
            f"--stream and --save-dumps do not take {refused}; "
            "diff in memory, or capture the reference alone (blockdiff capture) and replay against it"
        )
    ranking = dict(rank=rank, baseline_dtype=baseline_dtype)
    localize = lambda free_run: _localize(  # noqa: E731
        ref, cand, inputs, tolerance, fast_path=fast_path, capacity_factors=capacity_factors, free_run=free_run, **ranking
    )
    with ExitStack() as stack:
        stack.enter_context(eval_mode(reference))
        stack.enter_context(eval_mode(candidate))
        stack.enter_context(compiled_code_limits(reference, candidate))
        if save_dumps is None and not stream:
            return _in_memory([ref, cand], inputs, localize)
        if save_dumps is not None and distributed.rank() == 0:
            folder = Path(save_dumps)
        else:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DumpError(f"cannot create {folder}: {exc.strerror or exc}", path=str(folder)) from None
        for side in (ref, cand):
            path = folder / f"{side.name}.h5"
            _stream(side, inputs, path)
            # The dumps were just written by this process: no need to probe them.
            side.store = stack.enter_context(DumpReader(path, probe=False))

        def streamed_free_run(side: Side) -> DumpReader:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
            _stream(side, inputs, scratch / "free-run.h5")
            return stack.enter_context(DumpReader(scratch / "free-run.h5", probe=False))

        return _localize(
            ref, cand, inputs, tolerance, fast_path=fast_path, capacity_factors=capacity_factors,
            free_run=streamed_free_run, **ranking,
        )


def replay(
    reference: str | Path,
    candidate: nn.Module,
    *,
    inputs: Inputs | None = None,
    tolerance: Tolerance | None = None,
    candidate_hooks: HookMap | None = None,
    fast_path: bool = False,
    capacity_factors: tuple[float, ...] = (1.0, 1.25),
    labels: tuple[str | None, str | None] = (None, None),
) -> Report:
    """Run a live ``candidate`` on a reference dump's inputs and localize against it.

    The reference is read block by block from the dump. Calibrated floors come from the
    dump when it stores them for the candidate's precision (``capture --floors``); else the
    fixed thresholds judge, and the report says why. ``inputs``, when given, must be the
    ones the dump was captured on.
    """
    with DumpReader(reference) as dump:
        floors = dump.floors()
        stored = dump.inputs()
        if stored is None:
            raise DumpError(f"{reference}: the dump holds no model inputs to replay", path=str(reference))
        if inputs is not None and digest(check_inputs(inputs)) != digest(stored):
            raise InputError(
                f"{reference} was captured on other inputs (digest {digest(stored)}) than these "
                f"(digest {digest(inputs)}); replay uses the dump's own inputs"
            )
        ref = DumpSide("reference", dump, label=labels[0])
        stored_versions = dump.meta.get("versions")
        cand = _live_side("candidate", candidate, candidate_hooks, stored, labels[1])
        check_block_counts(len(ref.layout.blocks), len(cand.layout.blocks))
        with eval_mode(candidate), compiled_code_limits(candidate):
            report = _in_memory(
                [cand],
                stored,
                lambda free_run: _localize(
                    ref, cand, stored, tolerance, fast_path=fast_path, capacity_factors=capacity_factors, floors=floors,
                    free_run=free_run,
                ),
            )
    report.notes.insert(0, f"replay: the reference is the dump {reference}")
    changed = _version_changes(stored_versions, versions(candidate))
    if changed:
        report.notes.insert(1, f"the dump was captured under other package versions ({changed}): code may have moved between modules")
    return report


def _version_changes(stored: Any, current: dict[str, str]) -> str:
    """``transformers 4.57.0 → 5.23.0, ...`` for the packages both record with different versions."""
    if not isinstance(stored, dict):
        return ""
    return ", ".join(f"{name} {stored[name]} → {version}" for name, version in current.items() if name in stored and stored[name] != version)


def compare_dumps(
    reference: str | Path,
    candidate: str | Path,
    *,
    tolerance: Tolerance | None = None,
    labels: tuple[str | None, str | None] = (None, None),
) -> Report:
    """Compare two dumps offline: drift at every site, judged against fixed thresholds.

    Local errors need a live candidate module (replay); two dumps hold only what each
    side computed on its own inputs, so the report judges drift and says so.
    """
    with DumpReader(reference) as ref_dump, DumpReader(candidate) as cand_dump:
        ref = DumpSide("reference", ref_dump, label=labels[0])
        cand = DumpSide("candidate", cand_dump, label=labels[1])
        check_block_counts(len(ref_dump.block_indices()), len(cand_dump.block_indices()))
        ref_inputs, cand_inputs = ref_dump.inputs(), cand_dump.inputs()
        if ref_inputs is not None and cand_inputs is not None and digest(ref_inputs) != digest(cand_inputs):
            raise InputError(
                f"the dumps were captured on different inputs ({reference}: {digest(ref_inputs)}, "
                f"{candidate}: {digest(cand_inputs)}); capture both on the same token ids"
            )
        # Two dumps have no live modules to calibrate with: drift is judged against the drift
        # floors the reference stored for the candidate's precision, else fixed thresholds.
        floors = ref_dump.floors()
        stored = StoredFloors.of(floors, ref, cand) is not None
        tolerance = tolerance or Tolerance()
        if tolerance.policy is None:  # the user's choice stands; blockdiff's follows the floors
            tolerance = replace(tolerance, policy="calibrated" if stored else "fixed")
        report = _localize(ref, cand, ref_inputs, tolerance, fast_path=False, capacity_factors=(), floors=floors)
    basis = "its stored drift floors" if stored else "fixed thresholds"
    report.notes.append(
        f"offline comparison of two dumps: only drift could be computed, judged against {basis}; "
        "local errors (which sub-path is wrong rather than where the error shows) "
        f"need a live candidate: blockdiff diff {reference} CANDIDATE_MODEL"
    )
    return report


def capture(
    model: nn.Module,
    inputs: Inputs,
    out: str | Path,
    *,
    hooks: HookMap | None = None,
    compress: str | None = None,
    label: str | None = None,
    floors: Sequence[tuple[torch.dtype, torch.device | str]] = (),
    durable: bool = False,
) -> None:
    """Run ``model`` once on ``inputs`` and stream every site into the dump ``out``.

    Sites are written as the forward produces them, so memory does not grow with the
    number of blocks. The dump is complete, or absent (written under a temporary name and
    renamed at the end).

    Args:
        floors: precisions (dtype, device) to measure noise floors at and store in the dump
            (schema 3), so that a replay of a candidate in one of them is calibrated as a
            live diff is: every check's floor, the reference's own code at that precision
            on the reference's inputs. Measuring them holds the run in memory (like a live
            diff) and runs the model's modules again at each precision.
        durable: flush the dump to disk before it is renamed into place (see
            :class:`~blockdiff.dump.DumpWriter`).
    """
    check_inputs(inputs)
    side = _live_side("captured", model, hooks, inputs, label)
    with eval_mode(model), compiled_code_limits(model), _rank_zero_writes(out) as out:
        if not floors:
            _stream(side, inputs, out, compress=compress, durable=durable)
            return
        # Copies: the floor pass runs the model's modules again, which must not change the record.
        store = _run(side.name, _recorded, side, inputs, hold=None)
        measured = {
            precision_label(dtype, device): {
                "dtype": dtype_name(dtype),
                "device": precision_label(dtype, device).partition("@")[2],
                "values": _run(side.name, measure_floors, side, store, inputs, dtype, torch.device(device)),
            }
            for dtype, device in floors
        }
        with DumpWriter(out, meta=_dump_meta(side, inputs), compress=compress, durable=durable) as writer:
            writer.add_inputs(inputs)
            for site in store.sites():
                writer.add(site)
            writer.add_floors(measured)


@contextmanager
def _rank_zero_writes(out: str | Path) -> Iterator[str | Path]:
    """Where a capture writes: ``out``, but on the ranks other than 0 of a sharded run,
    which record the same whole tensors in lockstep, a scratch file thrown away after."""
    if distributed.rank() == 0:
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="blockdiff-rank-") as scratch:
        yield Path(scratch) / Path(out).name


def _recorded(side: LiveSide, inputs: Inputs, *, hold: str | None) -> MemoryStore:
    store = MemoryStore(side.meta)
    side.record(inputs, store, hold=hold, progress=_progress(side))
    return store


def measure_floors(
    side: LiveSide, store: Any, inputs: Inputs, dtype: torch.dtype, device: torch.device, *, drill_all: bool = False
) -> dict[str, Any]:
    """Every check's noise floor at one precision, by check key: the experiments of a
    calibrated diff of the model against itself, keeping what each floor measured
    (``drill_all``: every module's children's too)."""
    reference = LiveSide("reference", side.model, side.layout)
    reference.store = store
    localizer = Localizer(reference, reference, Tolerance("calibrated"), precision=(dtype, device), drill_all=drill_all)
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


def _localize(
    ref: Side,
    cand: Side,
    inputs: Inputs | None,
    tolerance: Tolerance | None,
    *,
    fast_path: bool,
    capacity_factors: tuple[float, ...],
    free_run: Callable[[Side], Any] | None = None,
    floors: dict[str, Any] | None = None,
    rank: bool = False,
    baseline_dtype: torch.dtype | None = None,
) -> Report:
    """Localize two recorded sides into a report. ``free_run(side)`` records the reference
    at the candidate's precision for drift floors, into a store it returns (in memory
    when not given)."""
    tolerance = (tolerance or Tolerance()).resolved(
        same_dtype=ref.dtype == cand.dtype,
        same_device=ref.device == cand.device,
    )
    stored = StoredFloors.of(floors, ref, cand)
    label = precision_label(working_dtype(ref.dtype, cand.dtype), cand.device)
    localizer = Localizer(
        ref, cand, tolerance, fast_path=fast_path, capacity_factors=capacity_factors, stored=stored, drill_all=rank
    )
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
        stages = _run("candidate", lambda: list(localizer.stages()))
        return stages, _run("candidate", lambda: _counted(localizer.blocks(), "localize", len(cand.layout.blocks)))

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
                baseline = _run("reference", measure_floors, ref, ref.store, inputs, baseline_dtype, cand.device, drill_all=True)
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
        else:
            why = f"it stores none: capture it with --floors {label}"
        report.notes.append(
            "calibrated tolerance needs the live reference modules or floors stored in the dump "
            f"({why}): fixed thresholds were used"
        )
        report.tolerance["policy"] = "fixed"
    return report


def _dump_meta(side: LiveSide, inputs: Inputs) -> dict[str, Any]:
    return {**side.meta, "layout": side.layout.to_dict(), "inputs_digest": digest(inputs), "versions": versions(side.model)}


def _record_in_memory(side: Side, inputs: Inputs) -> MemoryStore:
    """``side``'s run recorded into memory, with copies (the free run of drift floors when
    nothing checks it after: the experiments run that model copy again, and a module that
    reuses a buffer it returned would change what a record holding its tensors holds)."""
    store = MemoryStore(side.meta)
    _run(side.name, side.record, inputs, store, hold=None, progress=None)
    return store


def _stream(
    side: LiveSide, inputs: Inputs, path: str | Path, *, compress: str | None = None, durable: bool = False
) -> None:
    """Capture ``side`` into a dump, each site written as its call finishes, from the
    model's own tensors (see :func:`~blockdiff.capture.record_once`); should the model
    change one before its site is written, the dump is thrown away and the capture runs
    again with copies."""
    meta = _dump_meta(side, inputs)

    def attempt(copy: bool) -> None:
        with DumpWriter(path, meta=meta, compress=compress, durable=durable) as writer:
            writer.add_inputs(inputs)
            _run(side.name, side.record, inputs, writer, hold=None if copy else "written", progress=_progress(side))

    with_copies(attempt)


def _in_memory(
    sides: list[LiveSide], inputs: Inputs, localize: Callable[[Callable[[Side], MemoryStore]], Report]
) -> Report:
    """Record each side into memory and localize from there: ``localize(free_run)``, where
    ``free_run(side)`` records the reference at the candidate's precision (drift floors).

    Memory stores hold the models' own CPU tensors, the free run's too. Should a model
    write into one of them while localization runs it again (a module reusing a buffer it
    returned before: the free run's modules are the ones the floor experiments run), the
    run is repeated on copies.
    """

    def attempt(copy: bool) -> Report:
        hold = None if copy else "kept"
        recordings = [
            _run(side.name, side.record, inputs, MemoryStore(side.meta), hold=hold, progress=_progress(side))
            for side in sides
        ]

        def free_run(side: Side) -> MemoryStore:
            store = MemoryStore(side.meta)
            recordings.append(_run(side.name, side.record, inputs, store, hold=hold, progress=None))
            return store

        report = localize(free_run)
        if any(recording.changed() for recording in recordings):
            raise TensorChanged("a model changed a recorded tensor in place while it was localized")
        return report

    return with_copies(attempt)


# Where progress goes: a callable (what, done, total), set by the CLI around a command.
PROGRESS: contextvars.ContextVar[Callable[[str, int, int], None] | None] = contextvars.ContextVar(
    "blockdiff_progress", default=None
)


def _progress(side: LiveSide) -> Callable[[int, int], None] | None:
    report = PROGRESS.get()
    if report is None:
        return None
    what = f"capture {side.name}"
    return lambda done, total: report(what, done, total)


def _counted(items: Iterator, what: str, total: int) -> list:
    report, done = PROGRESS.get(), []
    for item in items:
        done.append(item)
        if report is not None:
            report(what, len(done), total)
    return done


def _run(side: str, fn, *args, **kwargs):
    """Call ``fn``; an exception raised by model code becomes a :class:`ModelRunError`."""
    try:
        return fn(*args, **kwargs)
    except BlockdiffError:
        raise
    except Exception as exc:
        raise ModelRunError(f"the {side} model raised {type(exc).__name__}: {exc}", side=side) from exc


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

