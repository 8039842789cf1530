"""The `blockdiff` command: exit codes, one-line errors, a real process in an 80-column
terminal. The README's commands run as printed in tests/test_readme.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blockdiff.cli import main
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = "samples/tinylm.py:build"


def blockdiff_process(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "blockdiff.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "factories.py").write_text(
        "from samples import tinylm\n"
        "def raises():\n    raise ValueError('weights file is corrupt')\n"
        "def not_a_module():\n    return 42\n"
        "def three_blocks():\n    return tinylm.build(blocks=3)\n"
        "def narrow():\n    return tinylm.build(hidden=32, heads=2, kv_heads=1)\n"
        "NOT_CALLABLE = 3\n"
    )
    (tmp_path / "big_ids.json").write_text("[[1, 2, 999]]")
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    (tmp_path / "bad.toml").write_text("name = [unclosed\n")
    (tmp_path / "missing_module.toml").write_text(
        'name = "x"\n[blocks]\npath = "blocks"\n[blocks.subpaths]\nattention = "self_attn"\n'
    )
    (tmp_path / "empty.json").write_text("[[]]")
    (tmp_path / "weights.pt").write_bytes(b"PK\x03\x04 a zipped state dict")
    (tmp_path / "weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    import h5py
    import torch
    from safetensors.torch import save_file

    from blockdiff.engine import capture
    from samples import tinylm

    save_file({"ids": torch.tensor([[1, 2]])}, str(tmp_path / "wrong_key.safetensors"))
    save_file({"input_ids": torch.zeros(1, 2, 3, dtype=torch.long)}, str(tmp_path / "ids3d.safetensors"))
    good = tmp_path / "good.h5"
    capture(tinylm.build(), torch.tensor([[1, 2, 3, 4]]), good)
    (tmp_path / "truncated.h5").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "garbage.h5").write_bytes(b"\x89HDF but not really" * 10)
    h5py.File(tmp_path / "foreign.h5", "w").close()
    for name, attr, value in (("newer.h5", "schema_version", 6), ("incomplete.h5", "complete", False)):
        (tmp_path / name).write_bytes(good.read_bytes())
        with h5py.File(tmp_path / name, "r+") as f:
            f.attrs[attr] = value
    (tmp_path / "report.json").write_text("{not json")
    (tmp_path / "broken.onnx").write_bytes(b"\x0a\xff\xff not a protobuf message" * 8)
    os.chdir(ROOT)
    sys.path.insert(0, str(tmp_path))
    return tmp_path


BAD_INPUTS = [
    (["diff", "nope.py:build"], "no such file nope.py"),
    (["diff", "samples/tinylm.py:nope"], "has no attribute 'nope'"),
    (["diff", "samples/tinylm.py:biuld"], "samples/tinylm.py has no attribute 'biuld'; did you mean 'build'?"),
    (["diff", "{tmp}/weights.pt"], "a checkpoint holds weights, not a model; expected path/to/file.py:factory"),
    (["arch", "{tmp}/weights.safetensors"], "model.load_state_dict(torch.load("),
    (["diff", "samples/tinylm.py"], "expected path/to/file.py:factory"),
    (["diff", "no_such_package_xyz.models:build"], "cannot import no_such_package_xyz.models"),
    (["diff", SAMPLE, "{tmp}/factories.py:raises"], "the factory raised ValueError: weights file is corrupt (add --debug for the traceback)"),
    (["diff", SAMPLE, "{tmp}/factories.py:not_a_module"], "the factory returned a int, expected a torch nn.Module"),
    (["diff", SAMPLE, "{tmp}/factories.py:NOT_CALLABLE"], "NOT_CALLABLE is a int, not callable"),
    (["diff", SAMPLE, "{tmp}/factories.py:three_blocks"], "the reference has 4 blocks and the candidate 3"),
    (["diff", SAMPLE, "{tmp}/factories.py:narrow"], "embed output: candidate has shape [2, 16, 32], reference [2, 16, 64]"),
    (["diff", SAMPLE, "--cand-dtype", "float12"], "unknown dtype 'float12'"),
    (["diff", SAMPLE, "--ref-device", "tpu9"], "unknown device 'tpu9'"),
    (["diff", SAMPLE, "--tokens", "{tmp}/big_ids.json"], "token ids out of range for the reference's vocabulary of 256: found ids from 1 to 999"),
    (["diff", SAMPLE, "--tokens", "{tmp}/ragged.json"], "rows have different lengths"),
    (["diff", SAMPLE, "--tokens", "{tmp}/absent.json"], "no such file"),
    (["diff", SAMPLE, "--tokens", "/dev/null"], "token file /dev/null: not a regular file"),
    (["diff", SAMPLE, "--seq", "0"], "--seq must be at least 1, found 0"),
    (["diff", SAMPLE, "--batch", "0"], "--batch must be at least 1, found 0"),
    (["diff", SAMPLE, "--tol", "ffn"], "expected SUBPATH=VALUE"),
    (["diff", SAMPLE, "--tol", "mlp=0.1"], "unknown tolerance target 'mlp'"),
    (["diff", SAMPLE, "--tol", "ffn=-1"], "must be a positive number"),
    (["diff", SAMPLE, "--tolerance", "loose"], "'loose' is not one of 'fixed', 'calibrated'"),
    (["diff", SAMPLE, "--hooks", "{tmp}/bad.toml"], "not valid TOML"),
    (["diff", SAMPLE, "--hooks", "{tmp}/missing_module.toml"], "attention module 'blocks.0.self_attn' does not exist in TinyLM"),
    (["diff", SAMPLE, "--hooks", "{tmp}/none.toml"], "no such file"),
    (["diff", SAMPLE, "--json", "{tmp}/no/such/dir/report.json"], "cannot write the JSON report"),
    (["diff", SAMPLE, "--frobnicate"], "No such option '--frobnicate'."),
    (["diff"], "Missing argument 'REFERENCE'"),
    (["diff", SAMPLE, "--tokens", "{tmp}/empty.json"], "empty.json: holds no tokens"),
    (["diff", SAMPLE, "--tokens", "{tmp}/wrong_key.safetensors"], "expected a tensor named 'input_ids', found ['ids']"),
    (["diff", SAMPLE, "--tokens", "{tmp}/ids3d.safetensors"], "input_ids must be [batch, seq], found shape [1, 2, 3]"),
    (["diff", "{tmp}/foreign.h5", SAMPLE], "is an HDF5 file but not a blockdiff dump"),
    (["diff", "{tmp}/good.h5"], "a reference dump needs a CANDIDATE"),
    (["diff", SAMPLE, "{tmp}/good.h5"], "a candidate dump needs a reference dump"),
    (["inspect", "{tmp}/truncated.h5"], "damaged"),
    (["inspect", "{tmp}/garbage.h5"], "is not an HDF5 file"),
    (["inspect", "{tmp}/newer.h5"], "has schema version 6; this blockdiff reads up to 5: upgrade blockdiff"),
    (["inspect", "{tmp}/incomplete.h5"], "is incomplete (the capture did not finish)"),
    (["inspect", "{tmp}/absent.h5"], "absent.h5: no such file"),
    (["export", "{tmp}/absent.h5", "{tmp}/out.safetensors"], "no such file"),
    (["capture", SAMPLE, "--out", "{tmp}/no/such/dir/x.h5"], "x.h5: cannot create the dump: the folder {tmp}/no/such/dir does not exist"),
    (["capture", SAMPLE, "--out", "{tmp}/good.h5/x.h5"], "cannot create the dump: {tmp}/good.h5 is not a folder"),
    (["report", "{tmp}/absent.json", "--html", "{tmp}/r.html"], "absent.json: no such file"),
    (["report", "{tmp}/report.json", "--html", "{tmp}/r.html"], "not a JSON report"),
    (["arch", "torch.nn:Linear"], "the factory raised TypeError"),
    (["arch", "torch.nn:Identity"], "no hook map matches model class Identity; write one and pass it with --hooks"),
    (["diff", SAMPLE, "{tmp}/broken.onnx"], "{tmp}/broken.onnx cannot be read as an ONNX model"),
]


# Errors in the command line itself (click's usage errors): the help to read follows the
# error on a line of its own.
USAGE_ERRORS = ("Error: Invalid value for", "Error: No such option", "Error: Missing argument")


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[" ".join(a)[:60] for a, _ in BAD_INPUTS])
def test_bad_input_gets_one_line_and_exit_2(args, message, factories, capsys):
    args = [a.replace("{tmp}", str(factories)) for a in args]
    message = message.replace("{tmp}", str(factories))
    code, out, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    usage = lines[0].startswith(USAGE_ERRORS)
    assert lines[1:] == ([f"Try 'blockdiff {args[0]} --help'."] if usage else []), err
    assert lines[0].startswith("Error: ")
    assert message in lines[0]
    assert "Traceback" not in err + out
    assert "errno" not in err and ".tmp-" not in err  # no libhdf5 internals


def test_cuda_asked_for_where_there_is_none(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli(["diff", SAMPLE, "--cand-device", "cuda"], capsys)
    assert code == 2
    assert err.strip() == "Error: device 'cuda' asked for, but CUDA is not available on this machine"


def test_debug_shows_the_traceback(capsys):
    code, _, err = run_cli(["diff", "samples/tinylm.py:nope", "--debug"], capsys)
    assert code == 2
    assert "Traceback" in err and err.strip().endswith("has no attribute 'nope'")


def test_exit_codes_and_json_report(tmp_path, capsys):
    os.chdir(ROOT)
    code, out, _ = run_cli(["diff", SAMPLE, "samples/bugs.py:attention_scale", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1
    assert "First divergence: block 1 attention (blocks.1.attn)" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"]["block"] == 1
    assert report["first_divergence"]["subpath"] == "attention"
    code, out, _ = run_cli(["diff", SAMPLE, "--cand-dtype", "bfloat16", "-q"], capsys)
    assert code == 0
    assert out.strip() == "no divergence"


def test_nan_candidate_is_reported_not_a_crash(capsys):
    os.chdir(ROOT)
    code, out, err = run_cli(["diff", SAMPLE, "samples/bugs.py:nan_in_ffn"], capsys)
    assert code == 1, err
    assert "First divergence: block 1 ffn (blocks.1.ffn):" in out
    assert "non-finite values in the candidate" in out
    assert "free-running candidate first holds" in out and "block 1 ffn" in out


def in_terminal(*args: str, columns: int, cwd: Path = ROOT) -> tuple[int, str, str]:
    """``python -m blockdiff ARGS`` with stdout on a pseudo-terminal ``columns`` wide (as
    in a terminal window), stderr on a pipe: exit code, stdout without escape codes, stderr."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "COLUMNS": str(columns), "TERM": "xterm"}
    process = subprocess.Popen(
        [sys.executable, "-m", "blockdiff", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
        stdout=follower, stderr=subprocess.PIPE,
    )
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            process.kill()
            raise AssertionError(f"no output for 300 s: {args}")
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is done writing
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    err = process.stderr.read().decode()
    process.wait(timeout=60)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", out.decode()).replace("\r\n", "\n")
    return process.returncode, text, err


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_diff_fits_an_80_column_terminal_even_with_a_long_model_path(tmp_path):
    # A model path longer than the terminal: the header keeps its file name and factory
    # whole and loses the middle of its directories; no printed line is wider than 80.
    folder = tmp_path.joinpath(*["a-directory-with-a-rather-long-name"] * 3)
    folder.mkdir(parents=True)
    (folder / "tinylm.py").write_text((ROOT / "samples" / "tinylm.py").read_text())
    spec = f"{folder / 'tinylm.py'}:build"
    assert len(spec) > 110
    code, out, err = in_terminal("diff", spec, "samples/bugs.py:gelu_for_silu", columns=80)
    assert code == 1, err
    lines = out.splitlines()
    wide = [line for line in lines if len(line.rstrip()) > 80]
    assert wide == [], "\n".join(wide)
    header = next(line for line in lines if line.startswith("blockdiff reference "))
    assert header.endswith("…/tinylm.py:build (cpu, float32)") and spec[:20] in header, header
    assert any(line.strip() == "candidate samples/bugs.py:gelu_for_silu (cpu, float32)" for line in lines), out
    assert "First divergence: block 1 ffn (blocks.1.ffn):" in out
    assert "1.62e-01!" in out  # the table's numbers whole
    assert all(len(line) <= 80 for line in err.splitlines())


def test_real_process_error_is_one_line():
    done = blockdiff_process("diff", "samples/tinylm.py:build", "--seq", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "Error: --seq must be at least 1, found 0"


def test_arch_prints_the_resolved_map(capsys):
    os.chdir(ROOT)
    main_result = main(["arch", SAMPLE])
    out, _ = capsys.readouterr()
    assert main_result is None
    assert "hook map tinylm" in out and "4 blocks" in out
    assert "attn_norm, ffn_norm" in out
    for stage, module in [("embed", "embed"), ("context", "rotary"), ("final_norm", "norm"), ("head", "lm_head")]:
        assert f"{stage:<11} {module}" in out
    main(["arch", SAMPLE, "--json"])
    layout = json.loads(capsys.readouterr().out)
    assert layout["blocks"][2]["subpaths"] == {
        "attention": ["blocks.2.attn"],
        "ffn": ["blocks.2.ffn"],
        "norm": ["blocks.2.attn_norm", "blocks.2.ffn_norm"],
    }


def test_tokens_from_safetensors_and_tolerance_override(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    os.chdir(ROOT)
    save_file({"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]])}, str(tmp_path / "ids.safetensors"))
    args = ["diff", SAMPLE, "samples/bugs.py:gelu_for_silu", "--tokens", str(tmp_path / "ids.safetensors"), "--json", str(tmp_path / "r.json")]
    code, _, _ = run_cli(args, capsys)
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and report["inputs"]["shape"] == [1, 6]
    # A generous fixed threshold for the FFN alone turns the verdict around.
    code, _, _ = run_cli([*args, "--tol", "ffn=5", "--tol", "block=5"], capsys)
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0, report["first_divergence"]
    assert report["blocks"][1]["subpaths"]["ffn"]["basis"] == "override"
    save_file({"input_ids": torch.zeros(2, 3)}, str(tmp_path / "float.safetensors"))
    code, _, err = run_cli(["diff", SAMPLE, "--tokens", str(tmp_path / "float.safetensors")], capsys)
    assert code == 2 and "input_ids must be integers, found torch.float32" in err


def test_progress_is_reported_per_block(ids):
    from blockdiff.engine import PROGRESS, diff
    from samples import bugs, tinylm

    seen = []
    token = PROGRESS.set(lambda what, done, total: seen.append((what, done, total)))
    try:
        diff(tinylm.build(), bugs.gelu_for_silu(), ids)
    finally:
        PROGRESS.reset(token)
    for what in ("capture reference", "capture candidate", "localize"):
        assert [(d, t) for w, d, t in seen if w == what] == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_bare_blockdiff_prints_the_help_alone(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 0 and err == ""
    assert out.startswith("Usage: blockdiff [OPTIONS] COMMAND [ARGS]...")
    assert "Commands:" in out and "Error" not in out


def test_a_diff_says_on_stderr_what_it_wrote_and_replaced(tmp_path, capsys):
    paths = {"json": tmp_path / "r.json", "html": tmp_path / "r.html"}
    args = ["diff", SAMPLE, "samples/bugs.py:gelu_for_silu", "--json", str(paths["json"]), "--html", str(paths["html"])]
    code, out, err = run_cli([*args, "--save-dumps", str(tmp_path / "kept")], capsys)
    assert code == 1
    kept = [tmp_path / "kept" / f"{side}.h5" for side in ("reference", "candidate")]
    assert err.splitlines() == [
        f"wrote {kept[0]}", f"wrote {kept[1]}", f"wrote {paths['json']} (JSON report)", f"wrote {paths['html']} (HTML report)",
    ]
    assert "First divergence: block 1 ffn" in out and "wrote" not in out
    # The closing line points at the JSON just written, not at `--json PATH`.
    assert f"next: read the module named above; {paths['json']} keeps every metric" in " ".join(out.split())
    assert "--json PATH" not in out
    code, out, err = run_cli([*args, "--save-dumps", str(tmp_path / "kept"), "-q"], capsys)
    assert code == 1 and err == "" and out.startswith("first divergence: block 1 ffn")
    code, out, err = run_cli(["diff", SAMPLE, "samples/bugs.py:gelu_for_silu", "--save-dumps", str(tmp_path / "kept")], capsys)
    assert err.splitlines() == [f"replaced {kept[0]}", f"replaced {kept[1]}"]
    assert "`--json PATH` keeps every metric" in " ".join(out.split())


def test_report_alone_shows_the_saved_report_in_the_terminal(tmp_path, gelu_report, capsys):
    saved = tmp_path / "bug.json"
    gelu_report.write_json(saved)
    code, out, err = run_cli(["report", str(saved)], capsys)
    assert code == 0 and err == ""
    text = " ".join(out.split())
    assert "First divergence: block 2 ffn (blocks.2.ffn)" in text
    assert f"`blockdiff report {saved} --html PATH` keeps it as a page" in text
    code, out, err = run_cli(["report", str(saved), "--html", str(tmp_path / "bug.html")], capsys)
    assert code == 0 and out == "" and err.strip() == f"wrote {tmp_path / 'bug.html'} (HTML report)"


def test_an_error_in_user_code_points_to_debug(factories, capsys):
    code, _, err = run_cli(["diff", SAMPLE, f"{factories}/factories.py:raises", "--debug"], capsys)
    assert code == 2
    assert "Traceback" in err and err.strip().endswith("the factory raised ValueError: weights file is corrupt")


def test_a_piped_report_is_80_columns_without_trailing_spaces():
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "blockdiff", "diff", SAMPLE, "samples/bugs.py:gelu_for_silu"], cwd=ROOT,
        env={**env, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if len(line) > 80] == []
    assert [line for line in lines if line != line.rstrip()] == []  # rich pads the table's cells
    assert lines[0] == "blockdiff reference samples/tinylm.py:build (cpu, float32)"  # one side a line at 80
    assert "1.62e-01!" in done.stdout  # the table's numbers whole


@pytest.mark.parametrize("columns", [60, 120])
def test_columns_sets_the_width_of_a_report_that_is_not_on_a_terminal(columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run_cli(["diff", SAMPLE, "samples/bugs.py:gelu_for_silu"], capsys)
    assert code == 1, err
    widest = max(len(line) for line in out.splitlines())
    assert widest <= columns and (columns < 80 or widest > 80), out  # not the 80 of a pipe
    assert "1.62e-01!" in out


@pytest.mark.parametrize("command", [[], ["diff"], ["capture"], ["report"], ["inspect"], ["export"], ["arch"], ["invariance"]])
def test_every_help_fits_80_columns(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli([*command, "--help"], capsys)
    assert code == 0 and "Usage: blockdiff" in out
    assert [line for line in out.splitlines() if len(line) > 80] == []
    if not command:  # each command's summary whole, not cut with "..."
        summaries = out.split("Commands:")[1].splitlines()[1:]
        assert len(summaries) == 7 and [line for line in summaries if line.endswith("...")] == [], out


def test_diff_help_names_every_exit_code(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(["diff", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    for exit_code in range(4):
        assert f"{exit_code}: " in text.split("Exit code ")[1].split("Examples:")[0], text


def test_capture_and_export_name_the_files_they_wrote_on_stderr(tmp_path, capsys):
    """As a diff does: stdout carries what a command shows, and nothing else."""
    dump, flat = tmp_path / "ref.h5", tmp_path / "ref.safetensors"
    code, out, err = run_cli(["capture", SAMPLE, "--out", str(dump), "--seq", "4"], capsys)
    assert (code, out, err) == (0, "", f"wrote {dump}\n")
    code, out, err = run_cli(["export", str(dump), str(flat)], capsys)
    assert code == 0 and out == "" and err.startswith(f"wrote {flat} (") and err.endswith("and ref.safetensors.manifest.json\n")


# What starting the command costs before it runs anything: the start-up line of
# benchmarks/overhead.py times it; here, that neither imports torch.
_NO_TORCH = "import sys; from blockdiff.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n    print('torch' in sys.modules)"


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["diff", "--help"], 0), (["diff", "--no-such-option"], 2), (["diff"], 2)])
def test_help_and_usage_errors_do_not_import_torch(args, code):
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines()[-1] == "False", done.stdout[-500:]


@pytest.mark.parametrize("args, said", [
    (("samples/hf_llama.py:build", "samples/hf_llama.py:residual_dropped"),
     "First divergence: block 1 residual (input of model.layers.1.post_attention_layernorm)"),
    (("samples/hf_ssm.py:build_mamba", "samples/hf_ssm.py:decay_wrong_when_decoding", "--decode", "2"),
     "step 1 block 1 attention (ssm state)"),
], ids=["llama", "mamba decode"])
def test_a_hugging_face_diff_prints_only_blockdiff_on_stderr(args, said):
    """transformers imports torchao when it is installed (the dev install has it): its
    warnings about CUDA kernels it could not load, and torch's about the Enums it registers,
    are not the user's business (BLOCKDIFF_DEBUG shows them again); nor are its notes that a
    Mamba mixer's kernels fall back to PyTorch code on a CPU, nor a warning from the
    project's own sample, whose planted bug runs the attention with the cache under the name
    transformers passed it (naming the other, the sample warned a FutureWarning)."""
    done = blockdiff_process("diff", *args)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr == ""
    assert said in " ".join(done.stdout.split())


_CONSOLE_SCRIPT = "import sys; sys.path = [p for p in sys.path if p not in ('', '.', {root!r})]; " \
    "from blockdiff.cli import main; main(sys.argv[1:])"


@pytest.mark.parametrize("cwd, code", [(ROOT, 1), (ROOT / "docs", 2)])
def test_dotted_specs_import_from_the_working_directory_as_under_python_m(cwd, code):
    """The console script's sys.path lacks the working directory (``python -m`` puts it
    first): a package there is imported all the same, and elsewhere the error says what to do."""
    done = subprocess.run(
        [sys.executable, "-c", _CONSOLE_SCRIPT.format(root=str(ROOT)), "diff", "samples.tinylm:build", "samples.bugs:gelu_for_silu", "-q"],
        cwd=cwd, env={**os.environ, "NO_COLOR": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == code, done.stderr[-2000:]
    if code == 1:
        assert done.stdout.startswith("first divergence: block 1 ffn (blocks.1.ffn)")
    else:
        assert "cannot import samples.tinylm (No module named 'samples')" in done.stderr
        assert "(the working directory holds no samples): run from the directory that holds it, set PYTHONPATH" in done.stderr
