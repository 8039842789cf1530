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
    assert "uncached-reference" in bug.note_codes


def test_a_decode_only_bug_is_found_with_no_candidate_at_its_step_block_and_subpath(tmp_path, capsys):
    """Its drill-down runs the reference's module on the whole sequence and cuts the
    children back to the step: the cut call alone (one position, no history) made eager
    attention raise, and blockdiff's error was reported as the model's."""
    out = tmp_path / "report.json"
    code, _, _ = run_cli(["diff", "samples/decode_bugs.py:scale_wrong_when_decoding", "--decode", "6", "--seq", "6", "--json", str(out)], capsys)
    assert code == 1
    first = json.loads(out.read_text())["first_divergence"]
    assert (first["step"], first["block"], first["subpath"], first["what"]) == (1, 2, "attention", "output")
    report = run("samples/decode_bugs.py:scale_wrong_when_decoding", None, IDS, options=Options(decode=STEPS))
    assert blamed(report) == (1, 2, "attention", "output")
    children = report.first_divergence.check.children
    assert children and not any(child.diverged for child in children)  # the scale is the module's own code
    assert [step["first_divergence"] is not None for step in report.steps] == [False] + [True] * STEPS
    clean = run(lambda: hf_llama.build(attn_implementation="eager"), None, IDS, options=Options(decode=STEPS))
    assert blamed(clean) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_moe_model_decodes_with_its_routing_judged_at_every_step(dtype, tmp_path, capsys):
    clean = run(hf_moe.build(), hf_moe.build().to(getattr(torch, dtype)), IDS, options=Options(decode=2))
    assert blamed(clean) is None and clean.moe
    whats = [c.what for c in clean.blocks[1].subpaths["ffn"].checks]
    assert "routing flips" in whats and any(w.startswith("experts") for w in whats)
    code, out, err = run_cli(
        ["diff", "samples/hf_moe.py:build", "samples/hf_moe.py:expert_off_by_one", "--decode", "2", "--cand-dtype", dtype,
         "--seq", "8", "--json", str(tmp_path / "r.json")], capsys,
    )
    assert code == 1, err
    bug = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
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
    with pytest.raises(InputError, match="decode runs in memory, on one process: not with stream"):
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


# A model that keeps its cache in its attention modules' buffers, written at input_pos
# (samples/cached_lm.py), against the Hugging Face Llama whose weights it holds.
OWN_CACHE = {
    "write_one_slot_early": (1, 1, "attention", "kv cache: keys"),
    # Rotary inside the attention: the attention is blamed (its cache holds the wrong keys).
    "rotary_not_offset": (1, 1, "attention", "kv cache: keys"),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bug", OWN_CACHE)
def test_a_model_with_its_cache_in_module_buffers_is_blamed_through_the_cli(bug, dtype, tmp_path, capsys):
    code, out, err = run_cli(
        ["diff", "samples/port.py:reference", f"samples/cached_lm.py:{bug}", "--decode", "3",
         "--cand-dtype", dtype, "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert blamed(report) == OWN_CACHE[bug]
    # The reference's rotary module has no counterpart: left out, and said.
    assert any(note.startswith("context: only the reference has this stage (model.rotary_emb)") for note in report.notes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_its_own_cache_against_hugging_face_blames_nothing_and_keeps_its_cache(dtype):
    from samples import cached_lm, port

    reference, candidate = port.reference(), cached_lm.port().to(dtype)
    report = run(reference, candidate, IDS, options=Options(decode=STEPS))
    assert blamed(report) is None and all(step["first_divergence"] is None for step in report.steps)
    for block in report.blocks:  # the buffers are read as a cache: keys and values compared
        assert [c.what for c in block.subpaths["attention"].checks][:2] == ["kv cache: keys", "kv cache: values"]
    # Every experiment wrote into buffers of its own: the model's cache holds its own decode.
    held = [b.attn.kv_cache.k_cache.clone() for b in candidate.blocks]
    again = cached_lm.port().to(dtype)
    stepper = again.blockdiff_stepper
    position = stepper.new_cache(again)
    with torch.no_grad():
        stepper.run(again, IDS, position)
        for token in report_tokens(reference, IDS, STEPS)[:-1]:
            stepper.run(again, token[:, None], position)
    assert all(torch.equal(a, b.attn.kv_cache.k_cache) for a, b in zip(held, again.blocks))
    # The other way round: its buffers are the reference's cache.
    back = run(cached_lm.port(), port.reference(), IDS, options=Options(decode=STEPS))
    assert blamed(back) is None and back.blocks[0].subpaths["attention"].checks[0].what == "kv cache: keys"


def report_tokens(model, prompt, steps):
    """The greedy tokens a decode feeds (the reference's, without a cache)."""
    ids, found = prompt, []
    with torch.no_grad():
        for _ in range(steps + 1):
            found.append(model(ids, use_cache=False).logits[:, -1].argmax(-1))
            ids = torch.cat([ids, found[-1][:, None]], 1)
    return found


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_model_with_its_cache_in_buffers_against_its_own_uncached_forward(dtype):
    clean = run("samples/cached_lm.py:port", None, IDS, options=Options(decode=64, dtypes=(dtype, None)))
    assert blamed(clean) is None and len(clean.steps) == 65
    bug = run("samples/cached_lm.py:write_one_slot_early", None, IDS, options=Options(decode=STEPS, dtypes=(dtype, None)))
    assert blamed(bug) == (1, 1, "attention", "output")


@pytest.fixture(scope="module")
def decode_dump(tmp_path_factory):
    """A Hugging Face Llama's decode of 4 steps, captured."""
    from blockdiff.engine import capture

    path = tmp_path_factory.mktemp("decode") / "reference.h5"
    capture(LLAMA, IDS, path, decode=4)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_candidate_decode_is_replayed_against_a_stored_reference_decode(decode_dump, dtype, tmp_path, capsys):
    code, out, err = run_cli(
        ["diff", str(decode_dump), "samples/decode_bugs.py:cache_one_slot_early", "--cand-dtype", dtype,
         "--json", str(tmp_path / "r.json")], capsys,
    )
    assert code == 1, err
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert blamed(report) == (1, 1, "attention", "kv cache: keys")
    assert report.decode["steps"] == 4 and len(report.steps) == 5
    assert any(n.startswith(f"replay: the reference is the decode dump {decode_dump} (4 steps") for n in report.notes)
    code, out, err = run_cli(["diff", str(decode_dump), LLAMA, "--cand-dtype", dtype, "--decode", "2"], capsys)
    assert code == 0, out + err
    assert "no step diverges" in " ".join(out.split())
    if dtype == "bfloat16":  # no floors for decode steps: fixed thresholds, and said why
        assert "floors are not stored for decode steps" in " ".join(out.split())


def test_a_decode_dump_holds_every_step_as_schema_5_and_a_forward_dump_stays_schema_4(decode_dump, tmp_path, capsys):
    import h5py

    from blockdiff.engine import capture
    from blockdiff.dump import DumpReader

    with h5py.File(decode_dump) as f:
        assert f.attrs["schema_version"] == 5
    with DumpReader(decode_dump) as dump:
        assert dump.steps() == 4 and dump.meta["decode"] == {"steps": 4, "prompt_length": 8, "cache": "dynamic"}
        assert [len(dump.at_step(t).block_indices()) for t in range(5)] == [4] * 5
        step1 = dump.at_step(1).block_sites(0)
        assert step1[0].hidden_input().shape[1] == 1  # one token
        held = dump.decode()
        assert len(held["greedy"]) == 5 and held["cache"][4][0]["held"] == 12
    forward = tmp_path / "forward.h5"
    capture(LLAMA, IDS, forward)
    with h5py.File(forward) as f:
        assert f.attrs["schema_version"] == 4
    # Through the CLI, and shown by `inspect` step by step.
    code, out, err = run_cli(["capture", LLAMA, "--out", str(tmp_path / "d.h5"), "--decode", "2", "--seq", "8"], capsys)
    assert code == 0 and f"wrote {tmp_path / 'd.h5'}" in err, err
    code, out, err = run_cli(["inspect", str(tmp_path / "d.h5")], capsys)
    assert code == 0 and "decode: the prompt (8 tokens), then 2 steps" in out, err
    from blockdiff.export import export_safetensors

    names = export_safetensors(tmp_path / "d.h5", tmp_path / "d.safetensors")["tensors"]
    assert {name.split("/")[0] for name in names} == {"step0", "step1", "step2", "inputs"}
    assert "step2/model.layers.0.self_attn#0/output/0" in names


def test_decode_dumps_refuse_what_they_cannot_do(decode_dump, tmp_path):
    from blockdiff.engine import capture

    with pytest.raises(InputError, match="holds 4 decode steps; decode=9 asks for more"):
        run(str(decode_dump), hf_llama.build(), options=Options(decode=9))
    with pytest.raises(InputError, match="two dumps of decodes are not compared"):
        run(str(decode_dump), str(decode_dump))
    forward = tmp_path / "forward.h5"
    capture(LLAMA, IDS, forward)
    with pytest.raises(InputError, match="holds one forward pass, not decode steps"):
        run(str(forward), hf_llama.build(), options=Options(decode=2))
    with pytest.raises(InputError, match="floors are not stored for decode steps"):
        capture(LLAMA, IDS, tmp_path / "x.h5", decode=2, floors=[(torch.bfloat16, "cpu")])


def test_a_cache_log_keeps_what_each_step_wrote_and_a_step_that_did_not_append_whole():
    from blockdiff.decoding import CacheLog

    torch.manual_seed(0)
    cache = torch.randn(1, 2, 4, 3)  # a prompt of 4 positions
    log = CacheLog()
    log.add([(cache, cache + 1)], length=4, fed=4)
    appended = torch.cat([cache, torch.randn(1, 2, 1, 3)], dim=2)
    log.add([(appended, appended + 1)], length=5, fed=1)
    overwritten = appended.clone()
    overwritten[:, :, 3] = torch.randn(1, 2, 3)  # written one slot early: not appended
    overwritten = overwritten[:, :, :5]
    log.add([(overwritten, overwritten + 1)], length=6, fed=1)
    assert [p[0][3] for p in log.pieces] == [False, False, True]  # kept whole where it did not append
    assert log.pieces[1][0][0].shape[2] == 1  # one new position, not the whole cache
    for step, expected in enumerate([cache, appended, overwritten]):
        keys, values = log.at(step)[0]
        assert torch.equal(keys, expected) and torch.equal(values, expected + 1)
    back = CacheLog.from_structure(log.to_structure())
    assert all(torch.equal(back.at(2)[0][i], log.at(2)[0][i]) for i in (0, 1))


def test_a_cache_laid_out_slots_first_is_read_through_the_adapters_kv_layout():
    from samples import cached_lm, port

    clean = run(port.reference(), cached_lm.slots_first().to(torch.bfloat16), IDS, options=Options(decode=STEPS))
    assert blamed(clean) is None
    keys = clean.blocks[1].subpaths["attention"].checks[0]
    assert keys.what == "kv cache: keys" and keys.measured < keys.threshold.value
    bug = run(port.reference(), cached_lm.slots_first_one_slot_early(), IDS, options=Options(decode=STEPS))
    assert blamed(bug) == (1, 1, "attention", "kv cache: keys")
    wrong = cached_lm.slots_first()
    wrong.blockdiff_stepper.kv_layout = ("batch", "positions", "heads", "head_dim")
    with pytest.raises(InputError, match="kv_layout .* must name each of batch, kv_heads, positions, head_dim once"):
        run(port.reference(), wrong, IDS, options=Options(decode=STEPS))
