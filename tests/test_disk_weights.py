"""Models larger than memory: both sides built without weights and read from their
checkpoints a block at a time (``max_memory``), with the same verdicts — the same numbers —
as the diff of the two models whole in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from blockdiff import Options, Report, run  # noqa: E402
from blockdiff.diskweights import parse_size  # noqa: E402
from blockdiff.engine import capture  # noqa: E402
from blockdiff.errors import ModelSpecError, OptionsError  # noqa: E402
from samples import hf_llama, hf_moe  # noqa: E402

from tests.conftest import run_cli, sample_ids  # noqa: E402
from tests.test_cli import ROOT  # noqa: E402

pytest_plugins = ["pytester"]  # the plugin's option, in a real pytest session
IDS = sample_ids()
BUDGET = 4 << 20  # bytes: a few blocks of the tiny models, far below either model whole


def _saved(model: torch.nn.Module, folder: Path, shard: str = "200KB") -> str:
    model.save_pretrained(folder, max_shard_size=shard)
    return str(folder)


def _planted(build, where: str, factor: float = 1.5, expert: int | None = None) -> torch.nn.Module:
    model = build()
    with torch.no_grad():
        weight = model.get_parameter(where)
        (weight if expert is None else weight[expert]).mul_(factor)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Sharded checkpoints of the tiny Llama (clean; a norm weight scaled in block 2; the
    down projection of block 1 scaled, in one file) and of the tiny Mixtral (clean; expert 3's
    gate and up projections scaled in block 1)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llama": _saved(hf_llama.build(), root / "llama"),
        "llama-norm": _saved(_planted(hf_llama.build, "model.layers.2.post_attention_layernorm.weight"), root / "norm"),
        "llama-down": _saved(_planted(hf_llama.build, "model.layers.1.mlp.down_proj.weight", 1.2), root / "down", "1GB"),
        "moe": _saved(hf_moe.build(), root / "moe"),
        "llama-tied": _saved(hf_llama.build(tie_word_embeddings=True), root / "tied"),
        "moe-expert": _saved(_planted(hf_moe.build, "model.layers.1.mlp.experts.gate_up_proj", 1.3, expert=3), root / "moe-expert"),
    }


def _without_run_facts(report: Report) -> dict:
    """The report's dict but for what a diff under a budget adds (its note on what it read)
    and when it was made."""
    data = json.loads(json.dumps(report.to_dict()))
    kept = [code != "disk-weights" for code in data["note_codes"]]
    data["notes"] = [n for n, keep in zip(data["notes"], kept) if keep]
    data["note_codes"] = [c for c, keep in zip(data["note_codes"], kept) if keep]
    del data["created"]
    return data


CASES = {
    "norm-bug": ("llama", "llama-norm", {}),
    "drill-down": ("llama", "llama-down", {}),
    "bfloat16": ("llama", "llama", {"dtypes": (None, torch.bfloat16)}),
    "moe-bfloat16": ("moe", "moe", {"dtypes": (None, torch.bfloat16)}),
    "moe-expert": ("moe", "moe-expert", {}),
    "ranked": ("llama", "llama-norm", {"rank": True}),
    "tied-bfloat16": ("llama-tied", "llama-tied", {"dtypes": (None, torch.bfloat16)}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_diff_read_from_disk_reports_what_the_diff_in_memory_reports(checkpoints, case, monkeypatch):
    reference, candidate, extra = CASES[case]
    # A noise floor read from disk runs the reference's own code at the candidate's
    # precision; in memory, a candidate that is the reference cast lends its own run
    # instead (the twin shortcut), whose floors differ in the last bits: compared with
    # the floors both compute alike.
    from blockdiff.sides.live import PrecisionSide

    with monkeypatch.context() as patched:
        patched.setattr(PrecisionSide, "runs_as", lambda self, other: False)
        whole = run(checkpoints[reference], checkpoints[candidate], IDS, options=Options(**extra))
    read = run(checkpoints[reference], checkpoints[candidate], IDS, options=Options(max_memory=BUDGET, **extra))
    assert _without_run_facts(read) == _without_run_facts(whole)
    (said,) = [n for n in read.notes if n.code == "disk-weights"]
    assert "max_memory 4.0 MiB" in said and "peak resident memory" in said
    blamed = None if read.first_divergence is None else (read.first_divergence.block, read.first_divergence.subpath)
    assert blamed == {
        "norm-bug": (2, "norm"), "drill-down": (1, "ffn"), "bfloat16": None, "moe-bfloat16": None,
        "moe-expert": (1, "ffn"), "ranked": (2, "norm"), "tied-bfloat16": None,
    }[case]
    if case == "norm-bug":  # the conversion diagnosis reads the block's weights from disk too
        assert "it is the reference's scaled by 1.5" in read.first_divergence.headline()
    if case == "drill-down":
        assert read.first_divergence.check.first_child.module == "model.layers.1.mlp.down_proj"
    if case == "moe-expert":
        assert [entry["block"] for entry in read.moe] == [0, 1, 2, 3]  # routing statistics, as in memory


def test_through_the_cli_with_its_budget_and_peak_in_the_report(checkpoints, tmp_path, capsys):
    code, out, err = run_cli(
        ["diff", checkpoints["llama"], checkpoints["llama-norm"], "--max-memory", "4MiB", "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert code == 1, err
    report = Report.from_dict(json.loads((tmp_path / "r.json").read_text()))
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "norm")
    text = " ".join(out.split())
    assert "weights read from disk a block at a time (max_memory 4.0 MiB): at most 289.0 KiB of weights at once" in text


def test_the_reference_captured_from_disk_replays_a_candidate_read_from_disk(checkpoints, tmp_path):
    dump = tmp_path / "ref.h5"
    capture(checkpoints["llama"], IDS, dump, max_memory=BUDGET)
    report = run(str(dump), checkpoints["llama-norm"], options=Options(max_memory=BUDGET))
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "norm")
    assert run(str(dump), checkpoints["llama"], options=Options(max_memory=BUDGET)).first_divergence is None


def test_a_factory_opts_in_with_a_meta_model_naming_its_checkpoint(checkpoints):
    import transformers

    from blockdiff.diskweights import empty_model

    def on_disk(folder: str):
        def build():
            with empty_model():
                model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
            model.blockdiff_checkpoint = folder
            return model

        return build

    report = run(on_disk(checkpoints["llama"]), on_disk(checkpoints["llama-norm"]), IDS, options=Options(max_memory=BUDGET))
    assert (report.first_divergence.block, report.first_divergence.subpath) == (2, "norm")
    # Without the budget, a model without weights is not read from disk: said, not run on meta tensors.
    with pytest.raises(OptionsError, match="the reference has no weights in memory .* give max_memory to read them"):
        run(on_disk(checkpoints["llama"]), on_disk(checkpoints["llama"]), IDS)
    # A model handed over as it is comes back as it was: no hook left on it, its weights
    # on the meta device, and it reads from disk again in the next run.
    model = on_disk(checkpoints["llama"])()
    for _ in range(2):
        assert run(model, on_disk(checkpoints["llama"]), IDS, options=Options(max_memory=BUDGET)).first_divergence is None
        assert not hasattr(model, "blockdiff_disk_weights")
        assert all(not m._forward_pre_hooks for m in model.modules())
        assert all(p.is_meta for p in model.parameters())


def test_a_model_with_its_weights_is_held_whole_and_said_so(checkpoints):
    report = run(checkpoints["llama"], hf_llama.build, IDS, options=Options(max_memory=200 << 10))
    assert report.first_divergence is None
    (said,) = [n for n in report.notes if n.code == "disk-weights"]
    whole = sum(p.numel() * 4 for p in hf_llama.build().parameters()) / 1024
    assert f"(the reference's model.layers.0 144.5 KiB); the candidate is held whole, {whole:.1f} KiB, over the budget" in said


def test_a_budget_below_one_block_names_the_block_and_its_size(checkpoints, capsys):
    code, _, err = run_cli(["diff", checkpoints["llama"], checkpoints["llama"], "--max-memory", "100KiB"], capsys)
    assert code == 2
    assert "Error: --max-memory 100.0 KiB is below what one unit of the reference needs: model.layers.0 takes 144.5 KiB" in err
    code, _, err = run_cli(["diff", checkpoints["llama"], checkpoints["llama"], "--max-memory", "200KiB"], capsys)
    assert code == 2 and "cannot hold a block of each side at once" in err and "(289.0 KiB)" in err


@pytest.mark.parametrize("flag", ["--decode", "--backward"])
def test_decode_and_backward_are_refused_in_one_line(checkpoints, flag, capsys):
    args = [flag, "2"] if flag == "--decode" else [flag]
    code, _, err = run_cli(["diff", checkpoints["llama"], "--max-memory", "4MiB", *args], capsys)
    assert code == 2 and f"Error: {flag}" in err and "not with --max-memory" in err
    with pytest.raises(OptionsError, match="not with max_memory"):
        run(checkpoints["llama"], checkpoints["llama"], IDS, options=Options(max_memory=BUDGET, backward=True))


def test_two_dumps_have_no_weights_to_read(tmp_path):
    with pytest.raises(OptionsError, match="neither side is a model"):
        run(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), options=Options(max_memory=BUDGET))


def _single(checkpoints: dict[str, str], folder: Path, edit) -> str:
    """The tiny Llama's checkpoint as one safetensors file in ``folder``, ``edit``-ed."""
    folder.mkdir()
    tensors = {}
    for name in sorted(os.listdir(checkpoints["llama"])):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoints["llama"], name)))
    save_file(edit(tensors), folder / "model.safetensors")
    (folder / "config.json").write_text(Path(checkpoints["llama"], "config.json").read_text())
    return str(folder)


def test_a_checkpoint_missing_a_tensor_or_holding_another_shape_is_named(checkpoints, tmp_path, capsys):
    missing = _single(checkpoints, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != "model.layers.3.mlp.up_proj.weight"})
    with pytest.raises(ModelSpecError, match="holds no tensor model.layers.3.mlp.up_proj.weight"):
        run(missing, missing, IDS, options=Options(max_memory=BUDGET))
    cut = _single(checkpoints, tmp_path / "cut", lambda t: {**t, "model.norm.weight": t["model.norm.weight"][:-1].clone()})
    code, _, err = run_cli(["diff", cut, "--max-memory", "4MiB"], capsys)
    assert code == 2 and "tensor model.norm.weight has shape [63], the model's parameter [64]" in err


def test_a_damaged_checkpoint_is_refused_and_no_dump_is_left(checkpoints, tmp_path, capsys):
    damaged = _single(checkpoints, tmp_path / "damaged", lambda t: t)
    path = Path(damaged, "model.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    out = tmp_path / "ref.h5"
    code, _, err = run_cli(["capture", damaged, "--out", str(out), "--max-memory", "4MiB"], capsys)
    assert code == 2 and "runs past the end of the file (truncated?)" in err
    assert not out.exists() and not list(tmp_path.glob("*.h5*"))


def test_without_a_budget_checkpoints_larger_than_the_machine_say_how_to_read_them_from_disk(checkpoints, monkeypatch):
    from blockdiff import diskweights

    monkeypatch.setattr(diskweights, "available_memory", lambda: 100_000)
    with pytest.raises(OptionsError, match=r"this machine has 97.7 KiB available: read them from disk a block at a time with max_memory"):
        run(checkpoints["llama"], checkpoints["llama"], IDS)


def test_sizes():
    assert parse_size("1GiB") == 1 << 30 and parse_size("1.5 GB") == 1_500_000_000 and parse_size("512M") == 512 << 20
    with pytest.raises(ValueError):
        parse_size("lots")


# The peak of the diff's own process (ru_maxrss would count this one's too: it is kept
# across the fork and exec that start the child).
_PEAK = """
import sys, torch
from blockdiff import Options, run
from blockdiff.diskweights import parse_size, peak_memory
report = run(sys.argv[1], sys.argv[1], torch.randint(0, 256, (1, 8)), options=Options(max_memory=parse_size("64MiB")))
assert report.first_divergence is None
print(peak_memory())
"""


def test_the_peak_does_not_grow_with_the_number_of_blocks(tmp_path):
    """Two and ten blocks of 6.3 MiB: whole, the ten-block diff would hold 2 x 8 blocks more
    (100 MiB); read from disk, its peak stays within one block per side of the two-block one."""
    peaks = {}
    for blocks in (2, 10):
        folder = _saved(
            hf_llama.build(num_hidden_layers=blocks, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                           num_key_value_heads=4),
            tmp_path / str(blocks), "8MB",
        )
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, folder], cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[blocks] = int(done.stdout.split()[-1])
    block = (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) * 4
    assert peaks[10] - peaks[2] < 2 * block, (peaks, block)


def test_the_pytest_plugin_reads_weights_from_disk_under_its_option(checkpoints, pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(
        test_ports=f"""
import torch

def test_port(blockdiff):
    ids = torch.randint(0, 256, (1, 8))
    report = blockdiff.diff({checkpoints["llama"]!r}, {checkpoints["llama-norm"]!r}, ids)
    assert any(n.startswith("weights read from disk a block at a time (max_memory 4.0 MiB)") for n in report.notes)
    blockdiff.assert_close({checkpoints["llama"]!r}, {checkpoints["llama-norm"]!r}, ids)
"""
    )
    result = pytester.runpytest("-p", "blockdiff", "--blockdiff-max-memory", "4MiB")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*DivergenceError: block 2 norm (model.layers.2.post_attention_layernorm)*"])
    result = pytester.runpytest("-p", "blockdiff", "--blockdiff-max-memory", "lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--blockdiff-max-memory: 'lots' is not a size*"])
