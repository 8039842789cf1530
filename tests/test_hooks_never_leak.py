"""Hooks are removed from both models after a diff, whether it succeeded or raised, and
the models are otherwise left as they were."""

from __future__ import annotations

import pytest
import torch

from blockdiff import BlockdiffError, ModelRunError, diff
from samples import bugs, tinylm


def hook_count(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
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
    assert hook_count(reference) == 0 and hook_count(candidate) == 0


def test_blockdiff_error_leaves_no_hooks(ids):
    reference, candidate = tinylm.build(), tinylm.build(blocks=3)
    with pytest.raises(BlockdiffError, match="4 blocks and the candidate 3"):
        diff(reference, candidate, ids)
    assert hook_count(reference) == 0 and hook_count(candidate) == 0
