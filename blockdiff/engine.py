"""Engine: open both sides, pick the execution, run it — and write dumps.

:func:`run` is the one entry point the CLI, the pytest plugin and golden files call. Each
side is opened by :func:`~blockdiff.sides.factory.open_side` (a model, a factory, a model
spec, an ``.h5`` dump, an ``.onnx`` graph); the options are checked against every
execution's rules (:func:`blockdiff.modes.refuse`), and the execution they ask for
(:func:`blockdiff.modes.chosen`: the forward, decode steps, the backward) records the
sides and localizes them. What the sides can do decides how (:mod:`blockdiff.modes.forward`):

=============  =============  ==================================================================
reference      candidate      mode
=============  =============  ==================================================================
live           live           live diff: full localization, calibrated floors (any live kind:
                              eager, compiled, sharded, pipeline, ONNX Runtime)
dump           live           replay: the candidate runs on the dump's inputs
dump           dump           offline comparison: drift at every site
=============  =============  ==================================================================

:func:`diff`, :func:`replay` and :func:`compare_dumps` are those for callers that know
which one they want (public API); :func:`capture` writes a dump.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from . import diskweights, distributed, modes
from .dtypes import dtype_name, precision_label
from .dump import DumpWriter
from .errors import InputError, OptionsError, run_model_code
from .hookmap import HookMap
from .inputs import Inputs, InputsFile, RandomTokens, check_inputs
from .loading import checkpoint_dtype, side_dtypes
from .modes import decode as decode_mode
from .modes.judging import describe_inputs, localize, measure_floors
from .modes.options import Options
from .modes.recording import PROGRESS, dump_meta, record_in_memory, stream
from .pairing import check_block_counts
from .report import Note, Report
from .sides.factory import kind_of, open_side

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
        OptionsError: options that do not go together (named as parameters).

    Inside an initialised process group of several ranks (``torchrun``), every rank calls
    it with the same arguments: the candidate may be split across the ranks
    (:mod:`blockdiff.distributed`), and every rank gets the same report.

    >>> run("ref.h5", bugs.gelu_for_silu).first_divergence.subpath   # doctest: +SKIP
    'ffn'
    """
    options = options or Options()
    if candidate is None:
        options = modes.alone(options)  # what "the model against itself" means for the execution
    candidate = _candidate_spec(reference, candidate)
    modes.refuse(options, (kind_of(reference), kind_of(candidate)))
    from_disk = options.max_memory is not None
    if not from_disk and (why := diskweights.too_large(reference, candidate)) is not None:
        raise OptionsError(why)
    dtypes = options.dtypes
    if checkpoint_dtype(reference) or checkpoint_dtype(candidate):  # each runs in its own unless asked
        dtypes = side_dtypes(reference, candidate, options.dtypes)
    with distributed.lockstep(), ExitStack() as opened:
        ref = open_side(
            "reference", reference, opened=opened, hooks=options.reference_hooks, label=options.labels[0],
            device=options.devices[0], dtype=dtypes[0], from_disk=from_disk,
        )
        cand = open_side(
            "candidate", candidate, opened=opened, hooks=options.candidate_hooks, label=options.labels[1],
            device=options.devices[1] or options.devices[0], dtype=dtypes[1] or dtypes[0], like=ref,
            from_disk=from_disk,
        )
        check_block_counts(len(ref.layout.blocks), len(cand.layout.blocks))
        models = getattr(ref, "model", None), getattr(cand, "model", None)
        _closed_after(models, opened)
        if options.max_memory is not None and (why := diskweights.refusal(options.max_memory, *models)) is not None:
            raise OptionsError(why)
        _show_reads(models)
        report = modes.chosen(options, ref, cand).run(ref, cand, inputs, options)
        if options.max_memory is not None:
            report.notes.append(Note("disk-weights", diskweights.note(options.max_memory, *models)))
        return report


def _closed_after(models: Sequence[Any], opened: ExitStack) -> None:
    """Models reading from disk let go when the run ends, however it ends: the unit held
    freed, the hooks off."""
    for weights in {id(w): w for w in map(diskweights.disk_weights, models) if w is not None}.values():
        opened.callback(weights.close)


def _show_reads(models: Sequence[Any]) -> None:
    """Weights read from disk counted on the progress bar (``PROGRESS``), with their rate."""
    progress = PROGRESS.get()
    readers = [w for w in map(diskweights.disk_weights, models) if w is not None]
    if progress is None:
        return
    for weights in readers:
        weights.on_read = lambda unit, ours=readers: progress(
            diskweights.READ_PROGRESS, sum(w.checkpoint.bytes_read for w in ours) // 10**6, 0
        )


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


# -- the public ways in --------------------------------------------------------------------------------


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
    max_memory: int | None = None,
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
        max_memory: bytes the model's weights may take: built without them and read
            from its checkpoint a block at a time (as :attr:`Options.max_memory`), so
            that a reference no machine holds whole is captured from disk.

    Returns:
        A note on what blockdiff made up of the inputs (random token ids), or ``None``.
    """
    if max_memory is not None and decode:
        raise OptionsError("{decode} runs every block at every step, a cache beside it: not with {max_memory}")
    with ExitStack() as opened:
        side = open_side(
            "captured", model, opened=opened, hooks=hooks, label=label, device=device, dtype=dtype,
            from_disk=max_memory is not None,
        )
        if not side.live:
            raise InputError(f"{model}: a dump cannot be captured again; capture a model")
        model = getattr(side, "model", None)  # a live side's model (what reads from disk)
        _closed_after([model], opened)
        if max_memory is not None and (why := diskweights.refusal(max_memory, model, None)) is not None:
            raise OptionsError(why)
        _show_reads([model])
        concrete, made = side.inputs(inputs)
        check_inputs(concrete)
        if decode:
            decode_mode.capture(side, concrete, out, steps=decode, cache=cache, floors=floors, compress=compress, durable=durable)
            return made
        with side.running(), _rank_zero_writes(out) as out:
            if not floors:
                stream(side, concrete, out, compress=compress, durable=durable)
                return made
            # Copies: the floor pass runs the model's modules again, which must not change the record.
            store = record_in_memory(side, concrete, progress=True)
            measured = {
                precision_label(dtype_, device_): {
                    "dtype": dtype_name(dtype_),
                    "device": precision_label(dtype_, device_).partition("@")[2],
                    "values": run_model_code(side.name, measure_floors, side, store, concrete, dtype_, torch.device(device_)),
                }
                for dtype_, device_ in floors
            }
            with DumpWriter(out, meta=dump_meta(side, concrete), compress=compress, durable=durable) as writer:
                writer.add_inputs(concrete)
                for site in store.sites():
                    writer.add(site)
                writer.add_floors(measured)
        return made


@contextmanager
def _rank_zero_writes(out: str | Path) -> Iterator[str | Path]:
    """Where a capture writes: ``out``, but on the ranks other than 0 of a sharded run,
    which record the same whole tensors in lockstep, a scratch file thrown away after."""
    if distributed.rank() == 0:
        yield out
        return
    with tempfile.TemporaryDirectory(prefix="blockdiff-rank-") as scratch:
        yield Path(scratch) / Path(out).name


__all__ = [
    "Options", "PROGRESS", "SideSpec", "capture", "compare_dumps", "describe_inputs", "diff", "localize", "measure_floors",
    "replay", "run",
]
