"""Backward: both sides run forward and backward on the same loss, and the first divergent
gradient is blamed on its block, sub-path and gradient, by the freeze-three/swap-one rule,
apart from the forward's verdict."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import DivergenceError, InputError, Options, Report, assert_no_divergence, run  # noqa: E402
from samples import backward_bugs, bugs, hf_llama, hf_moe, tinylm  # noqa: E402

from tests.conftest import run_cli, sample_ids  # noqa: E402

IDS = sample_ids()


def blamed(report: Report) -> tuple | None:
    """(block, sub-path, what) of the backward's first divergence, or None."""
    first = report.backward.first_divergence
    return None if first is None else (first.block, first.subpath, first.check.what)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bug", backward_bugs.BUGS)
def test_a_backward_bug_is_blamed_on_its_block_subpath_and_gradient_through_the_cli(bug, dtype, tmp_path, capsys):
    reference, block, subpath, what = backward_bugs.BUGS[bug]
    code, out, err = run_cli(
        ["diff", reference, f"samples/backward_bugs.py:{bug}", "--backward", "--cand-dtype", dtype,
         "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert report.first_divergence is None  # the forward is right
    assert blamed(report) == (block, subpath, what)
    assert f"forward: no divergence; backward: block {block} {subpath} ({what})" in " ".join(out.split())
    first = report.backward.first_divergence
    if dtype == "bfloat16":  # judged against the reference's own backward in bfloat16
        assert first.check.threshold.basis == "calibrated"
    if bug == "fused_norm_weight_grad":  # the norm's input gradient is right: only its weight's is not
        norm = report.backward.blocks[block].subpaths["norm"]
        assert first.module == "model.layers.1.post_attention_layernorm"
        assert [c.what for c in norm.checks if c.diverged] == ["parameter gradient: weight"]
    if bug in ("swiglu_backward_swapped", "moe_router_detached"):
        # Drilled down: every child's backward is right on its own gradients (the SwiGLU
        # function and the MoE's detach are the module's own code), and the drill says so.
        assert first.check.children and first.check.first_child is None
        assert "the cause is in" in " ".join(out.split())


@pytest.mark.parametrize(
    "reference, candidate",
    [
        (tinylm.build, lambda: tinylm.build().to(torch.bfloat16)),
        (hf_llama.build, lambda: hf_llama.build().to(torch.bfloat16)),
        (tinylm.build_moe, lambda: tinylm.build_moe().to(torch.bfloat16)),
        (tinylm.build, backward_bugs.checkpointed),
        (tinylm.build, lambda: backward_bugs.checkpointed().to(torch.bfloat16)),
        (tinylm.build, lambda: torch.compile(tinylm.build(), backend="aot_eager")),
        # its bfloat16 rotary differs a little: routing flips in the whole block (frozen there)
        (hf_moe.build_qwen3_moe, lambda: hf_moe.build_qwen3_moe().to(torch.bfloat16)),
    ],
    ids=["tinylm-bf16", "hf-llama-bf16", "moe-bf16", "checkpointed", "checkpointed-bf16", "compiled", "qwen3-moe-bf16"],
)
def test_clean_backwards_blame_nothing(reference, candidate):
    report = run(reference(), candidate(), IDS, options=Options(backward=True))
    assert report.verdict() == "forward: no divergence; backward: no divergence"
    assert not report.diverged
    back = report.backward
    # Every block was judged: its modules' gradients, its residual, the whole block, its drift.
    for block in back.blocks:
        assert {name for name, result in block.subpaths.items() if result.checks} == {"attention", "ffn", "norm", "residual"}
        assert block.block is not None and block.drift_check is not None
    if report.tolerance["policy"] == "calibrated":
        assert all(c.threshold.basis == "calibrated" for r in back.blocks[1].subpaths.values() for c in r.checks)
    if reference in (tinylm.build_moe, hf_moe.build_qwen3_moe):  # an MoE ffn's router and experts are judged apart too
        whats = {c.what for c in back.blocks[1].subpaths["ffn"].checks}
        assert {*ROUTER, EXPERTS} <= whats
    assert any("eval mode (dropout off)" in note for note in report.notes)


def test_gradients_are_judged_from_the_head_to_the_embedding():
    """Two residual bugs: the later block's backward runs first, so it is the first divergence."""
    model = tinylm.build()
    for index in (1, 3):
        model.blocks[index].__class__ = backward_bugs.ResidualDetached
    report = run(tinylm.build(), model, IDS, options=Options(backward=True))
    back = report.backward
    assert [(d.block, d.subpath) for d in back.divergences] == [(3, "residual"), (1, "residual")]
    assert [s.stage for s in sorted(back.stages, key=lambda s: s.order)] == ["head", "final_norm", "embed"]
    assert [b.index for b in sorted(back.blocks, key=lambda b: b.order)] == [3, 2, 1, 0]
    # Inside a block: the ffn's backward before the attention's, the residual last.
    block = back.blocks[3].subpaths
    assert block["ffn"].order < block["attention"].order < block["residual"].order


def test_a_forward_bug_is_not_blamed_again_by_the_backward():
    report = run(tinylm.build(), bugs.gelu_for_silu(block=2), IDS, options=Options(backward=True))
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "ffn")
    back = report.backward
    ffn = back.blocks[2].subpaths["ffn"]
    assert ffn.diverged and ffn.explained_by == "forward block 2 ffn"  # its gradients differ, as its forward does
    assert back.first_divergence is None
    assert all(b.drift_check is None for b in back.blocks)  # drift of gradients is not judged after it
    assert report.verdict().startswith("forward: block 2 ffn (blocks.2.ffn): rel_l2") and report.verdict().endswith(
        "; backward: no divergence"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug", ["head_untied_transposed", "post_norm", "residual_dropped", "norm_as_layernorm"])
def test_forward_bugs_of_every_kind_are_blamed_once(bug, dtype):
    report = run(tinylm.build(), getattr(bugs, bug)().to(dtype), IDS, options=Options(backward=True))
    first = report.first_divergence
    assert (first.stage, first.subpath) == bugs.BUGS[bug]
    assert report.backward.first_divergence is None
    back = report.backward
    if first.stage == "block":
        explained = {name: r.explained_by for name, r in back.blocks[first.block].subpaths.items() if r.explained_by}
        assert explained == {first.subpath: f"forward {first.where}"}
    else:
        assert [(s.stage, s.explained_by) for s in back.stages if s.explained_by] == [(first.stage, f"forward {first.where}")]


def test_a_backward_bug_beside_a_forward_bug_is_still_blamed():
    model = bugs.gelu_for_silu(block=1)
    model.blocks[3].__class__ = backward_bugs.ResidualDetached
    report = run(tinylm.build(), model, IDS, options=Options(backward=True))
    assert (report.first_divergence.block, report.first_divergence.subpath) == (1, "ffn")
    assert blamed(report) == (3, "residual", "input gradient")


def test_the_backward_report_round_trips_and_reports_without_one_still_read(tmp_path):
    report = run(tinylm.build(), backward_bugs.residual_detached(), IDS, options=Options(backward=True))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == "blockdiff.report/2" and data["first_divergence"] is None
    assert data["backward"]["first_divergence"]["subpath"] == "residual"
    back = Report.from_dict(data)
    assert back.to_dict() == data
    assert back.verdict() == report.verdict() and back.diverged
    assert [b.index for b in sorted(back.backward.blocks, key=lambda b: b.order)] == [3, 2, 1, 0]
    plain = run(tinylm.build(), tinylm.build(), IDS).to_dict()
    assert "backward" not in plain and Report.from_dict(plain).backward is None
    plain["schema"] = "blockdiff.report/1"
    assert Report.from_dict(plain).verdict() == "no divergence"
    # The HTML page says both verdicts and shows the gradients' table, from the saved JSON too.
    from blockdiff.html import document

    page = document(data, image=False)
    assert 'class="verdict diverged" id="verdict"><strong>Verdict</strong>: forward: no divergence; backward: block 1 residual' in page
    assert "No divergence</strong>: every local error" not in page
    assert 'id="backward"' in page and page.count('<table class="heat"') == 2 and 'id="backward-heatmap"' in page
    assert "First divergent gradient</strong>: block 1 residual (input gradient)" in page
    assert 'id="backward"' not in document(plain, image=False)
    # The terminal says both too, from the saved JSON as after the run (`blockdiff report`).
    import io

    from rich.console import Console

    from blockdiff.render import render

    out = io.StringIO()
    render(data, Console(file=out, width=120, no_color=True))
    said = out.getvalue()
    # One headline naming both verdicts, first (before any picture), its continuation indented.
    lines = said.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("Verdict: "))
    assert verdict < next(i for i, line in enumerate(lines) if line.startswith("local error / threshold"))
    assert "No divergence" not in said
    continued = []
    for line in lines[verdict + 1 :]:
        if not line.startswith("    "):
            break
        continued.append(line.strip())
    assert " ".join([lines[verdict], *continued]).startswith(
        "Verdict: forward: no divergence; backward: block 1 residual (input gradient) (blocks.1): rel_l2 "
    )
    # The backward's heatmap and table, laid out by the forward's renderer, with its numbers.
    back = said[said.index("Backward (gradients, judged from the head to the embedding):") :]
    assert "  block      3 2 1 0" in back and "  residual   · · X ·" in back
    rows = {line.split()[1]: line.split()[2:] for line in back.splitlines() if line.split()[:1] == ["block"]}
    (block,) = [b for b in data["backward"]["blocks"] if b["index"] == 1]
    residual = block["subpaths"]["residual"]["rel_l2"]
    assert rows["1"][3] == f"{residual:.2e}!" and len(rows) == 4
    out = io.StringIO()
    render(plain, Console(file=out, width=120, no_color=True))
    assert "Backward" not in out.getvalue()
    # The PNG draws the forward, under both verdicts (not the forward's "No divergence").
    pytest.importorskip("matplotlib")
    from blockdiff.plot import figure

    title = " ".join(figure(data).get_suptitle().split())
    assert "verdict: forward: no divergence; backward: block 1 residual (input gradient)" in title
    assert "No divergence" not in title


def test_the_assertion_judges_the_backward():
    assert_no_divergence(tinylm.build(), tinylm.build().to(torch.bfloat16), IDS, backward=True)
    with pytest.raises(DivergenceError, match=r"^forward: no divergence; backward: block 1 residual \(input gradient\)"):
        assert_no_divergence(tinylm.build(), backward_bugs.residual_detached(), IDS, backward=True)
    # Without backward=True the same candidate passes: its forward is right.
    assert_no_divergence(tinylm.build(), backward_bugs.residual_detached(), IDS)


def test_a_loss_of_ones_own(tmp_path, capsys):
    (tmp_path / "losses.py").write_text(
        "def last_position(output, inputs):\n    return output[:, -1].float().pow(2).mean()\n", encoding="utf-8"
    )
    code, out, err = run_cli(
        ["diff", "samples/tinylm.py:build", "samples/backward_bugs.py:residual_detached", "--backward",
         "--loss", f"{tmp_path / 'losses.py'}:last_position", "-q"],
        capsys,
    )
    assert code == 1, err
    assert out.startswith("forward: no divergence; backward: block 1 residual (input gradient)")
    code, out, err = run_cli(
        ["diff", "samples/tinylm.py:build", "--backward", "--loss", f"{tmp_path / 'losses.py'}:nothing"], capsys
    )
    assert code == 2 and "has no function 'nothing'" in err


def test_backward_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(InputError, match="backward runs in memory: not with stream"):
        run(tinylm.build(), tinylm.build(), IDS, options=Options(backward=True, stream=True))
    with pytest.raises(InputError, match="not with a dump, nor with decode"):
        run(hf_llama.build(), hf_llama.build(), IDS, options=Options(backward=True, decode=2))
    with pytest.raises(InputError, match="token ids"):
        run(tinylm.build(), tinylm.build(), IDS[:, :1], options=Options(backward=True))


def _ported(model: torch.nn.Module) -> torch.nn.Module:
    """The same model as other code: every module under a class of its own (no experiment
    is the floor's, every floor is measured)."""
    for module in model.modules():
        module.__class__ = type("Ported" + type(module).__name__, (type(module),), {})
    return model


@pytest.mark.parametrize("build", [hf_llama.build, tinylm.build_moe], ids=["hf-llama", "moe"])
def test_each_model_runs_forward_once_and_shared_runs_change_no_number(build, monkeypatch):
    """A backward diff records each side's forward in the run its backward differentiates,
    each module experiment's backward — and the candidate's whole-block one, where no routing
    is frozen — runs on the graph of the forward diff's experiment on that call, and a
    floor's whole-block run that is its residual's is run once: the report is the one
    separate runs give, number for number."""
    from blockdiff import backward

    judging = [False]
    blocks_judged: list[int] = []  # each candidate block run while the backward's experiments run
    real_judge = backward.judge

    def judge(*args, **kwargs):
        judging[0] = True
        try:
            return real_judge(*args, **kwargs)
        finally:
            judging[0] = False

    monkeypatch.setattr(backward, "judge", judge)
    from blockdiff.sides import gradients

    made: list[gradients.Graphs] = []  # every side's kept graphs
    real_init = gradients.Graphs.__init__
    monkeypatch.setattr(gradients.Graphs, "__init__", lambda self: (real_init(self), made.append(self))[0])

    def diffed() -> tuple[dict, dict[str, int]]:
        reference, candidate = build(), _ported(build()).to(torch.bfloat16)
        forwards = {"reference": 0, "candidate": 0, "candidate's modules": 0}
        for name, model in (("reference", reference), ("candidate", candidate)):
            # (the floor side's cast copy of the reference copies the hook: its runs are not counted)
            model.register_forward_pre_hook(
                lambda module, _, name=name, model=model: forwards.__setitem__(name, forwards[name] + (module is model))
            )
        for module in candidate.modules():
            module.register_forward_pre_hook(lambda *_: forwards.__setitem__("candidate's modules", forwards["candidate's modules"] + 1))
        blocks_judged.clear()
        for index, block in enumerate(_blocks(candidate)):
            block.register_forward_pre_hook(lambda *_, index=index: blocks_judged.append(index) if judging[0] else None)
        report = run(reference, candidate, IDS, options=Options(backward=True))
        assert report.verdict() == "forward: no divergence; backward: no divergence"
        assert report.tolerance["policy"] == "calibrated"
        data = report.to_dict()
        for part in (data, data["backward"]):
            part.pop("created")  # when it ran
        return data, forwards

    shared, forwards = diffed()
    modules = forwards.pop("candidate's modules")
    assert forwards == {"reference": 1, "candidate": 1}
    # In the backward, each block runs for its residual experiment (its modules answered by
    # the reference's); its whole-block experiment runs again only with routing frozen
    # (MoE), or where the forward's was answered by the candidate's own recorded call
    # (block 0: its input is the reference's cast, bit for bit), which kept no graph.
    count = len(_blocks(build()))
    again = range(count) if build is tinylm.build_moe else [0]
    assert sorted(blocks_judged) == sorted([*range(count), *again])
    # Every graph the forward kept was the backward's (none held for nothing until the end).
    assert len(made) == 2 and not any(graphs._kept for graphs in made)
    probe = backward.GradientChecks.residual_probe
    found: list[dict] = []

    def kept_apart(self, side, block, sites, shares):  # what it finds is not handed back: the residual runs
        found.append({})
        return probe(self, side, block, sites, found[-1])

    monkeypatch.setattr(backward.GradientChecks, "residual_probe", kept_apart)
    monkeypatch.setattr(backward.Recorder, "record", lambda self, side, inputs, store, **kw: side.record(inputs, store, **kw))
    apart, forwards = diffed()
    # Apart, each module experiment's forward runs again in the backward's (Graphs kept none).
    assert forwards.pop("candidate's modules") > modules
    assert forwards == {"reference": 2, "candidate": 2}
    # Where no block has MoE routing, every block's floor run is its residual's.
    if build is hf_llama.build:
        assert len(found) == 4 and all(shares and all(shares.values()) for shares in found)
    assert apart == shared


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks as blockdiff finds them."""
    from blockdiff.autodetect import resolve

    return [model.get_submodule(block.path) for block in resolve(model).blocks]


def test_the_users_models_are_left_as_they_were():
    reference, candidate = tinylm.build(), backward_bugs.residual_detached()
    candidate.blocks[0].attn.q_proj.weight.requires_grad_(False)
    flags = [p.requires_grad for p in candidate.parameters()]
    run(reference, candidate, IDS, options=Options(backward=True))
    assert [p.requires_grad for p in candidate.parameters()] == flags
    assert all(p.grad is None for model in (reference, candidate) for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in candidate.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drill_down_names_the_child_whose_backward_is_wrong(dtype):
    report = run(hf_llama.build(), backward_bugs.silu_backward_wrong().to(dtype), IDS, options=Options(backward=True))
    assert report.first_divergence is None
    first = report.backward.first_divergence
    assert (first.block, first.subpath) == (1, "ffn")
    # The projections before it and after it are right on their own gradients.
    assert first.check.first_child.module == "model.layers.1.mlp.act_fn"
    assert [c.what for c in first.check.children if c.diverged] == ["child act_fn"]


def test_a_compiled_candidates_backward_is_judged():
    """A torch.compile'd candidate (its experiments run its compiled modules): the detached
    residual is blamed, the forward clean."""
    bug = run(tinylm.build(), torch.compile(backward_bugs.residual_detached(), backend="aot_eager"), IDS,
              options=Options(backward=True))
    assert bug.first_divergence is None and blamed(bug) == (1, "residual", "input gradient")
    clean_blocks = [b for b in bug.backward.blocks if b.index != 1]
    assert not any(r.diverged for b in clean_blocks for r in b.subpaths.values())


ROUTER = ("router: input gradient", "router: parameter gradient: weight")
EXPERTS = "experts (routing frozen at the reference's): input gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug, router_wrong", [("moe_router_weight_grad_halved", True), ("moe_router_detached", False)])
def test_an_moe_ffn_backward_is_judged_as_router_and_experts_apart(bug, router_wrong, dtype):
    """The router alone (backward from the reference router's output gradient) and the
    experts with the reference's router in place: a wrong router backward is the router's;
    a detach in the MoE's own code leaves the router alone right."""
    report = run(tinylm.build_moe(), getattr(backward_bugs, bug)().to(dtype), IDS, options=Options(backward=True))
    assert report.first_divergence is None
    first = report.backward.first_divergence
    assert (first.block, first.subpath) == (1, "ffn")
    checks = {c.what: c for c in report.backward.blocks[1].subpaths["ffn"].checks}
    assert checks[ROUTER[1]].diverged is router_wrong and not checks[ROUTER[0]].diverged
    assert checks[EXPERTS].diverged is not router_wrong
    for block in (0, 2, 3):
        assert not report.backward.blocks[block].subpaths["ffn"].diverged


def test_a_kept_graph_holds_its_activations_so_no_other_tensor_can_take_it():
    # Graphs are found by the ids of the call and its activations: an activation made for
    # the forward diff's experiment and dropped after would hand its id to a later tensor.
    from blockdiff.sides.gradients import Graphs
    from blockdiff.site import Site

    graphs = Graphs()
    call = Site("block", 0, "ffn", "m", 0, 0, output=torch.zeros(4))
    made = torch.ones(4)
    leaves, out = {"primary": made.detach().requires_grad_()}, torch.zeros(4)
    graphs.keep("m", call, {"primary": made}, leaves, out)
    kept_id = id(made)
    del made
    later = [torch.ones(4) for _ in range(2000)]
    assert all(id(t) != kept_id for t in later)
    assert all(graphs.take("m", call, {"primary": t}) is None for t in later)
    assert graphs.take("m", call, {"primary": call.output}) is None
