"""TransformerLens against Hugging Face with the same weights, in whichever version is
installed: TransformerLens 3's ``HookedTransformer`` (the bundled ``transformer_lens`` map:
activation keywords, ``ln1``'s first call, the broadcast positional embedding) and the
``TransformerBridge`` of TransformerLens 4 (and 3.9) (the bundled ``transformer_bridge``
map: the TransformerLens names of the Hugging Face modules it wraps). TransformerLens 4
removed ``HookedTransformer``: its tests skip there, saying which version is installed."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch
from packaging.version import Version
from torch import nn

pytest.importorskip("transformers")

from blockdiff import diff  # noqa: E402
from blockdiff.capture import record  # noqa: E402
from blockdiff.autodetect import resolve  # noqa: E402
from blockdiff.hookmap import ModuleOptions  # noqa: E402
from blockdiff.store import MemoryStore  # noqa: E402
from samples import transformer_bridge as bridges  # noqa: E402
from samples import transformer_lens as tl_samples  # noqa: E402
from tests.conftest import blamed, run_cli  # noqa: E402

try:
    TL_VERSION: Version | None = Version(version("transformer-lens"))
except PackageNotFoundError:
    TL_VERSION = None
hooked_transformer = pytest.mark.skipif(
    TL_VERSION is None or TL_VERSION.major != 3,
    reason=f"HookedTransformer needs TransformerLens 3 (installed: {TL_VERSION or 'none'}; 4 removed it)",
)
transformer_bridge = pytest.mark.skipif(
    TL_VERSION is None or TL_VERSION < Version("3.9"),
    reason=f"a TransformerBridge around a model needs TransformerLens 3.9 or 4 (installed: {TL_VERSION or 'none'})",
)


@pytest.fixture(scope="module")
def hf():
    return tl_samples.reference()


@pytest.fixture(scope="module")
def tl():
    return tl_samples.build()


def hooks(family: str) -> dict:
    """Hugging Face Llama's model-level rotary module has no TransformerLens counterpart."""
    return dict(reference_hooks=tl_samples.llama_reference_map()) if family == "llama" else {}


@pytest.mark.parametrize("family", tl_samples.FAMILIES)
@pytest.mark.parametrize(
    "sample",
    [
        pytest.param(tl_samples, marks=hooked_transformer, id="HookedTransformer"),
        pytest.param(bridges, marks=transformer_bridge, id="TransformerBridge"),
    ],
)
def test_the_sample_computes_the_hugging_face_logits(sample, family, ids):
    with torch.no_grad():
        expected, got = sample.reference(family=family)(ids).logits, sample.build(family=family)(ids)
    assert float((got - expected).norm() / expected.norm()) < 1e-6


@hooked_transformer
def test_the_bundled_map_matches_hooked_transformer(tl):
    layout = resolve(tl)
    assert layout.hook_map.name == "transformer_lens"
    assert layout.outside == [("embed", "embed"), ("embed", "pos_embed"), ("final_norm", "ln_final"), ("head", "unembed")]
    assert layout.blocks[2].subpaths == {
        "attention": ["blocks.2.attn"], "ffn": ["blocks.2.mlp"], "norm": ["blocks.2.ln1", "blocks.2.ln2"]
    }
    assert all(not block.unmapped for block in layout.blocks)
    assert layout.options("blocks.2.attn").activations == ("query_input", "key_input", "value_input")
    assert layout.options("blocks.2.ln1").calls == "first"
    assert layout.options("pos_embed").broadcast
    assert layout.options("blocks.2.ln2") == layout.options("no.such.module")  # the defaults


@hooked_transformer
def test_capture_records_the_first_ln1_call_and_the_attention_inputs(tl, ids):
    store = MemoryStore()
    record(tl, resolve(tl), store, ids)
    sites = store.block_sites(1)
    norms = [(s.module, s.call, s.ordinal) for s in sites if s.subpath == "norm"]
    assert norms == [("blocks.1.ln1", 0, 0), ("blocks.1.ln2", 0, 1)]  # ln1's calls 1 and 2 are no sites
    (attn,) = [s for s in sites if s.subpath == "attention"]
    inputs = attn.hidden_inputs()
    assert set(inputs) == {"primary", "query_input", "key_input", "value_input"}
    assert inputs["primary"] is inputs["query_input"]
    # What reached attention is ln1's output, which the norm site recorded.
    (ln1,) = [s for s in sites if s.module == "blocks.1.ln1"]
    assert torch.equal(inputs["key_input"], ln1.primary_output())


@hooked_transformer
@pytest.mark.parametrize("family", tl_samples.FAMILIES)
def test_same_weights_blame_nothing(family, ids):
    report = diff(tl_samples.reference(family=family), tl_samples.build(family=family), ids, **hooks(family))
    assert report.tolerance["policy"] == "fixed"
    assert report.first_divergence is None and not report.divergences
    embeds = ["embed", "embed"] if family == "gpt2" else ["embed"]
    assert [s.stage for s in report.stages] == [*embeds, "final_norm", "head"]
    for block in report.blocks:
        checked = {name for name, result in block.subpaths.items() if result.checks}
        assert checked == {"attention", "ffn", "norm", "residual"}
        # The residual experiment compares what reaches attention's query_input too.
        assert f"input of blocks.{block.index}.attn" in [c.what for c in block.subpaths["residual"].checks]


@hooked_transformer
@pytest.mark.parametrize("family", tl_samples.FAMILIES)
def test_hugging_face_as_the_candidate_of_transformer_lens(family, ids):
    # The candidate's blocks run the experiments: Hugging Face calls each norm once.
    cand_hooks = {"candidate_hooks": h for h in hooks(family).values()}
    report = diff(tl_samples.build(family=family), tl_samples.reference(family=family), ids, **cand_hooks)
    assert blamed(report) is None and not report.divergences
    if family == "llama":
        return
    # TransformerLens' [2, 16, 64] positional embedding against Hugging Face's [1, 16, 64].
    assert [s.stage for s in report.stages][:2] == ["embed", "embed"]
    assert report.stages[1].local is not None and not report.stages[1].local.diverged
    assert report.stages[1].drift_check is not None and not report.stages[1].drift_check.diverged
    # An ffn bug on the Hugging Face side is blamed there, not on later attention.
    from samples.hf_families import ffn_bug

    report = diff(tl_samples.build(), ffn_bug(family="gpt2", block=0), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(0, "ffn")]


@hooked_transformer
def test_without_broadcast_the_positional_embedding_is_a_shape_mismatch(hf, tl, ids):
    from dataclasses import replace

    from blockdiff.errors import ShapeMismatchError
    from blockdiff.hookmap import find

    bundled = find(tl)
    unbroadcast = replace(bundled, modules={**bundled.modules, "pos_embed": ModuleOptions(activations=())})
    with pytest.raises(ShapeMismatchError, match=r"embed #1 output: candidate has shape \[1, 16, 64\], reference \[2, 16, 64\]"):
        diff(tl, hf, ids, reference_hooks=unbroadcast)


@hooked_transformer
@pytest.mark.parametrize("family", tl_samples.FAMILIES)
@pytest.mark.parametrize("make", list(tl_samples.BUGS), ids=lambda make: make.__name__)
def test_planted_bug_is_blamed_on_its_block_and_sub_path_only(make, family, ids):
    report = diff(tl_samples.reference(family=family), make(family=family, block=1), ids, **hooks(family))
    assert blamed(report) == ("block", 1, tl_samples.BUGS[make])
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, tl_samples.BUGS[make])]


@hooked_transformer
def test_bfloat16_transformer_lens_against_float32_hugging_face(hf, ids):
    """Calibrated floors: Hugging Face's own code at bfloat16 calls each norm once."""
    report = diff(hf, tl_samples.build().to(torch.bfloat16), ids)
    assert report.tolerance["policy"] == "calibrated"
    assert blamed(report) is None and not report.divergences
    report = diff(hf, tl_samples.ffn_bug(block=1).to(torch.bfloat16), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(1, "ffn")]


@hooked_transformer
def test_an_ffn_bug_in_block_0_is_not_blamed_on_later_attention(hf, ids):
    """Without the activation keywords, TransformerLens attention ran on its own drifted
    inputs, and a block-0 MLP bug was blamed on attention in blocks 1-3."""
    report = diff(hf, tl_samples.ffn_bug(block=0), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(0, "ffn")]
    later = [c for b in report.blocks[1:] for c in b.subpaths["attention"].checks]
    assert later and not any(c.diverged for c in later)


@hooked_transformer
def test_cli_diffs_transformer_lens_against_hugging_face(capsys):
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_lens.py:build", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    assert "Traceback" not in err
    code, out, _ = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_lens.py:ffn_bug", "-q"], capsys)
    assert code == 1
    assert out.startswith("first divergence: block 1 ffn (blocks.1.mlp)")


@hooked_transformer
def test_a_dump_gets_the_activation_keywords_from_its_stored_layout(tl, ids, tmp_path):
    from blockdiff.dump import DumpReader
    from blockdiff.engine import capture
    from blockdiff.hookmap import layout_from_dict
    from blockdiff.pairing import pair_block

    path = tmp_path / "tl.h5"
    capture(tl, ids, path)
    live = MemoryStore()
    record(tl, resolve(tl), live, ids)
    with DumpReader(path) as dump:
        stored = layout_from_dict(dump.meta["layout"])
        assert stored.options("blocks.1.ln1").calls == "first"
        (attn,) = [s for s in dump.block_sites(1) if s.subpath == "attention"]
        assert attn.activations is None and attn.hidden_inputs() == {}  # the dump holds no names
        pair = pair_block(dump, live, 1, stored, resolve(tl))
    (paired,) = [s for s in pair.ref.values() if s.subpath == "attention"]
    assert set(paired.hidden_inputs()) == {"primary", "query_input", "key_input", "value_input"}


@hooked_transformer
def test_cli_diffs_hugging_face_against_transformer_lens(capsys, tmp_path, ids):
    # A HookedTransformer's embedding is no nn.Embedding: random tokens are sized by its cfg.d_vocab.
    code, out, err = run_cli(["diff", "samples/transformer_lens.py:build", "samples/hf_families.py:build_gpt2", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps(ids.tolist()))
    args = ["diff", "samples/transformer_lens.py:build", "samples/hf_families.py:build_gpt2", "--tokens", str(tokens), "-q"]
    code, out, err = run_cli(args, capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    code, out, err = run_cli(["arch", "samples/transformer_lens.py:build", "--json"], capsys)
    assert code == 0 and '"calls": "first"' in out and '"broadcast": true' in out, err


# -- TransformerLens 4 (and 3.9): TransformerBridge ---------------------------------------------------


@pytest.fixture(scope="module")
def bridge_gpt2():
    return bridges.build()


@transformer_bridge
def test_the_bundled_map_names_the_bridge_modules_by_their_transformer_lens_names(bridge_gpt2):
    layout = resolve(bridge_gpt2)
    assert layout.hook_map.name == "transformer_bridge"
    # The bridge registers each wrapped module twice; the layout names it as named_modules() does.
    assert bridge_gpt2.get_submodule("blocks.2.ln1") is bridge_gpt2.get_submodule("blocks.2._original_component.ln_1")
    assert layout.outside == [("embed", "embed"), ("embed", "pos_embed"), ("final_norm", "ln_final"), ("head", "unembed")]
    inner = "blocks.2._original_component"
    assert layout.blocks[2].subpaths == {
        "attention": [f"{inner}.attn"], "ffn": [f"{inner}.mlp"], "norm": [f"{inner}.ln_1", f"{inner}.ln_2"]
    }
    assert all(not block.unmapped for block in layout.blocks)
    llama = resolve(bridges.build_llama())
    assert llama.outside == [("embed", "embed"), ("context", "rotary_emb"), ("final_norm", "ln_final"), ("head", "unembed")]
    inner = "blocks.1._original_component"
    assert llama.blocks[1].subpaths == {
        "attention": [f"{inner}.self_attn"],
        "ffn": [f"{inner}.mlp"],
        "norm": [f"{inner}.input_layernorm", f"{inner}.post_attention_layernorm"],
    }
    assert all(not block.unmapped for block in llama.blocks)


@transformer_bridge
@pytest.mark.parametrize("family", bridges.FAMILIES)
@pytest.mark.parametrize("bridge_is", ["candidate", "reference"])
def test_a_bridge_around_the_same_weights_blames_nothing(family, bridge_is, ids):
    hf, bridge = bridges.reference(family=family), bridges.build(family=family)
    report = diff(hf, bridge, ids) if bridge_is == "candidate" else diff(bridge, hf, ids)
    assert report.tolerance["policy"] == "fixed"
    assert blamed(report) is None and not report.divergences
    embeds = ["embed", "embed"] if family == "gpt2" else ["embed", "context"]
    assert [s.stage for s in report.stages] == [*embeds, "final_norm", "head"]
    for block in report.blocks:
        checked = {name for name, result in block.subpaths.items() if result.checks}
        assert checked == {"attention", "ffn", "norm", "residual"}


@transformer_bridge
@pytest.mark.parametrize("family", bridges.FAMILIES)
@pytest.mark.parametrize("make", list(bridges.BUGS), ids=lambda make: make.__name__)
def test_a_bug_in_the_bridge_is_blamed_on_its_block_and_sub_path_only(make, family, ids):
    report = diff(bridges.reference(family=family), make(family=family, block=1), ids)
    assert blamed(report) == ("block", 1, bridges.BUGS[make])
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, bridges.BUGS[make])]


@transformer_bridge
def test_a_bridge_drill_down_leaves_its_hook_points_out(ids):
    """A bridge's hook points are identities its users hook into, not children to judge:
    the drill-down of its divergent MLP names the activation and lists no hook point among
    what pairs with nothing (it listed hook_in and hook_out)."""
    report = diff(bridges.reference(family="llama"), bridges.ffn_bug(family="llama", block=1), ids)
    check = report.first_divergence.check
    assert check.first_child is not None and check.first_child.module.endswith("act_fn")
    unpaired = [name for names in (check.children_not_paired or {}).values() for name in names]
    assert not any("hook_" in name for name in unpaired), unpaired


@transformer_bridge
@pytest.mark.parametrize("family", ["gemma2", "olmo2", "gpt_neox"])
def test_bridges_of_other_families_pair_with_their_hugging_face_model(family, ids):
    """Gemma2's four norms (ln1, ln1_post, ln2, ln2_post), OLMo2's two after their branches,
    GPT-NeoX's parallel block: nothing unmapped, nothing blamed, a Hugging Face MLP bug the
    bridge runs blamed there."""
    from samples import hf_families

    bridge = bridges.wrap(hf_families.build(family=family))
    assert all(not block.unmapped for block in resolve(bridge).blocks)
    report = diff(hf_families.build(family=family), bridge, ids)
    assert blamed(report) is None and not report.divergences
    report = diff(hf_families.build(family=family), bridges.wrap(hf_families.ffn_bug(family=family, block=1)), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, "ffn")]


@transformer_bridge
def test_the_bridge_as_the_reference_of_a_buggy_hugging_face_model(bridge_gpt2, ids):
    from samples import hf_families, hf_llama

    report = diff(bridge_gpt2, hf_families.attention_bug(family="gpt2", block=2), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 2, "attention")]
    report = diff(bridges.build_llama(), hf_llama.residual_dropped(block=0), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 0, "residual")]


@transformer_bridge
def test_the_bridge_against_a_from_scratch_gpt2(bridge_gpt2, ids):
    """Another implementation: nanoGPT-style GPT-2 with the same weights (no hook map
    written: detected), clean and with block 1's c_proj left untransposed."""
    from samples import gpt2_port

    report = diff(bridge_gpt2, gpt2_port.port(), ids)
    assert blamed(report) is None and not report.divergences
    report = diff(bridge_gpt2, gpt2_port.attn_proj_not_transposed(), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, "attention")]


@transformer_bridge
def test_bfloat16_bridge_against_float32_hugging_face(ids):
    """Calibrated floors: the Hugging Face reference's own modules in bfloat16."""
    hf = bridges.reference()
    report = diff(hf, bridges.build().to(torch.bfloat16), ids)
    assert report.tolerance["policy"] == "calibrated"
    assert blamed(report) is None and not report.divergences
    report = diff(hf, bridges.ffn_bug().to(torch.bfloat16), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, "ffn")]


@hooked_transformer
@transformer_bridge
def test_the_bridge_against_hooked_transformer(bridge_gpt2, tl, ids):
    """TransformerLens 3.9 holds both: the same weights through TransformerLens' weight
    conversion and through the bridge pair site by site, each map with its own options."""
    report = diff(tl, bridge_gpt2, ids)
    assert blamed(report) is None and not report.divergences
    report = diff(bridge_gpt2, tl_samples.ffn_bug(), ids)
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, "ffn")]


@transformer_bridge
def test_a_dump_of_a_bridge_is_a_reference(bridge_gpt2, ids, tmp_path):
    from blockdiff.engine import capture

    path = tmp_path / "bridge.h5"
    capture(bridge_gpt2, ids, path)
    report = diff(str(path), bridges.reference(), ids)
    assert blamed(report) is None and not report.divergences
    report = diff(str(path), bridges.norm_bug(), ids)
    assert [(d.stage, d.block, d.subpath, d.module) for d in report.divergences] == [
        ("block", 1, "norm", "blocks.1._original_component.ln_2")
    ]


@transformer_bridge
def test_cli_diffs_a_bridge_against_hugging_face(capsys):
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_bridge.py:build", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_bridge.py:ffn_bug", "-q"], capsys)
    assert code == 1, err
    assert out.startswith("first divergence: block 1 ffn (blocks.1._original_component.mlp)")


# -- what the bridge needs of blockdiff, with or without TransformerLens --------------------


class _Passing(nn.Module):
    """A module that computes with the module it wraps and passes attribute writes on to
    it, as TransformerLens 4's bridge components do (``GeneralizedComponent.__setattr__``)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self._original_component = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self._original_component.weight)  # not the wrapped forward

    def __setattr__(self, name: str, value) -> None:
        inner = self.__dict__.get("_modules", {}).get("_original_component")
        if not name.startswith("_") and inner is not None and hasattr(inner, name):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)


def test_a_frozen_forward_is_set_on_a_module_that_passes_attributes_on():
    from blockdiff.hooking import Hooks

    inner = nn.Linear(4, 4, bias=False)
    wrapper = _Passing(inner)
    with Hooks() as hooks:
        hooks.replace_forward(wrapper, lambda previous: lambda *args, **kwargs: "frozen")
        assert wrapper(torch.zeros(4)) == "frozen"
        assert "forward" not in inner.__dict__
    assert "forward" not in wrapper.__dict__ and "forward" not in inner.__dict__
    assert wrapper(torch.ones(4)).shape == (4,)


def test_a_module_registered_twice_is_mapped_by_either_path():
    from blockdiff.errors import HookMapError
    from blockdiff.hookmap import apply_map, parse

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self._original_component = nn.Module()
            self._original_component.norm = nn.LayerNorm(8)
            self._original_component.mixer = nn.Linear(8, 8)
            self.ln1, self.attn = self._original_component.norm, self._original_component.mixer

    model = nn.Module()
    model.embed = nn.Embedding(16, 8)
    model.blocks = nn.ModuleList([Block(), Block()])
    text = 'name = "twice"\n[outside]\nembed = "embed"\n[blocks]\npath = "blocks"\n[blocks.subpaths]\n'
    layout = apply_map(model, parse(text + 'attention = "attn"\nnorm = "ln1"\n', source="twice.toml"))
    assert layout.blocks[1].subpaths == {
        "attention": ["blocks.1._original_component.mixer"], "norm": ["blocks.1._original_component.norm"]
    }
    assert layout.blocks[1].unmapped == []
    with pytest.raises(HookMapError, match="'blocks.0.mlp' does not exist"):
        apply_map(model, parse(text + 'attention = "attn"\nffn = "mlp"\n', source="twice.toml"))
