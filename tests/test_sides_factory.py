"""The one way in: every kind of spec becomes its side through sides.factory.open_side."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from blockdiff import InputError
from blockdiff.engine import capture
from blockdiff.sides import dump, gguf, mlx, onnx
from blockdiff.sides.dump import DumpSide
from blockdiff.sides.factory import KINDS, kind_of, open_side
from blockdiff.sides.live import LiveSide
from samples import tinylm


def test_kinds_are_read_off_the_spec_without_opening_anything(tmp_path):
    assert KINDS == (dump, onnx, gguf, mlx)
    assert kind_of(tmp_path / "absent.h5") == "dump"
    assert kind_of("graph.onnx") == "onnx"
    assert kind_of(tmp_path / "absent.gguf") == "gguf"  # importing neither llama_cpp nor mlx
    assert kind_of("samples/tinylm.py:build") == "model"
    assert kind_of(tinylm.build) == "model"


def test_models_factories_specs_and_dumps_become_their_sides(tmp_path, ids):
    capture(tinylm.build(), ids, tmp_path / "ref.h5")
    with ExitStack() as opened:
        built = open_side("reference", "samples/tinylm.py:build", opened=opened, dtype=torch.bfloat16)
        assert isinstance(built, LiveSide) and built.dtype == torch.bfloat16 and not built.lockstep
        assert isinstance(open_side("candidate", tinylm.build, opened=opened), LiveSide)
        stored = open_side("reference", tmp_path / "ref.h5", opened=opened, label="golden")
        assert isinstance(stored, DumpSide) and not stored.live and stored.meta["model"] == "golden"
        assert stored.inputs(ids)[0].equal(ids)
        with pytest.raises(InputError, match="captured on other inputs"):
            stored.inputs(ids + 1)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("model.py", "not a dump .* as a model spec, expected path/to/file.py:factory"),
        (lambda: 3, "the reference factory returned a int"),
        (42, "the reference is a int"),
    ],
)
def test_a_spec_of_no_kind_is_one_input_error(spec, message):
    with ExitStack() as opened, pytest.raises(InputError, match=message):
        open_side("reference", spec, opened=opened)


def test_an_onnx_graph_is_a_candidate_of_a_live_reference_only(tmp_path):
    with ExitStack() as opened, pytest.raises(InputError, match="can only be the candidate"):
        open_side("reference", tmp_path / "graph.onnx", opened=opened)
