"""Real architectures (Gemma2/3, Phi-3, OLMo2, GPT-2, GPT-NeoX, Falcon, BERT, T5): their
hook maps cover every block module, clean precision changes blame nothing, and one planted
bug per sub-path is blamed on exactly its block and sub-path, in float32 and bfloat16.
Also: local Hugging Face directories and config.json files as CLI models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import ModelSpecError, Tolerance, diff, resolve  # noqa: E402
from blockdiff.loading import build_model  # noqa: E402
from samples import hf_families  # noqa: E402
from tests.conftest import blamed, run_cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = hf_families.FAMILIES
HOOK_MAP = {"gemma2": "gemma", "gemma3": "gemma"}
_references: dict[str, torch.nn.Module] = {}


def reference(family: str) -> torch.nn.Module:
    """The float32 reference of a family, built once: diff never changes its models."""
    if family not in _references:
        _references[family] = hf_families.build(family=family)
    return _references[family]


def planted(family: str) -> list[tuple]:
    """(factory, sub-path, block) of every planted bug of a family; T5's bugs are planted in
    an encoder block (1) and in a decoder block (3)."""
    blocks = (1, 3) if family == "t5" else (1,)
    return [(factory, subpath, block) for factory, subpath in hf_families.BUGS[family] for block in blocks]


CASES = [
    pytest.param(family, factory, subpath, block, id=f"{family}-{factory.__name__}-block{block}")
    for family in FAMILIES
    for factory, subpath, block in planted(family)
]


@pytest.mark.parametrize("family", FAMILIES)
def test_map_covers_every_module_of_every_block(family):
    layout = resolve(reference(family))
    assert layout.hook_map.name == HOOK_MAP.get(family, family)
    assert layout.hook_map.source.startswith("hooks/")
    assert [b.unmapped for b in layout.blocks] == [[]] * len(layout.blocks)
    for block in layout.blocks:
        assert set(block.subpaths) == {"attention", "ffn", "norm"}
    stages = [stage for stage, _ in layout.outside]
    assert "embed" in stages and "head" in stages


@pytest.mark.parametrize("family", FAMILIES)
def test_clean_bfloat16_blames_nothing(family, ids):
    candidate = hf_families.build(family=family).to(torch.bfloat16)
    report = diff(reference(family), candidate, hf_families.inputs(family, ids))
    assert report.tolerance["policy"] == "calibrated"
    assert report.first_divergence is None, report.first_divergence.headline()
    assert report.divergences == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family,factory,subpath,block", CASES)
def test_planted_bug_is_blamed_on_its_block_and_subpath(family, factory, subpath, block, dtype, ids):
    candidate = factory(family=family, block=block).to(dtype)
    report = diff(reference(family), candidate, hf_families.inputs(family, ids))
    assert blamed(report) == ("block", block, subpath)
    assert len(report.divergences) == 1, [d.to_dict() for d in report.divergences]


# -- family by family: what the maps say and the cases that need a second look -----------------


def test_gemma_has_four_norms_and_offset_weights():
    model = reference("gemma2")
    block = resolve(model).blocks[0]
    assert [p.rsplit(".", 1)[1] for p in block.subpaths["norm"]] == [
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
    ]
    # (1 + w) norms: weights drawn around 0, so a forgotten "+ 1" is a large error.
    assert model.model.layers[0].input_layernorm.weight.abs().max() <= 0.2


def test_gemma_scaled_embedding_is_measured_at_the_embed_site(ids):
    """Gemma scales the embedding by sqrt(hidden) inside its embedding module (transformers
    5: Gemma2TextScaledWordEmbedding), so the embed site sees the scaled output: a missing
    scale is blamed on embed and on nothing after it."""
    candidate = hf_families.build(family="gemma2")
    candidate.model.embed_tokens.embed_scale.fill_(1.0)
    report = diff(reference("gemma2"), candidate.to(torch.bfloat16), ids)
    assert blamed(report) == ("embed", None, None)
    assert len(report.divergences) == 1


def test_gemma3_rotary_embedding_is_two_context_sites(ids):
    """Gemma3 calls its rotary embedding once per layer type (sliding and full attention)."""
    report = diff(reference("gemma3"), hf_families.build(family="gemma3").to(torch.bfloat16), ids)
    assert [s.stage for s in report.stages].count("context") == 2
    assert report.first_divergence is None


def test_gpt2_embeds_tokens_and_positions():
    layout = resolve(reference("gpt2"))
    assert [p for s, p in layout.outside if s == "embed"] == ["transformer.wte", "transformer.wpe"]


def test_gpt2_position_embedding_bug_is_blamed_on_embed(ids):
    candidate = hf_families.build(family="gpt2")
    with torch.no_grad():
        candidate.transformer.wpe.weight.copy_(candidate.transformer.wpe.weight.roll(1, dims=0))  # off by one
    report = diff(reference("gpt2"), candidate, ids)
    assert blamed(report) == ("embed", None, None)
    assert report.first_divergence.module == "transformer.wpe"


def test_bert_output_modules_split_between_subpaths():
    """BERT's BertSelfOutput / BertOutput (dense → dropout → LayerNorm(h + input)): the
    dense layers are attention / ffn, the LayerNorms norm, the add between them glue."""
    block = resolve(reference("bert")).blocks[2]
    prefix = block.path + "."
    rel = {k: [p.removeprefix(prefix) for p in v] for k, v in block.subpaths.items()}
    assert rel == {
        "attention": ["attention.self", "attention.output.dense"],
        "ffn": ["intermediate", "output.dense"],
        "norm": ["attention.output.LayerNorm", "output.LayerNorm"],
    }


def test_bert_residual_dropped_inside_its_output_module_is_residual(ids):
    """The add dropped inside BertOutput is glue: the LayerNorm it feeds is frozen, but its
    input differs, and the residual experiment compares that input."""
    report = diff(reference("bert"), hf_families.residual_bug(family="bert", block=2), ids)
    first = report.first_divergence
    assert (first.block, first.subpath) == (2, "residual")
    assert first.check.what == "input of bert.encoder.layer.2.output.LayerNorm"


def test_gpt_neox_sequential_instead_of_parallel_shows_in_the_mlp_norm_input(ids):
    report = diff(reference("gpt_neox"), hf_families.residual_bug(family="gpt_neox", block=3), ids)
    assert blamed(report) == ("block", 3, "residual")
    assert report.first_divergence.check.what == "input of gpt_neox.layers.3.post_attention_layernorm"


def test_t5_blocks_know_their_stack(ids):
    layout = resolve(reference("t5"))
    assert [b.stack for b in layout.blocks] == ["encoder.block"] * 2 + ["decoder.block"] * 2
    decoder = layout.blocks[2]
    assert [p.rsplit(".", 1)[1] for p in decoder.subpaths["attention"]] == ["SelfAttention", "EncDecAttention"]
    assert len(decoder.subpaths["norm"]) == 3 and len(layout.blocks[0].subpaths["norm"]) == 2
    report = diff(reference("t5"), hf_families.ffn_bug(family="t5", block=3), hf_families.inputs("t5", ids))
    assert report.first_divergence.stack == "decoder.block"
    assert report.to_dict()["first_divergence"]["stack"] == "decoder.block"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_t5_cross_attention_bug_is_attention(dtype, ids):
    report = diff(reference("t5"), hf_families.cross_attention_bug(block=2).to(dtype), hf_families.inputs("t5", ids))
    assert blamed(report) == ("block", 2, "attention")
    assert report.first_divergence.module == "decoder.block.0.layer.1.EncDecAttention"
    assert len(report.divergences) == 1


def test_t5_encoder_bug_does_not_leak_into_the_decoder(ids):
    """The decoder blocks receive the encoder output positionally (T5Stack → T5Block): it is
    replaced by the reference's like the hidden state, so an encoder bug stays in its block."""
    report = diff(reference("t5"), hf_families.ffn_bug(family="t5", block=0), hf_families.inputs("t5", ids))
    assert blamed(report) == ("block", 0, "ffn")
    assert [(d.block, d.subpath) for d in report.divergences] == [(0, "ffn")]
    assert report.blocks[3].drift.rel_l2 > 0.01  # the error did travel into the decoder


def test_falcon_blocks_return_tuples_and_norm_names_follow_the_config():
    layout = resolve(reference("falcon"))
    assert [p.rsplit(".", 1)[1] for p in layout.blocks[0].subpaths["norm"]] == ["input_layernorm"]
    new_arch = hf_families.build(family="falcon", new_decoder_architecture=True, num_kv_heads=2)
    norms = resolve(new_arch).blocks[0].subpaths["norm"]
    assert [p.rsplit(".", 1)[1] for p in norms] == ["ln_attn", "ln_mlp"]
    assert resolve(new_arch).blocks[0].unmapped == []


def test_falcon_in_place_add_does_not_corrupt_frozen_outputs(ids):
    candidate = hf_families.build(family="falcon")
    hf_families._swap_class(candidate.transformer.h[1], "HalfResidual", hf_families.falcon_residual(0.5))
    report = diff(reference("falcon"), candidate, ids, tolerance=Tolerance(policy="calibrated"))
    assert blamed(report) == ("block", 1, "residual")


# -- Hugging Face directories and config.json files as models -----------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Gemma2 written by save_pretrained, and a copy with block 2's MLP weight damaged."""
    folder = tmp_path_factory.mktemp("hf")
    model = hf_families.build(family="gemma2")
    model.save_pretrained(folder / "gemma2")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(folder / "damaged")
    return folder


def test_cli_diffs_a_save_pretrained_directory(saved, capsys, tmp_path):
    report_path = tmp_path / "r.json"
    args = ["diff", str(saved / "gemma2"), "--cand-dtype", "bfloat16", "--json", str(report_path)]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    report = json.loads(report_path.read_text())
    assert report["reference"]["hook_map"] == "gemma" and report["candidate"]["dtype"] == "bfloat16"
    assert len(report["blocks"]) == 4
    code, out, err = run_cli(["diff", str(saved / "gemma2"), str(saved / "damaged"), "-q"], capsys)
    assert code == 1, err
    assert out.startswith("first divergence: block 2 ffn (model.layers.2.mlp)")


def test_directory_weights_are_the_saved_ones(saved):
    loaded = build_model(str(saved / "gemma2"), device=torch.device("cpu"), dtype=torch.float32)
    for name, tensor in reference("gemma2").state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_cli_diffs_a_config_json(saved, capsys):
    config = str(saved / "gemma2" / "config.json")
    code, out, err = run_cli(["diff", config, "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    code, out, err = run_cli(["diff", config, str(saved / "damaged"), "-q"], capsys)
    assert code == 1 and out.startswith("first divergence: block 2 ffn"), err


def test_config_json_gives_both_sides_the_same_trained_looking_weights(saved):
    config = str(saved / "gemma2" / "config.json")
    one = build_model(config, device=torch.device("cpu"), dtype=torch.float32)
    two = build_model(config, device=torch.device("cpu"), dtype=torch.float32)
    for name, tensor in one.state_dict().items():
        assert torch.equal(two.state_dict()[name], tensor), name
    # Gemma's (1 + w) norms were found (initialised to 0 by the model) and drawn around 0.
    weight = one.model.layers[0].input_layernorm.weight
    assert weight.abs().max() <= 0.2 and weight.abs().mean() > 0.05
    assert float(one.model.layers[0].mlp.down_proj.weight.detach().std()) == pytest.approx(128**-0.5, rel=0.2)


def test_a_config_json_builds_the_other_side_as_a_copy(saved, monkeypatch):
    """The second side of one config.json is a copy of the first (its weights are drawn from
    CONFIG_SEED): bit for bit what building it again gives, in any dtype, drawn once; a
    first side no longer as built (cast) is not copied."""
    from blockdiff import loading
    from blockdiff.sides.precision import twins

    config, cpu = str(saved / "gemma2" / "config.json"), torch.device("cpu")
    apart = build_model(config, device=cpu, dtype=torch.float32)
    drawn, draw = [], loading.trained_looking_
    monkeypatch.setattr(loading, "trained_looking_", lambda *a, **k: drawn.append(1) or draw(*a, **k))
    one = build_model(config, device=cpu, dtype=torch.float32)
    two = build_model(config, device=cpu, dtype=torch.float32, like=one)
    bf16 = build_model(config, device=cpu, dtype=torch.bfloat16, like=one)
    assert len(drawn) == 1 and two is not one
    assert twins(two, apart) and twins(one, two)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(one.parameters(), two.parameters()))
    cast = build_model(config, device=cpu, dtype=torch.bfloat16)  # built, then cast in place
    assert twins(bf16, cast) and len(drawn) == 2
    build_model(config, device=cpu, dtype=torch.float32, like=cast)  # no longer as built: built again
    assert len(drawn) == 3


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: d, "is a directory without config.json; expected a Hugging Face model directory"),
        (lambda d: _write(d / "config.json", '{"model_type": "llama"}').parent,
         "cannot load the Hugging Face model in"),
        (lambda d: _write(d / "c.json", '{"model_type": "no-such-model"}'),
         "is not a loadable Hugging Face config (ValueError"),
        (lambda d: d / "absent.json", "no such file"),
    ],
    ids=["no-config", "no-weights", "unknown-type", "missing-json"],
)
def test_unloadable_hugging_face_specs_are_one_line_errors(make, message, tmp_path, capsys):
    code, out, err = run_cli(["diff", str(make(tmp_path))], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("Error: ")
    assert message in err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_transformers_is_a_clear_error(saved, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers → ImportError
    with pytest.raises(ModelSpecError, match=r"needs transformers \(pip install blockdiff\[hf\]\)"):
        build_model(str(saved / "gemma2"), device=torch.device("cpu"), dtype=torch.float32)


def test_a_hub_model_id_is_not_fetched(tmp_path, monkeypatch, capsys):
    """A Hub model id is not a local directory: it is a malformed spec, never a download."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["diff", "google/gemma-2-2b"], capsys)
    assert code == 2 and "expected path/to/file.py:factory" in err


def test_fast_path_cannot_see_a_divergence_the_block_hides(saved, capsys):
    # Gemma2 normalizes the MLP's output (post_feedforward_layernorm): a down_proj scaled by
    # 1.5 changes the MLP's output but barely the block's. The full run blames the MLP;
    # --fast judges the block as a whole within tolerance and skips its sub-paths. This is
    # why --fast is opt-in.
    args = ["diff", str(saved / "gemma2"), str(saved / "damaged"), "-q"]
    code, out, _ = run_cli(args, capsys)
    assert code == 1 and out.startswith("first divergence: block 2 ffn (model.layers.2.mlp)")
    code, out, _ = run_cli(args + ["--fast"], capsys)
    assert code == 0 and "first divergence" not in out
