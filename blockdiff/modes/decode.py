"""The decode mode (``--decode N``): the prompt prefilled, then N steps of one token, each
side with its own cache, every step localized (:mod:`blockdiff.decoding` holds the
steppers, the caches as sites and the uncached reference; docs/decode.md).

A live reference decodes beside the candidate; a reference dump of a decode (schema 5)
is replayed step by step; with no candidate, the model runs against its own uncached
forward (:meth:`Decode.alone`). :func:`capture` writes a decode dump.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import decoding
from ..capture import TensorChanged, with_copies
from ..dump import DumpWriter
from ..errors import InputError, OptionsError, run_model_code
from ..inputs import Inputs, check_inputs
from ..experiments import Experiments
from ..pairing import BlockPair
from ..report import Note, Report
from ..sides import Side
from ..tolerance import Tolerance, working_dtype
from .forward import with_inputs
from .judging import localize
from .options import Kinds, Options
from .recording import dump_inputs, dump_meta, takes


class Decode:
    """Decode steps with a cache, every step localized."""

    name = "decode"

    def asked(self, options: Options, ref: Side, cand: Side) -> bool:
        return bool(options.decode) or decoding.stored_steps(ref) is not None

    def refusal(self, options: Options, kinds: Kinds) -> OptionsError | None:
        if not options.decode:
            return None
        if options.decode < 0:
            return OptionsError("{decode} must be a number of steps, found {found}", found=options.decode)
        if kinds[1] == "dump":
            return OptionsError(
                "{decode} replays a live candidate against a reference dump of a decode (blockdiff capture MODEL "
                "--decode N): two dumps of decodes are not compared"
            )
        if options.save_dumps is not None or options.stream or options.rank:
            return OptionsError("{decode} runs in memory, on one process: not with {stream}, {save_dumps}, {rank} or torchrun")
        if options.max_memory is not None:
            return OptionsError(
                "{decode} runs every block at every step, a cache beside it: not with {max_memory}, which reads a block's "
                "weights once per pass; decode with the models in memory"
            )
        return None

    def alone(self, options: Options) -> Options:
        # The model against its own cache: its uncached forward is the reference.
        return replace(options, uncached_reference=True) if options.decode else options

    def run(self, ref: Side, cand: Side, inputs: Any, options: Options) -> Report:
        if not ref.live:
            return replayed(ref, cand, inputs, options, decoding.stored_steps(ref))

        def decoded_on(prompt: Inputs) -> Report:
            takes(cand, check_inputs(prompt))
            return decoded(ref, cand, prompt, options)

        return with_inputs(ref, inputs, decoded_on)


def replayed(ref: Side, cand: Side, inputs: Any, options: Options, stored_steps: int | None) -> Report:
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
        raise OptionsError("{where} holds {stored} decode steps; {decode}={steps} asks for more", where=where, stored=stored_steps, steps=steps)
    prompt = dump_inputs(ref, cand, inputs)
    captured = (ref.store.meta.get("decode") or {}).get("cache", options.caches[0])  # type: ignore[union-attr]
    report = decoded(ref, cand, prompt, replace(options, decode=steps, caches=(captured, options.caches[1])))
    report.notes.insert(1, Note("replay", f"replay: the reference is the decode dump {where} ({stored_steps} steps, {steps} replayed)"))
    return report


def decoded(ref: Side, cand: Side, prompt: Inputs, options: Options) -> Report:
    """Both sides live, decoding: the prompt prefilled (step 0), then ``options.decode``
    steps of one token fed to both (the reference's greedy choice), each side with its own
    cache; every step localized, its modules' experiments with caches of their own carried
    from step to step (:mod:`blockdiff.decoding`)."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise InputError("decode steps need token ids [batch, tokens] as the prompt")
    if ref.lockstep or cand.lockstep:
        raise OptionsError("{decode} runs in memory, on one process: not under torchrun")
    length = prompt.shape[1] + options.decode + 1
    # Each live side's decode steps (a reference dump's are stored: decoding.stored).
    steppings = [decoding.stepping(side) if side is cand or ref.live else None for side in (ref, cand)]
    steppers = [
        decoding.stepper_for(stepping.model, kind=kind, length=length) if stepping is not None else None
        for stepping, kind in zip(steppings, options.caches)
    ]
    steps = options.decode
    if options.uncached_reference and (ref.dtype != cand.dtype or ref.device != cand.device):
        raise OptionsError("a model against its own cache runs in one precision: give a CANDIDATE to compare precisions")
    tolerance = (options.tolerance or Tolerance()).resolved(same_dtype=ref.dtype == cand.dtype, same_device=ref.device == cand.device)

    def attempt(copy: bool) -> tuple[list[Report], Any, Any]:
        """The decode and its localization; the records hold the models' own tensors unless
        ``copy`` (:func:`~blockdiff.capture.with_copies`: should a model change one of them
        in place meanwhile, the whole attempt runs again on copies)."""
        hold = None if copy else "kept"
        for stepping, stepper in zip(steppings, steppers):
            if stepping is not None:
                stepping.start(stepper)  # fresh experiment caches
        if not ref.live:
            ref_run = decoding.stored(ref, steps)
        elif options.uncached_reference:
            ref_run = run_model_code("reference", decoding.uncached, ref, prompt, steps)
        else:
            ref_run = run_model_code("reference", decoding.decode, ref, prompt, steps, steppers[0], hold=hold, contents=True)
        # Each side's own cache contents too: an experiment cache that shadows its side's own
        # run holds those (decoding.cache_checks).
        cand_run = run_model_code("candidate", decoding.decode, cand, prompt, steps, steppers[1], ref_run.greedy, hold=hold, contents=True)
        live_floors = tolerance.calibrated and ref.live
        floor = ref.in_precision(working_dtype(ref.dtype, cand.dtype), cand.device) if live_floors else None
        floor_run = None
        if floor is not None and not floor.runs_as(cand):
            floor_run = run_model_code(
                "reference", decoding.decode, floor, prompt, steps, steppers[0], ref_run.greedy, hold=hold, contents=True
            )
        layers = decoding.attention_layers(ref, cand)
        stepped = [*steppings, None if floor is None else decoding.stepping(floor)]
        reports = []
        for step in range(steps + 1):
            for stepping in stepped:
                if stepping is not None:
                    stepping.begin_step()
            # The reference as this step: itself, or the step of its uncached run (decoding.uncached).
            ref_step = ref_run.sides[step] if ref_run.sides else ref
            ref_step.store, cand.store = ref_run.stores[step], cand_run.stores[step]
            free = floor_run.stores[step] if floor_run is not None else cand.store
            length = prompt.shape[1] + step

            def states(experiments: Experiments, pair: BlockPair, step: int = step, length: int = length) -> dict[str, list]:
                """The block's cache after this step (decoding.cache_checks), judged by the localizer with its token mixer."""
                own = cand_run.held(step), (floor_run or cand_run).held(step)
                layer = [entry for entry in layers if entry[0] == pair.index]
                found = decoding.cache_checks(experiments, cand, layer, ref_run.held(step) or [], length, step, own)
                return {"attention": found[pair.index]} if found.get(pair.index) else {}

            reports.append(
                localize(ref_step, cand, prompt, replace(options, tolerance=tolerance), free_run=lambda side: free,  # called at once, in this step
                          stateful=True, states=states, no_floors=NO_FLOORS)
            )
            # The reference's own calls, for the next steps' drill-downs (they replay its
            # modules' children on the cache its run held then).
            if ref_step is ref and ref.live:
                decoding.remember(ref, ref_run.stores[step])
        runs = [ref_run, cand_run, *([floor_run] if floor_run is not None else [])]
        if any(recording.changed() for run in runs for recording in run.recordings):
            raise TensorChanged("a model changed a recorded tensor in place while its decode was localized")
        return reports, ref_run, cand_run

    with ref.running(), cand.running():
        reports, ref_run, cand_run = with_copies(attempt)
    report = _steps_report(reports, prompt, options, decoding.first_difference(ref_run.greedy, cand_run.greedy))
    if options.uncached_reference:
        report.notes.insert(1, Note(
            "uncached-reference", "a model against its own cache: the reference is the same model without a cache, its whole sequence "
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
    report.notes.insert(0, Note(
        "decode", f"decode: the prompt ({int(prompt.shape[1])} tokens) prefilled as step 0, then {options.decode} steps of one "
        f"token fed to both sides (the reference's greedy choice), each with its own cache ({' and '.join(dict.fromkeys(options.caches))}); {where}"
        + ("" if tokens_differ is None else f"; the two sides' greedy tokens first differ after step {tokens_differ}")
    ))
    return report


def capture(
    side: Side, prompt: Inputs, out: str | Path, *, steps: int, cache: str, floors: Sequence, compress: str | None, durable: bool
) -> None:
    """A decode of ``steps`` steps on ``side`` (its own greedy tokens), written as a dump of
    schema 5: every step's sites with their step, the tokens fed, the cache's contents."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        raise InputError("decode steps need token ids [batch, tokens] as the prompt")
    if floors:
        raise OptionsError("{floors} with {decode}: noise floors are not stored for decode steps; a replay judges with fixed thresholds")
    if side.lockstep:
        raise OptionsError("{decode} captures on one process: not under torchrun")
    stepping = decoding.stepping(side)
    stepper = decoding.stepper_for(stepping.model, kind=cache, length=prompt.shape[1] + steps + 1)
    with side.running():
        stepping.start(stepper)
        found = run_model_code(side.name, decoding.decode, side, prompt, steps, stepper, hold=None, contents=True)
    meta = {**dump_meta(side, prompt), "decode": {"steps": steps, "prompt_length": int(prompt.shape[1]), "cache": cache}}
    with DumpWriter(out, meta=meta, compress=compress, durable=durable, decode=True) as writer:
        writer.add_inputs(prompt)
        for step, store in enumerate(found.stores):
            for site in store.sites():
                writer.add(site, step=step)
        writer.add_decode({"greedy": found.greedy, "cache": found.caches.to_structure(), "states": found.states})


# Why a replayed decode is judged by fixed thresholds.
NO_FLOORS = "floors are not stored for decode steps; diff the live reference to calibrate"

__all__ = ["Decode", "capture", "decoded", "replayed"]
