"""A candidate that is the reference's own code at its precision (a model against its own
cast) is the reference's free run: a calibrated diff takes the candidate's record for the
drift floors instead of running the reference a third time, with the same report; and a
floor experiment whose call is bit for bit the one the candidate's check made takes that
check's output instead of running again, with the same report."""

from __future__ import annotations

import json
import types

import pytest
import torch

from blockdiff import diff
from blockdiff.experiments import Experiments, same_arguments
from blockdiff.sides.live import PrecisionSide
from blockdiff.sides.precision import cast_copy, twins
from samples import hf_families, hf_llama, tinylm

IDS = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))


def _builders():
    return {
        "tinylm": lambda seed=0, **kw: tinylm.build(seed=seed, **kw),
        "qwen3": lambda seed=0, **kw: hf_llama.build(arch="qwen3", seed=seed, **kw),
        "gemma2": lambda seed=0, **kw: hf_families.build(family="gemma2", seed=seed, **kw),  # a partial as activation
    }


def _spy(monkeypatch) -> list[bool]:
    answers: list[bool] = []
    real = PrecisionSide.runs_as
    monkeypatch.setattr(PrecisionSide, "runs_as", lambda self, other: answers.append(real(self, other)) or answers[-1])
    return answers


def _as_json(report) -> str:
    found = report.to_dict()
    found.pop("created", None)  # the time of the run, to the second
    return json.dumps(found, sort_keys=True, default=str)


@pytest.mark.parametrize(
    ("family", "stream"), [("tinylm", False), ("qwen3", False), ("gemma2", False), ("tinylm", True)]
)
def test_a_model_against_its_own_cast_is_its_own_free_run(family, stream, monkeypatch):
    # Streamed, the candidate's record is its dump, read back.
    build = _builders()[family]
    reference, candidate = build(), build().to(torch.bfloat16)
    answers = _spy(monkeypatch)
    taken = diff(reference, candidate, IDS, stream=stream)
    assert answers == [True] and taken.first_divergence is None
    monkeypatch.setattr(PrecisionSide, "runs_as", lambda self, other: False)
    assert _as_json(diff(reference, candidate, IDS, stream=stream)) == _as_json(taken)  # report for report


def test_a_planted_bug_is_not_a_twin_and_is_still_found(monkeypatch):
    from samples import bugs

    reference = tinylm.build()
    answers = _spy(monkeypatch)
    report = diff(reference, bugs.gate_up_swapped().to(torch.bfloat16), IDS)
    assert answers == [False]
    assert (report.first_divergence.block, report.first_divergence.subpath) == (bugs.DEFAULT_BLOCK, "ffn")


def _nudged(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        weight = next(p for p in model.parameters() if p.dim() == 2)
        flat = weight.view(-1)
        flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf"), dtype=flat.dtype))
    return model


def _hooked(model: torch.nn.Module) -> torch.nn.Module:
    next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(lambda *a: None)
    return model


def _patched(model: torch.nn.Module) -> torch.nn.Module:
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.forward = types.MethodType(lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias), linear)
    return model


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_nudged, id="one weight one ulp away"),
        pytest.param(_hooked, id="a forward hook"),
        pytest.param(_patched, id="a module's forward replaced"),
        pytest.param(lambda m: m.to(torch.float16), id="another dtype"),
    ],
)
def test_what_makes_two_models_not_twins(change):
    reference = hf_llama.build(arch="llama")
    copy = cast_copy(reference, torch.bfloat16, torch.device("cpu"))
    assert twins(copy, hf_llama.build(arch="llama").to(torch.bfloat16))
    assert not twins(copy, change(hf_llama.build(arch="llama").to(torch.bfloat16)))


def test_a_setting_makes_two_models_not_twins():
    # The same classes and weights, one setting apart (the norms' epsilon, in the
    # configuration and in each norm module).
    copy = cast_copy(hf_llama.build(arch="llama"), torch.bfloat16, torch.device("cpu"))
    other = hf_llama.build(arch="llama", rms_norm_eps=1e-5).to(torch.bfloat16)
    assert hf_llama.build(arch="llama").config.rms_norm_eps != 1e-5
    assert not twins(copy, other)


def _floor_runs(monkeypatch) -> list[str]:
    """The module paths the floor side runs (modules and blocks), in order."""
    ran: list[str] = []
    module_on, run_block = PrecisionSide._module_on, PrecisionSide.run_block
    monkeypatch.setattr(PrecisionSide, "_module_on", lambda self, path, *a: ran.append(path) or module_on(self, path, *a))
    monkeypatch.setattr(PrecisionSide, "run_block", lambda self, path, *a: ran.append(path) or run_block(self, path, *a))
    return ran


@pytest.mark.parametrize(("family", "stream"), [("tinylm", False), ("qwen3", False), ("gemma2", False), ("tinylm", True)])
def test_a_floor_that_is_the_candidates_check_is_not_run_again(family, stream, monkeypatch):
    build = _builders()[family]
    reference, candidate = build(), build().to(torch.bfloat16)
    ran = _floor_runs(monkeypatch)
    taken = diff(reference, candidate, IDS, stream=stream)
    shared = list(ran)
    ran.clear()
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    everything = diff(reference, candidate, IDS, stream=stream)
    assert _as_json(everything) == _as_json(taken)  # report for report
    assert taken.first_divergence is None
    # Each of these families casts its rotary frequencies with the model, so the candidate's
    # own rotary tables differ from the reference's cast: the attention and every block
    # call (which hands them on) run on the floor side all the same; norms, MLPs, the
    # final norm and the head do not.
    assert len(shared) < len(ran)
    assert set(shared) < set(ran)
    assert not any(path.endswith(("mlp", "ffn", "lm_head")) for path in shared)
    assert any(path.endswith(("self_attn", "attn")) for path in shared)


def test_a_floor_is_not_shared_with_a_candidate_that_is_not_a_twin(monkeypatch):
    from samples import bugs

    found: list[bool] = []
    real = Experiments.floor_is_check
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *a, **k: found.append(real(self, *a, **k)) or found[-1])
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=2).to(torch.bfloat16), IDS)
    assert found and not any(found)
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "ffn")


def test_a_router_frozen_in_a_block_run_is_not_compared_so_that_run_is_not_shared(monkeypatch):
    from samples import hf_moe

    reference, candidate = hf_moe.build(), hf_moe.build().to(torch.bfloat16)
    ran = _floor_runs(monkeypatch)
    taken = diff(reference, candidate, IDS)
    shared = list(ran)
    ran.clear()
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    assert _as_json(diff(reference, candidate, IDS)) == _as_json(taken)
    blocks = {path for path in ran if path.rsplit(".", 1)[-1].isdigit()}
    assert blocks and blocks <= set(shared)  # each block's runs, routing frozen in every one
    assert len(shared) < len(ran)


def test_calls_laid_out_differently_are_not_the_same():
    x = torch.randn(4, 6)
    assert same_arguments(((x,), {}), ((x.to(torch.bfloat16),), {}), torch.bfloat16, strides=True)
    t = x.t().contiguous().t()  # the same values and shape, column-major
    assert same_arguments(((x,), {}), ((t,), {}), None)
    assert not same_arguments(((x,), {}), ((t,), {}), None, strides=True)
    assert not same_arguments(((x,), {"scale": 1.0}), ((x,), {"scale": 2.0}), None, strides=True)


def test_a_model_without_rotary_tables_runs_no_floor_of_its_own_cast(monkeypatch):
    # GPT-2's positions are an embedding: every call the candidate's checks make is the
    # reference's, cast, so every floor is a check's output and the floor side runs nothing.
    build = lambda: hf_families.build(family="gpt2")  # noqa: E731
    reference, candidate = build(), build().to(torch.bfloat16)
    ran = _floor_runs(monkeypatch)
    taken = diff(reference, candidate, IDS)
    assert ran == [] and taken.first_divergence is None
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    assert _as_json(diff(reference, candidate, IDS)) == _as_json(taken)
    assert ran
