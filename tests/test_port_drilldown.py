"""Drill-down across ports that name their children their own way (issue #33 item 2).

A drill-down says which child of a divergent module diverges first, or that none does.
Across two codebases children pair by name, else by role (activations, norms, dropouts by
type; projections by the order they run and their shapes), else a fused projection
against split ones; what pairs with nothing is named, never counted as checked, and the
cause is put in the module itself only when every child on both sides was checked.

Ports as independent codebases write them (samples/fused_port.py): a Meta-style Llama
(``wqkv``, ``wo``, ``w1, w3, w2`` or ``w13``, SiLU as a function) loaded from HF Llama
weights by its own conversion, and a GPT-2 whose MLP activation child is ``gelu`` where
HF's is ``act``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import blockdiff  # noqa: E402
from blockdiff import Report  # noqa: E402
from blockdiff.view import drill_down  # noqa: E402
from samples import bugs, fused_port, hf_families, port, tinylm  # noqa: E402
from tests.conftest import blamed  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
TINYLM_PORT = dict(reference_hooks=port.REFERENCE_HOOKS, candidate_hooks=port.PORT_HOOKS)


def diffed(reference, candidate, ids, dtype=torch.float32, **options):
    """The report of ``candidate`` at ``dtype`` against ``reference``, and its first divergence."""
    report = blockdiff.diff(reference, candidate.to(dtype), ids, **options)
    return report, report.first_divergence


def whats(first) -> list[str]:
    return [c.what for c in first.check.children]


# -- 1. honesty: what was not checked is said, by name ----------------------------------------


def test_children_that_pair_with_nothing_are_named_and_not_counted_as_checked(ids):
    # The port's projections are its own type: nothing tells which of HF's they stand for.
    report, first = diffed(fused_port.reference(), fused_port.port_own_projections_attention_scale(block=1), ids)
    assert blamed(report) == ("block", 1, "attention")
    assert first.check.children == []
    assert first.check.children_not_paired == {
        "reference": ["q_proj", "k_proj", "v_proj", "o_proj"], "candidate": ["wqkv", "wo"]
    }
    assert first.check.every_child_checked is False
    assert drill_down(first) == (
        "no child module diverges (0 checked; 2 candidate children not paired: wqkv, wo; 4 reference children not "
        "paired: q_proj, k_proj, v_proj, o_proj): the cause is in model.layers.1.attention's own code or in a child "
        "not checked"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_reference_activation_the_port_applies_as_a_function_is_named(dtype, ids):
    # tinylm applies SiLU as a function: HF's act_fn has no counterpart, and the line says
    # so instead of claiming the cause is in the FFN's own code.
    report, first = diffed(port.reference(), port.port_gelu_for_silu(block=2), ids, dtype, **TINYLM_PORT)
    assert blamed(report) == ("block", 2, "ffn")
    assert whats(first) == ["child gate_proj", "child up_proj", "child down_proj"]
    assert first.check.children_not_paired == {"reference": ["act_fn"], "candidate": []}
    assert drill_down(first) == (
        "no child module diverges (3 checked; 1 reference child not paired: act_fn): the cause is in "
        "blocks.2.ffn's own code or in a child not checked"
    )


def test_a_candidate_child_that_pairs_with_nothing_is_named_where_the_bug_is(ids):
    # Roles swapped: the port (SiLU as a function) is the reference, HF Llama with a GELU
    # act_fn in block 1 the candidate. The wrong child is the one nothing pairs with: the
    # line must not put the cause in the MLP's own code.
    candidate = port.reference()
    candidate.model.layers[1].mlp.act_fn = nn.GELU()
    report, first = diffed(fused_port.port(), candidate, ids)
    assert blamed(report) == ("block", 1, "ffn")
    assert first.check.first_child is None
    assert first.check.children_not_paired == {"reference": [], "candidate": ["act_fn"]}
    assert drill_down(first) == (
        "no child module diverges (3 checked; 1 candidate child not paired: act_fn): the cause is in "
        "model.layers.1.mlp's own code or in a child not checked"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cause_is_in_the_module_itself_only_when_every_child_was_checked(dtype, ids):
    report, first = diffed(tinylm.build(), bugs.gelu_for_silu(block=2), ids, dtype)
    assert blamed(report) == ("block", 2, "ffn")
    assert first.check.every_child_checked is True
    assert drill_down(first) == "no child module diverges (3 checked): the cause is in blocks.2.ffn itself (its code or its weights)"


def test_a_first_divergent_child_also_says_what_was_not_checked(ids):
    report, first = diffed(fused_port.reference(), fused_port.port_gate_up_swapped(), ids)
    line = drill_down(first)
    assert line.startswith("first divergent child: model.layers.0.feed_forward.w1 (as gate_proj): rel_l2 ")
    assert line.endswith("x); not checked: 1 reference child not paired: act_fn")


def test_children_paired_by_name_whose_shapes_differ_are_not_judged_and_say_why(ids):
    # A candidate with a narrower FFN: its projections pair by name but cannot be judged
    # on the reference's tensors; the drill-down says so instead of failing the diff.
    report, first = diffed(tinylm.build(), tinylm.build(intermediate=96), ids)
    assert blamed(report) == ("block", 0, "ffn")
    assert first.check.children == []
    assert first.check.children_not_judged == [
        "gate_proj (output shape [2, 16, 96] in the candidate, [2, 16, 172] in the reference)",
        "up_proj (output shape [2, 16, 96] in the candidate, [2, 16, 172] in the reference)",
        "down_proj (input shape [2, 16, 96] in the candidate, [2, 16, 172] in the reference)",
    ]
    assert first.check.children_not_paired == {"reference": [], "candidate": []}
    line = drill_down(first)
    assert line.startswith("no child module diverges (0 checked; 3 children not judged: gate_proj (output shape ")
    assert line.endswith("): the cause is in blocks.0.ffn's own code or in a child not checked")


def test_what_was_not_checked_is_in_the_json_and_old_reports_still_read(ids):
    report, _ = diffed(fused_port.reference(), fused_port.port_gelu_for_silu(block=1), ids)
    data = report.to_dict()
    check = data["blocks"][1]["subpaths"]["ffn"]["checks"][0]
    assert check["children_not_paired"] == {"reference": ["act_fn"], "candidate": []}
    assert check["children_not_judged"] == []
    assert [c["what"] for c in check["children"]] == ["child w1 (as gate_proj)", "child w3 (as up_proj)", "child w2 (as down_proj)"]
    assert Report.from_dict(data).to_dict() == data
    # A report of an older version has neither field: it reads, and the line does not
    # claim what it cannot know.
    del check["children_not_paired"], check["children_not_judged"]
    old = Report.from_dict(data).first_divergence
    assert old.check.children_not_paired is None and old.check.every_child_checked is None
    assert drill_down(old) == (
        "no child module diverges (3 checked; which children could not be paired is not recorded): the cause is in "
        "model.layers.1.feed_forward's own code or in a child not checked"
    )


# -- 2. pairing by role ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", [fused_port.port, fused_port.port_w13], ids=["wqkv", "w13"])
def test_the_clean_fused_port_blames_nothing(make, dtype, ids):
    report, first = diffed(fused_port.reference(), make(), ids, dtype)
    assert first is None
    assert len(report.blocks) == 4
    for block in report.blocks:
        assert {name for name, result in block.subpaths.items() if result.checks} == {"attention", "ffn", "norm", "residual"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_clean_gpt2_port_blames_nothing(dtype, ids):
    report, first = diffed(fused_port.gpt2_reference(), fused_port.gpt2_port(), ids, dtype)
    assert first is None and len(report.blocks) == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "activation",
    [nn.SiLU, lambda: hf_families._Swapped(torch.nn.functional.silu)],
    ids=["nn.SiLU", "parameter-free-leaf"],
)
def test_the_gpt2_ports_changed_activation_child_is_paired_by_role_and_named(activation, dtype, ids):
    # HF's mlp.act against the port's mlp.gelu: the changed activation is the child to blame,
    # by its type or, a module of no known type, by where it runs (between c_fc and c_proj).
    candidate = fused_port.gpt2_port(wrong={1: activation()})
    report, first = diffed(fused_port.gpt2_reference(), candidate, ids, dtype)
    assert blamed(report) == ("block", 1, "ffn")
    assert whats(first) == ["child c_fc", "child gelu (as act)", "child c_proj", "child dropout"]
    assert [c.diverged for c in first.check.children] == [False, True, False, False]
    assert first.check.first_child.module == "transformer.h.1.mlp.gelu"
    assert first.check.every_child_checked is True
    assert drill_down(first).startswith("first divergent child: transformer.h.1.mlp.gelu (as act): rel_l2 ")
    assert "not checked" not in drill_down(first)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_projections_pair_by_order_and_shape(dtype, ids):
    # The conversion loads HF's up projection as w1 (the gate) and the gate as w3.
    report, first = diffed(fused_port.reference(), fused_port.port_gate_up_swapped(), ids, dtype)
    assert blamed(report) == ("block", 0, "ffn")
    assert whats(first) == ["child w1 (as gate_proj)", "child w3 (as up_proj)", "child w2 (as down_proj)"]
    assert [c.diverged for c in first.check.children] == [True, True, False]
    assert first.check.first_child.module == "model.layers.0.feed_forward.w1"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_wrong_activation_in_the_ports_forward_code_clears_its_projections(dtype, ids):
    report, first = diffed(fused_port.reference(), fused_port.port_gelu_for_silu(block=2), ids, dtype)
    assert blamed(report) == ("block", 2, "ffn")
    assert whats(first) == ["child w1 (as gate_proj)", "child w3 (as up_proj)", "child w2 (as down_proj)"]
    assert not any(c.diverged for c in first.check.children)
    assert drill_down(first) == (
        "no child module diverges (3 checked; 1 reference child not paired: act_fn): the cause is in "
        "model.layers.2.feed_forward's own code or in a child not checked"
    )


# -- 3. fused against split ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_fused_projection_is_judged_against_the_split_ones_side_by_side(dtype, ids):
    # The conversion writes wqkv as q, v, k: the fused projection is the child to blame.
    report, first = diffed(fused_port.reference(), fused_port.port_kv_swapped(), ids, dtype)
    assert blamed(report) == ("block", 0, "attention")
    assert whats(first) == ["child wqkv (as q_proj+k_proj+v_proj)", "child wo (as o_proj)"]
    assert [c.diverged for c in first.check.children] == [True, False]
    assert first.check.first_child.module == "model.layers.0.attention.wqkv"
    assert drill_down(first).startswith("first divergent child: model.layers.0.attention.wqkv (as q_proj+k_proj+v_proj): ")
    fused = first.check.children[0]
    if dtype == torch.bfloat16:  # its floor: the three reference children's, together
        assert fused.threshold.basis == "calibrated" and fused.threshold.floor is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bug_in_the_fused_ports_attention_code_is_its_own(dtype, ids):
    report, first = diffed(fused_port.reference(), fused_port.port_attention_scale(block=3), ids, dtype)
    assert blamed(report) == ("block", 3, "attention")
    assert whats(first) == ["child wqkv (as q_proj+k_proj+v_proj)", "child wo (as o_proj)"]
    assert drill_down(first) == (
        "no child module diverges (2 checked): the cause is in model.layers.3.attention itself (its code or its weights)"
    )


def test_a_fused_gate_and_up_projection(ids):
    report, first = diffed(fused_port.reference(), fused_port.port_w13_gate_up_swapped(block=1), ids)
    assert blamed(report) == ("block", 1, "ffn")
    assert whats(first) == ["child w13 (as gate_proj+up_proj)", "child w2 (as down_proj)"]
    assert not any(c.diverged for c in first.check.children)
    assert first.check.children_not_paired == {"reference": ["act_fn"], "candidate": []}


def test_a_fused_reference_child_against_the_candidates_split_ones(ids):
    # Roles swapped: the fused port is the reference, HF Llama (with a wrong attention scale
    # in block 1) the candidate: q_proj, k_proj and v_proj side by side against wqkv.
    report, first = diffed(fused_port.port(), port.reference_attention_scale(block=1), ids)
    assert blamed(report) == ("block", 1, "attention")
    assert whats(first) == ["child q_proj+k_proj+v_proj (as wqkv)", "child o_proj (as wo)"]
    assert drill_down(first) == (
        "no child module diverges (2 checked): the cause is in model.layers.1.self_attn itself (its code or its weights)"
    )


def test_the_port_converts_every_weight_and_computes_the_same_logits(ids):
    reference = fused_port.reference()
    ported = fused_port.port_of(reference)
    q, k, v = (reference.model.layers[0].self_attn.get_submodule(f"{p}_proj").weight for p in "qkv")
    assert torch.equal(ported.model.layers[0].attention.wqkv.weight, torch.cat([q, k, v]))
    assert ported.model.output.weight is ported.model.tok_embeddings.weight
    with torch.inference_mode():
        expected = reference(ids, use_cache=False).logits
        got = ported(ids)
    assert float((got - expected).norm() / expected.norm()) < 1e-5
