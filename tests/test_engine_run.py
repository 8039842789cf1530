"""engine.run chooses the mode from what the sides are; sides behave as the protocol says."""

from __future__ import annotations

import copy

import pytest
import torch

import blockdiff
from blockdiff import InputError, Options, OptionsError, PairingError, RandomTokens, Tolerance, run
from blockdiff.engine import capture
from blockdiff.sides.dump import DumpSide
from blockdiff.sides.live import LiveSide
from samples import bugs, tinylm
from tests.conftest import blamed


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "ref.h5"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    capture(tinylm.build(), ids, path)
    return path, ids


def test_factories_on_both_sides_run_a_live_diff_with_random_tokens():
    report = run(tinylm.build, lambda: bugs.gelu_for_silu(block=1), RandomTokens(batch=1, seq=8, seed=3))
    assert blamed(report) == ("block", 1, "ffn")
    assert report.inputs["shape"] == [1, 8]
    assert not report.notes


def test_one_factory_builds_both_sides():
    built = []
    report = run(lambda: built.append(1) or tinylm.build())
    assert len(built) == 2  # two separate models
    assert report.tolerance["policy"] == "fixed" and blamed(report) is None


def test_a_precision_change_between_factories_is_calibrated_and_clean():
    report = run(tinylm.build, lambda: tinylm.build().to(torch.bfloat16))
    assert report.tolerance["policy"] == "calibrated"
    assert blamed(report) is None


def test_a_dump_reference_with_a_model_replays(golden):
    path, _ = golden
    report = run(path, bugs.gelu_for_silu(block=2))
    assert blamed(report) == ("block", 2, "ffn")
    assert report.notes[0].startswith("replay: the reference is the dump")


def test_replay_refuses_inputs_other_than_the_dumps(golden):
    path, ids = golden
    assert blamed(run(path, tinylm.build(), ids)) is None  # the same inputs are fine
    with pytest.raises(InputError, match="captured on other inputs"):
        run(path, tinylm.build(), ids + 1)


def test_two_dumps_compare_offline(golden, tmp_path):
    path, ids = golden
    capture(bugs.gelu_for_silu(block=2), ids, tmp_path / "cand.h5")
    report = run(str(path), str(tmp_path / "cand.h5"))
    assert report.first_divergence.block == 2
    assert report.note_codes[-1] == "offline-drift"
    assert all(r.status == "drift_only" for b in report.blocks for name, r in b.subpaths.items() if name != "residual")


@pytest.mark.parametrize(
    "sides, message",
    [
        (("ref.h5", None), "a reference dump needs a CANDIDATE"),
        ((tinylm.build, "cand.h5"), "a candidate dump needs a reference dump"),
        ((tinylm.build(), None), "a reference model alone"),
        (("model.py", tinylm.build), "not a dump"),
    ],
)
def test_pairings_without_a_mode_are_input_errors(sides, message):
    with pytest.raises(InputError, match=message):
        run(*sides)


def test_save_dumps_needs_a_live_pair(golden, tmp_path):
    with pytest.raises(OptionsError, match="save_dumps keeps the captures of a live diff") as caught:
        run(golden[0], tinylm.build(), options=Options(save_dumps=tmp_path))
    # The library names its parameters; the CLI spells them as its flags.
    assert caught.value.names == ("save_dumps",)
    assert caught.value.spelled({"save_dumps": "--save-dumps"}).startswith("--save-dumps keeps the captures")


def test_a_factory_returning_something_else_is_an_input_error():
    with pytest.raises(InputError, match="returned a dict"):
        run(tinylm.build, lambda: {})


def test_precision_side_runs_copies_and_leaves_the_model_alone(ids):
    model = tinylm.build()
    before = copy.deepcopy(model.state_dict())
    side = LiveSide("reference", model, blockdiff.resolve(model))
    floor = side.in_precision(torch.bfloat16, torch.device("cpu"))
    assert floor.dtype == torch.bfloat16 and side.dtype == torch.float32
    report = blockdiff.diff(model, tinylm.build().to(torch.bfloat16), ids, tolerance=Tolerance("calibrated"))
    assert report.blocks[0].subpaths["ffn"].checks[0].threshold.floor > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_dump_side_cannot_run_experiments(golden):
    from blockdiff.dump import DumpReader

    path, _ = golden
    with DumpReader(path) as dump:
        side = DumpSide("reference", dump)
        assert not side.live and side.in_precision(torch.bfloat16, torch.device("cpu")) is None
        (block,) = [s for s in dump.block_sites(0) if s.subpath is None]
        with pytest.raises(PairingError, match="is a dump"):
            side.call_module(block.module, block)


def test_a_streamed_diff_drops_each_block_once_it_is_judged(monkeypatch):
    """A streamed diff holds one block's records of its dumps at a time: once block i is
    judged, the reference's, the candidate's and the free run's dumps hold nothing of it
    (DumpReader.forget), and the report is the in-memory diff's."""
    from blockdiff import engine
    from blockdiff.dump import DumpReader

    readers, held = [], []
    opened = DumpReader.__init__

    def spied(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        readers.append(self)

    def progress(what, done, total):
        if what == "localize":  # block done - 1 is judged; the next one is not read yet
            held.append([sorted({e.block for e in r._held if e.block is not None}) for r in readers])

    monkeypatch.setattr(DumpReader, "__init__", spied)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    candidate = lambda: bugs.gelu_for_silu(block=1).to(torch.bfloat16)  # noqa: E731
    token = engine.PROGRESS.set(progress)
    try:
        streamed = blockdiff.diff(tinylm.build(), candidate(), ids, stream=True).to_dict()
    finally:
        engine.PROGRESS.reset(token)
    blocks = len(tinylm.build().blocks)
    assert len(readers) == 3  # reference, candidate, the reference's free run at bfloat16
    assert held == [[list(range(i, blocks))] * 3 for i in range(blocks)]
    assert all(not r._held or all(e.block is None for e in r._held) for r in readers)
    in_memory = blockdiff.diff(tinylm.build(), candidate(), ids).to_dict()
    streamed.pop("created"), in_memory.pop("created")
    assert streamed == in_memory
