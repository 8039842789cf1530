"""blockdiff.dumpfile: a candidate dump written from another runtime's arrays, read back by
blockdiff's own reader and compared by `blockdiff diff ref.h5 foreign.h5`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest
import torch

from blockdiff.dump import DumpReader
from blockdiff.dumpfile import (
    ForeignDumpWriter, TeacherForcedWriter, reference_inputs, reference_meta, reference_sites, run_path,
)
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
        assert dump.meta["schema_version"] == 4 and dump.meta["runtime"] == "numpy copy"
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


def _index(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        raw = f["index"][()]
        assert format(crc32c.crc32c(raw), "08x") == f["index"].attrs["crc32c"].decode()
        return json.loads(raw)


def test_foreign_dump_is_the_native_writers_layout(reference: Path, outputs: dict, tmp_path: Path):
    # Schema 4, as DumpWriter writes it: packed datasets and the JSON index. The reference's
    # own outputs written back give each site's output the reference's entry: the same
    # dtype, shape and CRC-32C, taken by the same code.
    path = write(tmp_path / "foreign.h5", reference, outputs)
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == 4 and f.attrs["torch_version"] == b""
        assert sorted(f) == ["index", "tensors"]
        assert all(name.startswith(("float32.", "int64.")) for name in f["tensors"])
    mine, theirs = _index(path), _index(reference)
    assert sorted(mine) == ["inputs", "sites", "tensors"]
    assert len(mine["sites"]) == len(theirs["sites"])
    key = ("stage", "block", "subpath", "module", "call", "ordinal", "order")
    by_site = {tuple(r[k] for k in key): r for r in theirs["sites"]}

    def output_entries(index, record):
        return [{k: index["tensors"][ref][k] for k in ("dtype", "shape", "count", "crc32c")}
                for ref in _refs(record["structure"]["output"])]

    for record in mine["sites"]:
        assert output_entries(mine, record) == output_entries(theirs, by_site[tuple(record[k] for k in key)])


def _refs(node):
    if node["type"] == "tensor":
        yield node["ref"]
    for item in node.get("items", ()):
        for part in item if isinstance(item, list) else [item]:
            yield from _refs(part)


def test_arrays_are_written_before_add_returns(reference: Path, outputs: dict, tmp_path: Path):
    # A runtime may reuse its output buffer (llama.cpp's callbacks do): what add was given is
    # what the dump holds. An array passed twice in one call is stored once.
    buffer = np.empty((2, 12, 64), np.float32)
    with ForeignDumpWriter(tmp_path / "reused.h5", reference=reference) as writer:
        writer.add_inputs(reference_inputs(reference))
        for site in writer.sites():
            out = outputs[(site.module, site.call)]
            if site.module.endswith(".ffn"):
                buffer[...] = out
                writer.add(site.module, buffer, call=site.call, args=(buffer,))
                buffer[...] = -1.0
            else:
                writer.add(site.module, out, call=site.call)
    with DumpReader(tmp_path / "reused.h5") as dump:
        for site in dump.iter_sites():
            if site.module.endswith(".ffn"):
                assert np.array_equal(site.output.numpy(), outputs[(site.module, site.call)])
                assert site.args[0] is site.output
    index = _index(tmp_path / "reused.h5")
    assert len(index["tensors"]) == sum(len(list(_refs(r["structure"]["output"]))) for r in index["sites"]) + 1


def test_a_failed_write_discards_the_dump(reference: Path, outputs: dict, tmp_path: Path, monkeypatch):
    import blockdiff.dump.packing as packing

    def failing(fd, views, offset, per_call):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(packing, "_pwrite_all", failing)
    path = tmp_path / "full.h5"
    with pytest.raises(DumpError, match=r"full\.h5: cannot write the inputs: OSError: .*No space left on device \(the dump was discarded\)"):
        with ForeignDumpWriter(path, reference=reference) as writer:
            writer.add_inputs(reference_inputs(reference))
    assert not list(tmp_path.iterdir())
    with pytest.raises(DumpError, match="the writer is closed"):
        writer.add("embed", outputs[("embed", 0)])


def _write_schema_3(path: Path, reference: Path, outputs: dict) -> None:
    """A foreign dump as blockdiff 0.4.1's ForeignDumpWriter wrote it (schema 3: a group per
    site, a dataset per array with its dtype, shape and CRC-32C), with plain h5py and the
    format's attribute helpers."""
    from blockdiff.dump.format import Link, digest, encode_meta, set_attr, tensor_crc32c

    links: dict[str, Link] = {}
    ref_meta = reference_meta(reference)
    with h5py.File(path, "w", libver=("v110", "v110")) as f:
        attrs = {"format": "blockdiff.dump", "schema_version": 3, "blockdiff_version": "0.4.1", "torch_version": "",
                 "created": "2025-06-01T12:00:00+00:00"}
        meta = {"model": "numpy copy", "class": "numpy copy (foreign dump)", "runtime": "numpy copy", "device": "cpu",
                "hook_map": ref_meta["hook_map"], "layout": ref_meta["layout"], "reference_dump": str(reference), "dtype": "float32"}
        encoded = {key: encode_meta(key, value) for key, value in meta.items()}
        attrs.update({key: stored for key, (stored, _) in encoded.items()})
        attrs["json_attributes"] = json.dumps([key for key, (_, is_json) in encoded.items() if is_json])
        root = {key: set_attr(f, key, value) for key, value in attrs.items()}

        def group(name: str, value, **record) -> None:
            arrays = value if isinstance(value, tuple) else (value,)
            g = f.create_group(name)
            for i, arr in enumerate(arrays):
                d = g.create_dataset(f"t{i}", data=arr.reshape(1) if arr.ndim == 0 else arr, chunks=arr.shape or (1,))
                stored = {"torch_dtype": arr.dtype.name, "shape": json.dumps(list(arr.shape)), "crc32c": tensor_crc32c(arr)}
                links[f"{name}/t{i}"] = Link("dataset", {k: set_attr(d, k, v) for k, v in stored.items()}, d.dtype.str, d.shape)
            nodes = [{"type": "tensor", "ref": f"t{i}"} for i in range(len(arrays))]
            node = {"type": "tuple", "items": nodes} if isinstance(value, tuple) else nodes[0]
            if record:
                node = {"args": {"type": "tuple", "items": []}, "kwargs": {"type": "dict", "items": []}, "output": node}
            links[name] = Link("group", {k: set_attr(g, k, v) for k, v in {**record, "structure": json.dumps(node)}.items()})

        f.create_group("sites")
        links["sites"] = Link("group", {})
        for n, site in enumerate(reference_sites(reference)):
            record = {k: getattr(site, k) for k in ("stage", "block", "subpath", "module", "call", "ordinal", "order")}
            group(f"sites/{n:06d}", outputs[(site.module, site.call)], **record)
        group("inputs", reference_inputs(reference))
        set_attr(f, "metadata_digest", digest(root, links))
        set_attr(f, "complete", True)


def test_a_schema_3_foreign_dump_still_reads_and_compares(reference: Path, outputs: dict, tmp_path: Path):
    # What ForeignDumpWriter wrote before it wrote schema 4 (blockdiff 0.4.1).
    path = tmp_path / "old.h5"
    _write_schema_3(path, reference, outputs)
    with DumpReader(path) as dump:
        assert dump.meta["schema_version"] == 3 and dump.meta["runtime"] == "numpy copy"
        assert dump.verify_all().sites == len(reference_sites(reference))
        for site in dump.iter_sites():
            want = outputs[(site.module, site.call)]
            got = tuple(t.numpy() for t in iter_tensors(site.output))
            assert all(np.array_equal(a, b) for a, b in zip(got, want if isinstance(want, tuple) else (want,)))
    assert [s.module for s in reference_sites(path)] == [s.module for s in reference_sites(reference)]
    assert np.array_equal(reference_inputs(path), reference_inputs(reference))
    assert run(str(reference), str(path)).first_divergence is None



# -- teacher-forced: the port's runs with the reference's values substituted


def port(writer: ForeignDumpWriter, outputs: dict, *, change=lambda module, out: out, **options) -> dict:
    """A port made of the reference's outputs (each through ``change``), each site's value
    passed through ``writer.substitute`` in execution order: what came back, by site."""
    got = {}
    for site in writer.sites():
        got[(site.module, site.call)] = writer.substitute(site.module, change(site.module, outputs[(site.module, site.call)]), **options)
    return got


def test_each_run_hands_the_port_the_reference_values_it_replaces(reference: Path, outputs: dict, tmp_path: Path):
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def to_bf16(module, out):
        return tuple(a.astype(ml_dtypes.bfloat16) for a in out) if isinstance(out, tuple) else out.astype(ml_dtypes.bfloat16)

    def shifted(module, out):  # the port's own values: the reference's, bfloat16, off by 1%
        return tuple(a * 1.01 for a in to_bf16(module, out)) if isinstance(out, tuple) else to_bf16(module, out) * 1.01

    path, handed = tmp_path / "port.h5", {}
    with TeacherForcedWriter(path, reference=reference, runtime="numpy port") as writer:
        writer.add_inputs(reference_inputs(reference))
        for dump in writer.runs():
            handed[dump.replacing] = port(dump, outputs, change=shifted)
    sites = {(s.module, s.call): s for s in reference_sites(reference)}
    for which, got in handed.items():
        for key, value in got.items():
            stage, subpath = sites[key].stage, sites[key].subpath
            replaced = {None: False, "every site": stage != "head", "block outputs": stage == "embed" or (stage == "block" and not subpath)}[which]
            want = to_bf16(key[0], outputs[key]) if replaced else shifted(key[0], outputs[key])
            for a, b in zip(value if isinstance(value, tuple) else (value,), want if isinstance(want, tuple) else (want,)):
                assert a.dtype == ml_dtypes.bfloat16 and np.array_equal(a, b), (which, key)
    assert handed.keys() == {"every site", "block outputs", None}
    # Three dumps, the free one at the path naming the others, each holding the inputs.
    linked = [DumpReader(run_path(path, which)) for which in ("free", "every site", "block outputs")]
    try:
        forced = [dump.meta["teacher_forced"] for dump in linked]
        assert [f["run"] for f in forced] == ["free", "every site", "block outputs"]
        assert len({f["id"] for f in forced}) == 1
        assert forced[0]["runs"] == {"every site": "port.every.h5", "block outputs": "port.blocks.h5", "free": "port.h5"}
        assert all(torch.equal(dump.inputs(), linked[0].inputs()) for dump in linked)
    finally:
        for dump in linked:
            dump.close()
    # Asked for another dtype, the reference's values come in it; calls are numbered by default.
    with ForeignDumpWriter(tmp_path / "f32.h5", reference=reference, replacing="every site") as dump:
        value = dump.substitute("blocks.0.ffn", to_bf16("", outputs[("blocks.0.ffn", 0)]), dtype="float32")
        assert value.dtype == np.float32 and np.array_equal(value, outputs[("blocks.0.ffn", 0)])
        assert ("blocks.0.ffn", 0) in dump.written


def test_a_teacher_forced_port_is_judged_by_local_errors(reference: Path, outputs: dict, tmp_path: Path):
    """Block 2's ffn off by 1% in every run: a local error there, nothing else blamed."""

    def off(module, out):
        return out * 1.01 if module == "blocks.2.ffn" else out

    path = tmp_path / "port.h5"
    with TeacherForcedWriter(path, reference=reference, runtime="numpy port") as writer:
        writer.add_inputs(reference_inputs(reference))
        for dump in writer.runs():
            port(dump, outputs, change=off)
    report = run(str(reference), str(path))
    first = report.first_divergence
    assert (first.block, first.subpath, first.check.key) == (2, "ffn", "module:block 2 ffn")
    assert [(d.block, d.subpath) for d in report.divergences] == [(2, "ffn")]
    assert report.blocks[2].subpaths["ffn"].status == "checked"


def test_a_site_the_port_leaves_out_is_not_judged_nor_what_it_feeds(reference: Path, outputs: dict, tmp_path: Path):
    """Block 1's ffn norm fused away (never written, so never substituted) and wrong by 1%:
    the ffn it feeds ran on the port's own value, so neither is judged; the block's check
    still sees the error, unattributed, and no sub-path of it or a neighbour is blamed."""

    def off(run, module, out):
        """The norm's error carried into the ffn; into the block's output unless the run
        handed the residual add the reference's ffn output (the run replacing every site)."""
        carried = ("blocks.1.ffn_norm", "blocks.1.ffn") + (("blocks.1",) if run != "every site" else ())
        return out * 1.01 if module in carried else out

    def fused(dump, change):
        for site in dump.sites():
            if site.module != "blocks.1.ffn_norm" or dump.replacing is None:
                dump.substitute(site.module, change(dump.replacing, site.module, outputs[(site.module, site.call)]), call=site.call)

    for name, change, blamed in (("clean", lambda r, m, o: o, None), ("buggy", off, (1, "unattributed"))):
        path = tmp_path / f"{name}.h5"
        with TeacherForcedWriter(path, reference=reference, runtime="numpy port") as writer:
            writer.add_inputs(reference_inputs(reference))
            for dump in writer.runs():
                fused(dump, change)
        report = run(str(reference), str(path))
        first = report.first_divergence
        assert (first and (first.block, first.subpath)) == blamed, name
        ffn = report.blocks[1].subpaths["ffn"]
        assert ffn.status == "not_judged" and report.blocks[0].subpaths["ffn"].status == "checked"
        assert any("no value for the input of block 1 ffn" in note for note in report.notes), report.notes
        assert not any(c.diverged for b in report.blocks for sub in b.subpaths.values() for c in sub.checks), name


def test_without_the_block_outputs_run_whole_blocks_are_not_judged(reference: Path, outputs: dict, tmp_path: Path):
    path = tmp_path / "every.h5"
    with TeacherForcedWriter(path, reference=reference, runtime="numpy port", runs=("every site",)) as writer:
        for dump in writer.runs():
            port(dump, outputs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["every.every.h5", "every.h5"]
    report = run(str(reference), str(path))
    assert report.first_divergence is None
    assert report.blocks[3].block is None and report.blocks[3].subpaths["ffn"].status == "checked"
    assert any("every.h5 was written without its run replacing block outputs" in note for note in report.notes)


def test_a_port_s_runs_are_written_together_or_not_at_all(reference: Path, outputs: dict, tmp_path: Path):
    path = tmp_path / "port.h5"
    with pytest.raises(ValueError, match="the port failed"):
        with TeacherForcedWriter(path, reference=reference) as writer:
            for n, dump in enumerate(writer.runs()):
                if n == 1:
                    raise ValueError("the port failed")
                port(dump, outputs)
    assert not list(tmp_path.iterdir()), "the first run's dump is removed with the rest"
    with pytest.raises(DumpError, match=r"the port's runs were not all written \(left: every site, block outputs, free\)"):
        with TeacherForcedWriter(path, reference=reference) as writer:
            for dump in writer.runs():
                port(dump, outputs)
                break
    assert not list(tmp_path.iterdir())


def test_a_port_s_runs_are_read_only_together(reference: Path, outputs: dict, tmp_path: Path):
    for name in ("a", "b"):
        with TeacherForcedWriter(tmp_path / f"{name}.h5", reference=reference) as writer:
            for dump in writer.runs():
                port(dump, outputs)
    with pytest.raises(DumpError, match=r"a.every.h5 is the run replacing every site of a port written teacher-forced: diff its free run, a.h5"):
        run(str(reference), str(tmp_path / "a.every.h5"))
    (tmp_path / "b.blocks.h5").replace(tmp_path / "a.blocks.h5")
    with pytest.raises(DumpError, match=r"a.blocks.h5 is not the run replacing block outputs written with .*a.h5 \(another writing's\)"):
        run(str(reference), str(tmp_path / "a.h5"))
    (tmp_path / "a.blocks.h5").unlink()
    with pytest.raises(DumpError, match=r"a.h5 names its run replacing block outputs, a.blocks.h5, which is not beside it"):
        run(str(reference), str(tmp_path / "a.h5"))


def test_an_engine_s_own_files_become_its_runs(reference: Path, tmp_path: Path):
    """docs/runtimes.md, "From an engine's own files": an engine outside Python reads the
    reference's values from `blockdiff export` (the manifest's sites, in order, and the runs
    that replace each), records its runs as safetensors files named by the export's keys,
    and a few lines of Python write the dumps. The engine here: block 2's ffn 1% off."""
    from safetensors.numpy import load_file, save_file

    from blockdiff.engine import run as diff  # `run` below is the documented lines' loop variable
    from blockdiff.export import export_safetensors

    manifest = export_safetensors(reference, tmp_path / "ref.safetensors")
    values = load_file(str(tmp_path / "ref.safetensors"))
    assert [s["order"] for s in manifest["sites"]] == sorted(s["order"] for s in manifest["sites"])
    by_module = {s["module"]: s for s in manifest["sites"]}
    assert by_module["blocks.1"]["replaced_in"] == ["every site", "block outputs"]
    assert by_module["blocks.1.ffn"]["replaced_in"] == ["every site"] and by_module["lm_head"]["replaced_in"] == []
    for run, name in (("every site", "every"), ("block outputs", "blocks"), (None, "free")):
        recorded = {}
        for site in manifest["sites"]:
            for key in site["outputs"]:  # what the engine computed there (the rotary tables: fused away)
                if site["module"] != "rotary" or run is None:
                    recorded[key] = values[key] * (1.01 if site["module"] == "blocks.2.ffn" else 1.0)
        save_file(recorded, str(tmp_path / f"{name}.safetensors"))

    # The documented lines, as they stand in docs/runtimes.md (paths made the test's own).
    recorded = {"every site": load_file(str(tmp_path / "every.safetensors")),
                "block outputs": load_file(str(tmp_path / "blocks.safetensors")),
                None: load_file(str(tmp_path / "free.safetensors"))}
    with TeacherForcedWriter(tmp_path / "port.h5", reference=reference, runtime="myengine 1.4 cpu") as w:
        w.add_inputs(reference_inputs(reference))
        for run in w.runs():
            values = recorded[run.replacing]
            for site in run.sites():
                found = [values[f"{site.module}#{site.call}/output/{i}"] for i in range(len(site.outputs))
                         if f"{site.module}#{site.call}/output/{i}" in values]
                if found:
                    run.add(site.module, found[0] if len(found) == 1 else tuple(found), call=site.call)

    report = diff(str(reference), str(tmp_path / "port.h5"))
    first = report.first_divergence
    assert (first.block, first.subpath, first.check.key) == (2, "ffn", "module:block 2 ffn")
    assert [(d.block, d.subpath) for d in report.divergences] == [(2, "ffn")]
    assert any("context: not judged: myengine 1.4 cpu exposes no value for context (rotary)" in n for n in report.notes)
