"""Planted bugs in the sample are blamed on exactly their block and sub-path; clean
precision changes are blamed on nothing."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from blockdiff import DivergenceError, Tolerance, assert_no_divergence, diff
from blockdiff.render import render
from samples import bugs, tinylm
from tests.conftest import blamed

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(bugs.BUGS))
def test_planted_bug_is_blamed_on_its_block_and_subpath(name, dtype, ids):
    stage, subpath = bugs.BUGS[name]
    block = 2 if stage == "block" else None
    factory = getattr(bugs, name)
    candidate = (factory(block=block) if block is not None else factory()).to(dtype)
    report = diff(tinylm.build(), candidate, ids)
    assert blamed(report) == (stage, block, subpath)
    # Local error isolates the bug: nothing else is blamed, although drift carries on.
    assert len(report.divergences) == 1


@pytest.mark.parametrize("name", ["gelu_for_silu", "residual_dropped", "norm_as_layernorm", "attention_scale"])
def test_planted_bug_in_first_and_last_block(name, ids):
    for block in (0, 3):
        report = diff(tinylm.build(), getattr(bugs, name)(block=block).to(torch.bfloat16), ids)
        assert blamed(report) == ("block", block, bugs.BUGS[name][1])


@pytest.mark.parametrize("name", ["gelu_for_silu", "post_norm", "norm_as_layernorm", "rope_sign_flipped", "head_untied_transposed"])
def test_fixed_policy_finds_bugs_in_bfloat16(name, ids):
    stage, subpath = bugs.BUGS[name]
    candidate = getattr(bugs, name)().to(torch.bfloat16)
    report = diff(tinylm.build(), candidate, ids, tolerance=Tolerance(policy="fixed"))
    assert blamed(report) == (stage, bugs.DEFAULT_BLOCK if stage == "block" else None, subpath)


@pytest.mark.parametrize("name", ["post_norm", "residual_dropped"])
def test_residual_bug_is_named_after_the_input_of_a_norm_not_the_norm(name, ids):
    # The norm computes nothing wrong (its column stays clean): the glue feeding it does.
    block = bugs.DEFAULT_BLOCK
    report = diff(tinylm.build(), getattr(bugs, name)(), ids)
    first = report.first_divergence
    assert blamed(report) == ("block", block, "residual")
    norm = f"blocks.{block}.ffn_norm"
    saved = first.to_dict()  # the JSON's fields as they were
    assert (saved["module"], saved["what"]) == (norm, f"input of {norm}")
    assert first.headline().startswith(f"block {block} residual (input of {norm}): rel_l2 ")
    assert not report.blocks[block].subpaths["norm"].diverged
    console = Console(file=io.StringIO(), width=120, no_color=True)
    render(report, console)
    assert f"First divergence: {first.headline()}\n" in console.file.getvalue()
    with pytest.raises(DivergenceError) as failed:  # the pytest failure message's first line
        assert_no_divergence(tinylm.build(), getattr(bugs, name)(), ids)
    assert str(failed.value).splitlines()[0] == first.headline()

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("residual", ["pre", "post", "parallel"])
@pytest.mark.parametrize("policy", [None, "fixed"])
def test_clean_precision_change_blames_nothing(dtype, residual, policy, ids):
    report = diff(tinylm.build(residual=residual), tinylm.build(residual=residual).to(dtype), ids, tolerance=Tolerance(policy=policy))
    assert report.first_divergence is None
    assert report.divergences == []
    # The candidate is the reference's own code: local errors are the floors themselves.
    if policy is None:
        for block in report.blocks:
            for result in block.subpaths.values():
                for check in result.checks:
                    assert check.threshold.basis == "calibrated"
                    assert check.metrics.rel_l2 == pytest.approx(check.threshold.floor, rel=0.05, abs=1e-6)


def test_same_model_float32_is_exact(ids):
    report = diff(tinylm.build(), tinylm.build(), ids)
    assert report.first_divergence is None
    assert report.tolerance["policy"] == "fixed"
    assert all(c.metrics.rel_l2 == 0.0 for b in report.blocks for r in b.subpaths.values() for c in r.checks)


def _count_ffn_computations(model: torch.nn.Module) -> list[int]:
    """How many times the FFNs compute (their down_proj runs; a frozen FFN answers without)."""
    counts = [0]
    for block in model.blocks:
        block.ffn.down_proj.register_forward_hook(lambda *_: counts.__setitem__(0, counts[0] + 1))
    return counts


def test_modules_given_their_own_inputs_are_not_run_again(ids):
    # Until the first difference the candidate's modules receive, in each experiment, the
    # very activations of their own forward: the recorded output is the answer.
    candidate = tinylm.build()
    calls = _count_ffn_computations(candidate)
    report = diff(tinylm.build(), candidate, ids)
    assert report.first_divergence is None and calls[0] == 4  # the candidate's forward only
    candidate = bugs.gelu_for_silu(block=2)
    calls = _count_ffn_computations(candidate)
    report = diff(tinylm.build(), candidate, ids)
    assert blamed(report) == ("block", 2, "ffn")
    # The forward's 4, and for block 3, the one block whose inputs differ, its module
    # experiment and its block experiment (the residual experiment freezes the FFN); then
    # the drill-down of block 2's divergent FFN: the FFN run once with its children
    # recorded, and its down_proj alone on the reference's input.
    assert calls[0] == 4 + 2 + 2


def test_same_bits_compares_every_bit():
    from blockdiff.experiments import same_bits

    x = torch.tensor([1.0, 0.0, float("nan")])
    assert same_bits({"primary": x}, {"primary": x.clone()})  # NaN equals itself bit for bit
    assert not same_bits({"primary": x}, {"primary": torch.tensor([1.0, -0.0, float("nan")])})
    assert not same_bits({"primary": x}, {"primary": x.double()})
    assert not same_bits({"primary": x}, {"primary": x, "residual": x})
    assert not same_bits({}, {})
    assert same_bits({"primary": x.bfloat16()}, {"primary": x.bfloat16()})
    assert same_bits({"primary": torch.arange(3)}, {"primary": torch.arange(3)})


def test_nan_in_candidate_is_a_divergence_at_its_first_site(ids):
    report = diff(tinylm.build(), bugs.nan_in_ffn(block=2), ids)
    assert blamed(report) == ("block", 2, "ffn")
    first = report.first_divergence
    assert first.check.metrics.nonfinite_cand > 0 and first.check.metrics.nonfinite_ref == 0
    assert report.first_nonfinite == {
        "site": "block 2 ffn",
        "module": "blocks.2.ffn",
        "nonfinite_cand": report.first_nonfinite["nonfinite_cand"],
        "nonfinite_ref": 0,
    }
    assert report.first_nonfinite["nonfinite_cand"] > 0
    assert "non-finite" in first.headline()


def test_fast_path_gives_the_same_verdicts(ids):
    for name in ["gelu_for_silu", "residual_dropped", "attention_scale"]:
        slow = diff(tinylm.build(), getattr(bugs, name)().to(torch.bfloat16), ids)
        fast = diff(tinylm.build(), getattr(bugs, name)().to(torch.bfloat16), ids, fast_path=True)
        assert blamed(fast) == blamed(slow)
        skipped = [b.index for b in fast.blocks if b.subpaths["residual"].status == "not_needed"]
        assert skipped == [b for b in range(4) if b != bugs.DEFAULT_BLOCK]


def test_unattributed_when_the_hook_map_misses_a_module(ids, tmp_path):
    # A map that leaves the FFN out: a bug inside it can only show at block level.
    text = (tmp_path / "partial.toml")
    text.write_text(
        'name = "partial"\nmatch = ["TinyLM"]\n[outside]\nembed = "embed"\nhead = "lm_head"\n'
        '[blocks]\npath = "blocks"\n[blocks.subpaths]\nattention = "attn"\nnorm = ["attn_norm", "ffn_norm"]\n'
    )
    from blockdiff import hookmap

    partial = hookmap.load(text)
    report = diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids, reference_hooks=partial, candidate_hooks=partial)
    assert blamed(report) == ("block", 2, "unattributed")


def test_a_tolerated_subpath_explains_its_block(ids):
    """Loosening one sub-path (ffn) must not turn its error into an 'unattributed' block."""
    candidate = bugs.gelu_for_silu(block=2)
    report = diff(tinylm.build(), candidate, ids, tolerance=Tolerance(overrides={"ffn": 1.0}))
    assert report.first_divergence is None
    ffn = report.blocks[2].subpaths["ffn"].checks[0]
    assert ffn.threshold.basis == "override" and ffn.tolerated
    assert report.blocks[2].block.diverged  # the whole block still shows the error
    # Without the override the ffn itself is blamed.
    assert blamed(diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids)) == ("block", 2, "ffn")
