"""Hooks are removed from both models after a diff, whether it succeeded or raised, and
the models are otherwise left as they were."""

from __future__ import annotations

import pytest
import torch

from blockdiff import BlockdiffError, ModelRunError, diff
from samples import bugs, tinylm


def hook_count(model: torch.nn.Module, *, users: tuple = ()) -> int:
    """Hooks, and instance forwards (how a capture records an eager model's sites) but on
    the modules ``users`` whose instance forward the test itself set."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
        + ("forward" in m.__dict__ and m not in users)
        for m in model.modules()
    )


def state(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hooks_removed_after_a_successful_diff(ids):
    reference, candidate = tinylm.build(), bugs.residual_dropped().to(torch.bfloat16)
    reference.train()
    before = state(candidate)
    report = diff(reference, candidate, ids)
    assert report.first_divergence is not None
    assert hook_count(reference) == 0 and hook_count(candidate) == 0
    assert reference.training and all(m.training for m in reference.modules())
    assert not candidate.training
    after = state(candidate)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert candidate.lm_head.weight.dtype == torch.bfloat16


class Exploding(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_hooks_removed_when_the_candidate_raises(ids):
    reference, candidate = tinylm.build(), tinylm.build()
    candidate.blocks[2].ffn.down_proj = Exploding()
    with pytest.raises(ModelRunError, match="candidate model raised RuntimeError: boom"):
        diff(reference, candidate, ids)
    assert hook_count(reference) == 0 and hook_count(candidate) == 0


def test_hooks_removed_when_localization_raises(ids):
    # Capture succeeds, then the candidate's FFN breaks during the local experiments (a
    # bfloat16 candidate: its modules see the reference's activations, not their own).
    reference, candidate = tinylm.build(), tinylm.build().to(torch.bfloat16)
    calls = {"n": 0}
    original = candidate.blocks[1].ffn.forward

    def flaky(x):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("second call fails")
        return original(x)

    candidate.blocks[1].ffn.forward = flaky
    with pytest.raises(ModelRunError, match="second call"):
        diff(reference, candidate, ids)
    assert hook_count(reference) == 0 and hook_count(candidate, users=(candidate.blocks[1].ffn,)) == 0
    assert candidate.blocks[1].ffn.__dict__["forward"] is flaky


def test_blockdiff_error_leaves_no_hooks(ids):
    reference, candidate = tinylm.build(), tinylm.build(blocks=3)
    with pytest.raises(BlockdiffError, match="4 blocks and the candidate 3"):
        diff(reference, candidate, ids)
    assert hook_count(reference) == 0 and hook_count(candidate) == 0


def test_the_hooks_context_undoes_everything_last_first_even_on_error():
    from blockdiff.hooking import Hooks

    model = tinylm.build(blocks=1)
    block = model.blocks[0]
    own = lambda *args, **kwargs: None  # noqa: E731 - an instance forward the user set
    block.ffn.forward = own
    seen = []
    with pytest.raises(RuntimeError, match="inside"):
        with Hooks() as hooks:
            hooks.before(block, lambda m, a, k: seen.append("pre") or None)
            hooks.after(block, lambda m, a, k, o: seen.append("post") or None)
            hooks.replace_forward(block.ffn, lambda previous: lambda *a, **k: "frozen")
            hooks.replace_forward(block.attn, lambda previous: lambda *a, **k: "frozen")
            assert block.ffn.forward() == "frozen" and len(block._forward_pre_hooks) == len(block._forward_hooks) == 1
            raise RuntimeError("inside")
    assert hook_count(model, users=(block.ffn,)) == 0
    assert block.ffn.__dict__["forward"] is own  # the user's own instance forward is back
    assert "forward" not in block.attn.__dict__  # none before: none after


def test_recording_around_an_in_place_compiled_call_is_undone():
    from blockdiff.hooking import Hooks

    layer = torch.nn.Linear(4, 4)
    original = lambda *args, **kwargs: "compiled"  # noqa: E731 - what module.compile() installs
    layer._compiled_call_impl = original
    seen = []
    with Hooks() as hooks:
        hooks.around(layer, lambda m, a, k: seen.append("pre"), lambda m, a, k, o: seen.append(o))
        assert layer._compiled_call_impl(torch.zeros(4)) == "compiled"
    assert seen == ["pre", "compiled"] and layer._compiled_call_impl is original and hook_count(layer) == 0
