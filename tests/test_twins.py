"""A candidate that is the reference's own code at its precision (a model against its own
cast) is the reference's free run: a calibrated diff takes the candidate's record for the
drift floors instead of running the reference a third time; and every floor experiment is
the one the candidate's check ran (its calls are the ones the reference's code makes at
that precision), so each floor is its check's number and the floor side runs nothing. The
measured numbers are the ones a diff that runs every floor gives."""

from __future__ import annotations

import json
import types

import pytest
import torch

from blockdiff import diff
from blockdiff.experiments import Experiments, same_arguments
from blockdiff.sides.live import PrecisionSide
from blockdiff.sides.precision import cast_copy, twin_copy, twins
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


def _copies(monkeypatch) -> list[torch.dtype]:
    """The dtypes of the cast copies the floor side makes (``cast_copy`` calls)."""
    import blockdiff.sides.live as live

    made: list[torch.dtype] = []
    real = live.cast_copy
    monkeypatch.setattr(live, "cast_copy", lambda model, dtype, device: made.append(dtype) or real(model, dtype, device))
    return made


def _as_json(report) -> str:
    def timeless(node):  # without the time of the run, to the second (the report's and its parts')
        if isinstance(node, dict):
            return {key: timeless(value) for key, value in node.items() if key != "created"}
        if isinstance(node, list):
            return [timeless(value) for value in node]
        return node

    return json.dumps(timeless(report.to_dict()), sort_keys=True, default=str)


JUDGED = ("threshold", "floor", "ratio", "budget")  # what a floor decides


def _measured(report) -> str:
    """The report's measured numbers: :func:`_as_json` without what the floors decide
    (thresholds, ratios, which check of a sub-path is its worst)."""

    def strip(value):
        if isinstance(value, dict) and "checks" in value:  # a sub-path: its checks (which is worst is judged)
            return strip(value["checks"])
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in JUDGED}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return json.dumps(strip(json.loads(_as_json(report))), sort_keys=True)


def _floors(report) -> list[tuple[float, float]]:
    """(floor, relative L2) of every calibrated check of the report, nested ones too."""
    found: list[tuple[float, float]] = []

    def walk(value):
        if isinstance(value, dict):
            if value.get("basis") == "calibrated":
                found.append((value["floor"], value["rel_l2"]))
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(report.to_dict())
    return found


@pytest.mark.parametrize(
    ("family", "stream"), [("tinylm", False), ("qwen3", False), ("gemma2", False), ("tinylm", True)]
)
def test_a_model_against_its_own_cast_is_its_own_free_run(family, stream, monkeypatch):
    # Streamed, the candidate's record is its dump, read back.
    build = _builders()[family]
    reference, candidate = build(), build().to(torch.bfloat16)
    answers = _spy(monkeypatch)
    copies = _copies(monkeypatch)
    taken = diff(reference, candidate, IDS, stream=stream)
    assert answers == [True] and taken.first_divergence is None
    assert copies == []  # the reference was never copied at the candidate's precision
    floors = _floors(taken)
    assert len(floors) > 20 and all(floor == value for floor, value in floors)  # its error is the floor exactly
    monkeypatch.setattr(PrecisionSide, "runs_as", lambda self, other: False)
    measured = diff(reference, candidate, IDS, stream=stream)  # every floor run on the reference's code, cast
    assert _measured(measured) == _measured(taken)  # number for number
    assert measured.first_divergence is None


def test_a_planted_bug_is_not_a_twin_and_is_still_found(monkeypatch):
    from samples import bugs

    reference = tinylm.build()
    answers = _spy(monkeypatch)
    copies = _copies(monkeypatch)
    report = diff(reference, bugs.gate_up_swapped().to(torch.bfloat16), IDS)
    assert answers == [False] and copies == [torch.bfloat16]  # made once, for the floors
    assert (report.first_divergence.block, report.first_divergence.subpath) == (bugs.DEFAULT_BLOCK, "ffn")


def test_a_twins_backward_diff_runs_its_residual_experiments_on_the_twins_weights(monkeypatch):
    # The backward's residual experiments run the reference's modules at the candidate's
    # precision: for a twin, the copy found holds the candidate's own parameters, so the
    # reference's weights are never cast again; the report is the real copy's, number for number.
    import blockdiff.sides.live as live
    from blockdiff import Options, run

    reference, candidate = hf_llama.build(arch="llama"), hf_llama.build(arch="llama").to(torch.bfloat16)
    copies = _copies(monkeypatch)
    taken = run(reference, candidate, IDS, options=Options(backward=True))
    assert copies == [] and taken.verdict() == "forward: no divergence; backward: no divergence"
    monkeypatch.setattr(live, "twin_copy", lambda model, other, dtype, device, made: (lambda c: c if twins(c, other) else None)(made()))
    copied = run(reference, candidate, IDS, options=Options(backward=True))
    assert copies == [torch.bfloat16]
    assert _as_json(copied) == _as_json(taken)


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
    # Without the copy, the same answers; a twin's found with no copy made.
    made: list[torch.nn.Module] = []

    def real():
        made.append(cast_copy(reference, torch.bfloat16, torch.device("cpu")))
        return made[-1]

    twin = hf_llama.build(arch="llama").to(torch.bfloat16)
    found = twin_copy(reference, twin, torch.bfloat16, torch.device("cpu"), made=real)
    assert found is not None and made == []
    # The copy found runs the twin's own parameters (no second copy of the weights); its
    # buffers are its own (a forward may write into one).
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(found.parameters(), twin.parameters()))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(found.buffers(), twin.buffers()) if b.is_floating_point())
    assert twin_copy(reference, change(hf_llama.build(arch="llama").to(torch.bfloat16)), torch.bfloat16, torch.device("cpu")) is None


def _tied(model: torch.nn.Module) -> torch.nn.Module:
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _untied(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    return model


def _transposed(model: torch.nn.Module) -> torch.nn.Module:
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous().t())
    return model


@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        pytest.param(_tied, _tied, True, id="tied on both sides"),
        pytest.param(_tied, _untied, True, id="tied here, the same bits apart there"),
        pytest.param(_untied, _tied, True, id="apart here, tied there"),
        pytest.param(_tied, lambda m: m, False, id="tied here, other weights there"),
        pytest.param(_transposed, _transposed, True, id="a weight stored transposed"),
        pytest.param(_transposed, lambda m: m, False, id="transposed here only"),
    ],
)
def test_twin_copy_answers_as_the_copy_would(ours, theirs, expected):
    # Tensors compare by their bits, not by which are shared; layouts the chunked
    # comparison does not vouch for ask the real copy: the answer is the copy's, whichever way.
    reference = ours(hf_llama.build(arch="llama"))
    candidate = theirs(hf_llama.build(arch="llama")).to(torch.bfloat16)
    copy = cast_copy(reference, torch.bfloat16, torch.device("cpu"))
    assert twins(copy, candidate) is expected
    assert (twin_copy(reference, candidate, torch.bfloat16, torch.device("cpu")) is not None) is expected


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
    module_on, run_block = PrecisionSide.module_on, PrecisionSide.run_block
    monkeypatch.setattr(PrecisionSide, "module_on", lambda self, path, *a: ran.append(path) or module_on(self, path, *a))
    monkeypatch.setattr(PrecisionSide, "run_block", lambda self, path, *a: ran.append(path) or run_block(self, path, *a))
    return ran


@pytest.mark.parametrize(("family", "stream"), [("tinylm", False), ("qwen3", False), ("gemma2", False), ("tinylm", True)])
def test_a_floor_that_is_the_candidates_check_is_not_run_again(family, stream, monkeypatch):
    build = _builders()[family]
    reference, candidate = build(), build().to(torch.bfloat16)
    ran = _floor_runs(monkeypatch)
    taken = diff(reference, candidate, IDS, stream=stream)
    assert ran == [] and taken.first_divergence is None  # the floor side ran nothing
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    everything = diff(reference, candidate, IDS, stream=stream)
    assert _measured(everything) == _measured(taken)  # number for number
    assert everything.first_divergence is None
    # Run on the floor side, every module and block replays the reference's calls cast: the
    # attention and every block call (which hands them on) get the reference's rotary
    # tables cast, where the candidate computes its own from the frequencies cast with the
    # model: there the floors measured differ from the checks.
    assert any(path.endswith(("self_attn", "attn")) for path in ran) and any(path.endswith(("mlp", "ffn")) for path in ran)
    assert any(floor != value for floor, value in _floors(everything))


def test_a_floor_is_not_shared_with_a_candidate_that_is_not_a_twin(monkeypatch):
    from samples import bugs

    found: list[bool] = []
    real = Experiments.floor_is_check
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *a, **k: found.append(real(self, *a, **k)) or found[-1])
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=2).to(torch.bfloat16), IDS)
    assert found and not any(found)
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "ffn")


def test_an_moe_models_block_runs_with_routing_frozen_are_its_floors_too(monkeypatch):
    from samples import hf_moe

    reference, candidate = hf_moe.build(), hf_moe.build().to(torch.bfloat16)
    ran = _floor_runs(monkeypatch)
    taken = diff(reference, candidate, IDS)
    assert ran == [] and taken.first_divergence is None
    monkeypatch.setattr(Experiments, "floor_is_check", lambda self, *args, **kwargs: False)
    assert _measured(diff(reference, candidate, IDS)) == _measured(taken)
    blocks = {path for path in ran if path.rsplit(".", 1)[-1].isdigit()}
    assert blocks  # each block's runs, routing frozen in every one, measured on the floor side


def test_the_same_arguments_are_the_same_bits_cast_and_the_same_plain_values():
    x = torch.randn(4, 6)
    assert same_arguments(((x,), {}), ((x.to(torch.bfloat16),), {}), torch.bfloat16)
    assert not same_arguments(((x,), {}), ((x.to(torch.bfloat16),), {}), None)
    t = x.t().contiguous().t()  # the same values and shape, column-major
    assert same_arguments(((x,), {}), ((t,), {}), None)
    assert not same_arguments(((x,), {"scale": 1.0}), ((x,), {"scale": 2.0}), None)


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


def _owned(model: torch.nn.Module) -> torch.nn.Module:
    """Each block holding its model outside the module tree (a back-reference)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__["owner"] = model
    return model


def test_a_module_referring_back_to_its_model_is_compared_not_recursed_into():
    reference = _owned(hf_llama.build(arch="llama"))
    copy = cast_copy(reference, torch.bfloat16, torch.device("cpu"))
    assert twins(copy, _owned(hf_llama.build(arch="llama")).to(torch.bfloat16))
    assert not twins(copy, _nudged(_owned(hf_llama.build(arch="llama")).to(torch.bfloat16)))
    assert twin_copy(reference, _owned(hf_llama.build(arch="llama")).to(torch.bfloat16), torch.bfloat16, torch.device("cpu")) is not None
