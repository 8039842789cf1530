"""Pictures of a report: the PNG (blockdiff.plot) and the self-contained HTML (blockdiff.html)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from blockdiff import BlockdiffError, diff, plot
from blockdiff import html as report_html
from blockdiff.view import View, ratio_colour
from samples import bugs, tinylm

# The PNG needs the `plot` extra; the HTML and the missing-matplotlib error do not.
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib: pip install -e '.[plot]'"
)

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DENSE_PANELS = ["local error / threshold", "drift per block"]
MOE_PANELS = [*DENSE_PANELS, "expert load"]


@pytest.fixture(scope="module")
def dense(gelu_report) -> dict:
    """GELU planted for SiLU in block 2's FFN, read back from a JSON file as `report` would."""
    return json.loads(json.dumps(gelu_report.to_dict()))


@pytest.fixture(scope="module")
def moe(moe_report) -> dict:
    return moe_report.to_dict()


@pytest.fixture(scope="module")
def clean(clean_report) -> dict:
    return clean_report.to_dict()


def panels(fig) -> list[str]:
    """Titles of the panels (colour bars are Axes too, but untitled)."""
    return [ax.get_title(loc="left") for ax in fig.axes if ax.get_title(loc="left")]


def _annotation() -> type:
    from matplotlib.text import Annotation

    return Annotation


def annotations(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts if isinstance(t, _annotation())]


# PNG ---------------------------------------------------------------------------------


@needs_matplotlib
def test_dense_png_has_two_panels_and_names_the_first_divergence(dense, tmp_path):
    fig = plot.figure(dense)
    assert panels(fig) == DENSE_PANELS
    (note,) = annotations(fig)
    assert "block 2 ffn" in note
    heatmap = fig.axes[0]
    marks = [t for t in heatmap.texts if t.get_text() == "X"]
    assert len(marks) == 2  # ffn and the whole block of block 2, nothing else

    from matplotlib import image as mpimg
    from PIL import Image  # a matplotlib dependency

    path = tmp_path / "report.png"
    plot.write_png(dense, path)
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 20_000
    pixels = mpimg.imread(path)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 600
    assert "block 2 ffn (blocks.2.ffn)" in Image.open(path).info["Description"]


@needs_matplotlib
def test_moe_png_adds_the_expert_load_panel(moe, tmp_path):
    fig = plot.figure(moe)
    assert panels(fig) == MOE_PANELS
    assert any("block 1 ffn" in a for a in annotations(fig))
    load = next(ax for ax in fig.axes if ax.get_title(loc="left") == "expert load")
    labels = [t.get_text() for t in load.get_yticklabels()]
    assert len(labels) == 2 * len(moe["moe"]) and labels[0] == "block 0 ref"
    counts = [int(t.get_text()) for t in load.texts]
    assert counts == [c for entry in moe["moe"] for side in ("reference", "candidate") for c in entry[side]["counts"]]
    plot.write_png(moe, tmp_path / "moe.png")
    assert (tmp_path / "moe.png").read_bytes()[:8] == PNG_MAGIC


@needs_matplotlib
def test_clean_png_annotates_nothing(clean):
    fig = plot.figure(clean)
    assert panels(fig) == DENSE_PANELS
    assert annotations(fig) == []
    assert "No divergence" in fig.get_suptitle()


def drift_thresholds(data: dict) -> dict[str, float]:
    """Each site's drift threshold as the JSON report holds it (``drift_check.threshold``),
    by the label the pictures give its column (a stage's name, a block's index)."""
    found = {s["stage"]: s["drift_check"]["threshold"] for s in data["stages"] if s.get("drift_check")}
    found.update({str(b["index"]): b["drift_check"]["threshold"] for b in data["blocks"] if b.get("drift_check")})
    return found


def drifts(data: dict) -> dict[str, float]:
    found = {s["stage"]: s["drift"]["rel_l2"] for s in data["stages"] if s.get("drift")}
    found.update({str(b["index"]): b["drift"]["rel_l2"] for b in data["blocks"] if b.get("drift")})
    return found


@needs_matplotlib
@pytest.mark.parametrize("name", ["clean", "dense", "moe"])
def test_png_draws_drift_against_its_own_threshold(name, request):
    data = request.getfixturevalue(name)
    expected = drift_thresholds(data)
    assert len(expected) == len(data["stages"]) + len(data["blocks"])  # every site's drift was judged
    ax = next(ax for ax in plot.figure(data).axes if ax.get_title(loc="left") == "drift per block")
    labels = [t.get_text() for t in ax.get_xticklabels()]
    (line,) = [line for line in ax.get_lines() if line.get_gid() == "drift-threshold"]
    assert dict(zip(labels, map(float, line.get_ydata()), strict=True)) == expected
    # Not the whole block's local-error threshold, which the panel drew before.
    whole = [c.threshold for c in View.of(data).columns]
    if name == "clean":
        assert list(line.get_ydata()) != whole
    # Each drift point coloured by its ratio to that threshold (the heatmap's colours).
    (points,) = [c for c in ax.collections if c.get_gid() == "drift"]
    from matplotlib.colors import to_hex

    measured = drifts(data)
    shown = [labels[round(x)] for x, _ in points.get_offsets()]
    colours = [to_hex(c) for c in points.get_facecolors()]
    assert colours == [ratio_colour(measured[site] / expected[site]) for site in shown]
    if name == "clean":  # "No divergence": every drift below its own line (the head's 1.1e-2 under 3.4e-2)
        assert all(measured[site] < expected[site] for site in expected)


@needs_matplotlib
def test_png_from_a_report_with_non_finite_values(ids, tmp_path):
    report = diff(tinylm.build(), bugs.nan_in_ffn(), ids, fast_path=True)
    report.write_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_divergence"]["value"] == "inf"
    (note,) = annotations(plot.figure(data))
    assert "block 1 ffn" in note and "non-finite" in note


@needs_matplotlib
def test_encoder_decoder_stages_stand_beside_their_own_blocks():
    pytest.importorskip("transformers")
    from samples import hf_families

    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    report = diff(hf_families.build(family="t5"), hf_families.cross_attention_bug(block=3), hf_families.inputs("t5", ids))
    data = report.to_dict()
    cols = View.of(data).columns
    assert [c.label for c in cols] == ["embed", "0", "1", "final_norm", "embed", "2", "3", "final_norm", "head"]
    assert [c.module for c in cols][3:5] == ["encoder.final_layer_norm", "decoder.embed_tokens"]
    fig = plot.figure(data)
    (note,) = [t for t in fig.axes[0].texts if isinstance(t, _annotation())]
    assert "block 3 attention" in note.get_text() and note.xy == (6, 0)  # decoder block 1, attention


def test_missing_matplotlib_is_a_clear_error(dense, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    message = re.escape("--plot needs matplotlib: pip install 'blockdiff[plot]'")
    with pytest.raises(BlockdiffError, match=message):
        plot.require_matplotlib()  # what the CLI checks before it runs the diff
    with pytest.raises(BlockdiffError, match=message):
        plot.write_png(dense, tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()
    # The HTML page does without: tables only.
    page = report_html.document(dense)
    assert "<img" not in page and "blockdiff[plot]" in page and "block 2 ffn" in page


def test_a_foreign_file_is_refused():
    with pytest.raises(BlockdiffError, match=r"expected a blockdiff.report/2 report \(or blockdiff.report/1\), found 'other/2'"):
        plot.write_png({"schema": "other/2"}, "never.png")
    with pytest.raises(BlockdiffError, match="blockdiff.report/2"):
        report_html.document([1, 2])


@needs_matplotlib
def test_docs_script_draws_the_sample_bug(tmp_path):
    from PIL import Image

    spec = importlib.util.spec_from_file_location("make_pictures", ROOT / "docs" / "make_pictures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.OUTPUT = tmp_path / "sample-bug.png"
    assert script.main() == tmp_path / "sample-bug.png"
    made = Image.open(tmp_path / "sample-bug.png")
    assert "block 1 ffn (blocks.1.ffn)" in made.info["Description"]
    committed = Image.open(ROOT / "docs" / "sample-bug.png")  # regenerate with the script if this fails
    assert committed.info["Description"] == made.info["Description"] and committed.size == made.size


# HTML --------------------------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Page(HTMLParser):
    """Walks the page: checks tags nest, keeps attributes, element texts by id, script data."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str | None]] = []
        self.errors: list[str] = []
        self.attributes: list[tuple[str, str, str]] = []  # (tag, name, value)
        self.text_by_id: dict[str, str] = {}
        self.scripts: list[tuple[dict, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += [(tag, name, value or "") for name, value in attrs]
        if tag in VOID:
            return
        self.stack.append((tag, dict(attrs).get("id")))
        if tag == "script":
            self.scripts.append((dict(attrs), ""))

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1][0] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] == "script":
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)
        for _, element_id in self.stack:
            if element_id:
                self.text_by_id[element_id] = self.text_by_id.get(element_id, "") + data


def parse(page: str) -> Page:
    parser = Page()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == [], (parser.errors, parser.stack)
    return parser


def embedded(parser: Page) -> dict:
    (script,) = [text for attrs, text in parser.scripts if attrs.get("id") == "blockdiff-report"]
    assert [attrs.get("type") for attrs, _ in parser.scripts] == ["application/json"]
    return json.loads(script)


def no_external_urls(page: str, parser: Page) -> None:
    for tag, name, value in parser.attributes:
        if name in ("src", "href"):
            assert value.startswith(("data:", "#")), f"<{tag} {name}={value[:40]!r}>"
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:|//)""", page, re.IGNORECASE)
    assert not re.search(r"https?://", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page


def test_html_is_balanced_self_contained_and_states_the_first_divergence(dense, tmp_path):
    path = tmp_path / "report.html"
    report_html.write_html(dense, path)
    page = path.read_text(encoding="utf-8")
    parser = parse(page)
    no_external_urls(page, parser)
    assert embedded(parser) == dense
    verdict = parser.text_by_id["verdict"]
    assert "First divergence" in verdict and "block 2 ffn (blocks.2.ffn)" in verdict
    assert page.index('id="verdict"') < page.index('id="heatmap"')  # stated near the top
    heat = parser.text_by_id["heatmap"]
    for name in ("attention", "ffn", "norm", "residual", "whole", "drift", "block 3", "head"):
        assert name in heat
    # ffn and the whole block of block 2, and drift over its own threshold from block 2 on.
    over = sum(entry["drift_check"]["diverged"] for entry in (*dense["stages"], *dense["blocks"]))
    assert over == 4 and heat.count("X") == 2 + over
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert ("img" in parser.tags) == has_matplotlib  # the inline figure when matplotlib is there


class Cells(HTMLParser):
    """The cells of the page's table of local errors and drift: per row, (attributes, text)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[tuple[dict, str]]] = []
        self.cell: tuple[dict, str] | None = None
        self.inside = False

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.inside = dict(attrs).get("id") == "heatmap"
        if self.inside and tag == "tr":
            self.rows.append([])
        if self.inside and tag == "td":
            self.cell = (dict(attrs), "")

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        if tag == "td" and self.cell is not None:
            self.rows[-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell = (self.cell[0], self.cell[1] + data)


@pytest.mark.parametrize("name", ["clean", "dense"])
def test_html_drift_column_is_judged_by_drift_s_own_threshold(name, request):
    data = request.getfixturevalue(name)
    parser = Cells()
    parser.feed(report_html.document(data, image=False))
    rows = [row for row in parser.rows if row]
    expected, measured = drift_thresholds(data), drifts(data)
    labels = [column.label for column in View.of(data).columns]
    assert len(rows) == len(labels) == len(expected)
    for label, row in zip(labels, rows):
        attrs, text = row[-1]  # the drift column
        assert "drift" in attrs["class"].split()
        assert float(attrs["data-threshold"]) == expected[label] and float(attrs["data-value"]) == measured[label]
        ratio = measured[label] / expected[label]
        assert attrs["style"].startswith(f"background:{ratio_colour(ratio)};")
        assert text.endswith(f"{ratio:.3g}x")  # its ratio, as the local errors show theirs
        assert ("X" in text) == (ratio > 1)


def test_html_of_a_moe_report_has_the_routing_table(moe):
    page = report_html.document(moe)
    parser = parse(page)
    no_external_urls(page, parser)
    assert embedded(parser) == moe
    table = parser.text_by_id["moe"]
    assert "tokens per expert" in table and "cand" in table
    assert "block 1 ffn (router" in parser.text_by_id["verdict"]


def test_html_of_a_clean_report(clean):
    parser = parse(report_html.document(clean, image=False))
    assert parser.text_by_id["verdict"].startswith("No divergence")
    assert "X" not in parser.text_by_id["heatmap"] and "img" not in parser.tags


def test_html_escapes_user_text(dense):
    # The divergent module renamed wherever the report names it (its checks, its
    # divergences): the page states the divergence from the checks.
    hostile = json.loads(json.dumps(dense).replace('"blocks.2.ffn"', '"blocks.2.<ffn>"'))
    assert hostile["first_divergence"]["module"] == "blocks.2.<ffn>"
    hostile["reference"]["model"] = "</script><script>alert(1)</script>"
    hostile["notes"] = ["<b>bold</b> & </script>"]
    page = report_html.document(hostile, image=False)
    assert "<script>alert" not in page and "<b>" not in page
    parser = parse(page)
    assert embedded(parser) == hostile  # the embedded JSON gives the strings back exactly
    assert "blocks.2.<ffn>" in parser.text_by_id["verdict"]
    assert sum(tag == "script" for tag in parser.tags) == 1
