"""Graph taps (blockdiff.taps) in their dry run: the tapped forward run eagerly on the CPU
records what the eager capture records, tensor for tensor; a record is a copy of the slab,
not a view a later run overwrites; another input shape is refused. On CUDA the same taps
are captured in a CUDA graph (benchmarks/device_check.py, check 11)."""

from __future__ import annotations

import pytest
import torch

from blockdiff import InputError, resolve
from blockdiff.capture import record
from blockdiff.site import iter_tensors
from blockdiff.store import MemoryStore
from blockdiff.taps import GraphTaps
from samples import hf_llama, tinylm


def _tensors(site):
    return list(iter_tensors((site.args, site.kwargs, site.output)))


def _same(expected: MemoryStore, got: MemoryStore) -> int:
    """Every site of ``expected`` in ``got`` under its key, each tensor equal bit for bit;
    how many tensors were compared."""
    want, have = expected.sites(), got.sites()
    assert [s.key for s in have] == [s.key for s in want]
    compared = 0
    for a, b in zip(want, have):
        ta, tb = _tensors(a), _tensors(b)
        assert len(ta) == len(tb), a.label
        for x, y in zip(ta, tb):
            assert x.dtype == y.dtype and torch.equal(x, y), a.label
            compared += 1
    return compared


@pytest.mark.parametrize("build", [tinylm.build, lambda: hf_llama.build(num_hidden_layers=3)], ids=["tinylm", "hf-llama"])
def test_taps_record_what_the_eager_capture_records(build):
    model = build().eval()
    layout = resolve(model)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    expected = MemoryStore()
    record(model, layout, expected, ids)
    taps = GraphTaps(model, layout, ids, graph=False)
    assert not taps.graphed and taps.nbytes > 0
    assert _same(expected, taps.record(ids)) > 3 * len(layout.blocks)


def test_each_record_is_its_own_copy_of_the_slab():
    model = tinylm.build().eval()
    layout = resolve(model)
    first_ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    second_ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(1))
    taps = GraphTaps(model, layout, first_ids, graph=False)
    first, second = taps.record(first_ids), taps.record(second_ids)
    expected_first, expected_second = MemoryStore(), MemoryStore()
    record(model, layout, expected_first, first_ids)
    record(model, layout, expected_second, second_ids)
    _same(expected_first, first)  # not overwritten by the second run
    _same(expected_second, second)


def test_another_shape_is_refused_with_what_to_do():
    model = tinylm.build().eval()
    taps = GraphTaps(model, resolve(model), torch.zeros(1, 8, dtype=torch.long), graph=False)
    with pytest.raises(InputError, match=r"shape \(1, 8\).*got \(1, 9\).*make new GraphTaps"):
        taps.record(torch.zeros(1, 9, dtype=torch.long))
