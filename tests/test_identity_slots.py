"""A module that computes nothing is no site: litgpt's ``Block`` holds ``post_attention_norm``
and ``post_mlp_norm`` as ``nn.Identity()`` unless its config asks for them, and
auto-detection must map only the real norms (``norm_1``, ``norm_2``), so that a litgpt
model pairs with an HF Llama of the same weights norm for norm.

The model below is litgpt's ``GPT`` (``litgpt/model.py``) cut down to what a Llama config
uses, with its names and order: ``transformer.wte``, ``transformer.h.N`` = ``norm_1``,
``attn`` (one fused ``qkv``, ``proj``), ``post_attention_norm``, ``norm_2``, ``mlp``
(``fc_1``, ``fc_2``, ``proj``), ``post_mlp_norm``; ``transformer.ln_f``, ``lm_head``;
rotary tables as buffers of the model (no module), rotate-half as HF's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockdiff import diff, resolve
from blockdiff.autodetect import detect
from tests.conftest import blamed

pytest.importorskip("transformers")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x_normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return (x_normed * self.weight.float()).to(dtype=dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_query_groups: int) -> None:
        super().__init__()
        self.n_head, self.n_query_groups, self.head_size = n_head, n_query_groups, dim // n_head
        self.qkv = nn.Linear(dim, (n_head + 2 * n_query_groups) * self.head_size, bias=False)
        self.proj = nn.Linear(n_head * self.head_size, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hs, query_size, key_size = self.head_size, self.n_head * self.head_size, self.n_query_groups * self.head_size
        q, k, v = self.qkv(x).split((query_size, key_size, key_size), dim=-1)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_query_groups, hs).transpose(1, 2)
        v = v.view(B, T, self.n_query_groups, hs).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q_per_kv = self.n_head // self.n_query_groups
        k, v = k.repeat_interleave(q_per_kv, dim=1), v.repeat_interleave(q_per_kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hs))
        return self.proj(y.transpose(1, 2).reshape(B, T, query_size))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class LLaMAMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(dim, hidden, bias=False)
        self.fc_2 = nn.Linear(dim, hidden, bias=False)
        self.proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_1 = RMSNorm(dim, eps)
        self.attn = CausalSelfAttention(dim, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.post_attention_norm = nn.Identity()
        self.norm_2 = RMSNorm(dim, eps)
        self.mlp = LLaMAMLP(dim, cfg.intermediate_size)
        self.post_mlp_norm = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attention_output = self.post_attention_norm(self.attn(self.norm_1(x), cos, sin))
        x = attention_output + x
        return self.post_mlp_norm(self.mlp(self.norm_2(x))) + x


class GPT(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers)),
                ln_f=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            )
        )
        head_size = cfg.hidden_size // cfg.num_attention_heads
        theta = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_size, 2).float() / head_size))
        angles = torch.outer(torch.arange(64).float(), theta).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        cos, sin = self.cos[:T].unsqueeze(0), self.sin[:T].unsqueeze(0)
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos.to(x.dtype), sin.to(x.dtype))
        return self.lm_head(self.transformer.ln_f(x))


def litgpt_of(hf_model: nn.Module) -> GPT:
    """``hf_model``'s (an HF ``LlamaForCausalLM``) weights in the litgpt-shaped model, as
    litgpt's ``convert_hf_checkpoint`` writes them: q, k, v rows concatenated into ``qkv``."""
    cfg = hf_model.config
    model = GPT(cfg)
    state = hf_model.state_dict()
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg.num_hidden_layers):
        hf, mine = f"model.layers.{i}.", f"transformer.h.{i}."
        out[f"{mine}norm_1.weight"] = state[f"{hf}input_layernorm.weight"]
        out[f"{mine}norm_2.weight"] = state[f"{hf}post_attention_layernorm.weight"]
        out[f"{mine}attn.qkv.weight"] = torch.cat([state[f"{hf}self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"{mine}attn.proj.weight"] = state[f"{hf}self_attn.o_proj.weight"]
        out[f"{mine}mlp.fc_1.weight"] = state[f"{hf}mlp.gate_proj.weight"]
        out[f"{mine}mlp.fc_2.weight"] = state[f"{hf}mlp.up_proj.weight"]
        out[f"{mine}mlp.proj.weight"] = state[f"{hf}mlp.down_proj.weight"]
    model.load_state_dict({k: v.detach().clone() for k, v in out.items()}, strict=True)
    return model.eval()


class NormWeightOffByOne(RMSNorm):
    """litgpt's ``add_unit_offset`` applied where the checkpoint's weights do not have it
    (Gemma-style ``1 + weight``): a norm bug."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x_normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return (x_normed * (1 + self.weight.float())).to(dtype=dtype)


@pytest.fixture(scope="module")
def reference() -> nn.Module:
    from samples import port

    return port.reference()


def test_identity_slots_are_no_sites(reference):
    model = litgpt_of(reference)
    hook_map = detect(model)
    assert hook_map.subpaths == {"norm": ("norm_1", "norm_2"), "attention": ("attn",), "ffn": ("mlp",)}
    layout = resolve(model)
    assert all(b.unmapped == [] for b in layout.blocks)
    assert dict(layout.outside)["final_norm"] == "transformer.ln_f"


def test_litgpt_shaped_port_of_hf_llama_blames_nothing(reference, ids):
    report = diff(reference, litgpt_of(reference), ids)
    assert report.candidate["hook_map"] == "auto"
    assert report.first_divergence is None, report.first_divergence.headline()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_bug_in_norm_2_is_blamed_on_its_block_norm(reference, ids, dtype):
    model = litgpt_of(reference)
    model.transformer.h[1].norm_2.__class__ = NormWeightOffByOne
    report = diff(reference, model.to(dtype), ids)
    assert blamed(report) == ("block", 1, "norm")
    assert report.first_divergence.module == "transformer.h.1.norm_2"


def test_a_slot_empty_in_some_blocks_only_is_optional_and_mapped_where_it_computes(reference, ids):
    """ModernBERT's first block has ``attn_norm = nn.Identity()``, the others a LayerNorm:
    the norm is optional, mapped in every block where it is one, in its place; nothing is
    unmapped, and the model diffed against itself in bfloat16 blames nothing."""
    model = litgpt_of(reference)
    model.transformer.h[0].norm_1 = nn.Identity()
    hook_map = detect(model)
    assert hook_map.subpaths["norm"] == ("norm_1", "norm_2") and hook_map.optional == ("norm_1",)
    layout = resolve(model)
    assert [b.unmapped for b in layout.blocks] == [[], [], [], []]
    assert [b.subpaths["norm"] for b in layout.blocks[1:]] == [
        [f"transformer.h.{i}.norm_1", f"transformer.h.{i}.norm_2"] for i in (1, 2, 3)
    ]
    twin = litgpt_of(reference)
    twin.transformer.h[0].norm_1 = nn.Identity()
    assert diff(model, twin.to(torch.bfloat16), ids).first_divergence is None
