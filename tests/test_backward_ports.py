"""Backward: gradients the backward once refused or passed silently.

- A module that passes no gradient at all (an HF MoE router whose outputs are
  ``detach()``ed) is the divergence, blamed on its block's ffn: not refused; a module with
  no gradient on both sides is not blamed.
- A port whose weights and children have other names than the reference's, and a fused
  ``wqkv`` (samples/fused_port.py): its parameter gradients pair as the forward pairs
  weights and children (``conversion.paired_parameters``, ``children.pair_children``), a
  weight-gradient bug is blamed on its parameter, the drill-down pairs children as the
  forward does, and a gradient that pairs with nothing is named, never dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from blockdiff import Options, Report, run  # noqa: E402
from samples import backward_bugs, fused_port, hf_moe  # noqa: E402
from tests.conftest import sample_ids  # noqa: E402

IDS = sample_ids()
ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROUTER_WEIGHT = "router: parameter gradient: weight"
NOT_PAIRED = "pair with nothing on the other side"


@pytest.fixture(scope="module")
def llama():
    """The port's reference (HF Llama), shared: a diff leaves a model as it was."""
    return fused_port.reference()


@pytest.fixture(scope="module")
def mixtral():
    return hf_moe.build()


def backward(reference, candidate) -> Report:
    return run(reference, candidate, IDS, options=Options(backward=True))


def checks(report: Report):
    """Every backward check of every block, with its block and sub-path."""
    return [(b.index, name, c) for b in report.backward.blocks for name, r in b.subpaths.items() for c in r.checks]


# -- 1. a module that passes no gradient ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_router_that_passes_no_gradient_is_blamed_not_refused(mixtral, dtype):
    _, block, subpath, what = backward_bugs.PAIRING_BUGS["hf_moe_router_detached"]
    report = backward(mixtral, backward_bugs.hf_moe_router_detached().to(DTYPES[dtype]))
    assert report.first_divergence is None  # the forward is right
    first = report.backward.first_divergence
    assert (first.block, first.subpath, first.check.what) == (block, subpath, what[dtype])
    router = "model.layers.1.mlp.gate"
    assert first.module == ("model.layers.1.mlp" if dtype == "float32" else router)
    ffn = {c.what: c for c in report.backward.blocks[block].subpaths["ffn"].checks}
    # Every gradient of the router is zero where the reference's is not: its weight's, in
    # the MoE's check and in the router's own, and its input's.
    for name in ("parameter gradient: gate.weight", ROUTER_WEIGHT, "router: input gradient"):
        assert ffn[name].diverged and ffn[name].measured == 1.0, name
    if dtype == "float32":  # the MoE's check drilled down: the router is its child that diverges
        assert first.check.first_child.module == router
    else:
        assert first.check.threshold.basis == "calibrated"
    # Nothing else diverges: the other blocks' routers pass their gradients.
    assert {(b, s) for b, s, c in checks(report) if c.diverged} == {(block, "ffn")}
    assert any(f"({router}): the candidate's module passes no gradient" in note for note in report.backward.notes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_module_without_gradient_on_both_sides_is_not_blamed(dtype):
    report = backward(backward_bugs.hf_moe_routers_detached(), backward_bugs.hf_moe_routers_detached().to(DTYPES[dtype]))
    assert report.verdict() == "forward: no divergence; backward: no divergence"
    ffn = {c.what: c for c in report.backward.blocks[1].subpaths["ffn"].checks}
    assert ffn["parameter gradient: gate.weight"].measured == 0.0  # zero on both sides
    assert ROUTER_WEIGHT not in ffn  # no gradient reaches the reference's router: nothing to judge
    assert "no-gradient" not in report.backward.note_codes


# -- 2. a port's weights and children of other names -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug", ["port_down_weight_grad_averaged", "port_qkv_weight_grad_v_rows_dropped"])
def test_a_ports_weight_gradient_bug_is_blamed_on_its_parameter(llama, bug, dtype):
    _, block, subpath, what = backward_bugs.PAIRING_BUGS[bug]
    report = backward(llama, getattr(backward_bugs, bug)().to(DTYPES[dtype]))
    assert report.first_divergence is None  # the forward is right
    first = report.backward.first_divergence
    assert (first.block, first.subpath, first.check.what) == (block, subpath, what[dtype])
    module = {"ffn": "feed_forward", "attention": "attention"}[subpath]
    assert first.module == f"model.layers.{block}.{module}"
    # Only that one gradient diverges: the module's input gradient and every other weight's are right.
    assert [(b, s, c.what) for b, s, c in checks(report) if c.diverged] == [(block, subpath, what[dtype])]
    if dtype == "bfloat16":
        assert first.check.threshold.basis == "calibrated"
    # The drill-down pairs children as the forward does, and judges them: each child's own
    # backward is right (the weight gradient is the kernel's).
    children = first.check.children
    assert children and first.check.first_child is None
    if subpath == "attention":  # every child has its counterpart: the fused wqkv as q, k and v
        assert [c.what for c in children] == ["child wqkv (as q_proj+k_proj+v_proj)", "child wo (as o_proj)"]
        assert first.check.children_not_paired == {"reference": [], "candidate": []}
        assert first.check.every_child_checked is True
    else:  # the port applies SiLU as a function: HF's act_fn has no counterpart, and is named
        assert [c.what for c in children] == ["child w1 (as gate_proj)", "child w3 (as up_proj)", "child w2 (as down_proj)"]
        assert first.check.children_not_paired == {"reference": ["act_fn"], "candidate": []}
    assert "gradients-not-paired" not in report.backward.note_codes


ATTENTION = ["input gradient", "parameter gradient: wqkv.weight (as q_proj.weight+k_proj.weight+v_proj.weight)",
             "parameter gradient: wo.weight (as o_proj.weight)"]
FFN = ["input gradient", "parameter gradient: w1.weight (as gate_proj.weight)",
       "parameter gradient: w3.weight (as up_proj.weight)", "parameter gradient: w2.weight (as down_proj.weight)"]
FFN_W13 = ["input gradient", "parameter gradient: w13.weight (as gate_proj.weight+up_proj.weight)",
           "parameter gradient: w2.weight (as down_proj.weight)"]


@pytest.mark.parametrize(
    "make, ffn",
    [(fused_port.port, FFN), (lambda: fused_port.port().to(torch.bfloat16), FFN), (fused_port.port_w13, FFN_W13)],
    ids=["wqkv", "wqkv-bf16", "w13"],
)
def test_a_clean_ports_gradients_are_every_one_paired_and_nothing_is_blamed(llama, make, ffn):
    report = backward(llama, make())
    assert report.verdict() == "forward: no divergence; backward: no divergence"
    for block in report.backward.blocks:
        assert [c.what for c in block.subpaths["attention"].checks] == ATTENTION
        assert [c.what for c in block.subpaths["ffn"].checks] == ffn
    assert not any((c.details or {}).get("parameters_not_paired") for _, _, c in checks(report))
    assert "gradients-not-paired" not in report.backward.note_codes
    if report.tolerance["policy"] == "calibrated":
        assert max(c.ratio for _, _, c in checks(report)) < 0.5


def test_gradients_that_pair_with_nothing_are_named_not_dropped(llama):
    # The port's projections are its own type: nothing tells which of HF's attention
    # projections wqkv and wo stand for (the MLP's pair by shape and order).
    candidate = fused_port.port()
    for layer in candidate.model.layers:
        for parent in (layer.attention, layer.feed_forward):
            for name, child in list(parent.named_children()):
                setattr(parent, name, fused_port.Projection(child))
    report = backward(llama, candidate)
    assert report.verdict() == "forward: no divergence; backward: no divergence"
    attention = report.backward.blocks[1].subpaths["attention"].checks
    assert [c.what for c in attention] == ["input gradient"]
    assert attention[0].details["parameters_not_paired"] == {
        "reference": ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"],
        "candidate": ["wqkv.weight", "wo.weight"],
    }
    assert [c.what for c in report.backward.blocks[1].subpaths["ffn"].checks] == FFN
    notes = [n for n in report.backward.notes if NOT_PAIRED in n]
    assert len(notes) == 4 and notes[1] == (
        "backward: block 1 attention (model.layers.1.attention): parameter gradients that pair with nothing on the "
        "other side (by name, by role, order and shape, or through the module's children), not judged: reference "
        "q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight; candidate wqkv.weight, wo.weight"
    )


class InputGradHalved(torch.autograd.Function):
    """``x Wᵀ`` whose backward halves the input gradient (the weight's is right)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        return 0.5 * (grad @ weight), flat.t() @ x.reshape(-1, x.shape[-1])


def test_the_drill_down_names_a_fused_child_whose_backward_is_wrong(llama):
    # The fused wqkv's input gradient halved in block 2: judged against the sum of what
    # q_proj, k_proj and v_proj pass back to their shared input.
    candidate = fused_port.port()
    wqkv = candidate.model.layers[2].attention.wqkv
    forward = lambda self, x: InputGradHalved.apply(x, self.weight)  # noqa: E731
    wqkv.__class__ = type("InputGradHalvedLinear", (type(wqkv),), {"forward": forward})
    report = backward(llama, candidate)
    assert report.first_divergence is None
    first = report.backward.first_divergence
    assert (first.block, first.subpath, first.check.what) == (2, "attention", "input gradient")
    assert first.check.first_child.module == "model.layers.2.attention.wqkv"
    assert [c.what for c in first.check.children if c.diverged] == ["child wqkv (as q_proj+k_proj+v_proj)"]
    assert first.check.every_child_checked is True


# -- 3. the real CLI ---------------------------------------------------------------------------


def test_a_ports_fused_weight_gradient_bug_is_blamed_through_the_cli(tmp_path):
    bug = "port_qkv_weight_grad_v_rows_dropped"
    reference, block, subpath, what = backward_bugs.PAIRING_BUGS[bug]
    done = subprocess.run(
        [sys.executable, "-m", "blockdiff", "diff", reference, f"samples/backward_bugs.py:{bug}", "--backward",
         "--cand-dtype", "bfloat16", "--json", str(tmp_path / "r.json")],
        cwd=ROOT, env={**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_divergence"] is None  # the forward is right
    first = data["backward"]["first_divergence"]
    assert (first["block"], first["subpath"], first["what"]) == (block, subpath, what["bfloat16"])
    assert first["module"] == "model.layers.1.attention"
    printed = " ".join(done.stdout.split())  # lines wrapped at the terminal's width
    assert "forward: no divergence; backward: block 1 attention (parameter gradient: wqkv.weight" in printed
