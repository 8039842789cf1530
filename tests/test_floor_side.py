"""The floor side is one cast copy of the reference; an experiment that is bit for bit a call
already made answers with that call's output, and the report is the same as when it runs."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from blockdiff import diff, resolve
from blockdiff import experiments as experiments_module
from blockdiff.sides.live import LiveSide
from blockdiff.sides.precision import cast_copy
from samples import bugs, tinylm


def test_a_cast_copy_is_the_deep_copy_cast_and_leaves_the_model_alone():
    model = tinylm.build()  # its head is tied to its embedding
    before = {name: t.clone() for name, t in model.state_dict().items()}
    made = cast_copy(model, torch.bfloat16, torch.device("cpu"))
    expected = copy.deepcopy(model).to(torch.bfloat16)
    assert made.state_dict().keys() == expected.state_dict().keys()
    for name, t in expected.state_dict().items():
        assert made.state_dict()[name].dtype == t.dtype and torch.equal(made.state_dict()[name], t), name
    for name, t in model.state_dict().items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    shared = _shared_parameters(model)
    assert shared and _shared_parameters(made) == shared


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters held by one object under several names (tied weights)."""
    by_object: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(name)
    return sorted(names for names in by_object.values() if len(names) > 1)


def test_every_floor_experiment_runs_the_one_copy():
    model = tinylm.build()
    side = LiveSide("reference", model, resolve(model)).in_precision(torch.bfloat16, torch.device("cpu"))
    block = side.module("blocks.1")
    assert side.module("blocks.1") is block and side.module("blocks.1.ffn") is block.ffn
    assert next(block.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32


def _checks(report) -> list:
    data = report.to_dict()
    data.pop("created")
    return data


@pytest.mark.parametrize("candidate", ["clean", "ffn bug"])
def test_answering_from_recorded_calls_changes_no_number_of_a_mixed_precision_diff(ids, monkeypatch, candidate):
    """A float32 reference against a bfloat16 candidate, calibrated: with answers taken from
    bit-identical recorded calls (the candidate's own, the free run's) the report is the
    same, number for number, as with every experiment run; and some were answered."""
    reference = tinylm.build()
    cand = (tinylm.build() if candidate == "clean" else bugs.gelu_for_silu(block=2)).to(torch.bfloat16)
    answered = {"own": 0, "free run": 0}
    same_bits, same_call = experiments_module.same_bits, experiments_module.same_call

    def counting_bits(a, b):
        found = same_bits(a, b)
        answered["own"] += found
        return found

    def counting_call(a, b, dtype):
        found = same_call(a, b, dtype)
        answered["free run"] += found
        return found

    monkeypatch.setattr(experiments_module, "same_bits", counting_bits)
    monkeypatch.setattr(experiments_module, "same_call", counting_call)
    # The clean candidate is the reference's own cast: a floor whose call is the check's
    # takes the check's output before the free run is asked (tests/test_twins.py); here
    # the recorded calls answer alone.
    monkeypatch.setattr(experiments_module.Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    reused = diff(reference, cand, ids)
    assert answered["own"] > 0 and answered["free run"] > 0
    monkeypatch.setattr(experiments_module, "same_bits", lambda a, b: False)
    monkeypatch.setattr(experiments_module, "same_call", lambda a, b, dtype: False)
    everything_run = diff(reference, cand, ids)
    assert _checks(reused) == _checks(everything_run)
    first = reused.first_divergence
    if candidate == "clean":
        assert first is None
    else:
        assert (first.block, first.subpath) == (2, "ffn")


def test_a_floor_module_overwriting_what_it_returned_leaves_the_report_unchanged(ids, monkeypatch):
    """The free run holds the floor copy's own tensors (no copies). Block 3 of the reference
    returns one buffer, overwritten by each call: the floor experiments call the copy's
    block 3 again, which overwrites the free run's block 3 output. The diff notices and
    runs again on copies: the report is the one of a reference without the buffer."""
    from blockdiff.sides.live import PrecisionSide

    cand = bugs.gelu_for_silu(block=2).to(torch.bfloat16)
    plain = _checks(diff(tinylm.build(), cand, ids))
    reference = tinylm.build()
    block = reference.blocks[3]

    class Reusing(type(block)):  # type: ignore[misc]
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            reused = getattr(self, "reused", None)
            if reused is None or reused.dtype != out.dtype:
                self.reused = reused = torch.empty_like(out)
            return reused.copy_(out)

    Reusing.__name__ = Reusing.__qualname__ = type(block).__name__  # the hook map finds it by name
    block.__class__ = Reusing
    free_runs = []
    record = PrecisionSide.record
    monkeypatch.setattr(PrecisionSide, "record", lambda self, *a, **k: free_runs.append(k.get("hold")) or record(self, *a, **k))
    assert _checks(diff(reference, cand, ids)) == plain
    assert free_runs == ["kept", None]  # held by reference, changed, recorded again with copies


def test_a_floor_bit_for_bit_the_candidates_takes_the_checks_number(ids, monkeypatch):
    """A model against its own bfloat16 cast: each floor experiment computes, bit for bit,
    what the candidate's computed, so its relative L2 is the check's. The report is the
    same, number for number, as with every floor summed; and most floors were answered."""
    from blockdiff.experiments import Experiments

    reference, cand = tinylm.build(), tinylm.build().to(torch.bfloat16)
    summed = []
    rel_l2 = experiments_module.rel_l2
    monkeypatch.setattr(experiments_module, "rel_l2", lambda a, b: summed.append(1) or rel_l2(a, b))
    answered = diff(reference, cand, ids)
    left = len(summed)
    summed.clear()
    monkeypatch.setattr(Experiments, "floor_l2", lambda self, ref, got, compared=None: experiments_module.rel_l2(ref, got))
    everything_summed = diff(reference, cand, ids)
    assert _checks(answered) == _checks(everything_summed)
    assert answered.first_divergence is None
    assert len(summed) > 20 and left < len(summed) / 4


@pytest.mark.parametrize("shape", [(2, 16, 64), (16, 64)], ids=["3d", "2d"])
def test_a_floor_linears_input_gradient_is_the_same_product_and_the_rest_is_autograds(shape):
    """In the floor's backward context (forced here for bfloat16, whatever this CPU has),
    ``F.linear`` gives the same output bits, the same weight and bias gradients, and an
    input gradient of the same product (elements one rounding apart at most)."""
    from blockdiff.sides import precision

    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(shape, generator=gen).to(torch.bfloat16)
    w0 = (torch.randn(48, 64, generator=gen) / 8).to(torch.bfloat16)
    b0 = torch.randn(48, generator=gen).to(torch.bfloat16)
    seed = torch.randn((*shape[:-1], 48), generator=gen).to(torch.bfloat16)

    def run(mode):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        with mode:
            y = torch.nn.functional.linear(x, w, b)
            passed = type(y.grad_fn).__name__
        return (y.detach(), *torch.autograd.grad(y, (x, w, b), seed)), passed

    (y, gx, gw, gb), native = run(contextlib.nullcontext())
    (y2, gx2, gw2, gb2), rerouted = run(precision._FloorLinear(frozenset({torch.bfloat16})))
    assert rerouted == "_InputGradientBackward" and native != rerouted
    assert torch.equal(y, y2) and torch.equal(gw, gw2) and torch.equal(gb, gb2)
    exact = seed.double().reshape(-1, 48) @ w0.double()
    assert (gx2.double().reshape(-1, 64) - exact).abs().max() <= (exact.abs().max() * 2**-7)
    assert (gx2 == gx).float().mean() > 0.99 and ((gx2.double() - gx.double()).abs() <= gx.double().abs() * 2**-7).all()
    # No input gradient asked for (an input that does not require grad): autograd's own path.
    with precision._FloorLinear(frozenset({torch.bfloat16})):
        y3 = torch.nn.functional.linear(x0, w0.clone().requires_grad_(), b0)
    assert type(y3.grad_fn).__name__ != "_InputGradientBackward" and torch.equal(y3.detach(), y)


def test_the_floors_backward_context_acts_only_where_the_matmul_is_a_scalar_loop():
    from blockdiff.sides import precision

    slow = precision._scalar_matmul_dtypes()
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float16, "cpu"), (torch.bfloat16, "meta")):
        with precision.floor_backward(dtype, torch.device(device)):
            active = torch._C._len_torch_function_stack() > 0
        assert active == (device == "cpu" and dtype in slow), (dtype, device)
    assert torch.float32 not in slow


def test_a_backward_diff_against_other_code_judges_the_same_with_the_floors_input_gradients_rerouted(monkeypatch):
    """The floor side's Linear input gradients by the column-major weight (the context
    forced on) or by autograd's own kernel (forced off): the same verdict, and every
    threshold within 0.1 % (the gradients differ only by elements one rounding apart)."""
    from blockdiff import Options, run
    from blockdiff.sides import precision

    pytest.importorskip("transformers")
    from samples import hf_llama

    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    ran = []
    backward = precision._InputGradient.backward
    monkeypatch.setattr(precision._InputGradient, "backward", staticmethod(lambda ctx, g: ran.append(1) or backward(ctx, g)))

    def thresholds(slow: frozenset) -> tuple[str, list[float]]:
        monkeypatch.setattr(precision, "_scalar_matmul_dtypes", lambda: slow)
        candidate = hf_llama.build().to(torch.bfloat16)
        for module in candidate.modules():  # other code: every floor measured on the floor side
            module.__class__ = type("Ported" + type(module).__name__, (type(module),), {})
        report = run(hf_llama.build(), candidate, ids, options=Options(backward=True))
        back = report.backward
        found = [c.threshold.value for b in back.blocks for s in b.subpaths.values() for c in s.checks]
        found += [b.block.threshold.value for b in back.blocks if b.block] + [s.local.threshold.value for s in back.stages if s.local]
        return report.verdict(), found

    verdict_on, on = thresholds(frozenset({torch.bfloat16}))
    assert ran, "the floor's Linear input gradients were not rerouted"
    ran.clear()
    verdict_off, off = thresholds(frozenset())
    assert not ran
    assert verdict_on == verdict_off == "forward: no divergence; backward: no divergence"
    assert len(on) == len(off) > 20
    assert on == pytest.approx(off, rel=1e-3)
