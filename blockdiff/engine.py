"""Engine: the whole diff — capture both sides, localize block by block, build the report.

:func:`diff` is the library's entry point; the CLI and the pytest plugin only prepare its
arguments.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ._version import __version__
from .capture import TensorChanged, record
from .dump import DumpReader, DumpWriter
from .errors import BlockdiffError, DumpError, InputError, ModelRunError
from .hookmap import HookMap, Layout, layout_from_dict, resolve
from .inputs import Inputs, check_inputs, check_vocab, digest, model_device, model_dtype
from .dtypes import dtype_name, parse_dtype
from .localize import Localizer, NonfiniteScan, Side, check_block_counts, offline_drift
from .report import Report
from .store import MemoryStore, SiteStore, release_freed_memory
from .tolerance import Tolerance, working_dtype


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
    """The vocabulary of the model's embedding, if it is an ``nn.Embedding``."""
    for stage, path in layout.outside:
        if stage == "embed":
            module = model.get_submodule(path)
            if isinstance(module, nn.Embedding):
                return module.num_embeddings
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def describe_side(model: nn.Module, layout: Layout, label: str | None) -> dict[str, Any]:
    return {
        "model": label or type(model).__name__,
        "class": type(model).__name__,
        "device": str(model_device(model)),
        "dtype": dtype_name(model_dtype(model)),
        "hook_map": layout.hook_map.name,
    }


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
    ref_layout = resolve(reference, reference_hooks)
    cand_layout = resolve(candidate, candidate_hooks)
    check_block_counts(len(ref_layout.blocks), len(cand_layout.blocks))
    if isinstance(inputs, torch.Tensor):
        check_vocab(inputs, vocab_size(reference, ref_layout), side="reference")
        check_vocab(inputs, vocab_size(candidate, cand_layout), side="candidate")
    with ExitStack() as stack:
        stack.enter_context(eval_mode(reference))
        stack.enter_context(eval_mode(candidate))
        ref_meta = describe_side(reference, ref_layout, labels[0])
        cand_meta = describe_side(candidate, cand_layout, labels[1])
        if save_dumps is not None or stream:
            folder = Path(save_dumps) if save_dumps is not None else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="blockdiff-")))
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DumpError(f"cannot create {folder}: {exc.strerror or exc}", path=str(folder)) from None
            stores = []
            for name, model, layout, meta in (
                ("reference", reference, ref_layout, ref_meta),
                ("candidate", candidate, cand_layout, cand_meta),
            ):
                path = folder / f"{name}.h5"
                _stream(name, model, layout, inputs, path, _dump_meta(meta, inputs, layout))
                # The dumps were just written by this process: no need to probe them.
                reader = stack.enter_context(DumpReader(path, probe=False))
                reader.meta = meta
                stores.append(reader)
            ref_store, cand_store = stores
        else:
            return _in_memory(
                [("reference", reference, ref_layout, ref_meta), ("candidate", candidate, cand_layout, cand_meta)],
                inputs,
                lambda stores: _localize(
                    Side("reference", reference, ref_layout, stores[0]),
                    Side("candidate", candidate, cand_layout, stores[1]),
                    inputs,
                    tolerance,
                    fast_path=fast_path,
                    capacity_factors=capacity_factors,
                ),
            )
        return _localize(
            Side("reference", reference, ref_layout, ref_store),
            Side("candidate", candidate, cand_layout, cand_store),
            inputs,
            tolerance,
            fast_path=fast_path,
            capacity_factors=capacity_factors,
        )


def _localize(
    ref: Side,
    cand: Side,
    inputs: Inputs,
    tolerance: Tolerance | None,
    *,
    fast_path: bool,
    capacity_factors: tuple[float, ...],
) -> Report:
    """Localize a captured pair of sides (the candidate live) into a report."""
    tolerance = (tolerance or Tolerance()).resolved(
        same_dtype=ref.dtype == cand.dtype,
        same_device=ref.device == cand.device,
    )
    localizer = Localizer(ref, cand, tolerance, fast_path=fast_path, capacity_factors=capacity_factors)
    with torch.inference_mode():
        stages = _run("candidate", lambda: list(localizer.stages()))
        blocks = _run("candidate", lambda: _counted(localizer.blocks(), "localize", len(cand.layout.blocks)))
    report = Report(
        reference=dict(ref.store.meta),
        candidate=dict(cand.store.meta),
        inputs=describe_inputs(inputs),
        tolerance=tolerance.to_dict(localizer.dtype),
        stages=stages,
        blocks=blocks,
        moe=localizer.moe,
        created=_now(),
        version=__version__,
    )
    _nonfinite_notes(report, localizer.nonfinite)
    if tolerance.calibrated and not localizer.calibrate:
        report.notes.append(
            "calibrated tolerance needs the live reference modules, which a dump does not hold: "
            "fixed thresholds were used"
        )
        report.tolerance["policy"] = "fixed"
    return report


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


def _dump_meta(side: dict[str, Any], inputs: Inputs, layout: Layout) -> dict[str, Any]:
    return {**side, "layout": layout.to_dict(), "inputs_digest": digest(inputs)}


def capture(
    model: nn.Module,
    inputs: Inputs,
    out: str | Path,
    *,
    hooks: HookMap | None = None,
    compress: str | None = None,
    label: str | None = None,
) -> None:
    """Run ``model`` once on ``inputs`` and stream every site into the dump ``out``.

    Sites are written as the forward produces them, so memory does not grow with the
    number of blocks. The dump is complete, or absent (written under a temporary name and
    renamed at the end).
    """
    check_inputs(inputs)
    layout = resolve(model, hooks)
    if isinstance(inputs, torch.Tensor):
        check_vocab(inputs, vocab_size(model, layout), side="model")
    meta = _dump_meta(describe_side(model, layout, label), inputs, layout)
    with eval_mode(model):
        _stream("captured", model, layout, inputs, out, meta, compress=compress)


def _stream(side: str, model: nn.Module, layout: Layout, inputs: Inputs, path: str | Path, meta: dict, *, compress: str | None = None) -> None:
    """Capture ``model`` into a dump, each site written as its call finishes.

    Tensors are written from the model's own (no copies, see :func:`~blockdiff.capture.record`);
    should the model change one in place before its site is written, the dump is thrown
    away and the capture runs again with copies.
    """
    for copy in (False, True):
        try:
            with DumpWriter(path, meta=meta, compress=compress) as writer:
                writer.add_inputs(inputs)
                _run(side, _record, side, model, layout, writer, inputs, copy)
        except TensorChanged:
            continue
        break
    release_freed_memory()


def _dump_side(name: str, dump: DumpReader, label: str | None) -> Side:
    meta = dump.meta
    layout = layout_from_dict(meta.get("layout") or {})
    dump_label = label or str(dump.path)
    dump.meta = {
        "model": dump_label,
        "class": meta.get("class"),
        "device": meta.get("device"),
        "dtype": meta.get("dtype"),
        "hook_map": meta.get("hook_map"),
        "dump": str(dump.path),
        "captured_model": meta.get("model"),
    }
    return Side(
        name,
        None,
        layout,
        dump,
        captured_dtype=parse_dtype(str(meta.get("dtype", "float32"))),
        captured_device=torch.device(str(meta.get("device", "cpu"))),
    )


def replay(
    reference: str | Path,
    candidate: nn.Module,
    *,
    tolerance: Tolerance | None = None,
    candidate_hooks: HookMap | None = None,
    fast_path: bool = False,
    capacity_factors: tuple[float, ...] = (1.0, 1.25),
    labels: tuple[str | None, str | None] = (None, None),
) -> Report:
    """Run a live ``candidate`` on a reference dump's inputs and localize against it.

    The reference is read block by block from the dump. Without live reference modules
    there are no calibrated noise floors: the fixed thresholds judge, and the report says so.
    """
    with DumpReader(reference) as dump:
        inputs = dump.inputs()
        if inputs is None:
            raise DumpError(f"{reference}: the dump holds no model inputs to replay", path=str(reference))
        ref = _dump_side("reference", dump, labels[0])
        cand_layout = resolve(candidate, candidate_hooks)
        check_block_counts(len(ref.layout.blocks), len(cand_layout.blocks))
        if isinstance(inputs, torch.Tensor):
            check_vocab(inputs, vocab_size(candidate, cand_layout), side="candidate")
        with eval_mode(candidate):
            report = _in_memory(
                [("candidate", candidate, cand_layout, describe_side(candidate, cand_layout, labels[1]))],
                inputs,
                lambda stores: _localize(
                    ref,
                    Side("candidate", candidate, cand_layout, stores[0]),
                    inputs,
                    tolerance,
                    fast_path=fast_path,
                    capacity_factors=capacity_factors,
                ),
            )
    report.notes.insert(0, f"replay: the reference is the dump {reference}")
    return report


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
        ref = _dump_side("reference", ref_dump, labels[0])
        cand = _dump_side("candidate", cand_dump, labels[1])
        check_block_counts(len(ref_dump.block_indices()), len(cand_dump.block_indices()))
        ref_inputs, cand_inputs = ref_dump.inputs(), cand_dump.inputs()
        if ref_inputs is not None and cand_inputs is not None and digest(ref_inputs) != digest(cand_inputs):
            raise InputError(
                f"the dumps were captured on different inputs ({reference}: {digest(ref_inputs)}, "
                f"{candidate}: {digest(cand_inputs)}); capture both on the same token ids"
            )
        tolerance = (tolerance or Tolerance(policy="fixed")).resolved(same_dtype=True, same_device=True)
        if tolerance.calibrated:
            tolerance = Tolerance("fixed", dict(tolerance.overrides), tolerance.multiplier, tolerance.atol, tolerance.fixed)
        dtype = working_dtype(ref.dtype, cand.dtype)
        scan = NonfiniteScan()
        stages, blocks = offline_drift(ref_dump, cand_dump, tolerance, dtype, scan)
        report = Report(
            reference=dict(ref_dump.meta),
            candidate=dict(cand_dump.meta),
            inputs=describe_inputs(ref_inputs) if ref_inputs is not None else {"kind": None, "shape": None, "digest": None},
            tolerance=tolerance.to_dict(dtype),
            stages=stages,
            blocks=blocks,
            created=_now(),
            version=__version__,
        )
        _nonfinite_notes(report, scan)
    report.notes.append(
        "offline comparison of two dumps: only drift could be computed, judged against fixed "
        "thresholds; local errors (which sub-path is wrong rather than where the error shows) "
        f"need a live candidate: blockdiff diff {reference} CANDIDATE_MODEL"
    )
    return report


# Where progress goes: a callable (what, done, total), set by the CLI around a command.
PROGRESS: contextvars.ContextVar[Callable[[str, int, int], None] | None] = contextvars.ContextVar(
    "blockdiff_progress", default=None
)


class _Counting:
    """Passes sites on to a store and reports each finished block as progress."""

    def __init__(self, store: SiteStore, what: str, total: int, report: Callable[[str, int, int], None]) -> None:
        self.store, self.meta, self.what, self.total, self.report = store, store.meta, what, total, report
        self.done = 0
        self.records_by_reference = getattr(store, "records_by_reference", None)

    def clear(self) -> None:
        self.store.clear()
        self.done = 0

    @property
    def references(self) -> Any:
        return self.store.references

    @references.setter
    def references(self, snapshot: Any) -> None:
        self.store.references = snapshot

    def add(self, site) -> None:
        self.store.add(site)
        if site.stage == "block" and site.subpath is None:
            self.done += 1
            self.report(self.what, self.done, self.total)


def _record(side: str, model: nn.Module, layout: Layout, store: SiteStore, inputs: Inputs, copy: bool = False) -> None:
    report = PROGRESS.get()
    if report is not None:
        store = _Counting(store, f"capture {side}", len(layout.blocks), report)
    record(model, layout, store, inputs, copy=copy)


def _in_memory(
    models: list[tuple[str, nn.Module, Layout, dict]], inputs: Inputs, localize: Callable[[list[MemoryStore]], Report]
) -> Report:
    """Record each (side, model, layout, meta) into memory and localize from there.

    Memory stores hold the models' own CPU tensors (:func:`~blockdiff.capture.record`).
    Should a model write into one of them while localization runs it again (a module
    reusing a buffer it returned before), the run is repeated on copies.
    """
    for copy in (False, True):
        stores = [MemoryStore(meta) for *_, meta in models]
        for (side, model, layout, _), store in zip(models, stores):
            _run(side, _record, side, model, layout, store, inputs, copy)
        report = localize(stores)
        if not any(store.changed() for store in stores):
            break
    return report


def _counted(items: Iterator, what: str, total: int) -> list:
    report, done = PROGRESS.get(), []
    for item in items:
        done.append(item)
        if report is not None:
            report(what, len(done), total)
    return done


def _run(side: str, fn, *args):
    """Call ``fn``; an exception raised by model code becomes a :class:`ModelRunError`."""
    try:
        return fn(*args)
    except BlockdiffError:
        raise
    except Exception as exc:
        raise ModelRunError(f"the {side} model raised {type(exc).__name__}: {exc}", side=side) from exc


def describe_inputs(inputs: Inputs) -> dict[str, Any]:
    if isinstance(inputs, torch.Tensor):
        kind, shape = "token_ids", list(inputs.shape)
    else:
        kind, shape = ("args" if isinstance(inputs, tuple) else "kwargs"), None
    return {"kind": kind, "shape": shape, "digest": digest(inputs)}
