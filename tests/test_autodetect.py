"""Auto-detection: a model no bundled map matches is mapped from its module tree, says so
(``source == "auto-detected"``, shown by ``blockdiff arch``), and is diffed correctly; a model
that cannot be mapped is a clear error pointing to ``--hooks``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from blockdiff import HookMapError, diff, hookmap, resolve
from blockdiff.cli import main
from samples import bugs, tinylm
from tests.conftest import blamed

ROOT = Path(__file__).resolve().parent.parent


class RenamedLM(tinylm.TinyLM):
    """tinylm under a class name no bundled map knows."""


def renamed(model: tinylm.TinyLM) -> tinylm.TinyLM:
    model.__class__ = RenamedLM
    return model


def test_unknown_class_with_tinylm_anatomy_is_detected_like_its_map():
    model = renamed(tinylm.build())
    layout = resolve(model)
    assert layout.hook_map.source == hookmap.AUTO_DETECTED == "auto-detected"
    assert layout.hook_map.match == ("RenamedLM",)
    bundled = resolve(tinylm.build())
    assert layout.outside == bundled.outside
    assert [(b.path, b.subpaths, b.unmapped) for b in layout.blocks] == [
        (b.path, b.subpaths, b.unmapped) for b in bundled.blocks
    ]


@pytest.mark.parametrize("name", ["gelu_for_silu", "attention_scale", "norm_as_layernorm", "residual_dropped"])
def test_detected_model_bug_is_blamed(name, ids):
    stage, subpath = bugs.BUGS[name]
    candidate = renamed(getattr(bugs, name)(block=2)).to(torch.bfloat16)
    report = diff(renamed(tinylm.build()), candidate, ids)
    assert report.reference["hook_map"] == "auto"
    assert blamed(report) == (stage, 2, subpath)
    assert len(report.divergences) == 1


def test_detected_model_clean_bfloat16_blames_nothing(ids):
    report = diff(renamed(tinylm.build()), renamed(tinylm.build()).to(torch.bfloat16), ids)
    assert report.first_divergence is None


def test_renamed_hugging_face_llama_is_detected_and_diffed(ids):
    pytest.importorskip("transformers")
    from samples import hf_llama

    def rename(model):
        model.__class__ = type("MyLlamaForCausalLM", (type(model),), {})
        return model

    reference = rename(hf_llama.build(arch="qwen3"))
    layout = resolve(reference)
    assert layout.hook_map.source == "auto-detected"
    assert layout.blocks[1].subpaths == resolve(hf_llama.build(arch="qwen3")).blocks[1].subpaths
    assert dict(layout.outside) == {
        "embed": "model.embed_tokens", "context": "model.rotary_emb", "final_norm": "model.norm", "head": "lm_head",
    }
    report = diff(reference, rename(hf_llama.residual_dropped(block=3, arch="qwen3")).to(torch.bfloat16), ids)
    assert blamed(report) == ("block", 3, "residual")
    assert len(report.divergences) == 1


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class SparseMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 6)
        self.experts = nn.ModuleList(Expert() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(8)
        self.block_sparse_moe = SparseMoe()
        self.gate = nn.Parameter(torch.ones(8))  # a block's own parameter: no sub-path has it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.gate * self.block_sparse_moe(self.ln_2(x))


class Net(nn.Module):
    """Two blocks of six experts: the longest list of same-class modules is the experts'."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, 8)
        self.stack = nn.Sequential(Layer(), Layer())
        self.out_norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.out_norm(self.stack(self.tok(ids))))


def test_detection_rules_on_a_plain_torch_model():
    layout = resolve(Net())
    assert layout.hook_map.blocks == ("stack",)  # not a block's experts list, though longer
    assert layout.blocks[1].subpaths == {
        "attention": ["stack.1.attention"],
        "ffn": ["stack.1.block_sparse_moe"],
        "norm": ["stack.1.ln_1", "stack.1.ln_2"],
    }
    # The block's own `gate` is glue: scaling by a block parameter is the residual's.
    assert layout.blocks[1].unmapped == []
    assert layout.outside == [("embed", "tok"), ("final_norm", "out_norm"), ("head", "proj")]


def test_detected_plain_torch_model_finds_a_bug_in_its_moe(ids):
    torch.manual_seed(0)
    reference = Net()
    candidate = Net()
    candidate.load_state_dict(reference.state_dict())
    expert = candidate.stack[0].block_sparse_moe.experts[3]
    expert.forward = lambda x: expert.down(torch.tanh(expert.up(x)))  # tanh for relu in one expert
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    report = diff(reference, candidate, tokens)
    assert blamed(report) == ("block", 0, "ffn")
    # Only block 0 is blamed, though block 1 reads its output: MultiheadAttention is called
    # as attention(h, h, h), and the key and value, passed positionally, are replaced by the
    # reference's like the query.
    assert len(report.divergences) == 1
    assert report.blocks[1].drift.rel_l2 > 1e-2
    assert report.blocks[1].subpaths["attention"].checks[0].metrics.rel_l2 < 1e-6


@pytest.mark.parametrize(
    "model,message",
    [
        (nn.Identity(), "no block list (a ModuleList or Sequential of two or more modules of one class)"),
        (nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "have no module named or typed like attention"),
    ],
    ids=["no-blocks", "no-attention-or-ffn"],
)
def test_unmappable_model_points_to_hooks(model, message):
    with pytest.raises(HookMapError) as raised:
        resolve(model)
    text = str(raised.value)
    assert text.startswith(
        f"no hook map matches model class {type(model).__name__}; write one and pass it with --hooks FILE.toml"
    )
    assert "docs/hook-maps.md" in text and message in text


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    (tmp_path / "unknown.py").write_text(
        "from torch import nn\n"
        "from samples import tinylm, bugs\n"
        "class MyLM(tinylm.TinyLM):\n    pass\n"
        "def build():\n    m = tinylm.build(); m.__class__ = MyLM; return m\n"
        "def buggy():\n    m = bugs.attention_scale(block=3); m.__class__ = MyLM; return m\n"
        "def shapeless():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"
    )
    os.chdir(ROOT)
    return tmp_path


def test_arch_shows_what_was_guessed(factories, capsys):
    main(["arch", f"{factories}/unknown.py:build"])
    out = capsys.readouterr().out
    assert "hook map auto (auto-detected), 4 blocks" in out
    assert "attn_norm, ffn_norm" in out
    main(["arch", f"{factories}/unknown.py:build", "--json"])
    layout = json.loads(capsys.readouterr().out)
    assert layout["source"] == "auto-detected"
    assert layout["blocks"][0]["subpaths"]["attention"] == ["blocks.0.attn"]


def test_cli_diffs_a_detected_model(factories, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["diff", f"{factories}/unknown.py:build", f"{factories}/unknown.py:buggy", "-q"])
    out = capsys.readouterr().out
    assert exited.value.code == 1
    assert out.startswith("first divergence: block 3 attention (blocks.3.attn)")


def test_cli_unmappable_model_is_one_line_pointing_to_hooks(factories, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["diff", f"{factories}/unknown.py:shapeless"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(
        "Error: no hook map matches model class Sequential; write one and pass it with --hooks FILE.toml"
    )


def test_a_bundled_map_wins_over_detection():
    assert resolve(tinylm.build()).hook_map.source == "hooks/tinylm.toml"
