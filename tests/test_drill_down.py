"""Drill-down: a divergent module's leaf children judged one by one."""

from __future__ import annotations

import pytest
import torch

import blockdiff
from blockdiff import Report
from blockdiff.view import drill_down
from samples import bugs, hf_families, hf_llama, tinylm
from tests.conftest import blamed

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bug_in_a_child_module_is_named(dtype, ids):
    report = blockdiff.diff(tinylm.build(), bugs.outlier_in_down_proj(block=2).to(dtype), ids)
    first = report.first_divergence
    assert blamed(report) == ("block", 2, "ffn")
    assert [c.what for c in first.check.children] == ["child gate_proj", "child up_proj", "child down_proj"]
    assert first.check.first_child.module == "blocks.2.ffn.down_proj"
    assert [c.diverged for c in first.check.children] == [False, False, True]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_hugging_face_activation_module_is_named(dtype, ids):
    report = blockdiff.diff(hf_llama.build(), hf_llama.gelu_for_silu(block=1).to(dtype), ids)
    assert report.first_divergence.check.first_child.module == "model.layers.1.mlp.act_fn"


@pytest.mark.parametrize("name", sorted(bugs.BUGS))
def test_bugs_in_a_modules_own_code_name_no_child(name, ids):
    # Every planted bug of the sample lives in a module's own forward code (an activation
    # applied as a function, a swapped gate, a scale, a mask, the glue), never in a child.
    report = blockdiff.diff(tinylm.build(), getattr(bugs, name)(), ids)
    first = report.first_divergence
    if first.check.children is not None:  # module checks of a live reference are drilled
        assert first.check.first_child is None
        assert drill_down(first).startswith("no child module diverges")
    else:
        assert first.subpath == "residual" or first.stage == "head" or first.subpath == "norm"


# Where each Hugging Face family's planted attention and FFN bug lives: the child module
# that holds it, or None for a bug in the sub-path module's own forward code.
WHERE = {
    ("gemma2", "ffn"): "model.layers.1.mlp.act_fn",
    ("gemma3", "ffn"): "model.layers.1.mlp.act_fn",
    ("olmo2", "ffn"): "model.layers.1.mlp.act_fn",
    ("phi3", "attention"): "model.layers.1.self_attn.qkv_proj",  # its fused projection's split
    ("gpt2", "ffn"): "transformer.h.1.mlp.act",
    ("gpt_neox", "ffn"): "gpt_neox.layers.1.mlp.act",
    ("falcon", "attention"): "transformer.h.1.self_attention.query_key_value",  # as Phi-3's
    ("falcon", "ffn"): "transformer.h.1.mlp.act",
    ("bert", "ffn"): "bert.encoder.layer.1.intermediate.intermediate_act_fn",
    ("t5", "ffn"): "encoder.block.1.layer.1.DenseReluDense.act",
}


@pytest.mark.parametrize("family", hf_families.FAMILIES)
@pytest.mark.parametrize("subpath", ["attention", "ffn"])
def test_hugging_face_family_bugs_drill_to_their_child_or_own_code(family, subpath, ids):
    bug = {"attention": hf_families.attention_bug, "ffn": hf_families.ffn_bug}[subpath]
    report = blockdiff.diff(hf_families.build(family=family), bug(family=family), hf_families.inputs(family, ids))
    first = report.first_divergence
    assert blamed(report) == ("block", 1, subpath) and first.check.children
    child = first.check.first_child
    assert (child and child.module) == WHERE.get((family, subpath))


def test_the_drill_down_is_in_the_json_the_terminal_and_the_html(ids, capsys, tmp_path):
    report = blockdiff.diff(tinylm.build(), bugs.outlier_in_down_proj(), ids)
    data = report.to_dict()["first_divergence"]
    check = next(c for c in report.to_dict()["blocks"][2]["subpaths"]["ffn"]["checks"])
    assert check["first_child"] == "blocks.2.ffn.down_proj" and len(check["children"]) == 3
    assert Report.from_dict(report.to_dict()).to_dict() == report.to_dict()
    assert data["module"] == "blocks.2.ffn"
    from blockdiff.html import document

    assert "First divergent child: blocks.2.ffn.down_proj" in document(report, image=False)
    from rich.console import Console
    import io

    out = io.StringIO()
    from blockdiff.render import render

    render(report, Console(file=out, width=120, no_color=True))
    assert "  first divergent child: blocks.2.ffn.down_proj: rel_l2 " in out.getvalue()


def test_clean_precision_drills_nothing(ids):
    report = blockdiff.diff(tinylm.build(), tinylm.build().to(torch.bfloat16), ids)
    assert all(c.children is None for b in report.blocks for r in b.subpaths.values() for c in r.checks)


def test_dynamically_quantized_projections_are_judged_as_children(ids):
    # A quantized Linear keeps its packed weights in a child that is never called: the
    # quantized Linear itself is the innermost module that ran, and is judged.
    candidate = torch.ao.quantization.quantize_dynamic(hf_llama.build(), {torch.nn.Linear}, dtype=torch.qint8)
    report = blockdiff.diff(hf_llama.build(), candidate, ids)
    first = report.first_divergence
    assert blamed(report) == ("block", 0, "attention")
    assert [c.module for c in first.check.children] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]
    assert all(c.diverged for c in first.check.children)
