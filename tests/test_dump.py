"""HDF5 dumps: lossless round trips, plain-h5py readability, atomic writes, damage detection."""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import crc32c
import h5py
import numpy as np
import pytest
import torch

from blockdiff.dump import DumpReader, DumpWriter
from blockdiff.errors import DumpError
from blockdiff.site import Opaque, Site, map_structure

ROOT = Path(__file__).resolve().parents[1]
META = {
    "model": "samples/tiny.py:build",
    "hook_map": "llama",
    "device": "cpu",
    "dtype": "float32",
    "input_digest": "ab12",
    "layers": 2,
    "eps": 1e-6,
    "config": {"heads": [4, 2], "rope": None},
}

Pair = collections.namedtuple("Pair", "first second")


def _site(stage="block", block=0, subpath="attention", module="layers.0.attn", *, call=0, ordinal=0, **kw):
    return Site(stage, block, subpath, module, call, ordinal, **kw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits as integers, so NaN payloads and signed zeros compare exactly."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    nan_payloads = torch.tensor(
        [0x7FC00001, 0x7F812345, 0xFFC0BEEF, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001], dtype=torch.int64
    ).to(torch.int32).view(torch.float32)
    return {
        "f32": torch.cat([torch.randn(9, generator=g), nan_payloads]).reshape(4, 4),
        "f16": torch.randn(3, 5, generator=g).half(),
        "bf16": torch.cat([torch.randn(6, generator=g), torch.tensor([float("nan"), -0.0, float("inf")])]).to(
            torch.bfloat16
        ),
        # every float8 bit pattern, NaNs included
        "f8e4m3": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16),
        "f8e5m2": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2),
        "i64": torch.tensor([torch.iinfo(torch.int64).min, -1, 0, torch.iinfo(torch.int64).max]),
        "bool": torch.tensor([[True, False, True]]),
        "scalar": torch.tensor(3.25),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "empty_bf16": torch.zeros(2, 0, 3, dtype=torch.bfloat16),
    }


def _write(path: Path, sites, *, inputs=None, meta=META, compress=None) -> Path:
    with DumpWriter(path, meta=meta, compress=compress) as writer:
        if inputs is not None:
            writer.add_inputs(inputs)
        for site in sites:
            writer.add(site)
    return path


def _model_sites() -> list[Site]:
    """A two-block run in the order capture writes it (when calls finish: a block's modules
    before the block), each site's ``order`` saying when its call started."""
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    sites = [_site("embed", None, None, "embed_tokens", args=(torch.arange(6),), output=rand(6, 4), order=0)]
    for i in range(2):
        start = 1 + 5 * i
        for n, (sub, ordinal) in enumerate((("norm", 0), ("attention", 0), ("norm", 1), ("ffn", 0))):
            module = f"layers.{i}.{sub}.{ordinal}"
            sites.append(
                _site(
                    "block", i, sub, module, ordinal=ordinal, args=(rand(6, 4),), output=rand(6, 4), order=start + 1 + n
                )
            )
        sites.append(_site("block", i, None, f"layers.{i}", args=(rand(6, 4),), output=rand(6, 4), order=start))
    sites.append(_site("final_norm", None, None, "norm", args=(rand(6, 4),), output=rand(6, 4), order=11))
    sites.append(_site("head", None, None, "lm_head", args=(rand(6, 4),), output=rand(6, 9), order=12))
    return sites


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0xFF]))


# --------------------------------------------------------------------------- round trips


def test_tensors_round_trip_bit_exact(tmp_path):
    tensors = _tensors()
    site = _site(args=tuple(tensors.values()), kwargs=dict(tensors), output=tensors["bf16"])
    path = _write(tmp_path / "d.h5", [site])
    with DumpReader(path) as dump:
        (site,) = dump.sites()
    assert len(site.args) == len(tensors)
    for got, (name, want) in zip(site.args, tensors.items()):
        _assert_same_tensor(got, want)
        _assert_same_tensor(site.kwargs[name], want)
    _assert_same_tensor(site.output, tensors["bf16"])
    assert site.args[_tensor_index("scalar")].dim() == 0
    assert site.args[_tensor_index("empty_bf16")].shape == (2, 0, 3)


def _tensor_index(name: str) -> int:
    return list(_tensors()).index(name)


def test_structures_and_plain_values_survive(tmp_path):
    x, y = torch.randn(2, 3), torch.randn(3)
    args = (x, None, True, False, 7, 2**70, 1.5, float("inf"), float("-inf"), float("nan"), -0.0, "héllo",
            Opaque("DynamicCache"), torch.bfloat16, torch.device("cpu"), [x, (y, None)], ())
    kwargs = {"attention_mask": y, "use_cache": False, "dtype": torch.float8_e4m3fn, "cache": Opaque("Cache")}
    output = Pair(x, {"logits": y, 3: [None, {"deep": (1, "two")}]})
    path = _write(tmp_path / "d.h5", [_site(args=args, kwargs=kwargs, output=output)])
    with DumpReader(path) as dump:
        (site,) = dump.sites()

    a = site.args
    assert type(a) is tuple and len(a) == len(args)
    _assert_same_tensor(a[0], x)
    assert a[1] is None and a[2] is True and a[3] is False
    assert type(a[4]) is int and a[4] == 7 and a[5] == 2**70
    assert type(a[6]) is float and a[6] == 1.5 and a[7] == math.inf and a[8] == -math.inf and math.isnan(a[9])
    assert a[10] == 0.0 and math.copysign(1.0, a[10]) == -1.0
    assert a[11] == "héllo"
    assert a[12] == Opaque("DynamicCache")
    assert a[13] is torch.bfloat16 and a[14] == torch.device("cpu")
    assert type(a[15]) is list and type(a[15][1]) is tuple and a[15][1][1] is None
    assert a[16] == ()
    # the same tensor object twice is stored once and comes back as one object
    assert a[15][0] is a[0]

    assert list(site.kwargs) == ["attention_mask", "use_cache", "dtype", "cache"]
    _assert_same_tensor(site.kwargs["attention_mask"], y)
    assert site.kwargs["use_cache"] is False and site.kwargs["dtype"] is torch.float8_e4m3fn
    assert site.kwargs["cache"] == Opaque("Cache")

    # a namedtuple comes back as a plain tuple of the same values
    out = site.output
    assert type(out) is tuple and len(out) == 2
    _assert_same_tensor(out[0], x)
    assert list(out[1]) == ["logits", 3]
    _assert_same_tensor(out[1]["logits"], y)
    assert out[1][3] == [None, {"deep": (1, "two")}]


def test_subclasses_of_plain_types_are_stored_as_their_base_type(tmp_path):
    # The writer encodes the plain types by their exact type first; their subclasses take
    # the general checks and must come back as before.
    import enum

    class Flag(enum.IntEnum):
        ON = 1

    class Name(str):
        pass

    class Options(dict):
        pass

    weight = torch.nn.Parameter(torch.randn(3))
    grad = torch.randn(2, 2, requires_grad=True) * 2  # not a leaf: recorded as its values
    args = (Flag.ON, Name("x"), Options(a=1), weight, grad, [True, 0])
    path = _write(tmp_path / "d.h5", [_site(args=args, output=weight)])
    with DumpReader(path) as dump:
        a = dump.sites()[0].args
        out = dump.sites()[0].output
    assert type(a[0]) is int and a[0] == 1
    assert type(a[1]) is str and a[1] == "x"
    assert type(a[2]) is dict and a[2] == {"a": 1}
    _assert_same_tensor(a[3], weight.detach())
    _assert_same_tensor(out, weight.detach())
    _assert_same_tensor(a[4], grad.detach())
    assert a[5] == [True, 0] and type(a[5][0]) is bool and type(a[5][1]) is int


def test_unknown_objects_are_stored_as_opaque(tmp_path):
    class Cache:
        pass

    path = _write(tmp_path / "d.h5", [_site(args=(torch.ones(2),), kwargs={"past": Cache()}, output=torch.ones(2))])
    with DumpReader(path) as dump:
        assert dump.sites()[0].kwargs["past"] == Opaque("Cache")


def test_site_attributes_order_and_blocks(tmp_path):
    sites = _model_sites()
    by_start = sorted(sites, key=lambda s: s.order)
    assert by_start != sites  # the test must tell written order from execution order
    inputs = {"input_ids": torch.arange(6).reshape(1, 6), "attention_mask": torch.ones(1, 6, dtype=torch.bool)}
    path = _write(tmp_path / "d.h5", sites, inputs=inputs)
    with DumpReader(path) as dump:
        assert len(dump) == len(sites)
        assert dump.block_indices() == [0, 1]
        block1 = dump.block_sites(1)
        assert [(s.subpath, s.ordinal, s.module, s.order) for s in block1] == [
            (None, 0, "layers.1", 6),
            ("norm", 0, "layers.1.norm.0", 7),
            ("attention", 0, "layers.1.attention.0", 8),
            ("norm", 1, "layers.1.norm.1", 9),
            ("ffn", 0, "layers.1.ffn.0", 10),
        ]
        assert [s.stage for s in dump.outside_sites()] == ["embed", "final_norm", "head"]
        assert dump.block_sites(7) == []
        got = dump.sites()
        def ident(s):
            return (s.key, s.module, s.call, s.order)

        assert [ident(s) for s in got] == [ident(s) for s in by_start]
        for g, w in zip(got, by_start):
            _assert_same_tensor(g.args[0], w.args[0])
            _assert_same_tensor(g.output, w.output)
        assert got[0].block is None and got[0].subpath is None
        assert got[1].block == 0 and got[1].subpath is None  # the block's own call
        read_inputs = dump.inputs()
        assert list(read_inputs) == ["input_ids", "attention_mask"]
        _assert_same_tensor(read_inputs["attention_mask"], inputs["attention_mask"])


def test_sites_without_order_keep_written_order(tmp_path):
    sites = [_site(block=i % 3, module=f"m{i}", args=(torch.full((2,), float(i)),)) for i in range(12)]
    with DumpReader(_write(tmp_path / "d.h5", sites)) as dump:
        assert [s.module for s in dump.sites()] == [f"m{i}" for i in range(12)]
        assert [s.module for s in dump.block_sites(1)] == ["m1", "m4", "m7", "m10"]


def test_inputs_absent_is_none_and_tensor_inputs(tmp_path):
    with DumpReader(_write(tmp_path / "a.h5", [_site(args=(torch.ones(1),))])) as dump:
        assert dump.inputs() is None
    ids = torch.tensor([[1, 2, 3]])
    with DumpReader(_write(tmp_path / "b.h5", [], inputs=ids)) as dump:
        _assert_same_tensor(dump.inputs(), ids)
        assert dump.sites() == [] and dump.block_indices() == []


def test_meta_round_trips_with_standard_attributes(tmp_path):
    path = _write(tmp_path / "d.h5", [_site(args=(torch.ones(1),))])
    with DumpReader(path) as dump:
        meta = dump.meta
    for key, value in META.items():
        assert meta[key] == value
    assert meta["format"] == "blockdiff.dump"
    assert meta["schema_version"] == 4
    assert meta["complete"] is True
    assert meta["torch_version"] == torch.__version__
    assert isinstance(meta["blockdiff_version"], str) and meta["blockdiff_version"]
    assert meta["created"][:4].isdigit() and "T" in meta["created"]
    assert len(meta["metadata_digest"]) == 64


@pytest.mark.parametrize("compress", ["lzf", "gzip"])
def test_compression_round_trips(tmp_path, compress):
    tensors = _tensors()
    path = _write(tmp_path / "d.h5", [_site(args=tuple(tensors.values()))], compress=compress)
    with h5py.File(path, "r") as f:
        for dset in f["tensors"].values():
            assert dset.compression == compress
            assert dset.fletcher32
    with DumpReader(path) as dump:
        (site,) = dump.sites()
    for got, want in zip(site.args, tensors.values()):
        _assert_same_tensor(got, want)


def test_verify_all_counts_everything(tmp_path):
    sites = _model_sites()
    path = _write(tmp_path / "d.h5", sites, inputs=torch.arange(6))
    with DumpReader(path) as dump:
        summary = dump.verify_all()
    assert summary.sites == len(sites)
    assert summary.tensors == 2 * len(sites) + 1
    assert summary.bytes == sum(s.args[0].nbytes + s.output.nbytes for s in sites) + torch.arange(6).nbytes


# --------------------------------------------------------------------------- plain h5py


def test_plain_h5py_reads_the_dump(tmp_path):
    tensors = _tensors()
    path = _write(tmp_path / "d.h5", _model_sites() + [_site(args=(tensors["bf16"],), output=tensors["f32"])])
    # Only h5py, numpy, json and crc32c from here, following docs/dump-format.md:
    # what someone without blockdiff has. Strings are fixed-length UTF-8 (bytes in h5py).
    def text(attrs, name):
        return attrs[name].decode("utf-8")

    with h5py.File(path, "r") as f:
        assert text(f.attrs, "format") == "blockdiff.dump"
        assert f.attrs["schema_version"] == 4
        assert bool(f.attrs["complete"]) is True
        assert text(f.attrs, "model") == META["model"]
        assert f.attrs["layers"] == 2
        assert json.loads(text(f.attrs, "config")) == META["config"]
        raw = f["index"][()]
        assert format(crc32c.crc32c(raw), "08x") == text(f["index"].attrs, "crc32c")
        index = json.loads(raw)

        def array(ref):
            t = index["tensors"][ref]
            data = f["tensors"][t["data"]][t["offset"] : t["offset"] + t["count"]]
            assert format(crc32c.crc32c(data.tobytes()), "08x") == t["crc32c"]
            return t, data.reshape(t["shape"])

        sites = index["sites"]
        assert len(sites) == 14
        embed = sites[0]
        assert [embed[k] for k in ("block", "stage", "subpath", "module")] == [-1, "embed", "", "embed_tokens"]
        attn = sites[2]
        assert [attn[k] for k in ("block", "stage", "subpath", "module", "order")] == [
            0, "block", "attention", "layers.0.attention.0", 3
        ]
        t, x = array(attn["structure"]["args"]["items"][0]["ref"])
        assert t["dtype"] == "float32" and x.dtype == np.float32 and x.shape == (6, 4)
        assert np.array_equal(x, _model_sites()[2].args[0].numpy())
        last = sites[-1]["structure"]
        t, bits = array(last["args"]["items"][0]["ref"])
        assert t["dtype"] == "bfloat16" and t["data"].split(".")[0] == "uint16" and bits.dtype == np.uint16
        assert np.array_equal(bits, tensors["bf16"].view(torch.int16).numpy().view(np.uint16))
        t, out = array(last["output"]["ref"])
        assert t["dtype"] == "float32" and out.dtype == np.float32
        assert np.array_equal(out.view(np.uint32), tensors["f32"].numpy().view(np.uint32))
        # Every element of the packed datasets belongs to exactly one tensor.
        for name, dset in f["tensors"].items():
            spans = sorted((t["offset"], t["count"]) for t in index["tensors"] if t["data"] == name)
            assert spans[0][0] == 0 and sum(c for _, c in spans) == dset.shape[0]
            assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_a_tensor_shared_by_two_sites_is_stored_once(tmp_path):
    sites = _model_sites()
    shared = sites[-2].output
    sites[-1].args = (shared,)  # the final norm's output is the head's input
    path = _write(tmp_path / "d.h5", sites)
    with h5py.File(path, "r") as f:
        index = json.loads(f["index"][()])
    head, norm = index["sites"][-1]["structure"], index["sites"][-2]["structure"]
    assert head["args"]["items"][0]["ref"] == norm["output"]["ref"]
    assert len(index["tensors"]) == 2 * len(sites) - 1
    with DumpReader(path) as dump:
        *_, norm_site, head_site = dump.sites()
        _assert_same_tensor(head_site.args[0], shared)
        _assert_same_tensor(norm_site.output, shared)


# --------------------------------------------------------------------------- atomic writes


def test_exception_inside_with_leaves_no_file(tmp_path):
    final = tmp_path / "d.h5"
    with pytest.raises(RuntimeError, match="boom"):
        with DumpWriter(final, meta=META) as writer:
            writer.add(_site(args=(torch.ones(3),)))
            assert writer.tmp_path.exists()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_nothing_at_final_path_until_close(tmp_path):
    final = tmp_path / "d.h5"
    writer = DumpWriter(final, meta=META)
    writer.add(_site(args=(torch.ones(3),)))
    assert not final.exists() and writer.tmp_path.exists()
    assert writer.tmp_path.parent == tmp_path and writer.tmp_path.name.startswith(".d.h5.tmp-")
    writer.close()
    assert final.exists() and not writer.tmp_path.exists()
    with pytest.raises(DumpError, match="closed"):
        writer.add(_site())


def test_sigkilled_writer_leaves_no_file(tmp_path):
    final = tmp_path / "d.h5"
    script = textwrap.dedent(
        """
        import sys, time, torch
        from blockdiff.dump import DumpWriter
        from blockdiff.site import Site
        with DumpWriter(sys.argv[1], meta={"model": "slow"}) as writer:
            i = 0
            while True:
                writer.add(Site("block", i, None, f"layers.{i}", 0, 0, args=(torch.randn(64),)))
                i += 1
                if i == 3:
                    print("ready", flush=True)
                time.sleep(0.01)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", script, str(final)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        tmp = tmp_path / f".d.h5.tmp-{proc.pid}"
        assert tmp.exists()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert not final.exists()
    # The leftover temporary file is never mistaken for a dump.
    with pytest.raises(DumpError):
        DumpReader(tmp).verify_all()


# --------------------------------------------------------------------------- errors


@pytest.fixture
def dump_path(tmp_path) -> Path:
    return _write(tmp_path / "d.h5", _model_sites(), inputs=torch.arange(6))


def test_missing_file(tmp_path):
    with pytest.raises(DumpError, match="no such file") as info:
        DumpReader(tmp_path / "nope.h5")
    assert info.value.path == str(tmp_path / "nope.h5")


def test_not_hdf5(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("just text\n" * 100)
    with pytest.raises(DumpError, match=r"notes\.h5 is not an HDF5 file"):
        DumpReader(path)


def test_foreign_hdf5(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
        f.attrs["format"] = np.arange(3)  # present but not ours
    with pytest.raises(DumpError, match=r"other\.h5 is an HDF5 file but not a blockdiff dump"):
        DumpReader(path)
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(DumpError, match="not a blockdiff dump"):
        DumpReader(path)


def test_newer_schema_version(dump_path):
    with h5py.File(dump_path, "r+") as f:
        f.attrs["schema_version"] = 6
    with pytest.raises(DumpError, match="has schema version 6; this blockdiff reads up to 5: upgrade blockdiff"):
        DumpReader(dump_path)


def test_incomplete_file(dump_path):
    with h5py.File(dump_path, "r+") as f:
        del f.attrs["complete"]
    with pytest.raises(DumpError, match=r"is incomplete \(the capture did not finish\)"):
        DumpReader(dump_path)


def test_truncated_file(dump_path):
    data = dump_path.read_bytes()
    dump_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DumpError, match="d.h5") as info:
        with DumpReader(dump_path) as dump:
            dump.verify_all()
    assert info.value.path == str(dump_path)


def _entry(f: h5py.File, site: int, part: str = "output") -> tuple[int, dict]:
    """The index entry of site ``site``'s output (or first argument): its ref and entry."""
    index = json.loads(f["index"][()])
    node = index["sites"][site]["structure"][part]
    ref = node["ref"] if part == "output" else node["items"][0]["ref"]
    return ref, index["tensors"][ref]


def test_flipped_byte_in_tensor_data_names_the_site(dump_path):
    with h5py.File(dump_path, "r") as f:
        _, entry = _entry(f, 4, "args")  # block 0 ffn
        dset = f["tensors"][entry["data"]]
        offset = dset.id.get_offset() + entry["offset"] * 4 + 5
    _flip_byte(dump_path, offset)
    with DumpReader(dump_path) as dump:
        dump.block_sites(1)  # other blocks still read
        with pytest.raises(DumpError, match=r"d\.h5: site sites\[4\] \(block 0 ffn, layers\.0\.ffn\.0\)") as info:
            dump.block_sites(0)
        assert info.value.site.startswith("sites[4]")
        with pytest.raises(DumpError, match=r"sites\[4\]"):
            dump.verify_all()


def test_large_tensors_are_verified_as_they_are_read(tmp_path, monkeypatch):
    # A tensor of 8 MiB or more is read in 4 MiB pieces, each piece's checksum taken on
    # another thread while the next is read: the same answer, the same damage caught.
    import blockdiff.dump.format as format_module

    pieces = []
    real = format_module._read_summing
    monkeypatch.setattr(format_module, "_read_summing", lambda *a: pieces.append(a[2].nbytes) or real(*a))
    big = torch.randn(3 * 2**20 + 5, generator=torch.Generator().manual_seed(7))  # 12 MiB and a bit
    path = _write(tmp_path / "d.h5", [_site(block=0, module="small", output=torch.ones(3)), _site(block=1, module="big", output=big)])
    _check_round_trip(path, [torch.ones(3), big])
    assert pieces and all(n == big.numel() * 4 for n in pieces)
    with h5py.File(path, "r") as f:
        index = json.loads(f["index"][()])
        entry = index["tensors"][1]
        at = f["tensors"][entry["data"]].id.get_offset() + entry["offset"] * 4 + 9 * 2**20 + 3  # in the third piece
    _flip_byte(path, at)
    with DumpReader(path) as dump:
        assert torch.equal(dump.block_sites(0)[0].output, torch.ones(3))
        with pytest.raises(DumpError, match=r"site sites\[1\] .*tensor 1 digest mismatch"):
            dump.block_sites(1)
    with DumpReader(path, verify=False) as dump:
        got = dump.block_sites(1)[0].output
        assert (got != big).sum() == 1


def test_a_read_failing_midway_through_a_large_tensor_is_a_dump_error(tmp_path, monkeypatch):
    # The read of a later piece fails while the checksum thread works on an earlier one:
    # the reader waits for that thread before it lets go of the array, and says which site.
    import blockdiff.dump.format as format_module

    big = torch.randn(3 * 2**20, generator=torch.Generator().manual_seed(8))  # 12 MiB
    path = _write(tmp_path / "d.h5", [_site(block=0, module="big", output=big)])
    real, calls = os.preadv, []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(format_module.os, "preadv", failing)
    with DumpReader(path) as dump:
        with pytest.raises(DumpError, match=r"site sites\[0\] .*Input/output error"):
            dump.block_sites(0)
    assert len(calls) == 2
    monkeypatch.setattr(format_module.os, "preadv", real)
    _check_round_trip(path, [big])


def test_damaged_inputs_are_named_by_every_read(tmp_path):
    path = _write(tmp_path / "d.h5", [_site(output=torch.ones(3))], inputs=torch.arange(1000.0))
    with h5py.File(path, "r") as f:
        index = json.loads(f["index"][()])
        ref = index["inputs"]["ref"]
        entry = index["tensors"][ref]
        at = f["tensors"][entry["data"]].id.get_offset() + entry["offset"] * 4 + 17
    _flip_byte(path, at)
    with DumpReader(path) as dump:
        for read in (dump.inputs, dump.verify_all):
            with pytest.raises(DumpError, match=rf"site /inputs cannot be read .*tensor {ref} digest mismatch"):
                read()


def test_changed_tensor_data_fails_digest(dump_path):
    # Rewritten through HDF5: only the tensor's CRC-32C catches it.
    with h5py.File(dump_path, "r+") as f:
        ref, entry = _entry(f, 3)
        dset = f["tensors"][entry["data"]]
        dset[entry["offset"]] = np.nextafter(dset[entry["offset"]], np.float32(np.inf))
    with DumpReader(dump_path) as dump:
        with pytest.raises(DumpError, match=rf"site sites\[3\] .*tensor {ref} digest mismatch: the file is damaged"):
            dump.block_sites(0)
        with pytest.raises(DumpError, match=r"sites\[3\]"):
            dump.verify_all()
    with DumpReader(dump_path, verify=False) as dump:
        assert len(dump.block_sites(0)) == 5


def _resign(f: h5py.File) -> None:
    """Write a new metadata digest and ``complete`` flag, as a writer would."""
    import blockdiff.dump as dump_module

    del f.attrs["complete"], f.attrs["metadata_digest"]
    f.attrs["metadata_digest"] = dump_module.metadata_digest(f)
    f.attrs["complete"] = True


SCHEMA_3 = ROOT / "tests" / "data" / "schema3.h5"  # written by blockdiff 0.3's DumpWriter


@pytest.fixture
def schema3_path(tmp_path) -> Path:
    path = tmp_path / "d3.h5"
    path.write_bytes(SCHEMA_3.read_bytes())
    return path


def test_schema_3_dump_is_still_read(schema3_path):
    # blockdiff 0.3 wrote a group per site, a dataset per tensor, hard links for shared ones.
    tensors = _tensors()
    with DumpReader(schema3_path) as dump:
        assert dump.meta["schema_version"] == 3
        assert dump.verify_all().sites == 14
        sites = dump.sites()
        _assert_same_tensor(dump.inputs(), torch.arange(6).reshape(1, 6))
    want = _model_sites()
    for got, site in zip(sites, sorted(want, key=lambda s: s.order)):
        assert (got.key, got.module, got.order) == (site.key, site.module, site.order)
    norm, head = (s for s in sites if s.stage in ("final_norm", "head"))
    _assert_same_tensor(head.args[0], norm.output)  # a hard link in the file
    last = sites[-1]
    assert last.module == "layers.1.ffn.1"
    for got, name in zip(last.args, ("bf16", "scalar", "empty_bf16")):
        _assert_same_tensor(got, tensors[name])
    _assert_same_tensor(last.output, tensors["f8e4m3"])


def _damage_site_3_and_expect_it_named(path: Path) -> None:
    """Change one element of site group 000003's tensor t1 (through HDF5); reading block 0
    must fail naming that group and tensor."""
    with h5py.File(path, "r+") as f:
        dset = f["sites/000003/t1"]
        dset[0, 0] = np.nextafter(dset[0, 0], np.float32(np.inf))
    with DumpReader(path) as dump:
        with pytest.raises(DumpError, match=r"site /sites/000003 .*tensor t1 digest mismatch: the file is damaged"):
            dump.block_sites(0)


def test_schema_3_damage_names_the_site_group(schema3_path):
    _damage_site_3_and_expect_it_named(schema3_path)


def test_schema_2_dump_without_floors_is_still_read(schema3_path):
    # blockdiff 0.2 wrote schema 2: schema 3 added the optional /floors group.
    with h5py.File(schema3_path, "r+") as f:
        f.attrs["schema_version"] = 2
        _resign(f)
    with DumpReader(schema3_path) as dump:
        assert dump.meta["schema_version"] == 2
        assert dump.floors() == {}
        assert dump.verify_all().tensors > 0


def test_schema_1_dump_with_zlib_crc32_is_still_read_and_verified(schema3_path):
    # blockdiff 0.1 wrote schema 1: the same layout with zlib's CRC-32 in ``crc32``.
    with h5py.File(schema3_path, "r+") as f:
        datasets = []
        f.visititems(lambda name, obj: datasets.append(obj) if isinstance(obj, h5py.Dataset) else None)
        for dset in datasets:
            if "crc32c" in dset.attrs:  # a hard-linked dataset is visited once
                del dset.attrs["crc32c"]
                crc = format(zlib.crc32(dset[()].tobytes()), "08x").encode()
                dset.attrs.create("crc32", np.array(crc, dtype=h5py.string_dtype("utf-8", 8)))
        f.attrs["schema_version"] = 1
        _resign(f)
    with DumpReader(schema3_path) as dump:
        assert dump.meta["schema_version"] == 1
        assert dump.verify_all().tensors > 0
        assert len(dump.block_sites(0)) == 5
    _damage_site_3_and_expect_it_named(schema3_path)


def _rewrite_index(f: h5py.File, index: dict, *, crc: bool = True) -> None:
    """Replace /index with ``index`` (and, with ``crc``, its matching checksum)."""
    data = json.dumps(index).encode()
    old_crc = f["index"].attrs["crc32c"]
    del f["index"]
    f["index"] = np.array(data, dtype=f"S{len(data)}")
    new = format(crc32c.crc32c(data), "08x").encode() if crc else old_crc
    f["index"].attrs.create("crc32c", np.array(new, dtype=h5py.string_dtype("utf-8", 8)))


def test_changed_attribute_or_index_fails_its_digest(dump_path, tmp_path):
    copy = tmp_path / "copy.h5"
    copy.write_bytes(dump_path.read_bytes())
    with h5py.File(dump_path, "r+") as f:
        f.attrs["model"] = "samples/tiny.py:other"
    with pytest.raises(DumpError, match="metadata digest mismatch: the file is damaged"):
        DumpReader(dump_path)
    # The index changed without its checksum: refused; with it, the digest covers the checksum.
    with h5py.File(copy, "r+") as f:
        index = json.loads(f["index"][()])
        index["sites"][2]["module"] = "layers.0.mlp"
        _rewrite_index(f, index, crc=False)
        _resign(f)
    with pytest.raises(DumpError, match="is damaged: ValueError: /index digest mismatch"):
        DumpReader(copy)
    with h5py.File(copy, "r+") as f:
        _rewrite_index(f, index)
    with pytest.raises(DumpError, match="metadata digest mismatch: the file is damaged"):
        DumpReader(copy)


def test_flipped_byte_in_site_name_is_detected(dump_path):
    data = dump_path.read_bytes()
    offset = data.index(b'"layers.0.ffn.0"')
    dump_path.write_bytes(data[:offset] + b'"layers.0.ffn.9"' + data[offset + 16 :])
    with pytest.raises(DumpError, match="d.h5"):
        with DumpReader(dump_path) as dump:
            dump.verify_all()


def test_damaged_index_is_a_dump_error(dump_path, tmp_path):
    copy = tmp_path / "copy.h5"
    copy.write_bytes(dump_path.read_bytes())
    # Past every checksum (a file re-signed by hand): bad JSON is a DumpError for the file,
    with h5py.File(dump_path, "r+") as f:
        raw = f["index"][()].decode()
        del f["index"]
        broken = raw[: len(raw) // 2].encode()
        f["index"] = np.array(broken, dtype=f"S{len(broken)}")
        f["index"].attrs.create("crc32c", np.array(format(crc32c.crc32c(broken), "08x").encode(), dtype=h5py.string_dtype("utf-8", 8)))
        _resign(f)
    with pytest.raises(DumpError, match=r"d\.h5 is damaged: JSONDecodeError"):
        DumpReader(dump_path)
    # a reference to no tensor a DumpError naming the site,
    with h5py.File(copy, "r+") as f:
        index = json.loads(f["index"][()])
        index["sites"][1]["structure"]["output"]["ref"] = 999
        _rewrite_index(f, index)
        _resign(f)
    with DumpReader(copy) as dump:
        with pytest.raises(DumpError, match=r"site sites\[1\] .*tensor 999 is not in the index"):
            dump.block_sites(0)
    # and entries that do not tile the packed data refuse the file.
    with h5py.File(copy, "r+") as f:
        index = json.loads(f["index"][()])
        index["tensors"][3]["offset"] += 1
        _rewrite_index(f, index)
        _resign(f)
    with pytest.raises(DumpError, match="the index does not tile it"):
        DumpReader(copy)


# --------------------------------------------------------------------------- writer misuse


def test_writer_rejects_bad_options(tmp_path):
    with pytest.raises(DumpError, match="compress must be None, 'lzf' or 'gzip'"):
        DumpWriter(tmp_path / "a.h5", meta={}, compress="zstd")
    with pytest.raises(DumpError, match="meta key 'format' is reserved"):
        DumpWriter(tmp_path / "a.h5", meta={"format": "mine"})
    with pytest.raises(DumpError, match=r"meta\['weights'\] cannot be stored"):
        DumpWriter(tmp_path / "a.h5", meta={"weights": object()})
    assert list(tmp_path.iterdir()) == []


def test_failed_add_leaves_no_partial_site(tmp_path):
    path = tmp_path / "d.h5"
    written_by_the_failed_site = torch.full((2,), 7.0)
    with DumpWriter(path, meta=META) as writer:
        writer.add(_site(args=(torch.ones(2),)))
        with pytest.raises(DumpError, match="only dense tensors"):
            writer.add(_site(block=1, args=(written_by_the_failed_site, torch.eye(3).to_sparse())))
        # Its dataset went with the failed site: the tensor is written again, not linked.
        writer.add(_site(block=2, args=(torch.zeros(2), written_by_the_failed_site)))
    with DumpReader(path) as dump:
        assert dump.block_indices() == [0, 2]
        assert dump.verify_all().tensors == 3
        assert torch.equal(dump.block_sites(2)[0].args[1], written_by_the_failed_site)


def _fingerprint(path: Path) -> list:
    """Everything a reader returns, tensors as (dtype, shape, bits)."""

    def tensor(t):
        return (str(t.dtype), tuple(t.shape), _bits(t).flatten().tolist())

    with DumpReader(path, probe=False) as dump:
        out = [sorted((k, repr(v)) for k, v in dump.meta.items()), map_structure(dump.inputs(), tensor)]
        for s in dump.sites():
            structures = [map_structure(x, tensor) for x in (s.args, s.kwargs, s.output)]
            out.append((s.key, s.module, s.call, s.order, *structures))
        dump.verify_all()
    return out


def test_flipped_metadata_bytes_never_pass_silently(tmp_path):
    sites = _model_sites()[:3]
    path = _write(tmp_path / "d.h5", sites, inputs=torch.arange(4))
    want = _fingerprint(path)
    with h5py.File(path, "r") as f:
        chunks = []  # where tensor data lies: chunks, and contiguous datasets' storage

        def data(name, obj):
            if isinstance(obj, h5py.Dataset) and obj.chunks:
                chunks.extend(
                    (obj.id.get_chunk_info(i).byte_offset, obj.id.get_chunk_info(i).size)
                    for i in range(obj.id.get_num_chunks())
                )
            elif isinstance(obj, h5py.Dataset) and name.startswith("tensors/") and obj.id.get_offset() is not None:
                chunks.append((obj.id.get_offset(), obj.id.get_storage_size()))

        f.visititems(data)
    in_data = np.zeros(path.stat().st_size, dtype=bool)
    for offset, size in chunks:
        in_data[offset : offset + size] = True
    metadata = np.flatnonzero(~in_data)
    positions = metadata[:: max(1, len(metadata) // 80)]
    original = path.read_bytes()
    detected = 0
    for pos in positions:
        damaged = bytearray(original)
        damaged[pos] ^= 0xFF
        path.write_bytes(damaged)
        try:
            got = _fingerprint(path)
        except DumpError:
            detected += 1
        else:
            assert got == want, f"byte {pos} changed what the dump reads as, undetected"
    # Most of an HDF5 file's metadata bytes matter; unused padding may flip harmlessly.
    assert detected > len(positions) // 2


# --------------------------------------------------------------------------- durability


@pytest.mark.parametrize("durable", [False, True])
def test_only_a_durable_dump_is_flushed_to_disk(tmp_path, monkeypatch, durable):
    import blockdiff.dump.packing as packing

    flushed = []
    real = packing._fsync
    monkeypatch.setattr(packing, "_fsync", lambda path: (flushed.append(Path(path)), real(path)))
    path = tmp_path / "d.h5"
    with DumpWriter(path, meta=META, durable=durable) as writer:
        writer.add(_site(args=(torch.ones(3),)))
    # durable: the file before its rename, then the folder that holds the new name.
    assert flushed == ([tmp_path / ".d.h5.tmp-{}".format(os.getpid()), tmp_path] if durable else [])
    with DumpReader(path) as dump:
        assert torch.equal(dump.sites()[0].args[0], torch.ones(3))


def test_capture_fsync_flag_makes_a_durable_dump(tmp_path, monkeypatch, capsys):
    import blockdiff.dump.packing as packing
    from tests.conftest import run_cli

    flushed = []
    monkeypatch.setattr(packing, "_fsync", flushed.append)
    out = tmp_path / "ref.h5"
    code, _, err = run_cli(["capture", "samples/tinylm.py:build", "--out", str(out), "--fsync"], capsys)
    assert code == 0, err
    assert flushed[-1] == tmp_path and out.exists()
    flushed.clear()
    code, _, err = run_cli(["capture", "samples/tinylm.py:build", "--out", str(tmp_path / "plain.h5")], capsys)
    assert code == 0 and flushed == [], err


def test_a_file_that_cannot_be_created_fails_the_writer(tmp_path):
    # The folder is fine (checked first); libhdf5 fails on the writer's thread, where the
    # file is created while the caller waits: the constructor raises it.
    (tmp_path / f".d.h5.tmp-{os.getpid()}").mkdir()
    with pytest.raises(DumpError, match=r"d\.h5: cannot create the dump: "):
        DumpWriter(tmp_path / "d.h5", meta=META)
    assert not (tmp_path / "d.h5").exists() and (tmp_path / f".d.h5.tmp-{os.getpid()}").is_dir()
    with pytest.raises(DumpError, match="the folder .* does not exist"):
        DumpWriter(tmp_path / "nowhere" / "d.h5", meta=META)


def test_a_tensor_changed_in_place_before_the_writer_copied_it_fails_the_dump(tmp_path):
    import threading

    from blockdiff.errors import TensorChanged

    path = tmp_path / "d.h5"
    writer = DumpWriter(path, meta=META)
    gate = threading.Event()
    writer._worker.submit(gate.wait)  # the writer's thread is busy until the gate opens
    held = torch.zeros(4, 8)
    writer.add(_site(output=held))
    held.add_(1.0)  # the model writes into the tensor it returned, before the thread copied it
    writer._hand_over()
    gate.set()
    with pytest.raises(TensorChanged, match=r"sites\[0\] .*changed in place before it was written"):
        writer.close()
    assert not path.exists() and not list(tmp_path.iterdir())


def _writer_sites(seed: int = 5) -> tuple[list[Site], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=g) for n in (3, 2**18 + 1, 7 * 2**18, 1000)] + [torch.zeros(0, 4)]
    return [_site(block=i, module=f"m{i}", output=t) for i, t in enumerate(tensors)], tensors


def _check_round_trip(path: Path, tensors: list[torch.Tensor]) -> None:
    with DumpReader(path) as dump:
        assert dump.verify_all().tensors == len(tensors)
        for i, want in enumerate(tensors):
            _assert_same_tensor(dump.block_sites(i)[0].output, want)


def test_contiguous_data_survives_short_writes(tmp_path, monkeypatch):
    # The writer writes the bytes itself: a write that takes fewer bytes than asked (which
    # POSIX allows) is continued where it stopped, mid-tensor and at tensor boundaries.
    import blockdiff.dump.packing as packing

    real, calls = os.pwritev, []

    def short(fd, buffers, offset):
        calls.append(len(buffers))
        head = [memoryview(b)[:100_003] for b in buffers[:1]]
        return real(fd, head, offset)

    monkeypatch.setattr(packing.os, "pwritev", short)
    sites, tensors = _writer_sites()
    _check_round_trip(_write(tmp_path / "d.h5", sites), tensors)
    assert len(calls) > 80  # 9 MiB, 100 kB at a time


def test_without_pwrite_libhdf5_writes_the_data(tmp_path, monkeypatch):
    # Where the platform has no pwrite (or libhdf5 gives no file descriptor), the bytes go
    # through libhdf5: the same dump.
    import blockdiff.dump.packing as packing

    monkeypatch.delattr(packing.os, "pwrite")
    monkeypatch.delattr(packing.os, "pwritev")
    sites, tensors = _writer_sites(6)
    path = _write(tmp_path / "d.h5", sites)
    _check_round_trip(path, tensors)
    with h5py.File(path, "r") as f:
        assert all(d.chunks is None for d in f["tensors"].values())


def test_datasets_are_allocated_at_once(tmp_path, monkeypatch):
    # A dataset of 1 MiB or more is allocated on disk (os.posix_fallocate) before it is
    # written, as numpy.tofile does; a smaller one is not. The call may grow the file to
    # the dataset's end: libhdf5 allocated that range and every byte of it is written, so
    # the dump's size and bytes are those of a dump written without it.
    import blockdiff.dump.packing as packing

    real, calls = os.posix_fallocate, []

    def allocate(fd, offset, n):
        calls.append((offset, n))
        real(fd, offset, n)

    monkeypatch.setattr(packing.os, "posix_fallocate", allocate)
    small = _write(tmp_path / "small.h5", [_site(output=torch.ones(1000))])
    assert calls == []
    _check_round_trip(small, [torch.ones(1000)])
    big = torch.arange(5 * 2**20, dtype=torch.float32)  # 20 MiB
    sites = [_site(block=0, module="small", output=torch.ones(3)), _site(block=1, module="big", output=big)]
    path = _write(tmp_path / "d.h5", sites)
    _check_round_trip(path, [torch.ones(3), big])
    with h5py.File(path, "r") as f:
        (dset,) = f["tensors"].values()  # one batch: both tensors
        assert calls == [(dset.id.get_offset(), (3 + big.numel()) * 4)]
        assert dset.id.get_offset() % 4096 == 0  # tensor data starts on a page
        start, end = dset.id.get_offset(), dset.id.get_offset() + (3 + big.numel()) * 4
    data = path.read_bytes()
    assert data[start:end] == np.ones(3, np.float32).tobytes() + big.numpy().tobytes()
    # Without the call (a platform without it: macOS), and with a filesystem that refuses
    # it: the same layout, size and tensor bytes.
    monkeypatch.delattr(packing.os, "posix_fallocate")
    plain = _write(tmp_path / "plain.h5", sites)

    def refusing(fd, offset, n):
        calls.append((offset, n))
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(packing.os, "posix_fallocate", refusing, raising=False)  # deleted above
    refused = _write(tmp_path / "refused.h5", sites)
    assert len(calls) == 2
    for other in (plain, refused):
        _check_round_trip(other, [torch.ones(3), big])
        with h5py.File(other, "r") as f:
            assert [d.id.get_offset() for d in f["tensors"].values()] == [start]
        assert other.stat().st_size == len(data) and other.read_bytes()[start:end] == data[start:end]


def test_write_calls_are_2_mib_at_most_and_datasets_are_allocated_where_placed(tmp_path, monkeypatch):
    # The writer's thread writes in calls of 2 MiB at most; each dataset of 1 MiB or more is
    # allocated on disk by the caller when it is placed, before any of it is written, and
    # the thread does not allocate again (docs/performance.md).
    import threading

    import blockdiff.dump.packing as packing

    real_write, real_allocate, events = os.pwritev, os.posix_fallocate, []

    def pwritev(fd, buffers, offset):
        events.append(("write", threading.current_thread().name, offset, sum(len(b) for b in buffers)))
        return real_write(fd, buffers, offset)

    def posix_fallocate(fd, offset, nbytes):
        events.append(("allocate", threading.current_thread().name, offset, nbytes))
        return real_allocate(fd, offset, nbytes)

    monkeypatch.setattr(packing.os, "pwritev", pwritev)
    monkeypatch.setattr(packing.os, "posix_fallocate", posix_fallocate, raising=False)
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(2**20, generator=g) for _ in range(3)] + [torch.randn(5 * 2**18 + 3, generator=g), torch.ones(5)]
    path = tmp_path / "d.h5"
    with DumpWriter(path, meta=META) as writer:
        for i, t in enumerate(tensors):
            writer.add(_site(block=i, module=f"m{i}", output=t))
    _check_round_trip(path, tensors)
    writes = [e for e in events if e[0] == "write"]
    assert {name for _, name, _, _ in writes} == {"blockdiff-dump_0"}
    assert max(size for *_, size in writes) == 2 * 2**20
    assert sum(size for *_, size in writes) == sum(t.numel() * 4 for t in tensors)
    with h5py.File(path, "r") as f:
        datasets = sorted((d.id.get_offset(), d.id.get_storage_size()) for d in f["tensors"].values())
    allocated = [(offset, nbytes) for kind, name, offset, nbytes in events if kind == "allocate"]
    if hasattr(os, "posix_fallocate"):
        assert allocated == [(o, n) for o, n in datasets if n >= 2**20]
        assert {name for kind, name, *_ in events if kind == "allocate"} == {threading.main_thread().name}
        for offset, nbytes in allocated:  # allocated before its first write
            first_write = next(i for i, e in enumerate(events) if e[0] == "write" and offset <= e[2] < offset + nbytes)
            assert events.index(("allocate", threading.main_thread().name, offset, nbytes)) < first_write


@pytest.mark.parametrize("compress", [None, "lzf"])
def test_tensors_across_chunk_boundaries_round_trip(tmp_path, compress):
    # Whole 1 MiB chunks straight from a tensor, partial ones through the staging buffer,
    # a tensor starting mid-chunk and spanning three, the last chunk partial; two dtypes
    # interleaved (each its own dataset); more than the 8 MiB handed over at a time.
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(1000, generator=g),
        torch.randn(3 * 2**18 + 17, generator=g),  # 3 chunks and a bit, from mid-chunk
        torch.randn(2**18, generator=g).to(torch.bfloat16),
        torch.randn(2**18, generator=g),  # exactly one chunk's elements, not aligned
        torch.randn(9 * 2**18, generator=g),  # 9 MiB
        torch.randn(5, generator=g).to(torch.bfloat16),
    ]
    sites = [_site(block=i, module=f"m{i}", output=t) for i, t in enumerate(tensors)]
    path = _write(tmp_path / "d.h5", sites, compress=compress)
    with DumpReader(path) as dump:
        assert dump.verify_all().tensors == len(tensors)
        for i, want in enumerate(tensors):
            _assert_same_tensor(dump.block_sites(i)[0].output, want)
    with h5py.File(path, "r") as f:
        lengths: dict[str, list[int]] = {}
        for name, dset in f["tensors"].items():
            lengths.setdefault(name.split(".")[0], []).append(dset.shape[0])
            assert (dset.chunks is not None) == (compress is not None)  # compressed: chunked
        assert sum(lengths["float32"]) == sum(t.numel() for t in tensors if t.dtype == torch.float32)
        assert sum(lengths["uint16"]) == 2**18 + 5
        if compress:  # one dataset per dtype, appended to
            assert sorted(f["tensors"]) == ["float32", "uint16"]
        else:  # one per dtype per batch handed to the writer's thread: 1 MiB first, then 8 MiB
            assert sorted(f["tensors"]) == ["float32.0", "float32.1", "uint16.0", "uint16.1"]


def test_meta_changed_before_close_is_what_the_dump_records(tmp_path):
    path = tmp_path / "d.h5"
    with DumpWriter(path, meta=META) as writer:
        writer.add(_site(args=(torch.ones(2),)))
        writer.meta["ranks"] = 2
        writer.meta["layers"] = 3
    with DumpReader(path) as dump:  # the metadata digest covers them too
        assert dump.meta["ranks"] == 2 and dump.meta["layers"] == 3 and dump.meta["model"] == META["model"]


def test_the_files_end_is_encoded_by_the_caller_while_the_thread_writes(tmp_path, monkeypatch):
    # At close the caller encodes the index, the meta, the headers, the digest and the
    # superblock (PackedFile.prepare) while the writer's thread writes the last batch; the
    # thread then only writes them. The file reads as one written by the thread alone, and
    # a meta written after them (write_meta) is not overtaken by what was encoded before.
    import threading

    import blockdiff.dump.packing as packing

    where, real_prepare, real_structures = [], packing.PackedFile.prepare, packing.PackedFile._encode_end

    def prepare(self, index, meta):
        where.append(("prepare", threading.current_thread() is threading.main_thread()))
        return real_prepare(self, index, meta)

    def structures(self, index):
        where.append(("encode", threading.current_thread() is threading.main_thread()))
        return real_structures(self, index)

    monkeypatch.setattr(packing.PackedFile, "prepare", prepare)
    monkeypatch.setattr(packing.PackedFile, "_encode_end", structures)
    sites, tensors = _writer_sites()
    path = tmp_path / "d.h5"
    with DumpWriter(path, meta=META) as writer:
        for site in sites:
            writer.add(site)
        writer.meta["ranks"] = 2
    assert where == [("prepare", True), ("encode", True)]  # on the caller, once
    _check_round_trip(path, tensors)
    with DumpReader(path) as dump:
        assert dump.meta["ranks"] == 2
    # The same file's end, prepared, then a different meta: the new meta is written.
    where.clear()
    file = packing.PackedFile(tmp_path / "p.h5", torch_version="2", meta=[("model", "a", False)])
    index = packing.encode_index([], [], {})
    assert file.prepare(index, [("model", "a", False)])
    file.write_meta([("model", "b", False)])
    file.finish(index)
    assert [w for w, _ in where] == ["prepare", "encode", "encode"]  # encoded again at finish
    with DumpReader(tmp_path / "p.h5") as dump:
        assert dump.meta["model"] == "b"


# --------------------------------------------------------------------------- memory


def test_freed_memory_goes_back_through_h5pys_own_libhdf5(tmp_path):
    # H5garbage_collect is found in the libhdf5 h5py loaded, not another copy: the same
    # handle sees the files h5py has open.
    import ctypes
    import platform

    from blockdiff.dump import memory

    lib = memory._hdf5_library()
    assert lib is not None and memory._hdf5_garbage_collect() is not None
    count = lib.H5Fget_obj_count
    count.argtypes, count.restype = (ctypes.c_int64, ctypes.c_uint), ctypes.c_ssize_t
    with h5py.File(tmp_path / "a.h5", "w"), h5py.File(tmp_path / "b.h5", "w"):
        opened = h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)
        assert opened >= 2 and count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE) == opened
    assert memory._hdf5_garbage_collect()() >= 0
    if platform.libc_ver()[0] == "glibc":
        assert memory._MALLOC_TRIM is not None


def test_release_freed_memory_calls_what_it_found(monkeypatch):
    from blockdiff.dump import memory

    calls = []
    monkeypatch.setattr(memory, "_MALLOC_TRIM", lambda pad: calls.append(("malloc_trim", pad)))
    monkeypatch.setattr(memory, "_hdf5_garbage_collect", lambda: lambda: calls.append("H5garbage_collect"))
    memory.release_freed_memory()
    assert calls == ["H5garbage_collect", ("malloc_trim", 0)]
    # Neither found (not glibc, an h5py whose extension cannot be opened): nothing is called.
    calls.clear()
    monkeypatch.setattr(memory, "_MALLOC_TRIM", None)
    monkeypatch.setattr(memory, "_hdf5_garbage_collect", lambda: None)
    memory.release_freed_memory()
    assert calls == []


def test_a_forgotten_block_holds_nothing_and_reads_again(tmp_path):
    """forget(block) drops the block's records of the index and the records of tensors no
    other site reads (a block's output is the next block's input: that one stays); the
    other blocks still read, and reading the forgotten block again indexes the file again."""
    from blockdiff.engine import capture
    from samples import tinylm

    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    capture(tinylm.build(), ids, tmp_path / "d.h5")
    with DumpReader(tmp_path / "d.h5") as reader:
        before = {b: reader.block_sites(b) for b in reader.block_indices()}
        reader.forget(0)
        assert reader.block_indices() == sorted(before)
        assert [e for e in reader._held if e.block == 0] == []
        sites = reader._index["sites"]
        assert sum(record is None for record in sites) == len(before[0])
        assert any(t is None for t in reader._index["tensors"])
        for b in sorted(before)[1:]:  # block 1's input (block 0's output) still reads
            assert [s.output.tolist() for s in reader.block_sites(b)] == [s.output.tolist() for s in before[b]]
        again = reader.block_sites(0)
        assert [(s.module, s.args[0].tolist()) for s in again] == [(s.module, s.args[0].tolist()) for s in before[0]]
        assert all(record is not None for record in reader._index["sites"])
        assert len(reader) == sum(len(v) for v in before.values()) + len(reader.outside_sites())


# --------------------------------------------------------------------------- written without libhdf5


def _libhdf5_wrote(monkeypatch) -> None:
    """Make PackedFile write through libhdf5, as it does for an attribute too large for an
    object header message."""
    import blockdiff.dump.packing as packing
    import blockdiff.dump.writer as writer

    for module in (packing, writer):
        monkeypatch.setattr(module, "written_raw", lambda compress, attributes: False)


def _contents(path: Path) -> tuple:
    """Everything a reader sees of a dump through plain h5py: the attributes but the
    creation time and digest, every dataset's path, dtype, shape, bytes and attributes."""
    with h5py.File(path, "r") as f:
        attrs = {k: v for k, v in f.attrs.items() if k not in ("created", "metadata_digest")}
        datasets = {}
        f.visititems(
            lambda name, obj: datasets.__setitem__(name, (obj.dtype.str, obj.shape, obj[()].tobytes(), dict(obj.attrs)))
            if isinstance(obj, h5py.Dataset) else None
        )
        groups = sorted(name for name, obj in f.items() if isinstance(obj, h5py.Group))
    return attrs, datasets, groups


def test_an_uncompressed_dump_is_written_without_libhdf5_and_reads_as_libhdf5s(tmp_path, monkeypatch):
    # Every structure of the file (superblock, object headers, messages, checksums) is
    # written by blockdiff.dump.hdf5; libhdf5 reads it exactly as the file it writes itself.
    import blockdiff.dump.packing as packing

    tensors = list(_tensors().values())
    sites = [_site(block=i, module=f"m{i}", output=t, args=(t,)) for i, t in enumerate(tensors)]
    meta = {**META, "flag": True, "empty": "", "naïve": "ünïcode"}
    with monkeypatch.context() as m:
        m.setattr(packing.h5py, "File", None)  # any libhdf5 file would fail the write
        own = _write(tmp_path / "own.h5", sites, inputs=torch.arange(6), meta=meta)
    with monkeypatch.context() as m:
        _libhdf5_wrote(m)
        theirs = _write(tmp_path / "theirs.h5", sites, inputs=torch.arange(6), meta=meta)
    assert own.read_bytes()[8] == 3 and theirs.read_bytes()[8] == 3  # superblock version 3 (HDF5 1.10)
    assert _contents(own) == _contents(theirs)
    with DumpReader(own) as a, DumpReader(theirs) as b:  # the metadata digest is checked on open
        assert a.meta["naïve"] == "ünïcode" and a.meta["flag"] is True and a.meta["empty"] == ""
        assert a.verify_all() == b.verify_all()
        assert [s.key for s in a.sites()] == [s.key for s in b.sites()]
        for i, want in enumerate(tensors):
            _assert_same_tensor(a.block_sites(i)[0].output, want)
    with h5py.File(own, "r") as f:
        assert sorted(f["tensors"]) == ["bool.0", "float16.0", "float32.0", "int64.0", "uint16.0", "uint8.0"]
    # libhdf5 can go on from it: the file opened for writing takes new attributes and links.
    with h5py.File(own, "r+") as f:
        for i in range(20):
            f.attrs[f"added{i}"] = i
            f["tensors"][f"added{i}"] = np.arange(i)
    with h5py.File(own, "r") as f:
        assert f.attrs["added19"] == 19 and f["tensors/added19"][()].tolist() == list(range(19))
        assert f.attrs["format"] == b"blockdiff.dump"


def test_lookup3_is_jenkins_hashlittle_in_c_and_in_python():
    from blockdiff.dump import hdf5

    # The published test vectors of lookup3.c's driver.
    assert hdf5._lookup3_python(b"") == 0xDEADBEEF
    assert hdf5._lookup3_python(b"Four score and seven years ago") == 0x17770551
    assert hdf5._lookup3_python(b"Four score and seven years ago", 1) == 0xCD628161
    data = bytes(range(256)) * 9
    assert hdf5._lookup3() is not hdf5._lookup3_python  # libhdf5's, found through h5py's
    assert all(hdf5.lookup3(data[:n]) == hdf5._lookup3_python(data[:n]) for n in range(0, 60))
    assert hdf5.lookup3(data) == hdf5._lookup3_python(data)


@pytest.mark.parametrize("when", ["at the start", "before close"])
def test_an_attribute_too_large_for_a_message_is_written_by_libhdf5(tmp_path, monkeypatch, when):
    # A meta entry of over 64 KiB cannot be an attribute message of an object header:
    # libhdf5 writes the file (from the start; or, for one that grew before close, again
    # from the bytes written so far, the first file removed).
    import blockdiff.dump.packing as packing

    big = {"layers": list(range(20000))}  # ~110 KB of JSON
    again, real = [], packing.PackedFile._through_libhdf5
    monkeypatch.setattr(packing.PackedFile, "_through_libhdf5", lambda self: (again.append(self.path), real(self)))
    sites, tensors = _writer_sites()
    path = tmp_path / "d.h5"
    with DumpWriter(path, meta={**META, **(big if when == "at the start" else {})}) as writer:
        for site in sites:
            writer.add(site)
        writer.meta.update(big)
    assert again == ([] if when == "at the start" else [path])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]
    _check_round_trip(path, tensors)
    with DumpReader(path) as dump:
        assert dump.meta["layers"] == big["layers"]
    with h5py.File(path, "r") as f:  # 1 MiB, then 8 MiB: two batches of float32
        assert sorted(f["tensors"]) == ["float32.0", "float32.1"]
    from blockdiff.dump import hdf5

    for name, value in (("k" * 70000, "v"), ("k", "v" * 65480), ("k", "v" * 65400)):  # name and value count
        if len(name) + len(value) > 65471:
            with pytest.raises(hdf5.TooLarge):
                hdf5.attribute(name, value)
        else:
            assert len(hdf5.attribute(name, value)[0]) < 2**16


def _read_sums(path: Path, out: Path) -> None:
    # numpy only: torch's OpenMP threads are not usable in a forked child either.
    with DumpReader(path) as r:
        out.write_text(repr([float(s.output.numpy().astype(np.float64).sum()) for s in r.iter_sites()]))


def test_the_readers_checksum_thread_is_not_taken_across_fork(tmp_path):
    # A large tensor read verified has its pieces summed on a thread of the reader's; a
    # forked child does not have its parent's (it hung there until 2026-12-04): it makes its own.
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    big = torch.randn(3 * 2**20, generator=torch.Generator().manual_seed(3))  # 12 MiB: read in pieces
    path = _write(tmp_path / "d.h5", [_site(output=big)])
    _read_sums(path, tmp_path / "parent.txt")  # the parent's thread is made
    child = multiprocessing.get_context("fork").Process(target=_read_sums, args=(path, tmp_path / "child.txt"))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert (tmp_path / "child.txt").read_text() == (tmp_path / "parent.txt").read_text()


def test_writer_threads_are_kept_between_dumps_and_not_across_fork(tmp_path):
    import multiprocessing

    from blockdiff.dump import writer as writer_module

    sites, tensors = _writer_sites()
    _write(tmp_path / "a.h5", sites)
    names = []

    class Recording(DumpWriter):
        def _write_tensors(self, groups, nbytes):
            names.append(__import__("threading").current_thread().ident)
            return super()._write_tensors(groups, nbytes)

    for name in ("b.h5", "c.h5"):
        with Recording(tmp_path / name, meta=META) as w:
            for site in sites:
                w.add(site)
    assert len(names) == 4 and len(set(names)) == 1  # the same thread wrote both
    assert any(pid == os.getpid() for pid, _ in writer_module._IDLE)
    if "fork" not in multiprocessing.get_all_start_methods():
        return
    child = multiprocessing.get_context("fork").Process(target=_write, args=(tmp_path / "child.h5", sites))
    child.start()
    child.join(60)
    assert child.exitcode == 0  # the parent's kept thread is not in the child: it made its own
    _check_round_trip(tmp_path / "child.h5", tensors)
