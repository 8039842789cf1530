"""The view every renderer reads (blockdiff.view): columns of cells, MoE rows, texts formatted once."""

from __future__ import annotations

import json

import pytest

from blockdiff import BlockdiffError, diff
from blockdiff.view import MOE_COLUMNS, ROWS, WHOLE, View, drop_rate
from blockdiff.vocab import SUBPATHS
from samples import bugs, tinylm


def test_columns_follow_execution_order_with_one_cell_per_row(gelu_report):
    view = View.of(gelu_report)
    assert [c.label for c in view.columns] == ["embed", "context", "0", "1", "2", "3", "final_norm", "head"]
    assert [c.name for c in view.blocks] == ["block 0", "block 1", "block 2", "block 3"]
    for column in view.columns:
        assert list(column.cells) == list(ROWS)
        diverged = [row for row, cell in column.cells.items() if cell.diverged]
        assert diverged == (["ffn", WHOLE] if column.block == 2 else []), column.label
    for stage in view.stages:  # a stage has its own check only
        assert all(stage.cells[name].status == "absent" and stage.cells[name].level == "none" for name in SUBPATHS)
        assert stage.cells[WHOLE].level == "low"
    ffn = view.blocks[2].cells["ffn"]
    assert ffn.level == "diverged" and ffn.module == "blocks.2.ffn"
    assert ffn.text == f"{ffn.value:.2e}" and ffn.ratio == pytest.approx(ffn.value / ffn.threshold)
    assert view.blocks[0].drift == 0.0 and view.blocks[3].drift > 0
    # Drift over its own threshold (drift_check): 0 before the bug, hundreds of times it after.
    for column, block in zip(view.blocks, gelu_report.blocks):
        assert column.drift_threshold == block.drift_check.threshold.value
        assert column.drift_ratio == pytest.approx(block.drift.rel_l2 / block.drift_check.threshold.value)
    assert view.drift_scale.startswith("drift / threshold 0 … ") and view.drift_scale.endswith("over 1: ▅ to █")


def test_the_headline_is_the_divergence_s_own(gelu_report):
    view = View.of(gelu_report)
    assert view.first.headline() == gelu_report.first_divergence.headline()
    assert view.first.where == "block 2 ffn"
    assert view.columns[view.column_of(view.first)].name == "block 2"


def test_a_report_and_its_saved_json_read_the_same(gelu_report, moe_report):
    for report in (gelu_report, moe_report):
        live, saved = View.of(report), View.of(json.loads(json.dumps(report.to_dict())))
        assert saved.columns == live.columns
        assert saved.moe == live.moe
        assert [d.headline() for d in saved.divergences] == [d.headline() for d in live.divergences]
    with pytest.raises(BlockdiffError, match="blockdiff.report/2"):
        View.of({"schema": "other/2"})


def test_non_finite_cells_say_how_many(ids):
    view = View.of(diff(tinylm.build(), bugs.nan_in_ffn(), ids, fast_path=True))
    cell = view.blocks[1].cells["ffn"]
    assert cell.diverged and cell.text.endswith(" non-finite") and int(cell.text.split()[0]) > 0
    assert view.blocks[0].cells["ffn"].status == "not_needed" and view.blocks[0].cells["ffn"].level == "none"


def test_moe_rows_two_per_block_with_the_block_s_own_figures_on_the_reference_row(moe_report):
    view = View.of(moe_report)
    assert len(view.moe) == 2 * len(moe_report.moe)
    for entry, (ref, cand) in zip(moe_report.moe, zip(view.moe[::2], view.moe[1::2])):
        assert (ref.side, cand.side) == ("ref", "cand") and ref.block == cand.block == entry["block"]
        assert ref.counts == entry["reference"]["counts"] and cand.counts == entry["candidate"]["counts"]
        assert len(ref.cells) == len(MOE_COLUMNS) - 1  # the counts are drawn, not text
        assert ref.cells[0] == str(entry["block"]) and cand.cells[0] == ""
        assert ref.agreement == f"{entry['agreement']['topk_agreement']:.1%}" and cand.agreement == ""
        assert ref.flips.endswith(" unexplained)") and cand.flips == ""
        assert ref.entropy == f"{entry['reference']['routing_entropy_norm']:.3f}"


def test_drop_rate_at_the_model_s_capacity_or_counterfactual():
    assert drop_rate({"capacity": 8, "assignment_drop_rate": 0.125}) == "12.5%"
    counterfactual = {"1.0": {"assignment_drop_rate": 0.25}, "1.25": {"assignment_drop_rate": 0.0}}
    assert drop_rate({"capacity": None, "counterfactual": counterfactual}) == "25.0% @cf1.0"
    assert drop_rate({"capacity": None, "counterfactual": {}}) == "—"
    assert drop_rate({"capacity": 8, "assignment_drop_rate": "nan"}) == "nan%"  # as JSON writes it


def test_two_dumps_compared_draw_drift_over_the_threshold_that_judged_it(tmp_path, ids):
    """Offline, the whole block's check is the drift, judged: the drift cell is it."""
    from blockdiff import run
    from blockdiff.engine import capture

    capture(tinylm.build(), ids, tmp_path / "ref.h5")
    capture(bugs.gelu_for_silu(block=2), ids, tmp_path / "cand.h5")
    view = View.of(run(str(tmp_path / "ref.h5"), str(tmp_path / "cand.h5")).to_dict())
    assert view.drift_only and view.drift_judged
    for column in view.columns:
        assert column.drift_cell.threshold == column.cells[WHOLE].threshold and column.drift_ratio is not None
        assert column.drift_cell.diverged == (column.drift > column.drift_threshold)
    assert view.drift_sparkline == "▁▁██"
