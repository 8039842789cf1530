"""``[modules."PATH"]`` of a hook map: activation keywords, which calls are sites,
broadcastable outputs; parsed strictly, carried by the layout, applied by capture, the
activation helpers of ``site.py`` and the comparison of outputs."""

from __future__ import annotations

import pytest
import torch
from blockdiff import HookMapError, hookmap, resolve
from blockdiff.capture import record
from blockdiff.errors import ShapeMismatchError
from blockdiff.experiments import comparable
from blockdiff.hookmap import ModuleOptions, layout_from_dict
from blockdiff.site import hidden_location, hidden_states, with_hidden
from blockdiff.store import MemoryStore
from samples import tinylm

TINYLM_MAP = """
name = "tinylm-options"
[outside]
embed = "embed"
context = "rotary"
final_norm = "norm"
head = "lm_head"
[blocks]
path = "blocks"
[blocks.subpaths]
attention = "attn"
ffn = "ffn"
norm = ["attn_norm", "ffn_norm"]
"""


def parse(extra: str) -> hookmap.HookMap:
    return hookmap.parse(TINYLM_MAP + extra, source="test.toml")


def test_module_options_are_parsed_by_the_path_as_written():
    parsed = parse('[modules.attn]\nactivations = ["q", "kv"]\n[modules.ffn_norm]\ncalls = 1\n[modules.rotary]\nbroadcast = true\n')
    assert parsed.modules == {
        "attn": ModuleOptions(activations=("q", "kv")),
        "ffn_norm": ModuleOptions(calls=1),
        "rotary": ModuleOptions(broadcast=True),
    }
    assert parse('[modules.embed]\nactivations = []').modules["embed"].activations == ()
    assert all(not m.modules for m in hookmap.bundled() if m.name not in ("transformer_lens", "transformer_bridge"))


@pytest.mark.parametrize(
    "extra,message",
    [
        ('[modules.attn]\nactivation = ["q"]', "unknown key 'activation' in [modules.\"attn\"]; expected activations, calls, broadcast"),
        ('[modules.self_attn]\ncalls = "first"', "[modules.\"self_attn\"] names a module the map does not name"),
        ('[modules.attn]\ncalls = "last"', "calls must be \"each\", \"first\" or a call index (0, 1, ...), found 'last'"),
        ('[modules.attn]\ncalls = -1', "found -1"),
        ('[modules.attn]\ncalls = true', "found True"),
        ('[modules.attn]\nbroadcast = "yes"', "broadcast must be true or false, found 'yes'"),
        ('[modules.attn]\nactivations = 3', "activations must be a string or a list of strings, found int"),
        ("[modules]\nattn = 3", "[modules.\"attn\"] must be a table"),
        ('[module.attn]\ncalls = "first"', "unknown key 'module'; expected name, description, match"),
        ('[blocks.modules.attn]\ncalls = "first"', "unknown key 'modules' in [blocks]; expected path, subpaths, moe"),
    ],
)
def test_malformed_module_options_are_clear_errors(extra, message):
    escaped = message
    for char in "[()].":
        escaped = escaped.replace(char, "\\" + char)
    with pytest.raises(HookMapError, match=escaped):
        parse(extra)


def test_the_layout_keeps_options_by_full_path_through_a_dump():
    layout = resolve(tinylm.build(), parse('[modules.attn_norm]\ncalls = "first"\n[modules.embed]\nbroadcast = true'))
    assert layout.options("blocks.2.attn_norm").calls == "first"
    assert layout.options("embed").broadcast
    assert layout.options("blocks.2.ffn_norm") == ModuleOptions()
    stored = layout_from_dict(layout.to_dict())
    assert stored.modules == layout.modules
    assert "modules" not in resolve(tinylm.build()).to_dict()  # maps without options: as before


def test_calls_choose_which_calls_are_sites(ids):
    """A norm module called twice per block (both norms one shared module): `each` gives
    two sites, `first` and an index one, with the other call left out of the ordinals."""
    model = tinylm.build()
    for block in model.blocks:
        block.ffn_norm = block.attn_norm
    text = TINYLM_MAP.replace('norm = ["attn_norm", "ffn_norm"]', 'norm = "attn_norm"')

    def norm_calls(options: str) -> list[tuple[int, int]]:
        store = MemoryStore()
        record(model, resolve(model, hookmap.parse(text + options, source="t.toml")), store, ids)
        return [(s.call, s.ordinal) for s in store.block_sites(1) if s.subpath == "norm"]

    assert norm_calls("") == [(0, 0), (1, 1)]
    assert norm_calls('[modules.attn_norm]\ncalls = "each"') == [(0, 0), (1, 1)]
    assert norm_calls('[modules.attn_norm]\ncalls = "first"') == [(0, 0)]
    assert norm_calls("[modules.attn_norm]\ncalls = 1") == [(1, 0)]
    assert norm_calls("[modules.attn_norm]\ncalls = 2") == []


def test_named_activations_take_the_other_sides_hidden_state():
    q, k, mask = torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.ones(1, 4)
    kwargs = dict(query_input=q, key_input=k, value_input=k, attention_mask=mask)
    names = ("query_input", "key_input", "value_input")
    assert hidden_location((), kwargs) is None  # unknown names: no activation without the map
    assert hidden_location((), kwargs, names) == ("kwarg", "query_input")
    found = hidden_states((), kwargs, names)
    assert set(found) == {"primary", *names} and found["primary"] is q
    # A Hugging Face attention's one hidden state feeds each of them.
    x = torch.randn(1, 4, 8)
    _, replaced = with_hidden((), kwargs, {"primary": x}, names)
    assert all(replaced[n] is x for n in names) and replaced["attention_mask"] is mask
    # Another TransformerLens attention's by name.
    k2 = torch.randn(1, 4, 8)
    _, replaced = with_hidden((), kwargs, {"primary": x, "query_input": x, "key_input": k2, "value_input": k2}, names)
    assert (replaced["query_input"], replaced["key_input"], replaced["value_input"]) == (x, k2, k2)
    # Without the names the call keeps its own.
    assert with_hidden((), kwargs, {"primary": x})[1]["query_input"] is q


def test_no_activations_keep_the_call_as_it_is():
    tokens = torch.randint(0, 9, (2, 4))
    assert hidden_states((tokens,), {}) and hidden_states((tokens,), {}, ()) == {}
    args, _ = with_hidden((tokens,), {}, {"primary": torch.arange(4)[None]}, ())
    assert args[0] is tokens


def test_broadcast_outputs_compare_after_broadcasting():
    row = torch.randn(1, 4, 8)
    batch = row.expand(3, 4, 8).clone()
    ref, cand = comparable("embed #1", "output", row, batch, broadcast=True)
    assert ref.shape == cand.shape == (3, 4, 8) and torch.equal(ref, cand)
    ref, cand = comparable("embed #1", "output", batch, row, broadcast=True)
    assert ref.shape == cand.shape == (3, 4, 8)
    with pytest.raises(ShapeMismatchError, match=r"candidate has shape \[3, 4, 8\], reference \[1, 4, 8\]"):
        comparable("embed #1", "output", row, batch)
    with pytest.raises(ShapeMismatchError, match=r"candidate has shape \[3, 5, 8\]"):
        comparable("embed #1", "output", row, torch.randn(3, 5, 8), broadcast=True)
    # Leading size-1 dimensions alone were always aligned.
    assert comparable("context", "output", torch.randn(1, 4, 8), torch.randn(4, 8))[1].shape == (1, 4, 8)
