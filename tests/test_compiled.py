"""Compiled candidates: the compiled program is what is judged, and capture does not change it.

The compile-only bug stand-in (`samples/bugs.py: CompiledOnly`) computes something else only
while dynamo traces it, as a compiler bug would; the plumbing backend `aot_eager` runs the
traced graph without building C++, so these tests judge the traced program, not inductor's
kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import blockdiff
from blockdiff.capture import record
from blockdiff.store import MemoryStore
from samples import bugs, tinylm
from tests.conftest import blamed

BACKEND = "aot_eager"


def whole(model):
    return torch.compile(model, backend=BACKEND)


def method(model):
    model.compile(backend=BACKEND)
    return model


def each_layer_in_place(model):
    for layer in model.blocks:
        layer.compile(backend=BACKEND)
    return model


def each_layer_replaced(model):
    for i, layer in enumerate(model.blocks):
        model.blocks[i] = torch.compile(layer, backend=BACKEND)
    return model


FORMS = [whole, method, each_layer_in_place, each_layer_replaced]


def compile_only_bug() -> torch.nn.Module:
    return bugs._plant(1, "ffn", bugs.CompiledOnly)


@pytest.mark.parametrize("form", FORMS)
def test_a_bug_only_in_generated_code_is_blamed_on_its_block_and_subpath(form, ids):
    report = blockdiff.diff(tinylm.build(), form(compile_only_bug()), ids)
    assert blamed(report) == ("block", 1, "ffn")
    assert [(d.block, d.subpath) for d in report.divergences] == [(1, "ffn")]


@pytest.mark.parametrize("form", FORMS)
def test_a_clean_compiled_candidate_blames_nothing(form, ids):
    assert blamed(blockdiff.diff(tinylm.build(), form(tinylm.build()), ids)) is None


def test_a_clean_compiled_bfloat16_candidate_blames_nothing(ids):
    assert blamed(blockdiff.diff(tinylm.build(), whole(tinylm.build().to(torch.bfloat16)), ids)) is None


def _graphs_and_breaks(run) -> tuple[int, int]:
    torch._dynamo.reset()
    counters.clear()
    run()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("form", FORMS)
def test_capture_adds_no_graphs_and_no_graph_breaks(form, ids):
    model = form(tinylm.build())
    layout = blockdiff.resolve(model)
    with torch.no_grad():
        plain = _graphs_and_breaks(lambda: model(ids))
    captured = _graphs_and_breaks(lambda: record(model, layout, MemoryStore(), ids))
    assert captured == plain
    store = MemoryStore()
    record(model, layout, store, ids)
    eager = MemoryStore()
    reference = tinylm.build()
    record(reference, blockdiff.resolve(reference), eager, ids)
    # Every site recorded, in the same order, with the values the compiled graph computed.
    got, want = store.sites(), eager.sites()
    assert [(s.key, s.order) for s in got] == [(s.key, s.order) for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.primary_output(), b.primary_output(), rtol=1e-5, atol=1e-5)


def test_the_bundled_map_sees_through_compiled_layers(ids):
    from samples import hf_llama

    model = hf_llama.build()
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend=BACKEND)
    layout = blockdiff.resolve(model)
    assert layout.hook_map.name == "llama"
    assert layout.blocks[1].subpaths["ffn"] == ["model.layers.1._orig_mod.mlp"]
    report = blockdiff.diff(hf_llama.build(), model, ids)
    assert blamed(report) is None


class InPlaceBlock(tinylm.Block):
    """Adds into its hidden state in place after its norms have been called on it."""

    def forward(self, x, cos, sin):
        x = x.clone()
        x += self.attn(self.attn_norm(x), cos, sin)
        x += self.ffn(self.ffn_norm(x))
        return x


def in_place() -> torch.nn.Module:
    model = tinylm.build()
    for block in model.blocks:
        block.__class__ = InPlaceBlock
    return model


def test_a_compiled_graph_is_recorded_as_its_hooks_saw_it_despite_in_place_updates(ids):
    # Inside the graph the norms' inputs are changed in place after their hooks ran: the
    # record must hold the values as they were then, or identical code is blamed.
    assert blamed(blockdiff.diff(in_place(), whole(in_place()), ids)) is None
    assert blamed(blockdiff.diff(whole(in_place()), in_place(), ids)) is None
    model = whole(in_place())
    with torch.no_grad():
        plain = _graphs_and_breaks(lambda: model(ids))
    assert _graphs_and_breaks(lambda: record(model, blockdiff.resolve(model), MemoryStore(), ids)) == plain


def test_a_compiled_function_around_the_model_is_said_in_the_notes(ids):
    """``model.forward = torch.compile(model.forward)``: the run goes through compiled code
    its experiments do not run; the report says so and what to do."""
    around = tinylm.build()
    around.forward = torch.compile(around.forward, backend="aot_eager")
    report = blockdiff.diff(tinylm.build(), around, ids)
    assert blamed(report) is None
    note = next(n for n in report.notes if "is a compiled function" in n)
    assert note.startswith("the candidate's forward of the model is a compiled function") and "module.compile()" in note
    plain = blockdiff.diff(tinylm.build(), tinylm.build(), ids)
    assert "compiled-forward" not in plain.note_codes
