"""Every MoE family transformers ships, every token mixer that is no attention, and BART:
routers detected with their formats, planted router, expert and token-mixer bugs blamed
exactly in float32 and bfloat16, clean bfloat16 on 128 tokens blaming nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import blockdiff  # noqa: E402
from blockdiff import diff  # noqa: E402
from samples import hf_families, hf_moe, hf_ssm  # noqa: E402
from tests.conftest import blamed, run_cli  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# Family → (router format, MoE blocks) as detected, or as the bundled map says (dbrx).
ROUTING = {
    "qwen3_next": ("topk", [0, 1, 2]),
    "deepseek_v2": ("topk", [1, 2]),  # dense first block
    "deepseek_v3": ("topk", [1, 2]),
    "gpt_oss": ("topk", [0, 1, 2]),
    "llama4": ("dense", [0, 1, 2]),
    "olmoe": ("topk", [0, 1, 2]),
    "glm4_moe": ("topk", [1, 2]),
    "granitemoe": ("topk", [0, 1, 2]),
    "dbrx": ("logits", [0, 1, 2]),
    "phimoe": ("topk", [0, 1, 2]),
    "jamba": ("topk", [1, 3]),  # MoE every other layer
    "nllb_moe": ("dense", [0, 1, 2, 3]),  # encoder and decoder
}
_built: dict[str, torch.nn.Module] = {}


def reference(family: str) -> torch.nn.Module:
    """One reference model per family for the whole module (diff never changes it)."""
    if family not in _built:
        _built[family] = hf_ssm.build(family) if family in hf_ssm.FAMILIES else hf_moe.build_family(family)
    return _built[family]


@pytest.fixture(scope="module", autouse=True)
def _release_models():
    yield
    _built.clear()


def ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", hf_moe.FAMILIES)
def test_router_is_found_with_its_format(family):
    layout = blockdiff.resolve(reference(family))
    fmt, moe_blocks = ROUTING[family]
    assert [b.index for b in layout.blocks if b.moe] == moe_blocks
    assert {b.moe["format"] for b in layout.blocks if b.moe} == {fmt}
    assert layout.hook_map.source == ("hooks/dbrx.toml" if family == "dbrx" else "auto-detected")
    assert not [p for b in layout.blocks for p in b.unmapped]


CASES = [
    (family, bug, part)
    for bug, (families, part) in hf_moe.FAMILY_BUGS.items()
    for family in families
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("family", "bug", "part"), CASES, ids=[f"{f}-{b}" for f, b, _ in CASES])
def test_planted_moe_bug_is_blamed_on_router_or_experts(family, bug, part, dtype):
    block = hf_moe.FAMILY_BLOCK
    candidate = getattr(hf_moe, bug)(family=family, block=block).to(dtype)
    report = diff(reference(family), candidate, hf_moe.family_inputs(family, ids(2, 16)))
    assert blamed(report) == ("block", block, "ffn")
    assert report.first_divergence.check.part == part
    assert len(report.divergences) == 1


@pytest.mark.parametrize("family", hf_moe.FAMILIES)
def test_clean_bfloat16_on_128_tokens_blames_nothing_and_reports_routing(family):
    model = reference(family)
    report = diff(model, hf_moe.build_family(family).to(torch.bfloat16), hf_moe.family_inputs(family, ids(4, 32)))
    assert report.first_divergence is None
    _, moe_blocks = ROUTING[family]
    assert [m["block"] for m in report.moe] == moe_blocks
    for m in report.moe:
        assert m["local_flips"]["unexplained"] == 0
        assert sum(m["reference"]["counts"]) == sum(m["candidate"]["counts"]) > 0
        assert 0.0 <= m["agreement"]["topk_agreement"] <= 1.0


def test_a_dropped_correction_bias_flips_tokens_the_floor_does_not():
    """Flips the reference's router does not make at bfloat16 stay unexplained: the
    explanation by the floor cannot hide a selection bug that leaves the logits alone."""
    report = diff(reference("deepseek_v3"), hf_moe.correction_bias_dropped().to(torch.bfloat16), ids(2, 16))
    flips = report.first_divergence.check.details
    assert flips["unexplained"] > 0 and flips["reproduced_by_floor"] < flips["flipped"]


MIXERS = {
    "mamba": ["backbone.layers.{}.mixer"] * 3,
    "mamba2": ["backbone.layers.{}.mixer"] * 3,  # its gated norm inside does not hide it
    "lfm2": ["model.layers.{}.conv", "model.layers.{}.self_attn", "model.layers.{}.conv"],
    "jamba": ["model.layers.{}.mamba", "model.layers.{}.self_attn"] * 2,  # two layer classes
    "qwen3_next": ["model.layers.{}.linear_attn", "model.layers.{}.self_attn", "model.layers.{}.linear_attn"],
}


@pytest.mark.parametrize("family", hf_ssm.FAMILIES)
def test_token_mixers_are_the_attention_sub_path(family):
    layout = blockdiff.resolve(reference(family))
    assert layout.hook_map.source == "auto-detected"
    assert [b.subpaths["attention"] for b in layout.blocks] == [[p.format(i)] for i, p in enumerate(MIXERS[family])]
    assert not [p for b in layout.blocks for p in b.unmapped]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", hf_ssm.FAMILIES)
def test_planted_token_mixer_bug_is_blamed_on_the_token_mixer(family, dtype):
    block = hf_ssm.MIXER_BLOCK[family]
    report = diff(reference(family), hf_ssm.conv_reversed(family).to(dtype), ids(2, 16))
    assert blamed(report) == ("block", block, "attention")
    mixer = blockdiff.resolve(reference(family)).blocks[block].subpaths["attention"][0]
    assert report.first_divergence.module.startswith(mixer)
    assert len(report.divergences) == 1


@pytest.mark.parametrize("family", ["mamba", "mamba2", "lfm2"])
def test_clean_bfloat16_token_mixers_blame_nothing(family):
    report = diff(reference(family), hf_ssm.build(family).to(torch.bfloat16), ids(2, 16))
    assert report.first_divergence is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [1, 3])
def test_bart_ffn_bug_is_blamed_on_its_ffn(block, dtype):
    model = hf_families.build_bart()
    assert blockdiff.resolve(model).hook_map.name == "bart"
    x = ids(2, 16)
    inputs = dict(input_ids=x, decoder_input_ids=torch.cat([torch.full_like(x[:, :1], 2), x[:, :-1]], 1))
    report = diff(model, hf_families.bart_fc2_bias_dropped(block=block).to(dtype), inputs)
    assert blamed(report) == ("block", block, "ffn")
    assert report.first_divergence.module.endswith("fc2")
    assert len(report.divergences) == 1


def test_arch_shows_each_router_and_its_format(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the table wide enough for a router's cell on one line
    code, out, err = run_cli(["arch", "samples/hf_moe.py:build_deepseek_v3"], capsys)
    assert code == 0, err
    assert out.count("router mlp.gate (topk)") == 2  # block 0 is dense
    code, out, err = run_cli(["arch", "samples/hf_moe.py:build_dbrx", "--json"], capsys)
    assert code == 0, err
    moe = [b["moe"] for b in json.loads(out)["blocks"]]
    assert moe == [{"router": f"transformer.blocks.{i}.ffn.router", "format": "logits", "top_k": "2"} for i in range(3)]


def test_a_dropped_correction_bias_through_the_cli(capsys):
    args = ["diff", "samples/hf_moe.py:build_deepseek_v3", "samples/hf_moe.py:deepseek_v3_correction_bias_dropped", "-q"]
    code, out, err = run_cli(args, capsys)
    assert code == 1
    assert "block 1" in out and "ffn" in out and "router" in out


def test_a_dense_router_output_reads_a_zero_weight_as_a_dropped_assignment():
    from blockdiff.moe import decision

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 3.0, 1.0, 0.0]])
    weights = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.0, 0.8, 0.0, 0.0]])  # token 1's second choice dropped
    read = decision((weights, logits), "dense")
    assert read.routing.indices.tolist() == [[0, 1], [1, 2]]
    assert read.routing.kept.tolist() == [[True, True], [True, False]]
    assert read.weights.flatten().tolist() == pytest.approx([0.7, 0.3, 0.8, 0.0])


def test_a_logits_router_needs_its_experts_per_token_in_the_map():
    from blockdiff import hookmap
    from blockdiff.errors import HookMapError

    text = (Path(__file__).parent.parent / "hooks" / "dbrx.toml").read_text()
    with pytest.raises(HookMapError, match="format 'logits' needs top_k"):
        hookmap.parse(text.replace('top_k = "top_k"', ""), source="x.toml")
    with pytest.raises(HookMapError, match="top_k 'moe_top_k' of DbrxFFN is None, expected a positive int"):
        blockdiff.resolve(reference("dbrx"), hookmap.parse(text.replace('top_k = "top_k"', 'top_k = "moe_top_k"'), source="x.toml"))
