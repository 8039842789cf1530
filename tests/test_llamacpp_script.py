"""samples/llamacpp_dump.py, the llama.cpp writer path, on its own half: tensor files in
llama.cpp's names and layout — written here from the PyTorch reference, since llama.cpp is
not built in these tests — converted into a dump that `blockdiff diff` compares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff.dump import DumpReader  # noqa: E402
from blockdiff.engine import capture, run  # noqa: E402
from samples import hf_llama, llamacpp_dump  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llamacpp") / "ref.h5"
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    capture(hf_llama.build(), ids, path)
    return path


def write_tensors(reference: Path, folder: Path, *, scale: dict[str, float]) -> Path:
    """What the eval callback writes: each mapped site's output as NAME.f32 (ggml order:
    ne0 = the last numpy dimension) and its ne line in shapes.txt."""
    folder.mkdir()
    lines = []
    with DumpReader(reference) as dump:
        for site in dump.iter_sites():
            name = llamacpp_dump.tensor_name(site.module)
            if name is None:
                continue
            arr = site.primary_output().numpy().reshape(-1, site.primary_output().shape[-1]) * scale.get(name, 1.0)
            arr.astype("<f4").tofile(folder / f"{name}.f32")
            lines.append(f"{name} {arr.shape[1]} {arr.shape[0]} 1 1")
    (folder / "shapes.txt").write_text("\n".join(lines) + "\n")
    return folder


def compared(reference: Path, tmp_path: Path, **scale: float) -> dict:
    """The JSON report of the converted tensors against the reference (``scale``: tensor
    name → a factor planted into that tensor)."""
    folder = write_tensors(reference, tmp_path / "tensors", scale=scale)
    out = tmp_path / "llamacpp.h5"
    llamacpp_dump.main([str(folder), str(reference), str(out), "--rope-theta", "10000", "--head-dim", "16"])
    return run(str(reference), str(out)).to_dict()


def test_tensors_in_llamacpp_layout_compare_clean(reference: Path, tmp_path: Path):
    report = compared(reference, tmp_path)
    assert (report["first_divergence"], report["divergences"]) == (None, [])
    # The rotary tables the script computes agree with the reference's to float32 rounding.
    context = next(s for s in report["stages"] if s["stage"] == "context")
    assert context["drift"]["rel_l2"] < 1e-6


def test_a_wrong_ffn_output_is_named(reference: Path, tmp_path: Path):
    first = compared(reference, tmp_path, **{"ffn_out-2": 1.05})["first_divergence"]
    assert (first["block"], first["subpath"], first["module"]) == (2, "ffn", "model.layers.2.mlp")


def test_names_cover_every_llama_site_but_the_rotary_tables(reference: Path):
    from blockdiff.dumpfile import reference_sites

    unnamed = [s.module for s in reference_sites(reference) if llamacpp_dump.tensor_name(s.module) is None]
    assert unnamed == ["model.rotary_emb"]
    assert llamacpp_dump.tensor_name("model.layers.3.mlp") == "ffn_out-3"
