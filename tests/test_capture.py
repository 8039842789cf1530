"""Capture into memory holds the model's own tensors, and never a value changed after its hook."""

from __future__ import annotations

import inspect

import torch

from blockdiff import resolve
from blockdiff.capture import DeviceCopies, Snapshots, capture, record
from blockdiff.dump import DumpReader, DumpWriter
from blockdiff.store import MemoryStore
from samples import tinylm


def _block_output(store: MemoryStore, index: int) -> torch.Tensor:
    (site,) = [s for s in store.block_sites(index) if s.subpath is None]
    return site.primary_output()


def test_memory_capture_holds_the_models_tensors_without_copying(ids):
    model = tinylm.build()
    layout = resolve(model)
    store = MemoryStore()
    record(model, layout, store, ids)
    # Block 0's output is block 1's input: one tensor, not a copy, in both sites.
    (block1,) = [s for s in store.block_sites(1) if s.subpath is None]
    assert block1.args[0].data_ptr() == _block_output(store, 0).data_ptr()
    copied = MemoryStore()
    with capture(model, layout, copied), torch.no_grad():
        model(ids)
    for index in range(4):
        assert torch.equal(_block_output(store, index), _block_output(copied, index))
        assert _block_output(store, index).data_ptr() != _block_output(copied, index).data_ptr()


def _adding_in_place(model: torch.nn.Module, index: int) -> list:
    """Block ``index`` adds 1 to its input in place: the previous block's recorded output
    (and its own recorded input). Returns a list that grows by one per call."""
    block = model.blocks[index]
    original = block.forward
    calls = []

    def in_place(x, *args, **kwargs):
        calls.append(1)
        x.add_(1.0)
        return original(x, *args, **kwargs)

    block.forward = in_place
    return calls


def _copied(model: torch.nn.Module, ids: torch.Tensor) -> MemoryStore:
    copied = MemoryStore()
    with capture(model, resolve(model), copied), torch.no_grad():
        model(ids)
    return copied


def test_a_tensor_changed_in_place_after_its_hook_is_recorded_as_the_hook_saw_it(ids):
    model = tinylm.build()
    calls = _adding_in_place(model, 1)
    copied = _copied(model, ids)
    store = MemoryStore()
    calls.clear()
    record(model, resolve(model), store, ids)
    assert len(calls) == 2  # the change was seen, and the forward ran again with copies
    assert len(store.block_sites(0)) == len(copied.block_sites(0))
    for index in range(4):
        assert torch.equal(_block_output(store, index), _block_output(copied, index))


def test_a_dump_holds_what_the_hooks_saw_when_the_model_changes_tensors_in_place(ids, tmp_path):
    from blockdiff.dump import DumpReader
    from blockdiff.engine import capture as capture_dump

    def sites(store, index):
        return {(s.subpath, s.ordinal): s for s in store.block_sites(index)}

    # Block 1 adds 1 to its input: block 0's output, already handed to the dump writer.
    # Written before the change (nothing to redo), or the writer sees its version counter
    # move and the capture runs again with copies: which one is up to the writer's thread.
    model = tinylm.build()
    calls = _adding_in_place(model, 1)
    copied = _copied(model, ids)
    calls.clear()
    capture_dump(model, ids, tmp_path / "a.h5")
    assert len(calls) in (1, 2)
    # Block 2's FFN norm scales its input in place before its site is written: the dump
    # is captured again, with copies.
    norm = model.blocks[2].ffn_norm
    original = norm.forward
    norm.forward = lambda x: original(x.mul_(1.5))
    copied_b = _copied(model, ids)
    calls.clear()
    capture_dump(model, ids, tmp_path / "b.h5")
    assert len(calls) == 2
    for path, expected in (("a.h5", copied), ("b.h5", copied_b)):
        with DumpReader(tmp_path / path) as dump:
            for index in range(4):
                got, want = sites(dump, index), sites(expected, index)
                assert got.keys() == want.keys()
                for key, site in got.items():
                    assert torch.equal(site.args[0], want[key].args[0]), (path, index, key)
                    assert torch.equal(site.primary_output(), want[key].primary_output()), (path, index, key)
    assert not list(tmp_path.glob(".*.tmp-*"))


def _reusing_buffer(module: torch.nn.Module) -> None:
    """Make ``module`` return the same buffer every call, written in place."""
    original = module.forward
    buffer = {}

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        if "t" not in buffer:
            buffer["t"] = torch.empty_like(out)
        return buffer["t"].copy_(out)

    module.forward = forward


def test_a_module_overwriting_what_it_returned_before_leaves_the_report_unchanged(ids):
    # Block 3 returns one buffer, overwritten by each call: the block experiment calls it
    # again (its input differs after the bug in block 2), which overwrites the output the
    # capture recorded by reference. The diff notices and runs again on copies.
    from blockdiff import diff
    from samples import bugs

    plain = diff(tinylm.build(), bugs.gelu_for_silu(block=2), ids).to_dict()
    candidate = bugs.gelu_for_silu(block=2)
    _reusing_buffer(candidate.blocks[3])
    reusing = diff(tinylm.build(), candidate, ids).to_dict()
    for report in (plain, reusing):
        del report["created"]
    assert reusing == plain


class _Landing:
    """A stand-in for a CUDA side stream: a copy reads its tensor and lands in the host
    buffer (NaN until then) only when its event is synchronized, as a side stream's copy
    may run long after it was queued; ``landed`` lists the copies in the order they landed."""

    def __init__(self) -> None:
        self.landed: list[int] = []
        self.queued = -1

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        source = t.detach()  # read when it lands, as a side stream's copy does
        host = torch.full_like(t, float("nan")) if t.is_floating_point() else torch.full_like(t, -1)
        landing = self
        queued = self.queued = self.queued + 1

        class Event:
            def synchronize(self) -> None:
                host.copy_(source)
                landing.landed.append(queued)

        return host, Event()


def test_device_copies_keep_a_bounded_number_in_flight_and_land_in_order():
    landing = _Landing()
    copies = DeviceCopies(limit=3, events=landing)
    hosts = [copies.copy(torch.full((4,), float(i))) for i in range(5)]
    # A fourth and a fifth copy each waited for the oldest: three in flight.
    assert copies.in_flight == 3 and landing.landed == [0, 1]
    assert torch.isnan(hosts[3]).all()
    copies.wait_for([hosts[3]])  # copies land in order: copy 2 first
    assert landing.landed == [0, 1, 2, 3] and copies.in_flight == 1
    assert torch.equal(hosts[3], torch.full((4,), 3.0))
    copies.wait_for([hosts[0], torch.ones(1)])  # landed already, or not a copy: nothing waits
    assert landing.landed == [0, 1, 2, 3]
    copies.wait_all()
    assert landing.landed == [0, 1, 2, 3, 4] and copies.in_flight == 0
    assert [float(h[0]) for h in hosts] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_tensor_written_in_place_after_its_hook_is_recorded_as_the_hook_saw_it(ids):
    """The race of asynchronous device copies, closed by construction: each copy reads a
    snapshot taken on the forward's stream at the hook, not the model's tensor, which the
    model writes again before the copy runs (the stand-in copies only when it lands)."""
    model = tinylm.build_adds_into_ffn(block=1)
    assert torch.equal(model(ids), tinylm.build()(ids))  # the same outputs, a tensor written again
    layout = resolve(model)
    expected = MemoryStore()
    record(model, layout, expected, ids)
    landing = _Landing()
    in_memory = MemoryStore()
    snapshots = Snapshots(device_copies=DeviceCopies(limit=64, events=landing))
    with capture(model, layout, in_memory, snapshot=snapshots), torch.no_grad():
        out = model(ids)
    assert landing.landed  # every copy went through the stand-in, landing late
    got = {s.key: s for i in in_memory.block_indices() for s in in_memory.block_sites(i)}
    for site in (s for i in expected.block_indices() for s in expected.block_sites(i)):
        assert torch.equal(got[site.key].primary_output(), site.primary_output()), site.label
    assert torch.isfinite(out).all()


def test_a_dump_written_through_device_copies_holds_every_value_landed(ids, tmp_path):
    """Sites reach a dump only once their copies landed (a site written early would hold
    the NaN the stand-in leaves until then); in memory, all have landed when capture ends.
    Two copies in flight at most, over a forward of dozens of tensors."""
    model = tinylm.build()
    layout = resolve(model)
    expected = MemoryStore()
    record(model, layout, expected, ids)
    landing = _Landing()
    with DumpWriter(tmp_path / "c.h5", meta={"model": "tinylm"}) as writer:
        snapshots = Snapshots(device_copies=DeviceCopies(limit=2, events=landing))
        with capture(model, layout, writer, snapshot=snapshots), torch.no_grad():
            model(ids)
    in_memory = MemoryStore()
    landing_memory = _Landing()
    snapshots = Snapshots(device_copies=DeviceCopies(limit=2, events=landing_memory))
    with capture(model, layout, in_memory, snapshot=snapshots), torch.no_grad():
        model(ids)
    assert len(landing.landed) > 20 and landing.landed == sorted(landing.landed)
    with DumpReader(tmp_path / "c.h5") as dump:
        for store in (dump, in_memory):
            got = {s.key: s for s in [*store.outside_sites(), *(s for i in store.block_indices() for s in store.block_sites(i))]}
            for site in [*expected.outside_sites(), *(s for i in expected.block_indices() for s in expected.block_sites(i))]:
                assert torch.equal(got[site.key].primary_output(), site.primary_output()), site.label


def test_an_eager_model_is_recorded_through_its_own_forwards_which_keep_their_signatures(ids):
    """A capture of a model no compiler runs wraps each site module's forward on the
    instance (no hooks), keeps what inspect sees of it (a model may read its modules'
    signatures, as HF's Falcon sample does), and takes every wrapper off after."""
    model = tinylm.build()
    layout = resolve(model)
    attention = model.blocks[1].attn
    seen = inspect.signature(attention.forward)
    with capture(model, layout, MemoryStore()) as store, torch.no_grad():
        assert "forward" in attention.__dict__ and not attention._forward_pre_hooks and not attention._forward_hooks
        assert inspect.signature(attention.forward) == seen
        model(ids)
    assert not any("forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert len(store.block_sites(1)) == len([p for p in layout.site_of() if p.startswith("blocks.1")])


def test_a_kept_record_holds_plain_calls_as_they_are_and_anything_else_as_map_structure_makes_it():
    from transformers import DynamicCache, LlamaConfig

    from blockdiff.site import Opaque

    kept = Snapshots(by_reference="kept")
    h, cos, sin = torch.ones(2, 3), torch.zeros(3), torch.ones(3)
    args = (h, (cos, sin), None, 2)
    assert kept(args) is args  # a tuple is immutable: the record holds it
    kwargs = {"hidden_states": h, "position_embeddings": (cos, sin), "use_cache": False}
    recorded = kept(kwargs)
    assert recorded == kwargs and recorded is not kwargs  # a dict is copied: the model may change it
    assert kept.call(args, kwargs) == (args, kwargs)
    # A cache, a list, a tensor that requires grad: what map_structure makes of them.
    cache = DynamicCache(config=LlamaConfig(num_hidden_layers=1))
    odd = kept({"cache": cache, "list": [h], "grad": torch.ones(2, requires_grad=True)})
    assert isinstance(odd["cache"], Opaque) and odd["cache"].cache
    assert odd["list"] == [h] and odd["list"][0] is h
    assert not odd["grad"].requires_grad
    assert not kept.changed()
    sin.mul_(2)  # met twice, held once: its first version is the one checked
    assert kept.changed()


def test_a_kept_record_notices_a_change_to_a_tensor_deep_in_a_tuple():
    kept = Snapshots(by_reference="kept")
    inner = torch.ones(4)
    kept(((torch.zeros(1), (inner,)),))
    assert not kept.changed()
    inner.add_(1)
    assert kept.changed()


def test_each_module_counts_its_own_calls_and_a_sub_path_numbers_its_sites_in_order(ids):
    from blockdiff.capture import Numbering
    from blockdiff.hookmap import ModuleOptions

    layout = resolve(tinylm.build())
    layout.modules["blocks.0.ffn"] = ModuleOptions(calls=1)  # its second call is the site
    numbering = Numbering(layout, whole=False, copy=lambda args, kwargs: (args, kwargs))
    where = ("block", 0, "ffn")
    ffn, other = numbering.opener("blocks.0.ffn", where), numbering.opener("blocks.0.ffn_norm", where)
    assert ffn((), {}) is None  # call 0: not selected
    first = other((), {})
    second = ffn((), {})
    assert (first.call, first.ordinal, first.order) == (0, 0, 0)
    assert (second.module, second.call, second.ordinal, second.order) == ("blocks.0.ffn", 1, 1, 1)
    assert ffn((), {}) is None


def test_whether_a_model_takes_an_argument_follows_a_forward_replaced_on_the_instance():
    from blockdiff.inputs import accepts

    model = tinylm.build()
    assert not accepts(model, "use_cache")
    model.forward = lambda ids, use_cache=False: None
    assert accepts(model, "use_cache")
    del model.forward
    assert not accepts(model, "use_cache")
