"""Decode of state-space models: Hugging Face Mamba and Mamba2 (and the hybrids, Jamba and
LFM2) step with their own cache, and each mixer's conv and ssm states are sites after every
step, as attention's keys and values are; a state updated with the wrong decay at decode
steps only is blamed on its step, block and sub-path (``ssm state``)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import Options, Report, run  # noqa: E402
from blockdiff.engine import capture  # noqa: E402
from samples import hf_ssm  # noqa: E402

from tests.conftest import run_cli  # noqa: E402

IDS = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
STEPS = 2
STATES = ["conv state", "ssm state"]
KV = ["kv cache: keys", "kv cache: values"]


@pytest.fixture(scope="module")
def references():
    """One reference model per family, built once (runs never change a model)."""
    built: dict[str, torch.nn.Module] = {}

    def reference(family: str) -> torch.nn.Module:
        if family not in built:
            built[family] = hf_ssm.build(family)
        return built[family]

    return reference


def blamed(report: Report) -> tuple | None:
    first = report.first_divergence
    return None if first is None else (first.step, first.block, first.subpath, first.check.what)


def mixer_checks(report: Report) -> list[list[str]]:
    """Per block, what its token mixer's checks compared, in order."""
    return [[c.what for c in block.subpaths["attention"].checks] for block in report.blocks]


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_a_clean_state_space_decode_in_bfloat16_blames_nothing_and_compares_every_state(family, references):
    report = run(references(family), hf_ssm.build(family).to(torch.bfloat16), IDS, options=Options(decode=STEPS))
    assert blamed(report) is None and len(report.steps) == STEPS + 1
    assert all(step["first_divergence"] is None for step in report.steps)
    for block in report.blocks:
        checks = block.subpaths["attention"].checks
        assert [c.what for c in checks][:3] == [*STATES, "output"]
        for state in checks[:2]:
            # Really compared: bfloat16 moves every state a little, within the floor of the
            # reference's own code in bfloat16, stepped the same way.
            assert 0 < state.metrics.rel_l2 < state.threshold.value and state.threshold.basis == "calibrated"


# family, candidate dtype → the CLI's blame (the state is wrong from step 1 on, the prompt right)
PLANTED = [("mamba", "float32"), ("mamba", "bfloat16"), ("mamba2", "bfloat16")]


@pytest.mark.parametrize("family, dtype", PLANTED, ids=[f"{f}-{d}" for f, d in PLANTED])
def test_a_state_decayed_wrong_at_decode_steps_only_is_blamed_at_its_step_block_and_state(family, dtype, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    code, out, err = run_cli(
        ["diff", f"samples/hf_ssm.py:build_{family}", f"samples/hf_ssm.py:{family}_decay_wrong_when_decoding",
         "--decode", str(STEPS), "--cand-dtype", dtype, "--seq", "6", "--json", str(out_json)],
        capsys,
    )
    assert code == 1, err
    data = json.loads(out_json.read_text())
    report = Report.from_dict(data)
    block = hf_ssm.MIXER_BLOCK[family]
    assert blamed(report) == (1, block, "attention", "ssm state")
    assert data["first_divergence"]["part"] == "ssm state"
    assert f"step 1 block {block} attention (ssm state)" in " ".join(out.split())
    # The prompt's step blames nothing; step 1 only this block's mixer, its conv state right.
    assert data["steps"][0]["first_divergence"] is None
    assert data["steps"][1]["diverged"] == {str(b): ["attention"] if b == block else [] for b in range(3)}
    conv = report.blocks[block].subpaths["attention"].checks[0]
    assert conv.what == "conv state" and not conv.diverged


def test_a_hybrid_compares_its_mamba_layers_states_and_its_attention_layers_keys(references):
    """Jamba: Mamba layers in blocks 0 and 2, attention in 1 and 3, one cache for both."""
    bug = run(references("jamba"), hf_ssm.decay_wrong_when_decoding("jamba").to(torch.bfloat16), IDS, options=Options(decode=STEPS))
    assert blamed(bug) == (1, 2, "attention", "ssm state")
    assert bug.steps[1]["diverged"] == {"0": [], "1": [], "2": ["attention"], "3": []}
    assert [whats[:2] for whats in mixer_checks(bug)] == [STATES, KV, STATES, KV]
    # LFM2: short convolutions (a conv state, no ssm state) in blocks 0 and 2.
    clean = run(references("lfm2"), hf_ssm.build("lfm2").to(torch.bfloat16), IDS, options=Options(decode=STEPS))
    assert blamed(clean) is None
    assert [whats[:2] for whats in mixer_checks(clean)] == [["conv state", "output"], KV, ["conv state", "output"]]


def test_a_candidate_decode_is_replayed_against_a_stored_state_space_decode(tmp_path, monkeypatch):
    path = tmp_path / "mamba.h5"
    capture("samples/hf_ssm.py:build_mamba", IDS, path, decode=STEPS)
    bug = run(str(path), hf_ssm.decay_wrong_when_decoding("mamba"), options=Options())
    assert blamed(bug) == (1, 1, "attention", "ssm state")
    assert mixer_checks(bug)[0][:2] == STATES
    # A decode dump written before states were stored still replays: no state compared,
    # the wrong decay blamed through the mixer's output.
    from blockdiff.dump import DumpWriter

    add_decode = DumpWriter.add_decode
    monkeypatch.setattr(DumpWriter, "add_decode", lambda self, decode: add_decode(self, {k: v for k, v in decode.items() if k != "states"}))
    capture("samples/hf_ssm.py:build_mamba", IDS, tmp_path / "old.h5", decode=STEPS)
    old = run(str(tmp_path / "old.h5"), hf_ssm.decay_wrong_when_decoding("mamba"), options=Options())
    assert blamed(old) == (1, 1, "attention", "output")
    assert [whats[0] for whats in mixer_checks(old)] == ["output"] * 3


def test_a_mamba_against_its_own_uncached_forward_blames_the_wrong_decay_on_its_mixer():
    """No candidate: the reference is the model without a cache (no states to compare),
    and the decay the cached path gets wrong shows in the mixer's output at step 1."""
    bug = run("samples/hf_ssm.py:mamba_decay_wrong_when_decoding", None, IDS, options=Options(decode=STEPS))
    assert bug.decode["uncached_reference"] and blamed(bug) == (1, 1, "attention", "output")
    clean = run("samples/hf_ssm.py:build_mamba", None, IDS, options=Options(decode=STEPS))
    assert blamed(clean) is None
