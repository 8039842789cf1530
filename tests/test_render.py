"""The terminal pictures: the compact heatmap and the drift sparkline, with and without colour."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from rich.console import Console

from blockdiff import diff
from blockdiff.render import ADVICE, render, render_heatmap
from blockdiff.view import SPARKS, View, ratio_sparkline, sparkline
from samples import bugs, tinylm

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROWS = ("attention", "ffn", "norm", "residual", "whole")


def plain(width: int = 120) -> Console:
    return Console(no_color=True, width=width, file=io.StringIO())


def output(console: Console) -> str:
    return console.file.getvalue()


def grid(text: str) -> dict[str, list[str]]:
    """Heatmap rows by name: their cells, one symbol per block (all chunks joined)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        name = line[2:13].strip()
        if line.startswith("  ") and name in (*ROWS, "drift"):
            cells = line[13:].split("   rel L2")[0]
            rows.setdefault(name, []).extend(cells.split(" ") if " " in cells.strip() else list(cells.strip()))
    return rows


def test_heatmap_marks_the_blamed_block_and_subpath_with_symbols(gelu_report):
    console = plain()
    render_heatmap(gelu_report, console)
    text = output(console)
    assert not ANSI.search(text)
    rows = grid(text)
    assert set(rows) == {*ROWS, "drift"}
    for name in ROWS:
        assert len(rows[name]) == 4
        expected = ["X" if block == 2 and name in ("ffn", "whole") else "·" for block in range(4)]
        assert rows[name] == expected, name
    assert "head ·" in text and "embed ·" in text
    assert "X diverged" in text  # the legend says what the symbols mean


def test_render_prints_heatmap_and_sparkline_after_the_first_divergence_and_keeps_the_table(gelu_report):
    console = plain()
    render(gelu_report, console)
    lines = output(console).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("First divergence"))
    # Under the headline, what the drill-down found (the sample's GELU is applied as a
    # function: no child module diverges), then the heatmap.
    assert lines[first + 1].startswith("  no child module diverges (3 checked)")
    assert lines[first + 2].startswith("local error / threshold:")
    drift = next(i for i, line in enumerate(lines) if line.startswith("  drift"))
    table = next(i for i, line in enumerate(lines) if "1.62e-01!" in line or "e-01!" in line)
    assert first < drift < table
    assert View.of(gelu_report).drift_sparkline in lines[drift].replace(" ", "")


def test_forced_colour_adds_ansi_codes_and_nothing_else(gelu_report):
    coloured = Console(force_terminal=True, color_system="truecolor", width=120, file=io.StringIO())
    render_heatmap(gelu_report, coloured)
    text = output(coloured)
    assert re.search(r"\x1b\[[0-9;]*3[18][;m]", text)  # red X (and other foreground colours)
    console = plain()
    render_heatmap(gelu_report, console)
    assert ANSI.sub("", text) == output(console)


def test_no_color_environment_keeps_symbols_without_colour_codes(gelu_report, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = Console(force_terminal=True, width=120, file=io.StringIO())
    assert console.no_color
    render_heatmap(gelu_report, console)
    text = output(console)
    assert not re.search(r"\x1b\[[0-9;]*(3[0-9]|9[0-7])[;m]", text)  # no foreground colour
    assert grid(ANSI.sub("", text))["ffn"] == ["·", "·", "X", "·"]


def test_clean_report_shows_no_x(clean_report):
    console = plain()
    render(clean_report, console)
    rows = grid(output(console))
    assert all(cell in ("·", "o") for name in ROWS for cell in rows[name])
    assert "X" not in "".join(line for line in output(console).splitlines() if line.startswith("  stages"))


def test_fast_path_and_head_bug_show_dashes_and_an_x_outside_blocks(ids):
    report = diff(tinylm.build(), bugs.head_untied_transposed(), ids, fast_path=True)
    console = plain()
    render_heatmap(report, console)
    text = output(console)
    rows = grid(text)
    assert all(cell == "-" for name in ("attention", "ffn", "norm", "residual") for cell in rows[name])
    assert rows["whole"] == ["·"] * 4
    stages = next(line for line in text.splitlines() if line.startswith("  stages"))
    assert "head X" in stages and "final_norm ·" in stages


def test_advice_closes_a_divergent_report_unless_left_out(gelu_report, clean_report):
    default, none, own = plain(200), plain(200), plain(200)
    render(gelu_report, default)
    render(gelu_report, none, advice=None)
    render(gelu_report, own, advice="next: bisect the commits")
    assert output(default).rstrip().splitlines()[-1] == ADVICE
    assert "next:" not in output(none) and output(default) == output(none) + ADVICE + "\n"
    assert output(own) == output(none) + "next: bisect the commits\n"
    nothing = plain(200)
    render(clean_report, nothing)  # nothing diverged: nothing to advise
    assert "next:" not in output(nothing)


def test_a_saved_report_renders_as_the_live_one(gelu_report):
    live, saved = plain(), plain()
    render(gelu_report, live)
    render(json.loads(json.dumps(gelu_report.to_dict())), saved)
    assert output(saved) == output(live)


def test_sparkline_draws_drift_over_its_own_threshold_on_a_fixed_scale(gelu_report, moe_report, clean_report):
    # Drift is exactly 0 before the bug (float32, same weights), then hundreds of times its threshold.
    assert View.of(gelu_report).drift_sparkline == SPARKS[0] * 2 + SPARKS[-1] * 2
    # The MoE router bug in block 1 (bfloat16): block 0's precision noise low, the bug's blocks high.
    moe = View.of(moe_report)
    line = moe.drift_sparkline
    assert len(line) == len(moe_report.blocks)
    for column, bar in zip(moe.blocks, line):
        assert (SPARKS.index(bar) >= 4) == (column.drift_ratio > 1), (column.block, column.drift_ratio, bar)
    assert SPARKS.index(line[0]) <= 3 and all(SPARKS.index(bar) >= 4 for bar in line[1:])
    # Clean bfloat16 noise (drift a third of its threshold, growing block by block) stays low:
    # the run's own scale drew it as a jump to the top.
    clean = View.of(clean_report)
    drifts = [column.drift for column in clean.blocks]
    assert drifts == sorted(drifts) and all(0.1 < column.drift_ratio < 0.5 for column in clean.blocks)
    assert clean.drift_sparkline == SPARKS[2] * 4
    assert SPARKS[-1] in sparkline(drifts)  # what the terminal drew before: noise at the top
    assert clean.drift_scale.startswith("drift / threshold 0.3")
    # The scale is fixed: a ratio draws the same bar whatever else the run holds.
    assert ratio_sparkline([0.32, 0.32]) == ratio_sparkline([0.32, 566.0])[:1] * 2
    assert ratio_sparkline([0.005, 0.05, 0.3, 0.7, 1.0, 2.0, 5.0, 50.0, 566.0]) == "▁▂▃▄▄▅▆▇█"
    assert ratio_sparkline([None, float("nan"), 0.0]) == "-!▁"
    # Drift not judged (two dumps compared): the drift itself on the run's own log scale.
    assert sparkline([1e-4, 1e-3, 1e-2, 1e-1, 1.0]) == "▁▃▅▆█"  # four decades over bars 0, 1.75, 3.5, 5.25, 7
    assert sparkline([0.006, 0.007, 0.008]) == "███"  # flat: no decade of spread to show
    assert sparkline([None, float("inf"), 0.0]) == "-!▁"


def test_many_blocks_wrap_with_every_block_once(ids):
    candidate = tinylm.build(blocks=24)
    candidate.blocks[17].ffn.act = torch.nn.functional.gelu  # gelu_for_silu, in a deeper model
    report = diff(tinylm.build(blocks=24), candidate, ids[:1, :8])
    console = plain(width=40)
    render_heatmap(report, console)
    text = output(console)
    rows = grid(text)
    assert all(len(rows[name]) == 24 for name in ROWS) and len(rows["drift"]) == 24
    assert rows["ffn"].index("X") == 17
    assert all(len(line) <= 40 for line in text.splitlines() if line[2:13].strip() in ROWS)



def divergent_cells(report) -> list[str]:
    """Every divergent table cell as it should print: its value and ``!``."""
    view = View.of(report)
    return [f"{cell.text}!" for column in view.columns for cell in column.cells.values() if cell.diverged]


@pytest.mark.parametrize("width", [80, 60])
@pytest.mark.parametrize("name", ["gelu_report", "moe_report"])
def test_narrow_terminals_print_every_value_whole(name, width, request):
    report = request.getfixturevalue(name)
    console = plain(width)
    render(report, console)
    text = output(console)
    expected = divergent_cells(report)
    assert expected and all(value in text for value in expected), (expected, text)
    for divergence in report.divergences:  # the report's own numbers, not only the view's
        assert f"{divergence.check.measured:.2e}!" in text
    cut = [line for line in text.splitlines() if "…" in line and "drift / threshold" not in line]  # the drift scale's own …
    assert cut == [], text
    assert all(len(line.rstrip()) <= width for line in text.splitlines())


def test_eighty_columns_keep_one_table_and_sixty_stack_it(gelu_report):
    def headers(width: int) -> list[list[str]]:
        console = plain(width)
        render(gelu_report, console)
        return [line.split() for line in output(console).splitlines() if line.split()[:1] == ["site"]]

    assert headers(120) == headers(80) == [["site", *ROWS, "drift"]]
    assert headers(60) == [["site", "attention", "ffn", "norm", "residual"], ["site", "whole", "drift"]]
    console = plain(60)
    render(gelu_report, console)
    rows = [line.split()[2:] for line in output(console).splitlines() if line.split()[:2] == ["block", "2"]]
    column = next(column for column in View.of(gelu_report).columns if column.block == 2)
    shown = {name: column.cells[name].text + ("!" if column.cells[name].diverged else "") for name in ROWS}
    # The bug's block once per stacked table: its sub-paths, then its whole block and drift.
    drift = f"{column.drift:.2e}" + ("!" if column.drift_cell.diverged else "")  # over drift's own threshold
    assert rows == [[shown[name] for name in ROWS[:4]], [shown["whole"], drift]] and drift.endswith("!")
    assert shown["ffn"].endswith("!") and shown["whole"].endswith("!")

def test_table_rows_follow_execution_order_across_stacks():
    """An encoder-decoder's table: the encoder's final norm before the decoder's blocks."""
    from rich.console import Console

    pytest.importorskip("transformers")
    from blockdiff import diff
    from blockdiff.render import render
    from samples import hf_families

    g = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=torch.randint(1, 100, (1, 8), generator=g), decoder_input_ids=torch.randint(1, 100, (1, 6), generator=g))
    report = diff(hf_families.build(family="t5"), hf_families.build(family="t5"), inputs)
    buffer = io.StringIO()
    render(report, Console(file=buffer, width=140, no_color=True))
    rows = []
    for line in buffer.getvalue().splitlines():
        words = line.split()
        # Table rows carry numbers (the heatmap's rows carry symbols).
        if words and words[0] in ("embed", "block", "final_norm", "head") and "e+" in line:
            rows.append(" ".join(words[:2]) if words[0] == "block" else words[0])
    assert rows == ["embed", "block 0", "block 1", "final_norm", "embed", "block 2", "block 3", "final_norm", "head"]


def test_moe_headline_names_the_part_in_words_and_the_json_keeps_it(moe_report):
    from dataclasses import replace

    from blockdiff.view import MOE_COUNTS
    from blockdiff.vocab import EXPERTS, ROUTER_WEIGHTS

    first = moe_report.first_divergence
    assert first.check.what == ROUTER_WEIGHTS and first.check.part == "router"
    assert first.headline().startswith("block 1 ffn (router weights, tokens whose top-k agree) (")
    experts = replace(first, check=replace(first.check, what=EXPERTS))
    assert experts.headline().startswith("block 1 ffn (experts, routing frozen at the reference's) (")
    console = plain(200)
    render(moe_report, console)
    text = output(console)
    assert f"First divergence: {first.headline()}" in text and "[router:" not in text
    # The table's two agreement columns are told apart, once, under it.
    words = " ".join(text.split())
    assert words.count(MOE_COUNTS) == 1 and words.index("top-k agree") < words.index(MOE_COUNTS)
    # The JSON is unchanged: part and what as the report holds them.
    data = moe_report.to_dict()["first_divergence"]
    assert (data["part"], data["what"]) == ("router", ROUTER_WEIGHTS)


# -- every line within the console's width


def test_shorten_keeps_the_file_name_and_factory():
    from blockdiff.render import shorten

    path = "/tmp/some/very/long/directory/name/for/a/model/file/tinylm.py:build"
    assert shorten(path, 200) == path
    short = shorten(path, 40)
    assert len(short) <= 40 and short.startswith("/tmp/") and short.endswith("/…/tinylm.py:build")
    assert shorten(path, 10) == "…/tinylm.py:build"  # never cut the file name and factory
    dotted = shorten("mypkg.models.very.deep.module:build", 24)
    assert len(dotted) <= 24 and dotted.endswith("….module:build")


def test_eighty_columns_fit_a_long_model_path_and_a_quantized_candidate(gelu_report):
    data = json.loads(json.dumps(gelu_report.to_dict()))
    long = "/tmp/some/very/long/directory/name/for/a/model/file/and/more/of/it/tinylm.py:build"
    data["reference"]["model"] = long
    data["candidate"]["quantization"] = "torch.ao dynamic quantized Linear in 29 modules"
    console = plain(80)
    render(data, console)
    lines = output(console).splitlines()
    assert [line for line in lines if len(line.rstrip()) > 80] == []
    reference, candidate, more, tolerance = lines[:4]
    # One line per side under aligned labels, the path's middle cut, its file name kept.
    assert reference.startswith("blockdiff reference /tmp/some/") and reference.endswith("…/tinylm.py:build (cpu, float32)")
    # The quantization it names wraps under the model, "(cpu, float32;" kept together.
    assert candidate.startswith("          candidate TinyLM (cpu, float32;") and more.startswith(" " * 20)
    assert " ".join((candidate + more).split()) == "candidate TinyLM (cpu, float32; torch.ao dynamic quantized Linear in 29 modules)"
    assert tolerance == "          tolerance fixed"
    wide = plain(400)
    render(data, wide)  # wide enough: the header in one line, the path whole
    assert output(wide).splitlines()[0].startswith(f"blockdiff reference {long} (cpu, float32) vs candidate ")


def test_wrapped_sentences_keep_commands_whole_and_leave_no_word_alone(gelu_report):
    for width in (60, 80, 120):
        console = plain(width)
        render(gelu_report, console)
        lines = output(console).splitlines()
        advice = lines[next(i for i, line in enumerate(lines) if line.startswith("next: ")) :]
        assert all(len(line) <= width for line in advice)
        assert "`blockdiff arch MODEL`" in "\n".join(advice)  # a quoted command is never split
        if len(advice) > 1:
            assert all(line.startswith("      ") for line in advice[1:])  # under "next: "
            assert len(advice[-1].split()) > 1, advice  # balanced: no word alone on the last line
    console = plain(60)
    render(gelu_report, console)
    text = output(console)
    for entry in ("· below 0.5", "o 0.5 to 1", "X diverged", "- not needed, absent or not judged"):
        assert any(entry in line for line in text.splitlines()), entry  # the legend's entries whole


@pytest.fixture(scope="module")
def ranked():
    from samples import quant

    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    return diff(quant.outlier(), quant.outlier_int8_dynamic(), ids, rank=True)


def test_the_ranking_fits_the_console_and_keeps_module_names_recognizable(ranked):
    from blockdiff.render import render_ranking

    for width in (120, 80, 60):
        console = plain(width)
        render_ranking(ranked, console, top=5)
        lines = output(console).splitlines()
        assert [line for line in lines if len(line) > width] == [], (width, lines)
        entries = [line for line in lines if re.match(r"\s+\d+\. ", line)]
        assert len(entries) == 5
        for entry, expected in zip(entries, ranked.ranking[:5], strict=True):
            module = expected["child"] or expected["module"]
            name = module.rsplit(".", 1)[-1]
            assert module in entry or ("…" in entry and name in entry), (width, entry)
            assert f"{expected['ratio']:.1f}x" in entry  # numbers never cut
    console = plain(120)
    render_ranking(ranked, console, top=5)
    assert output(console).splitlines()[0] == "ranking: local error over each check's threshold, worst 5 of " + str(len(ranked.ranking))
