"""Candidates in other runtimes, judged teacher-forced: the tiny Hugging Face Llama saved with
``save_pretrained``, converted to GGUF by llama.cpp's own converter and run by llama.cpp
(llama-cpp-python), and loaded by mlx-lm. The mistakes real conversions make, planted in
the GGUF with the ``gguf`` package or in the MLX model after loading, are each blamed on
their block and sub-path; the clean conversions blame nothing in float32; a q8_0 file is
ranked. Needs ``blockdiff[llamacpp]`` and ``blockdiff[mlx]`` (``.ci/run`` installs both)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from blockdiff.engine import run  # noqa: E402
from blockdiff.errors import InputError  # noqa: E402
from blockdiff.modes.options import Options  # noqa: E402
from samples import runtimes  # noqa: E402
from tests.test_cli import ROOT, blockdiff_process  # noqa: E402

SAMPLE = str(ROOT / "samples" / "runtimes.py")
REFERENCE = f"{SAMPLE}:reference"


def blamed(report) -> tuple | None:
    first = report.first_divergence
    return None if first is None else (first.block, first.subpath)


def worst_local(report) -> float:
    return max(check.measured for block in report.blocks for sub in block.subpaths.values() for check in sub.checks)


# -- GGUF -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason='llama-cpp-python is not installed: pip install -e ".[llamacpp]"')


@pytest.fixture(scope="module")
def clean_gguf(llama_cpp) -> Path:
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    return runtimes.gguf("f32")


def test_clean_gguf_blames_nothing_through_the_cli(clean_gguf, tmp_path):
    out = blockdiff_process("diff", REFERENCE, str(clean_gguf), "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"] is None
    assert report["candidate"]["runtime"].startswith("llama.cpp")
    assert any(note.startswith("teacher-forced:") for note in report["notes"])
    assert any(note.startswith("context: only the reference") for note in report["notes"])
    # every sub-path judged, each from the reference's inputs: float32 in two runtimes
    locals_ = [c["rel_l2"] for b in report["blocks"] for s in b["subpaths"].values() for c in s["checks"]]
    assert len(locals_) >= 4 * 5 and max(locals_) < 1e-5
    assert "No divergence" in out.stdout


@pytest.mark.parametrize("bug", list(runtimes.GGUF_BUGS))
def test_planted_gguf_mistake_blamed_on_its_block_and_subpath(clean_gguf, bug):
    _, expected = runtimes.GGUF_BUGS[bug]
    report = run(REFERENCE, str(runtimes.gguf("f32", bug)))
    assert blamed(report) == expected
    first = report.first_divergence
    assert first.check.measured > 100 * first.check.threshold.value
    if bug == "rope_base":  # every attention, and the note says where and why
        assert all(block.subpaths["attention"].checks[0].diverged for block in report.blocks)
        assert any("llama.rope.freq_base = 500000" in note and "rope_theta = 10000" in note for note in report.notes)
    else:  # only that block's sub-path: what follows is judged on the reference's inputs
        diverged = {(b.index, name) for b in report.blocks for name, sub in b.subpaths.items() if any(c.diverged for c in sub.checks)}
        assert diverged == {expected}


def test_q8_0_file_ranked_against_fixed_thresholds(llama_cpp):
    report = run(REFERENCE, str(runtimes.gguf("q8_0")), options=Options(rank=True))
    assert report.candidate["weights"] == "Q8_0"
    assert any("Q8_0" in note and "fixed" in note for note in report.notes)
    ranked = report.ranking
    assert ranked and all(a["ratio"] >= b["ratio"] for a, b in zip(ranked, ranked[1:]))
    assert ranked[0]["block"] is not None  # the block that hurts most is named first
    assert worst_local(report) < 0.05  # precision, not a bug: q8_0 loses ~1e-2


def test_bf16_file_judged_against_the_references_own_bfloat16(llama_cpp):
    report = run(REFERENCE, str(runtimes.gguf("bf16")))
    assert report.tolerance["policy"] == "calibrated"
    assert blamed(report) is None
    assert any("BF16" in note and "bfloat16" in note for note in report.notes)


def test_gguf_of_another_model_is_refused_naming_both(clean_gguf):
    out = blockdiff_process("diff", "samples/hf_llama.py:build", str(clean_gguf))
    assert out.returncode == 2
    assert "vocabulary is 259 tokens, the reference's 256" in out.stderr + out.stdout


def test_gguf_architecture_without_a_map_is_refused(clean_gguf, monkeypatch):
    from blockdiff.sides import gguf

    monkeypatch.setattr(gguf, "ARCHITECTURES", {"qwen2": gguf.LLAMA})
    with pytest.raises(InputError, match="architecture 'llama' has no tensor map.*mapped: qwen2"):
        run(REFERENCE, str(clean_gguf))


def test_a_tensor_the_runtime_fuses_away_is_not_judged_never_blamed(clean_gguf, monkeypatch):
    """A map naming a tensor llama.cpp never hands the callback (as a fused operation would
    not): that site is not judged, and neither is the attention whose input it is (never
    replaced, so not the reference's) — a bug in the fused norm is the block's, unattributed,
    not the attention's."""
    from blockdiff.sides import gguf

    fused = {**gguf.LLAMA, ("norm", 0): ("attn_norm_fused-{i}", "{previous}"), ("attention", 0): ("attn_out-{i}", "attn_norm_fused-{i}")}
    monkeypatch.setattr(gguf, "ARCHITECTURES", {"llama": fused})
    clean = run(REFERENCE, str(clean_gguf))
    assert blamed(clean) is None
    assert all(block.subpaths["attention"].status == "not_judged" for block in clean.blocks)
    assert any("exposes no value for block 0 norm (attn_norm_fused-0)" in note for note in clean.notes)
    buggy = run(REFERENCE, str(runtimes.gguf("f32", "norm_from_other")))
    assert blamed(buggy) == (1, "unattributed")
    assert not any(c.diverged for b in buggy.blocks for sub in b.subpaths.values() for c in sub.checks)


def test_missing_llama_cpp_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(InputError, match=r'pip install "blockdiff\[llamacpp\]"'):
        run(REFERENCE, str(path))


# -- MLX --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx():
    pytest.importorskip("mlx.core", reason='mlx is not installed: pip install -e ".[mlx]"')
    return pytest.importorskip("mlx_lm", reason='mlx-lm is not installed: pip install -e ".[mlx]"')


def test_clean_mlx_model_blames_nothing(mlx):
    report = run(REFERENCE, runtimes.mlx_model)
    assert blamed(report) is None
    assert report.candidate["runtime"].startswith("MLX")
    assert worst_local(report) < 1e-5


@pytest.mark.parametrize("bug", list(runtimes.MLX_BUGS))
def test_planted_mlx_mistake_blamed_on_its_block_and_subpath(mlx, bug):
    report = run(REFERENCE, getattr(runtimes, bug))
    assert blamed(report) == runtimes.MLX_BUGS[bug]


def test_mlx_lm_rotary_base_it_does_not_read_is_blamed_with_why(mlx):
    """Not planted: mlx-lm 0.32 reads ``rope_theta`` where transformers 5 writes
    ``rope_parameters``, and its Qwen2 falls back to 1e6 against the config's 1e4."""
    report = run(f"{SAMPLE}:reference_qwen2", runtimes.mlx_qwen2)
    assert blamed(report) == (0, "attention")
    assert all(block.subpaths["attention"].checks[0].diverged for block in report.blocks)
    assert not any(c.diverged for b in report.blocks for name, sub in b.subpaths.items() if name != "attention" for c in sub.checks)
    assert any("model.args.rope_theta = 1e+06" in note and "rope_theta = 10000" in note for note in report.notes)


def test_mlx_attention_scale_through_the_cli(mlx):
    out = blockdiff_process("diff", REFERENCE, f"{SAMPLE}:mlx_attention_scale")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "First divergence: block 2 attention (model.layers.2.self_attn)" in out.stdout


def test_missing_mlx_names_the_extra(mlx, monkeypatch):
    model = runtimes.mlx_model()
    monkeypatch.setitem(sys.modules, "mlx.core", None)
    with pytest.raises(InputError, match=r'pip install "blockdiff\[mlx\]"'):
        run(REFERENCE, lambda: model)


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--decode", "2"], "the candidate cannot run --decode"),
        (["--backward"], "the candidate cannot run a backward"),
        (["--stream"], "--stream and --save-dumps do not take a candidate run in another runtime"),
        (["--max-memory", "1GiB"], "--max-memory does not take a candidate run in another runtime"),
    ],
)
def test_executions_a_gguf_cannot_run_are_refused_in_one_line(clean_gguf, flags, refusal):
    out = blockdiff_process("diff", REFERENCE, str(clean_gguf), *flags)
    assert out.returncode == 2
    assert refusal in out.stderr + out.stdout
