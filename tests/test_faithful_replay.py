"""Arguments that are not plain data are replayed as the side's own objects, or the check
is not judged: never replayed as something else and blamed."""

from __future__ import annotations

import pytest
import torch

import blockdiff
from blockdiff.site import NotReplayable, Opaque, for_replay, map_structure
from samples import hf_llama
from tests.conftest import blamed, run_cli

pytest.importorskip("transformers")


class BlockMaskLike:
    """An argument object holding tensors, as flex attention's BlockMask does."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask


class DynamicCache:
    """Named like Hugging Face's cache: never held, never replayed."""


def test_an_object_is_replayed_as_itself_and_a_cache_as_nothing():
    mask = BlockMaskLike(torch.ones(2, 2))
    recorded = map_structure({"attention_mask": mask, "past_key_values": DynamicCache(), "x": torch.ones(1)}, lambda t: t)
    assert recorded["attention_mask"] == Opaque("BlockMaskLike")
    replayed = for_replay(recorded, device="cpu")
    assert replayed["attention_mask"] is mask
    assert replayed["past_key_values"] is None


def test_an_object_a_dump_kept_by_type_only_cannot_be_replayed():
    with pytest.raises(NotReplayable, match="BlockMask argument was recorded by type only"):
        for_replay({"attention_mask": Opaque("BlockMask")}, device="cpu")
    assert for_replay({"cache": Opaque("DynamicCache", cache=True)}, device="cpu") == {"cache": None}


@pytest.fixture(scope="module")
def flex():
    return hf_llama.build(attn_implementation="flex_attention")


@pytest.mark.parametrize("reference", ["eager", "sdpa"])
def test_flex_attention_against_eager_and_sdpa_blames_nothing(flex, reference, ids):
    report = blockdiff.diff(hf_llama.build(attn_implementation=reference), flex, ids)
    assert blamed(report) is None
    assert not report.notes
    assert all(b.subpaths["attention"].checks for b in report.blocks)


def test_flex_attention_in_bfloat16_blames_nothing(ids):
    candidate = hf_llama.build(attn_implementation="flex_attention").to(torch.bfloat16)
    report = blockdiff.diff(hf_llama.build(), candidate, ids)
    assert blamed(report) is None
    assert report.tolerance["policy"] == "calibrated"


def test_a_streamed_flex_candidate_is_not_judged_where_its_mask_was_not_kept(ids):
    # In bfloat16 every experiment replays the candidate's calls (no recorded output can
    # stand in); streamed, the candidate's BlockMask was kept by type only.
    candidate = hf_llama.build(attn_implementation="flex_attention").to(torch.bfloat16)
    report = blockdiff.diff(hf_llama.build(), candidate, ids, stream=True)
    assert blamed(report) is None
    for block in report.blocks:
        assert block.subpaths["attention"].status == "not_judged" and not block.subpaths["attention"].checks
        assert block.subpaths["residual"].status == "not_judged"
        # What does not need the mask is still judged.
        assert block.subpaths["ffn"].checks and not block.subpaths["ffn"].diverged
    assert any("BlockMask" in note and "not judged" in note for note in report.notes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flex_attention_through_the_cli_exits_zero(dtype, capsys):
    code, out, err = run_cli(["diff", "samples/hf_llama.py:build", "samples/hf_llama.py:build_flex", "--cand-dtype", dtype, "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
