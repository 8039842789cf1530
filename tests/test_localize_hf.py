"""Hugging Face Llama-family models: clean precision changes blame nothing, planted bugs
are blamed on their block and sub-path (real transformers code, tiny configs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from blockdiff import diff, resolve  # noqa: E402
from samples import hf_llama  # noqa: E402
from tests.conftest import blamed  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2"])
def test_clean_bfloat16_blames_nothing(arch, ids):
    reference = hf_llama.build(arch=arch)
    candidate = hf_llama.build(arch=arch).to(torch.bfloat16)
    assert len(reference.model.layers) >= 4
    report = diff(reference, candidate, ids)
    assert report.first_divergence is None
    assert report.tolerance["policy"] == "calibrated"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(hf_llama.BUGS))
def test_llama_planted_bug_is_blamed(name, dtype, ids):
    stage, subpath = hf_llama.BUGS[name]
    candidate = getattr(hf_llama, name)(block=2).to(dtype)
    report = diff(hf_llama.build(), candidate, ids)
    assert blamed(report) == (stage, 2, subpath)
    assert len(report.divergences) == 1


def test_qwen3_attention_bug_is_blamed(ids):
    report = diff(hf_llama.build(arch="qwen3"), hf_llama.attention_scale(block=1, arch="qwen3").to(torch.bfloat16), ids)
    assert blamed(report) == ("block", 1, "attention")


def test_qwen3_q_norm_belongs_to_attention():
    layout = resolve(hf_llama.build(arch="qwen3"))
    block = layout.blocks[0]
    assert block.subpaths["attention"] == ["model.layers.0.self_attn"]
    assert block.subpaths["norm"] == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"]
    assert block.unmapped == []
    assert dict(layout.outside) == {
        "embed": "model.embed_tokens",
        "context": "model.rotary_emb",
        "final_norm": "model.norm",
        "head": "lm_head",
    }


def test_base_model_without_head_resolves(ids):
    model = hf_llama.build().model  # LlamaModel: no "model." level, no lm_head
    layout = resolve(model)
    assert [stage for stage, _ in layout.outside] == ["embed", "context", "final_norm"]
    report = diff(hf_llama.build().model, hf_llama.gelu_for_silu(block=3).model, ids)
    assert blamed(report) == ("block", 3, "ffn")
