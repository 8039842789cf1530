"""TransformerLens ``HookedTransformer`` against Hugging Face GPT-2 and Llama with the same
weights: the bundled ``transformer_lens`` map (activation keywords, ``ln1``'s first call,
the broadcast positional embedding) pairs the two codebases site by site."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformer_lens")

from blockdiff import diff  # noqa: E402
from blockdiff.capture import record  # noqa: E402
from blockdiff.autodetect import resolve  # noqa: E402
from blockdiff.hookmap import ModuleOptions  # noqa: E402
from blockdiff.store import MemoryStore  # noqa: E402
from samples import transformer_lens as tl_samples  # noqa: E402
from tests.conftest import blamed, run_cli  # noqa: E402



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
def test_the_sample_computes_the_hugging_face_logits(family, ids):
    with torch.no_grad():
        expected, got = tl_samples.reference(family=family)(ids).logits, tl_samples.build(family=family)(ids)
    assert float((got - expected).norm() / expected.norm()) < 1e-6


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


def test_without_broadcast_the_positional_embedding_is_a_shape_mismatch(hf, tl, ids):
    from dataclasses import replace

    from blockdiff.errors import ShapeMismatchError
    from blockdiff.hookmap import find

    bundled = find(tl)
    unbroadcast = replace(bundled, modules={**bundled.modules, "pos_embed": ModuleOptions(activations=())})
    with pytest.raises(ShapeMismatchError, match=r"embed #1 output: candidate has shape \[1, 16, 64\], reference \[2, 16, 64\]"):
        diff(tl, hf, ids, reference_hooks=unbroadcast)


@pytest.mark.parametrize("family", tl_samples.FAMILIES)
@pytest.mark.parametrize("make", list(tl_samples.BUGS), ids=lambda make: make.__name__)
def test_planted_bug_is_blamed_on_its_block_and_sub_path_only(make, family, ids):
    report = diff(tl_samples.reference(family=family), make(family=family, block=1), ids, **hooks(family))
    assert blamed(report) == ("block", 1, tl_samples.BUGS[make])
    assert [(d.stage, d.block, d.subpath) for d in report.divergences] == [("block", 1, tl_samples.BUGS[make])]


def test_bfloat16_transformer_lens_against_float32_hugging_face(hf, ids):
    """Calibrated floors: Hugging Face's own code at bfloat16 calls each norm once."""
    report = diff(hf, tl_samples.build().to(torch.bfloat16), ids)
    assert report.tolerance["policy"] == "calibrated"
    assert blamed(report) is None and not report.divergences
    report = diff(hf, tl_samples.ffn_bug(block=1).to(torch.bfloat16), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(1, "ffn")]


def test_an_ffn_bug_in_block_0_is_not_blamed_on_later_attention(hf, ids):
    """Without the activation keywords, TransformerLens attention ran on its own drifted
    inputs, and a block-0 MLP bug was blamed on attention in blocks 1-3."""
    report = diff(hf, tl_samples.ffn_bug(block=0), ids)
    assert [(d.block, d.subpath) for d in report.divergences] == [(0, "ffn")]
    later = [c for b in report.blocks[1:] for c in b.subpaths["attention"].checks]
    assert later and not any(c.diverged for c in later)


def test_cli_diffs_transformer_lens_against_hugging_face(capsys):
    code, out, err = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_lens.py:build", "-q"], capsys)
    assert (code, out.strip()) == (0, "no divergence"), err
    assert "Traceback" not in err
    code, out, _ = run_cli(["diff", "samples/hf_families.py:build_gpt2", "samples/transformer_lens.py:ffn_bug", "-q"], capsys)
    assert code == 1
    assert out.startswith("first divergence: block 1 ffn (blocks.1.mlp)")


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
