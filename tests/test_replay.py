"""Dumps in use: capture, replay against a stored reference, offline dump-vs-dump, save,
inspect and export — through the library and the CLI."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from blockdiff import DumpError, diff
from blockdiff.cli import main
from blockdiff.dump import DumpReader
from blockdiff.engine import capture, compare_dumps, replay
from blockdiff.export import load_export, manifest_path
from samples import bugs, tinylm
from tests.conftest import blamed, run_cli

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dumps") / "ref.h5"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    capture(tinylm.build(), ids, path, label="samples/tinylm.py:build")
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(bugs.BUGS))
def test_replay_gives_the_live_first_divergence(name, dtype, reference_dump):
    stage, subpath = bugs.BUGS[name]
    factory = getattr(bugs, name)
    with DumpReader(reference_dump) as dump:
        ids = dump.inputs()
    live = diff(tinylm.build(), factory().to(dtype), ids, tolerance=None)
    replayed = replay(reference_dump, factory().to(dtype))
    assert blamed(replayed) == blamed(live) == (stage, bugs.DEFAULT_BLOCK if stage == "block" else None, subpath)
    assert replayed.note_codes[0] == "replay"


def test_replay_of_a_clean_precision_change_blames_nothing(reference_dump):
    report = replay(reference_dump, tinylm.build().to(torch.bfloat16))
    assert report.first_divergence is None
    assert report.tolerance["policy"] == "fixed"
    assert "fixed-thresholds" in report.note_codes


def test_replay_of_moe_bugs(tmp_path, ids):
    path = tmp_path / "moe.h5"
    capture(tinylm.build_moe(), ids, path)
    for name, (reference, part) in bugs.MOE_BUGS.items():
        if reference != "build_moe":
            continue
        report = replay(path, getattr(bugs, name)(block=2))
        assert blamed(report) == ("block", 2, "ffn"), name
        assert report.first_divergence.check.part == part
        assert len(report.moe) == 4


pytest.importorskip("transformers")
from samples import hf_llama  # noqa: E402


@pytest.mark.parametrize("name", sorted(hf_llama.BUGS))
def test_replay_of_hf_llama_bugs(name, tmp_path, ids):
    path = tmp_path / "llama.h5"
    capture(hf_llama.build(), ids, path)
    for dtype in (torch.float32, torch.bfloat16):
        live = diff(hf_llama.build(), getattr(hf_llama, name)(block=2).to(dtype), ids)
        replayed = replay(path, getattr(hf_llama, name)(block=2).to(dtype))
        assert blamed(replayed) == blamed(live) == ("block", 2, hf_llama.BUGS[name][1])


def test_two_dumps_compare_drift_offline(tmp_path, ids):
    ref, good, bad = tmp_path / "ref.h5", tmp_path / "good.h5", tmp_path / "bad.h5"
    capture(tinylm.build(), ids, ref)
    capture(tinylm.build().to(torch.bfloat16), ids, good)
    capture(bugs.residual_dropped(block=2), ids, bad)
    clean = compare_dumps(ref, good)
    assert clean.first_divergence is None
    found = compare_dumps(ref, bad)
    # Offline, drift shows where the error first appears: block 2's own output.
    first = found.first_divergence
    assert (first.stage, first.block) == ("block", 2)
    assert first.check.what == "drift (offline)"
    assert "offline-drift" in found.note_codes
    other = tmp_path / "other.h5"
    capture(tinylm.build(), ids[:, :8], other)
    with pytest.raises(Exception, match="captured on different inputs"):
        compare_dumps(ref, other)


def test_cli_capture_replay_inspect_export(tmp_path, capsys):
    os.chdir(ROOT)
    ref = tmp_path / "ref.h5"
    code, out, err = run_cli(["capture", "samples/tinylm.py:build", "--out", str(ref), "--compress", "lzf"], capsys)
    assert ref.is_file() and err.strip() == f"wrote {ref}" and out == ""
    code, out, _ = run_cli(["diff", str(ref), "samples/bugs.py:attention_scale", "--cand-dtype", "bfloat16"], capsys)
    assert code == 1 and "First divergence: block 1 attention" in out
    code, out, _ = run_cli(["inspect", str(ref), "--verify"], capsys)
    assert code == 0
    assert "every checksum matches" in out and "block 3 ffn" in out
    run_cli_json = main(["inspect", str(ref), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert run_cli_json is None
    assert summary["meta"]["format"] == "blockdiff.dump" and summary["meta"]["hook_map"] == "tinylm"
    assert len(summary["blocks"]) == 4 and summary["blocks"][0]["sites"][0]["output"][0]["shape"] == [2, 16, 64]
    out_file = tmp_path / "ref.safetensors"
    main(["export", str(ref), "--to", "safetensors", str(out_file)])
    tensors = load_export(out_file)
    with DumpReader(ref) as dump:
        head = [s for s in dump.outside_sites() if s.stage == "head"][0]
    assert torch.equal(tensors["lm_head#0/output/0"], head.output)
    with DumpReader(ref) as dump:
        assert torch.equal(tensors["inputs/0"], dump.inputs())
    data = bytearray(out_file.read_bytes())
    data[-5] ^= 0x01
    out_file.write_bytes(bytes(data))
    with pytest.raises(DumpError, match="digest mismatch"):
        load_export(out_file)
    manifest_path(out_file).unlink()
    with pytest.raises(DumpError, match="no digest manifest"):
        load_export(out_file)


def test_cli_save_dumps_and_dump_vs_dump(tmp_path, capsys):
    os.chdir(ROOT)
    folder = tmp_path / "kept"
    code, _, _ = run_cli(["diff", "samples/tinylm.py:build", "samples/bugs.py:post_norm", "--save-dumps", str(folder), "-q"], capsys)
    assert code == 1
    assert (folder / "reference.h5").is_file() and (folder / "candidate.h5").is_file()
    code, out, _ = run_cli(["diff", str(folder / "reference.h5"), str(folder / "candidate.h5")], capsys)
    assert code == 1 and "block 1" in out and "only drift could be computed" in out
    code, out, _ = run_cli(["diff", str(folder / "reference.h5"), "samples/bugs.py:post_norm", "-q"], capsys)
    assert code == 1 and out.startswith("first divergence: block 1 residual")


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p.write_bytes(b"not hdf5 at all"), "is not an HDF5 file"),
        (lambda p: p.write_bytes(p.with_name("good.h5").read_bytes()[:4000]), "damaged"),
        (lambda p: __import__("h5py").File(p, "w").close(), "not a blockdiff dump"),
    ],
    ids=["foreign bytes", "truncated", "foreign hdf5"],
)
def test_bad_dumps_are_one_line_errors(make, message, tmp_path, capsys, ids):
    capture(tinylm.build(), ids, tmp_path / "good.h5")
    bad = tmp_path / "bad.h5"
    make(bad)
    code, _, err = run_cli(["diff", str(bad), "samples/tinylm.py:build"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_incomplete_and_newer_dumps_are_refused(tmp_path, capsys, ids):
    import h5py

    for attr, value, message in [("complete", False, "is incomplete"), ("schema_version", 6, "has schema version 6")]:
        path = tmp_path / f"{attr}.h5"
        capture(tinylm.build(), ids, path)
        with h5py.File(path, "r+") as f:
            f.attrs[attr] = value
        code, _, err = run_cli(["inspect", str(path)], capsys)
        assert code == 2 and message in err


def test_sigkill_mid_capture_leaves_no_file(tmp_path):
    from tests.test_hardening import start, wait_for

    proc = start(["capture", "slow:build", "--out", str(tmp_path / "ref.h5")], tmp_path)
    wait_for(".ref.h5.tmp-*", tmp_path, proc)
    time.sleep(0.5)  # some sites written
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "ref.h5").exists()


@pytest.mark.parametrize("name", ["gelu_for_silu", "post_norm", "head_untied_transposed"])
def test_streamed_diff_gives_the_same_report(name, ids):
    """Captured to dumps and localized block by block from them: the same report."""
    in_memory = diff(tinylm.build(), getattr(bugs, name)().to(torch.bfloat16), ids).to_dict()
    streamed = diff(tinylm.build(), getattr(bugs, name)().to(torch.bfloat16), ids, stream=True).to_dict()
    in_memory.pop("created"), streamed.pop("created")
    assert streamed == in_memory


def test_offline_comparison_names_the_first_site_in_execution_order(tmp_path, ids, capsys):
    # The golden-failure flow: the attention scale is wrong in block 0. The first norm of
    # block 0 runs before attention and is clean; the second (before the FFN) runs after it.
    capture(tinylm.build(), ids, tmp_path / "golden.h5")
    capture(bugs.attention_scale(block=0), ids, tmp_path / "golden.obtained.h5")
    code, out, _ = run_cli(["diff", str(tmp_path / "golden.h5"), str(tmp_path / "golden.obtained.h5"), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1
    assert "First divergence: block 0 attention (blocks.0.attn)" in out
    data = json.loads((tmp_path / "r.json").read_text())
    in_block_0 = [(d["subpath"], d["module"]) for d in data["divergences"] if d["block"] == 0]
    assert in_block_0 == [("attention", "blocks.0.attn"), ("norm", "blocks.0.ffn_norm"), ("ffn", "blocks.0.ffn")]
    # The heatmap shows the drift it judged (no "-" for checks that ran), and says it is drift.
    assert "drift / threshold:" in out and "local error / threshold:" not in out
    attention_row = next(line for line in out.splitlines() if line.strip().startswith("attention "))
    assert attention_row.split()[1] == "X"
