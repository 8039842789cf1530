"""Ports whose conversion script copied a weight wrong: the divergence is blamed on its
block and sub-path, and the weight is named with what it is instead — in float32, and in
bfloat16 where the candidate holds the reference's weights rounded."""

from __future__ import annotations

import json

import pytest
import torch

from blockdiff import Report
from blockdiff.inputs import RandomTokens
from blockdiff.conversion import explain
from tests.conftest import run_cli

pytest.importorskip("transformers")

REFERENCE = "samples/port.py:reference"
# mistake → (stage or block, sub-path, the weight and what it is, as the headline ends)
PLANTED = {
    "norm_from_the_other_norm": (
        1, "norm", "blocks.1.ffn_norm.weight differs from the reference's model.layers.1.post_attention_layernorm.weight: "
        "it equals the reference's model.layers.1.input_layernorm.weight"),
    "gate_up_swapped": (
        1, "ffn", "blocks.1.ffn.gate_proj.weight differs from the reference's model.layers.1.mlp.gate_proj.weight: "
        "it equals the reference's model.layers.1.mlp.up_proj.weight"),
    "square_projection_not_transposed": (
        1, "attention", "blocks.1.attn.o_proj.weight differs from the reference's model.layers.1.self_attn.o_proj.weight: "
        "it is the reference's transposed"),
    "query_rows_permuted": (
        1, "attention", "blocks.1.attn.q_proj.weight differs from the reference's model.layers.1.self_attn.q_proj.weight: "
        "it is the reference's with its rows permuted"),
    "rotary_base_wrong": ("context", None, "rotary.inv_freq differs from the reference's model.rotary_emb.inv_freq"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mistake", PLANTED)
def test_a_conversion_mistake_is_blamed_and_its_weight_named(mistake, dtype, tmp_path, capsys):
    where, subpath, weight = PLANTED[mistake]
    code, out, err = run_cli(
        ["diff", REFERENCE, f"samples/converted_port.py:{mistake}", "--cand-dtype", dtype, "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    first = report.first_divergence
    assert ((first.block if first.stage == "block" else first.stage), first.subpath) == (where, subpath)
    assert weight in first.headline()
    assert any(weight in note for note in report.notes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_clean_port_names_no_weight(dtype):
    from blockdiff import run
    from samples import port

    report = run(port.reference(), port.port().to(dtype), torch.randint(0, 256, (2, 16)))
    assert report.first_divergence is None and "conversion" not in report.note_codes


def test_explain_tells_each_kind_of_conversion_mistake():
    torch.manual_seed(0)
    w, other = torch.randn(6, 6), torch.randn(6, 6)
    assert explain(w, w, {}) is None
    assert explain(other, w, {"layers.0.up.weight": other}) == "equals the reference's layers.0.up.weight"
    assert explain(w.T, w, {}) == "is the reference's transposed"
    assert explain(w[[1, 0, 2, 3, 4, 5]], w, {}).startswith("is the reference's with its rows permuted")
    assert explain(w * 0.5, w, {}) == "is the reference's scaled by 0.5"
    assert explain(w.to(torch.bfloat16).float(), w, {}) == "is the reference's rounded through bfloat16"
    assert explain(torch.randn(6, 6), w, {}) is None  # something else: only "differs"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_weight_converted_wrong_is_named_against_the_split_ones(dtype, tmp_path, capsys):
    """A Meta-style port (fused wqkv, samples/fused_port.py) whose conversion concatenated
    q, v, k: the fused weight is named with the order it holds; a bug in the port's code
    (an attention scale) names no weight."""
    code, out, err = run_cli(
        ["diff", "samples/fused_port.py:reference", "samples/fused_port.py:port_kv_swapped", "--cand-dtype", dtype, "-q"], capsys
    )
    assert code == 1, err
    assert ("block 0 attention (model.layers.0.attention)" in out and "model.layers.0.attention.wqkv.weight holds the reference's "
            "q_proj.weight, v_proj.weight, k_proj.weight in that order (expected q_proj.weight, k_proj.weight, v_proj.weight)" in out)
    code, out, err = run_cli(
        ["diff", "samples/fused_port.py:reference", "samples/fused_port.py:port_attention_scale", "--cand-dtype", dtype, "-q"], capsys
    )
    assert code == 1 and "block 1 attention" in out and "weight" not in out, out


def test_fused_parts_names_the_part_that_differs_and_nothing_for_an_unrelated_weight():
    from blockdiff.conversion import fused_parts

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    split = {"q.weight": q, "k.weight": k, "v.weight": v}
    assert fused_parts(torch.cat([q, k, v]), split) is None
    assert fused_parts(torch.cat([q, k, v * 2]), split) == (
        "differs from the reference's q.weight, k.weight, v.weight concatenated, in the part of v.weight")
    assert fused_parts(torch.randn(4, 3), split) is None  # the size of k and v together, and neither


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gpt2_port_whose_copy_loop_missed_a_transpose(dtype, capsys):
    """A from-scratch GPT-2 (nn.Linear) loading HF's Conv1D weights through its own loop,
    transposing each: clean, it blames nothing; the one square projection left
    untransposed is blamed on its block's attention and named (no hook map written)."""
    code, out, err = run_cli(["diff", "samples/gpt2_port.py:reference", "samples/gpt2_port.py:port", "--cand-dtype", dtype, "-q"], capsys)
    assert code == 0 and out.strip() == "no divergence", out + err
    code, out, err = run_cli(
        ["diff", "samples/gpt2_port.py:reference", "samples/gpt2_port.py:attn_proj_not_transposed", "--cand-dtype", dtype, "-q"],
        capsys,
    )
    assert code == 1, err
    assert out.startswith("first divergence: block 1 attention (h.1.attn)")
    assert "h.1.attn.c_proj.weight differs from the reference's transformer.h.1.attn.c_proj.weight: it is the reference's transposed" in out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny Llama saved twice by save_pretrained: in float32, and in bfloat16
    (``config.json``: ``dtype: bfloat16``), its weights the first's rounded."""
    from samples import hf_llama

    folder = tmp_path_factory.mktemp("checkpoints")
    model = hf_llama.build()
    model.save_pretrained(folder / "float32")
    model.to(torch.bfloat16).save_pretrained(folder / "bfloat16")
    assert json.loads((folder / "bfloat16" / "config.json").read_text())["dtype"] == "bfloat16"
    return folder / "float32", folder / "bfloat16"


def test_a_checkpoint_runs_in_its_own_dtype_and_the_header_says_so(checkpoints, tmp_path, capsys):
    ref, cand = map(str, checkpoints)
    code, out, err = run_cli(["diff", ref, cand, "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["reference"]["dtype"], data["reference"]["checkpoint_dtype"]) == ("float32", "float32")
    assert (data["candidate"]["dtype"], data["candidate"]["checkpoint_dtype"]) == ("bfloat16", "bfloat16")
    assert data["tolerance"]["policy"] == "calibrated" and data["first_divergence"] is None
    said = " ".join(out.split())
    assert "(cpu, float32 as saved)" in said and "(cpu, bfloat16 as saved)" in said and "rounded" not in said
    # Asked for, a dtype wins over the checkpoint's: the header says it was cast.
    from blockdiff.loading import side_dtypes

    assert side_dtypes(ref, cand, (None, None)) == (torch.float32, torch.bfloat16)
    assert side_dtypes(cand, None, (None, None)) == (torch.bfloat16, torch.bfloat16)
    assert side_dtypes(cand, ref, (torch.float32, None)) == (torch.float32, torch.float32)
    assert side_dtypes(ref, "samples/tinylm.py:build", (None, None)) == (torch.float32, torch.float32)


def test_the_library_and_capture_run_a_checkpoint_in_its_own_dtype_too(checkpoints, tmp_path):
    """The rule lives where sides are opened, not in the CLI alone: engine.run with no dtype
    asked runs each checkpoint in its own, and a capture of the bfloat16 save is bfloat16."""
    from blockdiff import engine
    from blockdiff.dump import DumpReader

    ref, cand = map(str, checkpoints)
    report = engine.run(ref, cand, RandomTokens(batch=1, seq=8))
    assert (report.reference["dtype"], report.candidate["dtype"]) == ("float32", "bfloat16")
    assert report.first_divergence is None
    engine.capture(cand, RandomTokens(batch=1, seq=8), tmp_path / "c.h5")
    with DumpReader(tmp_path / "c.h5") as dump:
        assert dump.meta["dtype"] == "bfloat16"


def test_weights_rounded_through_bfloat16_are_said_once_with_the_option_that_judges_them(checkpoints, tmp_path, capsys):
    ref, cand = map(str, checkpoints)
    code, out, err = run_cli(["diff", ref, cand, "--cand-dtype", "float32", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1, out + err  # asked for float32, the rounded weights are divergences
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert len(report.divergences) > 10 and report.candidate["checkpoint_dtype"] == "bfloat16"
    lines = out.splitlines()
    assert "(cpu, float32, saved in bfloat16)" in " ".join(out.split())
    # One note for every rounded weight, once, naming the option; no headline repeats it.
    rounded = [i for i, line in enumerate(lines) if "rounded through" in line]
    assert len(rounded) == 1 and lines[rounded[0]].startswith("note: ")
    # The note and its continuation lines (indented), as wrapped to the terminal's width.
    following = lines[rounded[0] + 1:]
    continued = following[:next((i for i, line in enumerate(following) if not line.startswith(" ")), len(following))]
    note = " ".join(word for line in [lines[rounded[0]], *continued] for word in line.split())
    assert "--cand-dtype bfloat16" in note and "judge that as precision" in note
    assert [n for n in report.notes if "rounded" in n] == [report.notes[-1]]
    assert report.note_codes.count("rounded-weights") == 1 and "conversion" not in report.note_codes
    assert not any("rounded" in d.headline() for d in report.divergences)
    # Each divergent module's rounded weights stay on its check.
    head = next(d for d in report.divergences if d.stage == "head")
    assert head.check.details["rounded_through"] == [{"dtype": "bfloat16", "weights": ["lm_head.weight"]}]
    weights = sum(len(entry["weights"]) for d in report.divergences for entry in (d.check.details or {}).get("rounded_through", []))
    modules = sum(bool((d.check.details or {}).get("rounded_through")) for d in report.divergences)
    assert f"({weights} weights of {modules} divergent modules)" in report.notes[-1]
    # The option it names judges them as precision.
    code, out, err = run_cli(["diff", ref, cand, "--cand-dtype", "bfloat16", "-q"], capsys)
    assert (code, out) == (0, "no divergence\n"), err
