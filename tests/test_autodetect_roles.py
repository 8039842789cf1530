"""Auto-detection by role: a token mixer under another name (``stack.N.mixer`` holding
``qkv`` and ``proj``), and an embedding and a head that are no ``nn.Embedding`` or
``nn.Linear`` (TransformerLens's ``Embed``/``Unembed`` anatomy), are found by what they
do; what still cannot be mapped is shown with the fix (a hook map passed with --hooks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff import diff, resolve
from blockdiff.autodetect import detect
from blockdiff.render import render_layout
from tests.conftest import blamed

FIX = "write a hook map (docs/hook-maps.md) and pass it with --hooks"
VOCAB, WIDTH, CONTEXT = 64, 32, 16


class Mixer(nn.Module):
    """Causal self-attention whose name says nothing: a fused qkv projection and an output one."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def scale(self) -> float | None:
        return None  # 1 / sqrt(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale())
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class WrongScale(Mixer):
    """The planted bug: softmax temperature 1 instead of 1 / sqrt(head_dim)."""

    def scale(self) -> float | None:
        return 1.0


class MaskedMixer(Mixer):
    """A mixer that cannot run alone (it needs a mask) and whose children say nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.out = self.qkv, self.proj
        del self.qkv, self.proj
        self.mix = nn.Linear(WIDTH, 2 * WIDTH)  # not 3 x hidden: nothing tells it from an FFN

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        a, v = self.mix(x).chunk(2, dim=-1)
        weights = (a @ a.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        return self.out(weights @ v)


class Layer(nn.Module):
    def __init__(self, mixer: type[nn.Module] = Mixer) -> None:
        super().__init__()
        self.ln_a = nn.LayerNorm(WIDTH)
        self.mixer = mixer()
        self.ln_b = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.mixer, MaskedMixer):
            t = x.shape[1]
            x = x + self.mixer(self.ln_a(x), torch.ones(t, t, dtype=torch.bool).tril())
        else:
            x = x + self.mixer(self.ln_a(x))
        return x + self.mlp(self.ln_b(x))


class Embed(nn.Module):
    """TransformerLens's Embed: a lookup in ``W_E`` [vocab, d]."""

    def __init__(self) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    """TransformerLens's PosEmbed: ``W_pos`` [n_ctx, d], one row per position."""

    def __init__(self) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_pos[: tokens.shape[-1]].expand(*tokens.shape, WIDTH)


class Unembed(nn.Module):
    """TransformerLens's Unembed: ``x @ W_U + b_U``, ``W_U`` [d, vocab]."""

    def __init__(self) -> None:
        super().__init__()
        self.W_U = nn.Parameter(torch.randn(WIDTH, VOCAB) / WIDTH**0.5)
        self.b_U = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.W_U + self.b_U


class MixerLM(nn.Module):
    """``stack.N`` = ln_a, mixer (qkv + proj), ln_b, mlp; plain torch embedding and head."""

    def __init__(self, mixer: type[nn.Module] = Mixer, blocks: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.stack = nn.ModuleList(Layer(mixer) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for layer in self.stack:
            x = layer(x)
        return self.out(self.ln_f(x))


class LensLike(nn.Module):
    """TransformerLens's anatomy: embed, pos_embed, blocks, ln_final, unembed."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()
        self.pos_embed = PosEmbed()
        self.blocks = nn.ModuleList(Layer() for _ in range(2))
        self.ln_final = nn.LayerNorm(WIDTH)
        self.unembed = Unembed()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.ln_final(x))


def twin(build, plant=None):
    """Two models with the same weights; ``plant`` changes the second in place."""
    torch.manual_seed(0)
    reference = build()
    candidate = build()
    candidate.load_state_dict(reference.state_dict())
    if plant is not None:
        plant(candidate)
    return reference, candidate


def tokens(n: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def test_mixer_named_otherwise_is_attention():
    layout = resolve(MixerLM())
    assert layout.hook_map.source == "auto-detected"
    assert layout.blocks[1].subpaths == {
        "attention": ["stack.1.mixer"],
        "ffn": ["stack.1.mlp"],
        "norm": ["stack.1.ln_a", "stack.1.ln_b"],
    }
    assert all(block.unmapped == [] for block in layout.blocks)
    assert layout.outside == [("embed", "tok"), ("final_norm", "ln_f"), ("head", "out")]


def test_detection_leaves_the_model_as_it_was():
    model = MixerLM().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    detect(model)
    assert torch.equal(torch.rand(3), expected)  # the probes drew nothing from the global RNG
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_detected_mixer_clean_diff_blames_nothing():
    reference, candidate = twin(MixerLM)
    assert diff(reference, candidate, tokens()).first_divergence is None
    assert diff(reference, candidate.to(torch.bfloat16), tokens()).first_divergence is None


def test_detected_mixer_bug_is_blamed_on_attention_of_its_block():
    def plant(model: MixerLM) -> None:
        model.stack[1].mixer.__class__ = WrongScale

    report = diff(*twin(MixerLM, plant), tokens())
    assert blamed(report) == ("block", 1, "attention")
    assert report.first_divergence.module == "stack.1.mixer"
    assert len(report.divergences) == 1


def test_a_fused_qkv_projection_marks_a_mixer_that_cannot_run_alone():
    class NeedsMask(Mixer):
        def forward(self, x, mask):  # the probe cannot call it: its children decide
            return super().forward(x)

    layout = resolve(MixerLM(NeedsMask))
    assert layout.blocks[0].subpaths["attention"] == ["stack.0.mixer"]


def test_embedding_and_head_by_their_role():
    layout = resolve(LensLike())
    assert layout.outside == [
        ("embed", "embed"),
        ("embed", "pos_embed"),
        ("final_norm", "ln_final"),
        ("head", "unembed"),
    ]
    assert layout.blocks[0].subpaths["attention"] == ["blocks.0.mixer"]


def test_role_embedding_and_head_bugs_are_blamed_on_their_stage():
    def head_bug(model: LensLike) -> None:
        with torch.no_grad():
            model.unembed.b_U += 1.0

    def embed_bug(model: LensLike) -> None:
        with torch.no_grad():
            model.embed.W_E[:, 0] *= -1

    assert diff(*twin(LensLike), tokens()).first_divergence is None
    report = diff(*twin(LensLike, head_bug), tokens())
    assert blamed(report) == ("head", None, None) and len(report.divergences) == 1
    report = diff(*twin(LensLike, embed_bug), tokens())
    assert blamed(report)[0] == "embed"
    assert report.first_divergence.module == "embed"


def test_a_mixer_that_cannot_be_detected_prints_the_fix(capsys):
    layout = resolve(MixerLM(MaskedMixer))
    assert "attention" not in layout.blocks[0].subpaths
    assert layout.blocks[0].unmapped == ["stack.0.mixer.mix", "stack.0.mixer.out"]
    render_layout(layout, "masked")
    out = " ".join(capsys.readouterr().out.split())
    assert "stack.0.mixer.mix" in out and FIX in out

    from blockdiff.render import render

    def plant(model: MixerLM) -> None:
        with torch.no_grad():
            model.stack[1].mixer.out.weight *= 2

    report = diff(*twin(lambda: MixerLM(MaskedMixer), plant), tokens())
    assert blamed(report) == ("block", 1, "unattributed")
    render(report)
    out = " ".join(capsys.readouterr().out.split())
    assert "stack.1.mixer.mix, stack.1.mixer.out belong to no sub-path" in out
    assert FIX in out
