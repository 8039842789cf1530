"""MoE blocks: routing-aware localization (router vs experts) and routing statistics."""

from __future__ import annotations

import json

import pytest
import torch

from blockdiff import diff
from samples import bugs, tinylm
from tests.conftest import blamed

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def many_ids() -> torch.Tensor:
    # 128 tokens: enough for bfloat16 to flip a few near-tie routing decisions.
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(bugs.MOE_BUGS))
def test_sample_moe_bug_is_blamed_on_router_or_experts(name, dtype, ids):
    reference_factory, part = bugs.MOE_BUGS[name]
    report = diff(getattr(tinylm, reference_factory)(), getattr(bugs, name)(block=2).to(dtype), ids)
    assert blamed(report) == ("block", 2, "ffn")
    assert report.first_divergence.check.part == part
    assert len(report.divergences) == 1
    assert report.to_dict()["first_divergence"]["part"] == part


@pytest.mark.parametrize("factory", ["build_moe", "build_moe_unnormalized", "build_moe_capacity"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sample_moe_clean_precision_blames_nothing(factory, dtype, many_ids):
    report = diff(getattr(tinylm, factory)(), getattr(tinylm, factory)().to(dtype), many_ids)
    assert report.first_divergence is None
    assert len(report.moe) == 4


def test_precision_flips_are_reported_with_their_margins_not_blamed(many_ids):
    report = diff(tinylm.build_moe(), tinylm.build_moe().to(torch.bfloat16), many_ids)
    assert report.first_divergence is None
    flips = [m["local_flips"] for m in report.moe]
    assert sum(f["flipped"] for f in flips) > 0, "this input is known to flip a few near-tie tokens"
    for f in flips:
        assert f["unexplained"] == 0
        assert len(f["flip_margins"]) == f["flipped"] == len(f["flipped_tokens"])
        assert all(m <= f["margin_tolerance"] for m in f["flip_margins"])
    # Free-running agreement is below 1 somewhere, and flips are binned by margin.
    assert min(m["agreement"]["topk_agreement"] for m in report.moe) < 1.0
    assert all(sum(b["flipped"] for b in m["agreement"]["flips_by_margin"]) == len(m["agreement"]["flipped_tokens"]) for m in report.moe)


def test_fast_path_never_skips_a_router(ids):
    report = diff(tinylm.build_moe(), bugs.moe_not_renormalized(block=2), ids, fast_path=True)
    assert blamed(report) == ("block", 2, "ffn")
    assert report.first_divergence.check.part == "router"


def test_moe_json_has_both_sides_counts_as_integer_lists(ids, tmp_path):
    report = diff(tinylm.build_moe_capacity(), tinylm.build_moe_capacity().to(torch.bfloat16), ids)
    report.write_json(tmp_path / "r.json")
    moe = json.loads((tmp_path / "r.json").read_text())["moe"]
    assert [m["block"] for m in moe] == [0, 1, 2, 3]
    tokens = ids.numel()
    for m in moe:
        for side in ("reference", "candidate"):
            counts = m[side]["counts"]
            assert len(counts) == 8 and all(isinstance(c, int) for c in counts)
            assert sum(counts) == tokens * 2
            # The sample's own capacity: ceil(1.0 * T * k / E).
            assert m[side]["capacity"] == -(-tokens * 2 // 8)
            assert all(a <= m[side]["capacity"] for a in m[side]["counts_after"])
        assert m["router"] == f"blocks.{m['block']}.ffn.router"


def test_reported_drops_match_the_sample_dispatch(ids):
    """The capacity statistics equal what the sample model's own dispatch drops."""
    model = tinylm.build_moe_capacity()
    report = diff(tinylm.build_moe_capacity(), model, ids)
    x = model.embed(ids)
    for block_index, stats in enumerate(m["reference"] for m in report.moe):
        moe = model.blocks[block_index].ffn
        # Recompute the block's MoE input from the model itself.
        with torch.no_grad():
            h = x
            cos, sin = model.rotary(h, torch.arange(ids.shape[1]))
            for b in model.blocks[:block_index]:
                h = b(h, cos, sin)
            blk = model.blocks[block_index]
            h = h + blk.attn(blk.attn_norm(h), cos, sin)
            flat = blk.ffn_norm(h).reshape(-1, h.shape[-1])
            _, _, indices = moe.router(flat)
            kept = moe.keep(indices)
        dropped = int((~kept).sum())
        assert stats["assignment_drop_rate"] == pytest.approx(dropped / indices.numel(), abs=1e-12)
        assert stats["token_drop_rate"] == pytest.approx(float((~kept).all(-1).float().mean()), abs=1e-12)


pytest.importorskip("transformers")
from samples import hf_moe  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(hf_moe.BUGS))
def test_hf_moe_bug_is_blamed_on_router_or_experts(name, dtype, ids):
    arch, part = hf_moe.BUGS[name]
    report = diff(hf_moe.build(arch=arch), getattr(hf_moe, name)(block=2, arch=arch).to(dtype), ids)
    assert blamed(report) == ("block", 2, "ffn")
    assert report.first_divergence.check.part == part
    assert len(report.divergences) == 1


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_moe_clean_bfloat16_blames_nothing_and_reports_flips(arch, many_ids):
    report = diff(hf_moe.build(arch=arch), hf_moe.build(arch=arch).to(torch.bfloat16), many_ids)
    assert report.first_divergence is None
    assert len(report.moe) == 4
    flips = [m["local_flips"] for m in report.moe]
    assert all(f["unexplained"] == 0 for f in flips)
    if arch == "mixtral":
        assert sum(f["flipped"] for f in flips) > 0
        # With routing frozen at the reference's, the flips stay out of the experts check:
        # it sits at a third of its threshold, like any clean check.
        for block in report.blocks:
            experts = next(c for c in block.subpaths["ffn"].checks if c.part == "experts")
            assert experts.ratio < 0.5


@pytest.fixture
def switch_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        input_ids=torch.randint(1, 256, (2, 16), generator=g),
        decoder_input_ids=torch.randint(1, 256, (2, 8), generator=g),
    )


def test_switch_drop_rate_equals_what_the_model_dropped(switch_inputs):
    """SwitchTransformers with a small expert_capacity: the reported drops are the model's
    own, read independently here from its routers' dispatch masks."""
    model = hf_moe.build_switch(expert_capacity=4)
    dispatch: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, a, out, name=name: dispatch.__setitem__(name, out[0].clone()))
        for name, module in model.named_modules()
        if type(module).__name__ == "SwitchTransformersTop1Router"
    ]
    with torch.no_grad():
        model(**switch_inputs, use_cache=False)
    for handle in handles:
        handle.remove()
    report = diff(hf_moe.build_switch(expert_capacity=4), model, switch_inputs)
    assert report.first_divergence is None
    assert len(report.moe) == 4 and len(dispatch) == 4
    total_dropped = 0
    for entry in report.moe:
        mask = dispatch[entry["router"]]  # [batch, seq, E] one-hot after capacity
        tokens = mask.shape[0] * mask.shape[1]
        dropped = int((mask.sum(-1) == 0).sum())
        total_dropped += dropped
        for side in ("reference", "candidate"):
            stats = entry[side]
            assert stats["capacity"] == 4 and stats["dispatch"] == "model"
            assert stats["token_drop_rate"] == dropped / tokens
            assert stats["assignment_drop_rate"] == dropped / tokens  # top-1
            assert stats["counts_after"] == [int(n) for n in mask.reshape(-1, mask.shape[-1]).sum(0)]
            # Per-sequence first-come simulation agrees with the model's dispatch.
            assert stats["simulated_matches_model"] is True
    assert total_dropped > 0, "capacity 4 is meant to drop tokens here"
    assert [entry["router"].split(".")[0] for entry in report.moe] == ["encoder", "encoder", "decoder", "decoder"]


def test_switch_clean_bfloat16_blames_nothing(switch_inputs):
    report = diff(hf_moe.build_switch(), hf_moe.build_switch().to(torch.bfloat16), switch_inputs)
    assert report.first_divergence is None
    assert {b.stack for b in report.blocks} == {"encoder.block", "decoder.block"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_a_candidate_routing_top_1_where_the_reference_routes_top_2_is_a_router_divergence(arch, ids):
    from samples import hf_moe

    report = diff(hf_moe.build(arch=arch), hf_moe.build(arch=arch, num_experts_per_tok=1), ids)
    first = report.first_divergence
    assert blamed(report) == ("block", 0, "ffn") and first.check.part == "router"
    assert first.headline().endswith("the candidate routes top-1 where the reference routes top-2")
    assert report.to_dict()["first_divergence"]["part"] == "router"
    (check,) = report.to_dict()["blocks"][0]["subpaths"]["ffn"]["checks"]
    assert check["details"]["candidate"] == {"experts": 8, "top_k": 1} and check["details"]["reference"]["top_k"] == 2
    # Routing of another shape is never frozen across sides: no block is unattributed.
    assert all(d.subpath == "ffn" for d in report.divergences)


def test_another_number_of_experts_is_a_router_divergence_through_the_cli(tmp_path, capsys):
    from tests.conftest import run_cli

    factory = tmp_path / "moe_factories.py"
    factory.write_text(
        "from samples import tinylm\n"
        "def four(): return tinylm.build_moe(experts=4)\n"
    )
    code, out, err = run_cli(["diff", "samples/tinylm.py:build_moe", f"{factory}:four", "-q"], capsys)
    assert code == 1, err
    assert "(router: routing differs)" in out and "4 experts where the reference has" in out
