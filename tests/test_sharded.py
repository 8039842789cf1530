"""Sharded candidates at world size 2 on CPU (gloo): tensor, sequence and expert parallel
samples against their single-device references, every planted distributed bug blamed on
exactly its block and sub-path, clean runs blaming nothing, in float32 and bfloat16.

The ranks are real processes with a launcher's environment: the Python API runs in one
spawn of ``tests/sharded_worker.py`` for every scenario (rank 0 writes the outcomes); the
CLI runs under our own two-process launch (each rank's exit code and output seen) and under
``torchrun`` (the README's command).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samples import sharded

ROOT = Path(__file__).resolve().parent.parent
BLOCK = sharded.DEFAULT_BLOCK

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo launches on Linux and macOS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], *, world: int = 2, timeout: float = 240, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``python ARGS`` as ``world`` ranks of one run, with the environment torchrun gives
    each rank; every rank's exit code, stdout and stderr."""
    port = _free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


# -- the Python API: every scenario in one launch ----------------------------------------------

LLAMA = "samples/hf_llama.py:build"
CLEAN = sharded.CLEAN  # clean sharded sample → (reference, candidate hook map)
PLANTED = sharded.BUGS  # planted bug → (reference, blamed block, sub-path, part, candidate hook map)
DTYPES = ("float32", "bfloat16")
BACKWARD_CLEAN = sharded.BACKWARD_CLEAN  # clean tensor-parallel sample → reference
BACKWARD_BUGS = sharded.BACKWARD_BUGS  # backward-only bug → (reference, block, sub-path, what)


def _scenarios(dump: Path) -> list[dict]:
    found = []
    for dtype in DTYPES:
        for name, (ref, hooks) in CLEAN.items():
            found.append({"name": f"clean {name} {dtype}", "reference": ref, "candidate": f"samples/sharded.py:{name}", "dtype": dtype, "hooks": hooks})
        for name, (ref, _, _, _, hooks) in PLANTED.items():
            found.append({"name": f"bug {name} {dtype}", "reference": ref, "candidate": f"samples/sharded.py:{name}", "dtype": dtype, "hooks": hooks})
    # --backward: the tensor-parallel samples' backward is the model's (planted backward
    # bugs run through the CLI below); a pipeline's is refused.
    for dtype in DTYPES:
        for name, ref in BACKWARD_CLEAN.items():
            found.append({"name": f"backward clean {name} {dtype}", "reference": ref, "candidate": f"samples/sharded.py:{name}", "dtype": dtype, "backward": True})
    for dtype in DTYPES:
        for name, (ref, *_) in sharded.BACKWARD_FOUND.items():
            found.append({"name": f"backward found {name} {dtype}", "reference": ref, "candidate": f"samples/sharded.py:{name}", "dtype": dtype, "backward": True})
    found.append({"name": "backward pipeline refused", "reference": "samples/tinylm.py:build", "candidate": "samples/sharded.py:tinylm_pp", "hooks": sharded.PP_HOOKS, "backward": True})
    # A single-device reference dump replayed against sharded candidates.
    found.append({"name": "replay clean", "reference": str(dump), "candidate": "samples/sharded.py:llama_tp"})
    found.append({"name": "replay norm_on_one_rank", "reference": str(dump), "candidate": "samples/sharded.py:norm_on_one_rank"})
    # Streaming would read the candidate back without the layouts its modules expect.
    found.append({"name": "stream refused", "reference": LLAMA, "candidate": "samples/sharded.py:llama_tp", "stream": True})
    # assert_no_divergence on built models inside the process group.
    found.append({"name": "assert clean", "api": "assert", "reference": LLAMA, "candidate": "samples/sharded.py:llama_tp"})
    found.append({"name": "assert kv_heads_swapped", "api": "assert", "reference": LLAMA, "candidate": "samples/sharded.py:kv_heads_swapped"})
    return found


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("sharded")
    dump = folder / "llama.h5"
    made = subprocess.run(
        [sys.executable, "-m", "blockdiff", "capture", LLAMA, "--out", str(dump)], cwd=ROOT, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    scenarios, out = folder / "scenarios.json", folder / "outcomes.json"
    scenarios.write_text(json.dumps(_scenarios(dump)))
    ranks = launch([str(ROOT / "tests" / "sharded_worker.py"), str(scenarios), str(out)], timeout=600)
    for rank, done in enumerate(ranks):
        assert done.returncode == 0, f"rank {rank}:\n{done.stderr[-3000:]}"
    found = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(2)]
    for item in found[0].values():
        item.pop("traceback", None)
    for name in found[0]:  # every rank built the same report
        for key in ("created",):
            found[0][name].pop(key, None), found[1][name].pop(key, None)
        assert found[0][name] == found[1][name], name
    return found[0]


def _found(outcomes: dict, name: str) -> dict:
    found = outcomes[name]
    assert "error" not in found, found.get("traceback", found.get("error"))
    return found


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_sharded_candidate_blames_nothing(outcomes, name, dtype):
    found = _found(outcomes, f"clean {name} {dtype}")
    assert found["first"] is None, found["first"]
    assert found["candidate"]["ranks"] == 2
    assert not any("replicas disagree" in note for note in found["notes"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_distributed_bug_is_blamed_exactly(outcomes, name, dtype):
    _, block, subpath, part, _ = PLANTED[name]
    first = _found(outcomes, f"bug {name} {dtype}")["first"]
    assert first is not None, f"{name} in {dtype}: nothing blamed"
    assert (first["block"], first["subpath"], first["part"]) == (block, subpath, part), first["headline"]


def test_replicas_that_disagree_are_blamed_where_they_first_differ_naming_the_rank(outcomes):
    found = _found(outcomes, "bug norm_on_one_rank float32")
    first = found["first"]
    assert first["what"] == "replicas"
    assert first["module"] == f"model.layers.{BLOCK}.post_attention_layernorm"
    assert "rank 1 differs from rank 0" in first["headline"]
    # The all-reduce after the next attention and FFN mixes rank 1's replica into every
    # rank: blamed on the norm, not downstream.
    assert "replicas disagree" in found["notes"][0]


def test_every_sharded_report_reads_back_from_its_json(outcomes):
    # replicas checks, hand-over checks and the candidate's ranks and stages included
    assert {name for name, found in outcomes.items() if "error" not in found and not found["round_trip"]} == set()


def test_a_skipped_all_reduce_leaves_replicas_that_disagree_at_the_ffn(outcomes):
    first = _found(outcomes, "bug all_reduce_skipped float32")["first"]
    assert first["module"] == f"model.layers.{BLOCK}.mlp"


def test_expert_parallel_routing_statistics_are_global(outcomes):
    found = _found(outcomes, "clean tinylm_ep float32")
    assert found["moe"], "no routing statistics"
    for block in found["moe"]:
        # Every token's top-2 experts counted once over the ranks (2 sequences x 16
        # tokens x 2), as the single-device reference counts them.
        assert sum(block["candidate"]["counts"]) == 2 * 16 * 2, block
        assert block["candidate"]["counts"] == block["reference"]["counts"]


def test_offset_expert_on_one_rank_is_blamed_on_the_experts(outcomes):
    first = _found(outcomes, "bug expert_offset float32")["first"]
    assert first["part"] == "experts" and first["module"] == f"blocks.{BLOCK}.ffn"


def test_a_pipeline_stage_fed_the_wrong_output_is_blamed_on_the_hand_over(outcomes):
    first = _found(outcomes, "bug stage_fed_wrong_output float32")["first"]
    assert first["what"] == "input handed over from block 1 (rank 0 to rank 1)", first["headline"]
    clean = _found(outcomes, "clean tinylm_pp float32")
    assert clean["candidate"]["stages"] == [[0, 1], [2, 3]]


def test_a_reference_dump_replays_against_a_sharded_candidate(outcomes):
    assert _found(outcomes, "replay clean")["first"] is None
    first = _found(outcomes, "replay norm_on_one_rank")["first"]
    assert (first["block"], first["subpath"]) == (BLOCK, "norm")


def test_streaming_a_sharded_candidate_is_refused_clearly(outcomes):
    assert outcomes["stream refused"]["error"].startswith("OptionsError: stream and save_dumps do not take a sharded candidate")


def test_assert_no_divergence_inside_a_process_group(outcomes):
    assert _found(outcomes, "assert clean")["first"] is None
    first = _found(outcomes, "assert kv_heads_swapped")["first"]
    assert (first["block"], first["subpath"]) == (BLOCK, "attention")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BACKWARD_CLEAN))
def test_the_backward_of_a_clean_tensor_parallel_candidate_blames_nothing(outcomes, name, dtype):
    found = _found(outcomes, f"backward clean {name} {dtype}")
    assert found["first"] is None, found["first"]
    assert found["backward"] is not None and found["backward"]["first"] is None, found["backward"]
    assert not any("replicas disagree" in note for note in found["backward"]["notes"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(sharded.BACKWARD_FOUND))
def test_a_replicated_parameter_whose_gradient_is_not_summed_over_ranks_is_blamed(outcomes, name, dtype):
    _, block, subpath, gradient = sharded.BACKWARD_FOUND[name]
    found = _found(outcomes, f"backward found {name} {dtype}")
    assert found["first"] is None  # every rank's forward is right
    first = found["backward"]["first"]
    assert first is not None and first.startswith(f"block {block} {subpath} "), first
    assert f"replicas disagree: rank 1 differs from rank 0 in the {gradient}" in first


def test_the_backward_of_a_pipeline_is_refused_clearly(outcomes):
    assert outcomes["backward pipeline refused"]["error"].startswith(
        "InputError: the candidate cannot run a backward: it is pipeline-parallel"
    )


# -- the CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BACKWARD_BUGS))
def test_cli_backward_only_tensor_parallel_bug_is_blamed_exactly(tmp_path, name, dtype):
    reference, block, subpath, what = BACKWARD_BUGS[name]
    report = tmp_path / "report.json"
    ranks = launch([
        "-m", "blockdiff", "diff", reference, f"samples/sharded.py:{name}", "--backward", "--cand-dtype", dtype,
        "--json", str(report),
    ])
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-2000:] for r in ranks]
    data = json.loads(report.read_text())
    assert data["first_divergence"] is None, data["first_divergence"]  # the forward is the clean one
    first = data["backward"]["first_divergence"]
    assert (first["block"], first["subpath"], first["what"]) == (block, subpath, what), first
    printed = " ".join(ranks[0].stdout.split())  # lines wrapped at the terminal's width
    assert f"forward: no divergence; backward: block {block} {subpath} " in printed
    if what == "replicas":  # each rank's input gradient is its own share: the replicas split there
        assert "replicas disagree: rank 1 differs from rank 0 in the input gradient" in printed
        # drilled down to the projection whose backward lacks the all-reduce
        assert f"first divergent child: model.layers.{block}.self_attn.q_proj" in printed
    else:
        assert not any("replicas disagree" in note for note in data["backward"]["notes"])
    assert ranks[1].stdout == ""




def test_cli_rank_zero_reports_and_every_rank_exits_alike(tmp_path):
    report = tmp_path / "report.json"
    ranks = launch(["-m", "blockdiff", "diff", LLAMA, "samples/sharded.py:kv_heads_swapped", "--json", str(report)])
    assert [r.returncode for r in ranks] == [1, 1], [r.stderr[-2000:] for r in ranks]
    assert "First divergence: block 1 attention" in ranks[0].stdout
    assert re.search(r"\(cpu,\s+2\s+ranks,", ranks[0].stdout)  # the header names the ranks
    assert ranks[1].stdout == ""
    assert "wrote" not in ranks[1].stderr and "Error" not in ranks[1].stderr
    data = json.loads(report.read_text())
    assert (data["first_divergence"]["block"], data["first_divergence"]["subpath"]) == (BLOCK, "attention")
    assert data["candidate"]["ranks"] == 2


def test_cli_a_rank_that_fails_stops_every_rank_with_one_line(tmp_path):
    start = time.monotonic()
    ranks = launch(
        ["-m", "blockdiff", "diff", LLAMA, "tests/sharded_factories.py:fails_on_rank_one"],
        env={"BLOCKDIFF_TIMEOUT": "120"},
    )
    elapsed = time.monotonic() - start
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-2000:] for r in ranks]
    lines = [line for r in ranks for line in r.stderr.splitlines() if line.startswith("Error")]
    assert lines == [
        "Error: rank 1: model spec 'tests/sharded_factories.py:fails_on_rank_one': the factory raised "
        "RuntimeError: rank 1 could not load its shard (add --debug for the traceback)"
    ], lines
    assert ranks[0].stdout == "" and ranks[1].stdout == ""
    assert elapsed < 60, f"{elapsed:.0f} s: the ranks waited for a collective timeout"


def test_cli_rank_zero_failing_after_the_run_stops_every_rank(tmp_path):
    # Rank 0 cannot write the report: the other rank, done with the run, must not wait.
    ranks = launch(["-m", "blockdiff", "diff", LLAMA, "samples/sharded.py:llama_tp", "--json", "/proc/no/such/report.json"])
    assert [r.returncode for r in ranks] == [2, 2], [r.stderr[-2000:] for r in ranks]
    assert "Error: rank 0: cannot write the JSON report" in ranks[0].stderr
    assert ranks[1].stderr == "" and ranks[1].stdout == ""


def test_torchrun_runs_the_readme_command(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("no torchrun beside this Python")
    done = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "-m", "blockdiff", "diff", LLAMA, "samples/sharded.py:llama_tp"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("No divergence") == 1  # rank 0 alone printed the report


def test_a_launcher_environment_that_is_not_numbers_exits_2_in_one_line(monkeypatch, capsys):
    from blockdiff.cli import main

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "two"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        main(["diff", "samples/tinylm.py:build", "samples/tinylm.py:build"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.strip().splitlines() == ["Error: cannot join the launched run: WORLD_SIZE='two' is not a number"]
