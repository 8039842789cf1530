"""A candidate that is the reference's own code at its precision (a model against its own
cast) is the reference's free run: a calibrated diff takes the candidate's record for the
drift floors instead of running the reference a third time, with the same report."""

from __future__ import annotations

import json
import types

import pytest
import torch

from blockdiff import diff
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
