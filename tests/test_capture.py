"""Capture into memory holds the model's own tensors, and never a value changed after its hook."""

from __future__ import annotations

import torch

from blockdiff import resolve
from blockdiff.capture import capture, record
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


def test_a_tensor_changed_in_place_after_its_hook_is_recorded_as_the_hook_saw_it(ids):
    # Block 1 adds 1 to its input in place: that tensor is block 0's recorded output.
    model = tinylm.build()
    block = model.blocks[1]
    original = block.forward
    forwards = []

    def in_place(x, *args, **kwargs):
        forwards.append(1)
        x.add_(1.0)
        return original(x, *args, **kwargs)

    block.forward = in_place
    layout = resolve(model)
    copied = MemoryStore()
    with capture(model, layout, copied), torch.no_grad():
        model(ids)
    store = MemoryStore()
    forwards.clear()
    record(model, layout, store, ids)
    assert len(forwards) == 2  # the change was seen, and the forward ran again with copies
    assert len(store.block_sites(0)) == len(copied.block_sites(0))
    for index in range(4):
        assert torch.equal(_block_output(store, index), _block_output(copied, index))


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
