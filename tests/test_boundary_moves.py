"""Code that moved across a module boundary is not a bug: Gemma's embedding scale, applied
after the embedding by one release and inside it by the next."""

from __future__ import annotations

import math

import torch
from torch import nn

import blockdiff
from blockdiff.dump import DumpReader
from blockdiff.engine import capture, replay
from samples import tinylm
from tests.conftest import blamed, run_cli


class ScaledEmbedding(nn.Embedding):
    """The embedding that scales its own output (the newer spelling)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * math.sqrt(self.embedding_dim)


class ScaleAfterEmbedding(tinylm.TinyLM):
    """The model that scales the embedding's output itself (the older spelling)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * math.sqrt(self.cfg.hidden)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        cos, sin = self.rotary(x, positions)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def scale_after_embedding() -> tinylm.TinyLM:
    model = tinylm.build()
    model.__class__ = ScaleAfterEmbedding
    return model


def scale_inside_embedding() -> tinylm.TinyLM:
    model = tinylm.build()
    model.embed.__class__ = ScaledEmbedding
    return model


def embedding_scaled_twice() -> tinylm.TinyLM:
    """A real bug: both spellings at once."""
    model = scale_after_embedding()
    model.embed.__class__ = ScaledEmbedding
    return model


def test_a_scale_moved_into_the_embedding_is_not_blamed(ids):
    report = blockdiff.diff(scale_after_embedding(), scale_inside_embedding(), ids)
    assert blamed(report) is None
    embed = report.stages[0]
    assert embed.stage == "embed" and embed.local.diverged  # the outputs do differ
    assert embed.boundary_move["reaches"] == "block 0 input" and embed.boundary_move["rel_l2"] == 0.0
    assert "boundary-move" in report.note_codes
    assert report.to_dict()["stages"][0]["boundary_move"] == embed.boundary_move


def test_both_spellings_at_once_is_still_a_bug(ids):
    report = blockdiff.diff(scale_after_embedding(), embedding_scaled_twice(), ids)
    assert blamed(report) == ("embed", None, None)


def test_a_moved_scale_is_not_blamed_in_bfloat16_or_on_replay(ids, tmp_path):
    report = blockdiff.diff(scale_after_embedding(), scale_inside_embedding().to(torch.bfloat16), ids)
    assert blamed(report) is None
    capture(scale_after_embedding(), ids, tmp_path / "older.h5")
    assert blamed(replay(tmp_path / "older.h5", scale_inside_embedding())) is None


def test_dumps_record_package_versions_and_a_replay_names_changes(ids, tmp_path, monkeypatch):
    import blockdiff.sides.live

    capture(tinylm.build(), ids, tmp_path / "ref.h5")
    with DumpReader(tmp_path / "ref.h5") as dump:
        stored = dump.meta["versions"]
    assert stored["torch"] == torch.__version__
    assert replay(tmp_path / "ref.h5", tinylm.build()).notes == [f"replay: the reference is the dump {tmp_path / 'ref.h5'}"]
    monkeypatch.setattr(blockdiff.sides.live, "versions", lambda model: {**stored, "torch": "9.9.9"})
    notes = replay(tmp_path / "ref.h5", tinylm.build()).notes
    assert notes[1] == (
        f"the dump was captured under other package versions (torch {torch.__version__} → 9.9.9): "
        "code may have moved between modules"
    )


def test_the_cli_exits_zero_on_a_moved_boundary(tmp_path, capsys):
    factory = tmp_path / "spellings.py"
    factory.write_text(
        "from tests.test_boundary_moves import scale_after_embedding, scale_inside_embedding\n"
    )
    code, out, err = run_cli(["diff", f"{factory}:scale_after_embedding", f"{factory}:scale_inside_embedding", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
