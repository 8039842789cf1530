"""Decode steps with a KV cache: each side decodes with its own cache, every step is
localized, and a bug only the cached path has is blamed on its step, block and sub-path."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import InputError, Options, Report, run  # noqa: E402
from samples import decode_bugs, hf_llama, hf_moe  # noqa: E402

from tests.conftest import run_cli  # noqa: E402

IDS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
STEPS = 3

LLAMA, MISTRAL, QWEN3 = "samples/hf_llama.py:build", "samples/decode_bugs.py:sliding", "samples/hf_llama.py:build_qwen3"
# bug → (step, stage or block, sub-path, what the check compared), the caches, the
# reference, the prompt's length (a window of 6: a prompt of 4 passes it at step 3).
PLANTED = {
    "cache_one_slot_early": ((1, 1, "attention", "kv cache: keys"), ("dynamic", "dynamic"), LLAMA, 8),
    "cache_one_slot_early-static": ((1, 1, "attention", "kv cache: keys"), ("dynamic", "static"), LLAMA, 8),
    "kv_heads_reversed_when_cached": ((1, 1, "attention", "output"), ("dynamic", "dynamic"), LLAMA, 8),
    "rotary_not_offset": ((1, "context", None, None), ("dynamic", "dynamic"), LLAMA, 8),
    "static_slots_unmasked": ((1, 0, "attention", "output"), ("dynamic", "static"), LLAMA, 8),
    "window_one_too_many": ((3, 0, "attention", "output"), ("dynamic", "dynamic"), MISTRAL, 4),
    "window_one_too_few": ((2, 0, "attention", "output"), ("dynamic", "dynamic"), MISTRAL, 4),
    # Written wrong from the prompt on, while the prompt's own output is right: the cache
    # check names it at step 0.
    "keys_cached_before_knorm": ((0, 1, "attention", "kv cache: keys"), ("dynamic", "dynamic"), QWEN3, 8),
}


def blamed(report: Report) -> tuple | None:
    first = report.first_divergence
    if first is None:
        return None
    if first.stage != "block":
        return (first.step, first.stage, None, None)
    return (first.step, first.block, first.subpath, first.check.what)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bug", PLANTED)
def test_a_cache_bug_is_blamed_on_its_step_block_and_subpath_through_the_cli(bug, dtype, tmp_path, capsys):
    expected, (ref_cache, cand_cache), reference, seq = PLANTED[bug]
    factory = bug.removesuffix("-static")
    code, out, err = run_cli(
        ["diff", reference, f"samples/decode_bugs.py:{factory}", "--decode", "4",
         "--cand-dtype", dtype, "--ref-cache", ref_cache, "--cand-cache", cand_cache, "--seq", str(seq),
         "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    data = json.loads((tmp_path / "r.json").read_text())
    report = Report.from_dict(data)
    assert blamed(report) == expected
    step = expected[0]
    assert data["first_divergence"]["step"] == step and data["decode"]["step"] == step
    # The steps before (prefill, step 0, included) blame nothing.
    assert all(s["first_divergence"] is None for s in data["steps"][:step])
    assert f"step {step} " in out
    if bug == "keys_cached_before_knorm":  # the prompt's attention output itself is right
        output = next(c for c in report.blocks[1].subpaths["attention"].checks if c.what == "output")
        assert not output.diverged


@pytest.mark.parametrize(
    "build, caches",
    [(hf_llama.build, ("dynamic", "dynamic")), (hf_llama.build, ("dynamic", "static")),
     (hf_llama.build, ("static", "dynamic")), (decode_bugs.sliding, ("dynamic", "dynamic"))],
    ids=["dynamic", "dynamic-static", "static-dynamic", "sliding-window"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clean_decodes_blame_nothing_at_any_step(build, caches, dtype):
    steps = STEPS if build is hf_llama.build else 6  # the window passed
    report = run(build(), build().to(dtype), IDS[:, :4] if steps == 6 else IDS, options=Options(decode=steps, caches=caches))
    assert blamed(report) is None and len(report.steps) == steps + 1
    assert all(step["first_divergence"] is None for step in report.steps)
    # The cache is a site: every attention's keys and values were compared.
    for block in report.blocks:
        whats = [c.what for c in block.subpaths["attention"].checks]
        assert whats[:2] == ["kv cache: keys", "kv cache: values"]
    if dtype == torch.bfloat16:  # calibrated: the reference's own cached run in bfloat16
        assert report.tolerance["policy"] == "calibrated"
        assert all(c.threshold.basis == "calibrated" for c in report.blocks[1].subpaths["attention"].checks)


def test_the_first_step_whose_greedy_tokens_differ_is_reported():
    report = run(hf_llama.build(), decode_bugs.kv_heads_reversed_when_cached(), IDS, options=Options(decode=STEPS))
    assert report.decode["tokens_differ_at"] is not None and report.decode["tokens_differ_at"] >= 1
    clean = run(hf_llama.build(), hf_llama.build(), IDS, options=Options(decode=STEPS))
    assert clean.decode["tokens_differ_at"] is None


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_model_against_its_own_uncached_forward(dtype):
    clean = run("samples/hf_llama.py:build", None, IDS, options=Options(decode=64, dtypes=(dtype, None)))
    assert clean.decode["uncached_reference"] and blamed(clean) is None and len(clean.steps) == 65
    bug = run("samples/decode_bugs.py:cache_one_slot_early", None, IDS, options=Options(decode=STEPS, dtypes=(dtype, None)))
    assert blamed(bug) == (1, 1, "attention", "output")
    assert any("against its own cache" in note for note in bug.notes)


def test_an_moe_model_decodes_with_its_routing_judged_at_every_step():
    clean = run(hf_moe.build(), hf_moe.build().to(torch.bfloat16), IDS, options=Options(decode=2))
    assert blamed(clean) is None and clean.moe
    whats = [c.what for c in clean.blocks[1].subpaths["ffn"].checks]
    assert "routing flips" in whats and any(w.startswith("experts") for w in whats)
    bug = run(hf_moe.build(), hf_moe.expert_off_by_one(), IDS, options=Options(decode=2))
    assert blamed(bug)[:3] == (0, 1, "ffn")  # the experts are wrong from the prompt on


def test_a_decode_report_round_trips_and_a_schema_1_report_still_reads():
    report = run(hf_llama.build(), decode_bugs.cache_one_slot_early(), IDS, options=Options(decode=2))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema"] == "blockdiff.report/2"
    back = Report.from_dict(data)
    assert back.to_dict() == data and back.first_divergence.headline() == report.first_divergence.headline()
    assert back.first_divergence.headline().startswith("step 1 block 1 attention (kv cache: keys)")
    old = run(hf_llama.build(), hf_llama.build(), IDS).to_dict()
    old["schema"] = "blockdiff.report/1"
    assert Report.from_dict(old).decode is None


def test_decode_refuses_what_it_cannot_do():
    with pytest.raises(InputError, match="token ids"):
        run(hf_llama.build(), hf_llama.build(), {"input_ids": IDS}, options=Options(decode=2))
    with pytest.raises(InputError, match="dumps of decode steps"):
        run("never.h5", hf_llama.build(), IDS, options=Options(decode=2))
    with pytest.raises(InputError, match="not with --stream"):
        run(hf_llama.build(), hf_llama.build(), IDS, options=Options(decode=2, stream=True))
    from samples import tinylm

    with pytest.raises(InputError, match="no decode step blockdiff knows"):
        run(tinylm.build(), tinylm.build(), IDS, options=Options(decode=2))


def test_the_assertion_judges_decode_steps():
    from blockdiff import DivergenceError, assert_no_divergence

    assert_no_divergence(hf_llama.build(), hf_llama.build(), IDS, decode=2, caches=("dynamic", "static"))
    with pytest.raises(DivergenceError, match=r"step 1 block 1 attention \(kv cache: keys\)"):
        assert_no_divergence(hf_llama.build(), decode_bugs.cache_one_slot_early(), IDS, decode=2)


def test_a_drill_down_at_a_decode_step_replays_each_child_once_on_the_cache_before_the_step():
    ids = IDS[:, :4]
    report = run(decode_bugs.sliding(), decode_bugs.window_one_too_many(), ids, options=Options(decode=4))
    first = report.first_divergence
    assert (first.step, first.block, first.subpath) == (3, 0, "attention")
    children = first.check.children
    # Each projection once, every one right: the window is the attention's own code.
    assert [c.what for c in children] == ["child q_proj", "child k_proj", "child v_proj", "child o_proj"]
    assert not any(c.diverged for c in children)


def test_the_html_page_of_a_decode_shows_its_steps_by_blocks(tmp_path):
    from blockdiff import html

    report = run(hf_llama.build(), decode_bugs.cache_one_slot_early(), IDS, options=Options(decode=2))
    page = html.document(report, image=False)
    assert '<table id="steps">' in page and "<th>step 2</th>" in page
    row = page.split("<th>step 1</th>")[1].split("</tr>")[0]
    assert '<td class="bad">attention</td>' in row and "block 1 attention" in row
    assert "step 1 block 1 attention (kv cache: keys)" in page
