"""ONNX Runtime candidates: the sample model and a tiny Hugging Face Llama exported with the
dynamo exporter, localized through sub-graph experiments; bugs edited into the graph are
blamed on their exact block and sub-path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
onnx = pytest.importorskip("onnx")

from blockdiff.engine import RandomTokens, run  # noqa: E402
from blockdiff.errors import InputError, PairingError  # noqa: E402
from blockdiff.sides.onnx import OnnxModel, export_onnx, module_sites, node_scopes  # noqa: E402
from samples import onnx_bugs, tinylm  # noqa: E402
from tests.test_cli import blockdiff_process  # noqa: E402

BATCH, SEQ = 2, 12
IDS = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _llama():
    pytest.importorskip("transformers")
    from samples import hf_llama

    return hf_llama.build()


# name → (factory, block path, attention path, ffn path) of block 1 / block 2
MODELS = {
    "tinylm": (tinylm.build, "blocks.{}", "blocks.{}.attn", "blocks.{}.ffn"),
    "llama": (_llama, "model.layers.{}", "model.layers.{}.self_attn", "model.layers.{}.mlp"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each model (the reference) and its export, once per module."""
    folder = tmp_path_factory.mktemp("onnx")
    found = {}
    for name, (build, *_) in MODELS.items():
        model = build()
        found[name] = (model, export_onnx(model, IDS, folder / f"{name}.onnx"))
    return found


def blamed(report) -> tuple | None:
    first = report.first_divergence
    return None if first is None else (first.block, first.subpath)


@pytest.mark.parametrize("name", MODELS)
def test_clean_export_blames_nothing_and_capture_changes_nothing(exported, name):
    model, path = exported[name]
    candidate = OnnxModel(path)
    report = run(model, candidate, IDS)
    assert blamed(report) is None and not report.divergences
    # Real experiments ran on the graph: every block's sub-paths and residual were checked.
    for block in report.blocks:
        assert {k: v.status for k, v in block.subpaths.items()} == dict.fromkeys(["norm", "attention", "ffn", "residual"], "checked")
        assert block.subpaths["attention"].checks[0].measured < 1e-5
    # Recording every site as an extra graph output leaves the graph's own outputs bit for
    # bit (capture_changes_outputs, measured on every run, says so in a note).
    assert any("left the graph's outputs unchanged (bit for bit)" in note for note in report.notes)


EDITS = {
    "swap_activation": (lambda proto, blk, attn, ffn: onnx_bugs.swap_activation(proto, ffn.format(2)), (2, "ffn")),
    "scale_scores": (lambda proto, blk, attn, ffn: onnx_bugs.scale_scores(proto, attn.format(1)), (1, "attention")),
    "drop_residual": (lambda proto, blk, attn, ffn: onnx_bugs.drop_residual(proto, blk.format(1), attn.format(1)), (1, "residual")),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("edit", EDITS)
def test_bug_edited_into_the_graph_is_blamed_on_its_block_and_subpath(exported, name, edit):
    model, path = exported[name]
    plant, expected = EDITS[edit]
    edited = plant(onnx.load(str(path)), *MODELS[name][1:])
    report = run(model, OnnxModel(edited), IDS)
    assert blamed(report) == expected


def test_cli_diffs_an_onnx_file(exported, tmp_path):
    _, path = exported["tinylm"]
    bad = tmp_path / "gelu.onnx"
    onnx.save(onnx_bugs.swap_activation(onnx.load(str(path)), "blocks.2.ffn"), str(bad))
    out = tmp_path / "report.json"
    done = blockdiff_process("diff", "samples/tinylm.py:build", str(bad), "--seq", str(SEQ), "--seed", "5", "--json", str(out))
    assert done.returncode == 1, done.stderr
    first = json.loads(out.read_text())["first_divergence"]
    assert (first["block"], first["subpath"], first["module"]) == (2, "ffn", "blocks.2.ffn")
    assert json.loads(out.read_text())["candidate"]["class"] == "ONNX Runtime"


def test_inputs_of_another_shape_and_graphs_without_scopes_are_refused(exported):
    model, path = exported["tinylm"]
    with pytest.raises(InputError, match=r"static shape \[2, 12\], the inputs \[2, 8\]"):
        run(model, OnnxModel(path), RandomTokens(batch=2, seq=8))
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        del node.metadata_props[:]
    with pytest.raises(PairingError, match="has no module scopes"):
        module_sites(proto, ["embed"])


def test_an_onnx_candidate_without_onnxruntime_installed_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    from blockdiff.errors import ModelSpecError
    from blockdiff.sides.onnx import OnnxModel

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as where it is not installed
    with pytest.raises(ModelSpecError, match=r"needs the onnx and onnxruntime packages .*pip install 'blockdiff\[onnx\]'"):
        OnnxModel(tmp_path / "model.onnx")


def test_an_export_with_the_exporters_defaults_and_a_node_a_graph_editor_inserted(tmp_path):
    """The exporter's optimizer folds the constant-only rotary module away: an absent
    optional stage, said in the notes. A node inserted without module scope (a graph
    editor's) belongs to the module around it: scaling block 2's attention scores is blamed
    there, not taken for the block's output."""
    model = _llama()
    with torch.no_grad():
        program = torch.onnx.export(model.eval(), (IDS,), kwargs={"use_cache": False}, dynamo=True, verbose=False)
    path = tmp_path / "defaults.onnx"
    program.save(str(path))
    proto = onnx.load(str(path))
    clean = run(model, OnnxModel(proto), IDS)
    assert blamed(clean) is None and [s.stage for s in clean.stages] == ["embed", "final_norm", "head"]
    assert any(n.startswith("model.rotary_emb: no node of the ONNX graph belongs to it") for n in clean.notes)
    assert any(n.startswith("context: only the reference has this stage (model.rotary_emb)") for n in clean.notes)
    edited = onnx_bugs.scale_scores(proto, "model.layers.2.self_attn", scoped=False)
    assert not node_scopes(next(n for n in edited.graph.node if n.name.endswith("_planted_scale")))
    assert blamed(run(model, OnnxModel(edited), IDS)) == (2, "attention")
