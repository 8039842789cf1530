"""blockdiff.dumpfile: a candidate dump written from another runtime's arrays, read back by
blockdiff's own reader and compared by `blockdiff diff ref.h5 foreign.h5`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from blockdiff.dump import DumpReader
from blockdiff.dumpfile import ForeignDumpWriter, reference_inputs, reference_meta, reference_sites
from blockdiff.engine import capture, run
from blockdiff.errors import DumpError
from blockdiff.site import iter_tensors
from samples import tinylm
from tests.test_cli import ROOT, blockdiff_process


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """tinylm captured with its bfloat16 drift floors."""
    path = tmp_path_factory.mktemp("dumpfile") / "ref.h5"
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    capture(tinylm.build(), ids, path, floors=[(torch.bfloat16, "cpu")])
    return path


@pytest.fixture(scope="module")
def outputs(reference: Path) -> dict[tuple[str, int], object]:
    """Each reference site's output as numpy (an array, or a tuple of them)."""
    found = {}
    with DumpReader(reference) as dump:
        for site in dump.iter_sites():
            arrays = tuple(t.numpy() for t in iter_tensors(site.output))
            found[(site.module, site.call)] = arrays[0] if len(arrays) == 1 else arrays
    return found


def write(path: Path, reference: Path, outputs: dict, *, change=lambda module, out: out, **options) -> Path:
    """A foreign dump holding ``outputs`` (each passed through ``change``)."""
    with ForeignDumpWriter(path, reference=reference, runtime="numpy copy", **options) as writer:
        writer.add_inputs(reference_inputs(reference))
        for site in writer.sites():
            writer.add(site.module, change(site.module, outputs[(site.module, site.call)]), call=site.call)
    return path


def report_of(reference: Path, candidate: Path, tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    done = blockdiff_process("diff", str(reference), str(candidate), "--json", str(out))
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(out.read_text())


def test_importing_it_imports_no_torch():
    code = (
        "import sys, blockdiff.dumpfile\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_reference_helpers_list_sites_inputs_and_meta(reference: Path):
    sites = reference_sites(reference)
    assert [s.order for s in sites] == sorted(s.order for s in sites)
    assert [s.module for s in sites[:3]] == ["embed", "rotary", "blocks.0"]
    rotary = next(s for s in sites if s.module == "rotary")
    assert rotary.stage == "context" and rotary.outputs == ((12, 16), (12, 16))
    ffn = next(s for s in sites if s.module == "blocks.2.ffn")
    assert (ffn.stage, ffn.block, ffn.subpath, ffn.outputs) == ("block", 2, "ffn", ((2, 12, 64),))
    ids = reference_inputs(reference)
    assert ids.dtype == np.int64 and ids.shape == (2, 12)
    assert reference_meta(reference)["layout"]["blocks"][0]["subpaths"]["attention"] == ["blocks.0.attn"]


def test_reference_helpers_read_a_schema_3_dump_too():
    # tests/data/schema3.h5: written by blockdiff 0.3 (a group per site).
    path = ROOT / "tests" / "data" / "schema3.h5"
    sites = reference_sites(path)
    assert [s.order for s in sites] == sorted(s.order for s in sites) and len(sites) == 14
    head = next(s for s in sites if s.stage == "head")
    assert (head.module, head.outputs) == ("lm_head", ((6, 9),))
    assert reference_inputs(path).tolist() == [list(range(6))]
    assert reference_meta(path)["schema_version"] == 3


def test_foreign_dump_reads_back_through_blockdiffs_reader(reference: Path, outputs: dict, tmp_path: Path):
    path = write(tmp_path / "foreign.h5", reference, outputs)
    with DumpReader(path) as dump, DumpReader(reference) as ref:
        assert dump.meta["schema_version"] == 3 and dump.meta["runtime"] == "numpy copy"
        assert dump.meta["dtype"] == "float32" and dump.meta["hook_map"] == "tinylm"
        assert dump.verify_all().sites == len(reference_sites(reference))
        assert torch.equal(dump.inputs(), ref.inputs())
        mine = {s.key: s for s in dump.iter_sites()}
        for site in ref.iter_sites():
            got = mine[site.key]
            assert (got.module, got.order) == (site.module, site.order)
            assert all(torch.equal(a, b) for a, b in zip(iter_tensors(got.output), iter_tensors(site.output)))


def test_bfloat16_copy_is_judged_with_the_stored_floors_and_blames_nothing(reference, outputs, tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def to_bf16(module, out):
        return tuple(a.astype(ml_dtypes.bfloat16) for a in out) if isinstance(out, tuple) else out.astype(ml_dtypes.bfloat16)

    path = write(tmp_path / "bf16.h5", reference, outputs, change=to_bf16)
    with DumpReader(path) as dump:
        assert dump.meta["dtype"] == "bfloat16"
        assert next(dump.iter_sites()).output.dtype == torch.bfloat16
    code, report = report_of(reference, path, tmp_path)
    assert report["tolerance"]["floors"] == "stored bfloat16@cpu"
    assert (code, report["first_divergence"]) == (0, None)


def test_a_wrong_site_is_named(reference, outputs, tmp_path):
    """Block 2's attention output off by 1% (every other site as the reference's)."""
    path = write(tmp_path / "off.h5", reference, outputs, change=lambda m, out: out * 1.01 if m == "blocks.2.attn" else out)
    first = run(str(reference), str(path)).first_divergence
    assert (first.block, first.subpath, first.module) == (2, "attention", "blocks.2.attn")


def test_writer_refuses_what_would_not_pair(reference: Path, outputs: dict, tmp_path: Path):
    path = tmp_path / "bad.h5"
    with pytest.raises(DumpError, match="'blocks.9.attn' \\(call 0\\) is not a site"):
        with ForeignDumpWriter(path, reference=reference) as writer:
            writer.add("blocks.9.attn", outputs[("blocks.0.attn", 0)])
    with pytest.raises(DumpError, match=r"block 1 ffn \(blocks.1.ffn\): output has shape \[2, 12, 32\], the reference's \[2, 12, 64\]"):
        with ForeignDumpWriter(path, reference=reference) as writer:
            writer.add("blocks.1.ffn", np.zeros((2, 12, 32), np.float32))
    with pytest.raises(DumpError, match=r"23 sites of the reference were not written: embed \(embed\), context \(rotary\), block 0 \(blocks.0\)"):
        with ForeignDumpWriter(path, reference=reference) as writer:
            writer.add("blocks.0.attn", outputs[("blocks.0.attn", 0)])
    with pytest.raises(DumpError, match=r"cannot store a str\w* array"):
        with ForeignDumpWriter(path, reference=reference) as writer:
            writer.add("blocks.0.attn", np.array(["x"]))
    assert not list(tmp_path.glob("*bad.h5*")), "a refused dump leaves no file"
    (tmp_path / "other.h5").write_bytes(b"not hdf5")
    with pytest.raises(DumpError, match="cannot be opened as HDF5"):
        reference_sites(tmp_path / "other.h5")
