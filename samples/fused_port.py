"""Ports that name their children as their own codebase does: what a drill-down must pair.

**A Llama port in Meta's style.** :class:`FusedLM` is a Llama written the way Meta's
``llama`` code and its descendants (gpt-fast) write it: ``model.tok_embeddings``,
``model.layers.N.attention`` with one fused ``wqkv`` projection and ``wo``,
``attention_norm``, ``ffn_norm``, ``feed_forward`` with ``w1`` (gate), ``w3`` (up) and
``w2`` (down) — or one fused ``w13`` — and SiLU applied as a function in the forward code,
``model.norm``, ``model.output`` tied to the embedding. Rotary tables are computed in the
forward (no module: no context stage) in HF's rotate-half layout, so the conversion
copies q and k rows as they are. :func:`convert_hf_llama` is its own conversion of a
``LlamaForCausalLM`` state dict: q, k and v concatenated into ``wqkv`` (gate and up into
``w13``). The reference is :func:`samples.port.reference` (HF Llama, tinylm's default
config). Factories: :func:`port`, :func:`port_w13`, and planted bugs in the port's
forward code (:func:`port_gelu_for_silu`, :func:`port_attention_scale`,
:func:`port_w13_gate_up_swapped`; :func:`port_own_projections_attention_scale`, whose
projections are of its own type) or its conversion (:func:`port_kv_swapped`,
:func:`port_gate_up_swapped`; in one block's ``wqkv``: :func:`qk_rotary_permuted_in_fused_qkv`,
q's and k's rows in llama.cpp's interleaved rotary order). With q, k and v biases
(``ModelArgs.qkv_bias``, on ``wqkv``): :func:`reference_qkv_bias` (HF Qwen2, the same
sizes), :func:`port_qkv_bias`, and :func:`kv_bias_swapped_in_fused_qkv` (one block's
``wqkv.bias`` written q, v, k).

**A GPT-2 port whose activation child has another name.** :func:`gpt2_port` is a second
HF ``GPT2LMHeadModel`` with :func:`gpt2_reference`'s weights whose MLPs are the port's
own :class:`GPT2PortMLP`: ``c_fc``, ``gelu`` (HF: ``act``), ``c_proj``, ``dropout``;
:func:`gpt2_port_wrong_activation` has another activation in one block's ``gelu``.

Needs ``transformers``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.weights import trained_looking_

try:  # imported as samples.fused_port (tests) or loaded from its file path (CLI)
    from . import bugs, hf_families, port as hf_port
except ImportError:  # pragma: no cover
    import bugs
    import hf_families
    import port as hf_port


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    hidden_dim: int = 172
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fused_ffn: bool = False  # one w13 for gate and up
    qkv_bias: bool = False  # a bias on wqkv (Qwen2's q, k and v biases)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._norm(x.float()).type_as(x)


def rotary_tables(args: ModelArgs, seqlen: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0..seqlen-1``, [seqlen, head_dim], in float32 then cast."""
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim)
    freqs = torch.arange(seqlen, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [bsz, seqlen, heads, head_dim]; rotate-half RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wqkv = nn.Linear(args.dim, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.softmax_scale = 1.0 / math.sqrt(args.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_kv_heads * self.head_dim
        xq, xk, xv = self.wqkv(x).split([self.n_heads * self.head_dim, kv_size, kv_size], dim=-1)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, cos, sin), apply_rotary_emb(xk, cos, sin)
        keys = xk.repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
        values = xv.repeat_interleave(self.n_rep, dim=2).transpose(1, 2)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) * self.softmax_scale + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.fused = args.fused_ffn
        if self.fused:
            self.w13 = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False)
        else:
            self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
            self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return gate, up
        return self.w1(x), self.w3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[-1]
        h = self.tok_embeddings(tokens)
        cos, sin = rotary_tables(self.args, seqlen, tokens.device, h.dtype)
        mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu(1).to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))


class FusedLM(nn.Module):
    """The port as its codebase ships it: a ``Transformer`` under ``model``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model = Transformer(args)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def model_args(hf_config, *, fused_ffn: bool = False) -> ModelArgs:
    """The port's arguments for an HF ``LlamaConfig``, or a ``Qwen2Config`` (a Llama with
    q, k and v biases: ``qkv_bias``), with tinylm's checks of what it can port."""
    qkv_bias = getattr(hf_config, "model_type", None) == "qwen2"
    if qkv_bias:  # tinylm refuses biases; the port holds these on wqkv, and Qwen2 has no others
        hf_config = copy.copy(hf_config)
        hf_config.attention_bias = hf_config.mlp_bias = False
    cfg = hf_port.tinylm_config(hf_config)
    return ModelArgs(
        dim=cfg.hidden, n_layers=cfg.blocks, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads, vocab_size=cfg.vocab_size,
        hidden_dim=cfg.intermediate, norm_eps=cfg.eps, rope_theta=cfg.rope_theta, fused_ffn=fused_ffn, qkv_bias=qkv_bias,
    )


def gguf_rotary_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``weight``'s rows (q or k, ``heads`` heads) permuted as llama.cpp's GGUF conversion
    permutes them for its interleaved rotary (``LlamaModel.permute``): per head of ``d``
    rows, ``0, d/2, 1, d/2 + 1, ...`` — wrong for a port whose rotary is rotate-half, as HF's."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def convert_hf_llama(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    *,
    qkv_order: str = "qkv",
    gate_up_order: str = "gate,up",
    qk_permuted_in: tuple[int, ...] = (),
    kv_bias_swapped_in: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """An HF ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) state dict under the port's
    names: ``wqkv`` = q, k and v rows concatenated (in ``qkv_order``), its bias likewise
    (``args.qkv_bias``), ``w13`` = gate and up rows (``args.fused_ffn``), else ``w1`` =
    gate and ``w3`` = up (``gate_up_order``: which HF weight becomes which). Mistakes in
    the blocks listed: ``qk_permuted_in``, q's and k's rows permuted by
    :func:`gguf_rotary_order`; ``kv_bias_swapped_in``, the bias written as q, v, k.

    Raises:
        KeyError: a parameter the port has no place for, or one it needs and lacks.
    """
    out = {
        "model.tok_embeddings.weight": state["model.embed_tokens.weight"],
        "model.norm.weight": state["model.norm.weight"],
    }
    first, second = gate_up_order.split(",")
    used = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(args.n_layers):
        hf, mine = f"model.layers.{i}.", f"model.layers.{i}."
        attn = {p: state[f"{hf}self_attn.{p}_proj.weight"] for p in "qkvo"}
        mlp = {p: state[f"{hf}mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
        if i in qk_permuted_in:
            attn["q"], attn["k"] = gguf_rotary_order(attn["q"], args.n_heads), gguf_rotary_order(attn["k"], args.n_kv_heads)
        out[f"{mine}attention.wqkv.weight"] = torch.cat([attn[p] for p in qkv_order])
        if args.qkv_bias:
            bias = {p: state[f"{hf}self_attn.{p}_proj.bias"] for p in "qkv"}
            out[f"{mine}attention.wqkv.bias"] = torch.cat([bias[p] for p in ("qvk" if i in kv_bias_swapped_in else qkv_order)])
            used |= {f"{hf}self_attn.{p}_proj.bias" for p in "qkv"}
        out[f"{mine}attention.wo.weight"] = attn["o"]
        if args.fused_ffn:
            out[f"{mine}feed_forward.w13.weight"] = torch.cat([mlp[first], mlp[second]])
        else:
            out[f"{mine}feed_forward.w1.weight"], out[f"{mine}feed_forward.w3.weight"] = mlp[first], mlp[second]
        out[f"{mine}feed_forward.w2.weight"] = mlp["down"]
        out[f"{mine}attention_norm.weight"] = state[f"{hf}input_layernorm.weight"]
        out[f"{mine}ffn_norm.weight"] = state[f"{hf}post_attention_layernorm.weight"]
        used |= {f"{hf}self_attn.{p}_proj.weight" for p in "qkvo"} | {f"{hf}mlp.{p}_proj.weight" for p in mlp}
        used |= {f"{hf}input_layernorm.weight", f"{hf}post_attention_layernorm.weight"}
    extra = sorted(set(state) - used)
    if extra:
        raise KeyError(f"the port has no place for {extra}")
    out["model.output.weight"] = out["model.tok_embeddings.weight"]
    return out


def port_of(hf_model: nn.Module, *, into: FusedLM | None = None, fused_ffn: bool = False, **conversion) -> FusedLM:
    """``hf_model``'s weights in the port (a new one, or ``into``: one with a planted bug),
    loaded strictly, in eval mode."""
    model = into if into is not None else FusedLM(model_args(hf_model.config, fused_ffn=fused_ffn))
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    model.load_state_dict(convert_hf_llama(state, model.model.args, **conversion), strict=True)
    model.model.output.weight = model.model.tok_embeddings.weight
    return model.eval()


# -- factories: the reference, the ports, planted bugs --------------------------------------


def reference(*, seed: int = 0) -> nn.Module:
    """HF ``LlamaForCausalLM``, tinylm's default config, trained-looking weights."""
    return hf_port.reference(seed=seed)


def reference_qkv_bias(*, seed: int = 0) -> nn.Module:
    """HF ``Qwen2ForCausalLM`` (a Llama with q, k and v biases), :func:`reference`'s sizes,
    trained-looking weights (biases ±0.1)."""
    import transformers

    llama = hf_port.llama_config()
    keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "rope_parameters", "hidden_act", "tie_word_embeddings",
        "max_position_embeddings",
    )
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: getattr(llama, k) for k in keys}))
    return trained_looking_(model, seed=seed).eval()


def port(*, seed: int = 0) -> FusedLM:
    """The port with :func:`reference`'s weights: fused ``wqkv``, ``w1, w3, w2``."""
    return port_of(reference(seed=seed))


def port_qkv_bias(*, seed: int = 0) -> FusedLM:
    """The port with :func:`reference_qkv_bias`'s weights: ``wqkv`` with a bias."""
    return port_of(reference_qkv_bias(seed=seed))


def port_w13(*, seed: int = 0) -> FusedLM:
    """The port with gate and up fused too (``w13``)."""
    return port_of(reference(seed=seed), fused_ffn=True)


def _blank(*, fused_ffn: bool = False) -> FusedLM:
    return FusedLM(model_args(hf_port.llama_config(), fused_ffn=fused_ffn))


def _replace_forward(module: nn.Module, name: str, **methods) -> None:
    """Give ``module`` (this one object, not its class) its own methods."""
    module.__class__ = type(name + type(module).__name__, (type(module),), methods)


def port_gelu_for_silu(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """The port's forward code applies GELU where SiLU belongs in ``block``'s feed-forward."""
    model = _blank()

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.w2(F.gelu(gate) * up)

    _replace_forward(model.model.layers[block].feed_forward, "GeluForSilu", forward=forward)
    return port_of(reference(), into=model)


def port_attention_scale(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """The port scales ``block``'s attention scores by 1/head_dim, not 1/sqrt(head_dim)."""
    model = _blank()
    attn = model.model.layers[block].attention
    attn.softmax_scale = 1.0 / attn.head_dim
    return port_of(reference(), into=model)


def port_w13_gate_up_swapped(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """The ``w13`` port's forward code takes the up half of ``w13``'s output as the gate in
    ``block``."""
    model = _blank(fused_ffn=True)

    def gate_up(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return up, gate

    _replace_forward(model.model.layers[block].feed_forward, "GateUpSwapped", gate_up=gate_up)
    return port_of(reference(), into=model)


def port_kv_swapped() -> FusedLM:
    """The conversion writes ``wqkv`` as q, v, k (every block): the fused projection is wrong."""
    return port_of(reference(), qkv_order="qvk")


def port_gate_up_swapped() -> FusedLM:
    """The conversion loads HF's up projection into ``w1`` (the gate) and the gate into ``w3``."""
    return port_of(reference(), gate_up_order="up,gate")


def qk_rotary_permuted_in_fused_qkv(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """The conversion permutes q's and k's rows for an interleaved rotary (llama.cpp's
    GGUF permute, :func:`gguf_rotary_order`) in ``block``'s ``wqkv``, whose rotary is HF's
    rotate-half: v and the other blocks are right."""
    return port_of(reference(), qk_permuted_in=(block,))


def kv_bias_swapped_in_fused_qkv(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """The ``wqkv`` port of :func:`reference_qkv_bias` whose conversion writes ``block``'s
    ``wqkv.bias`` as q, v, k (the weight is right)."""
    return port_of(reference_qkv_bias(), kv_bias_swapped_in=(block,))


class Projection(nn.Module):
    """A codebase's own projection layer (a weight and ``F.linear``, as tensor-parallel
    codebases write theirs): no type a drill-down knows, so it pairs by name only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def port_own_projections_attention_scale(*, block: int = bugs.DEFAULT_BLOCK) -> FusedLM:
    """:func:`port_attention_scale` whose blocks' projections are the port's own
    :class:`Projection`: none of its children pairs with HF's."""
    model = port_attention_scale(block=block)
    for layer in model.model.layers:
        for parent in (layer.attention, layer.feed_forward):
            for name, child in list(parent.named_children()):
                setattr(parent, name, Projection(child))
    return model


# -- a GPT-2 port whose activation child is named gelu ---------------------------------------


class GPT2PortMLP(nn.Module):
    """The port's GPT-2 MLP: HF's ``c_fc`` and ``c_proj`` (Conv1D), its activation named
    ``gelu``, and ``dropout``."""

    def __init__(self, mlp: nn.Module, gelu: nn.Module | None = None) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = mlp.c_fc, mlp.c_proj, mlp.dropout
        self.gelu = gelu if gelu is not None else mlp.act

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(hidden_states))))


def gpt2_reference(*, seed: int = 0) -> nn.Module:
    """HF ``GPT2LMHeadModel``, the tiny config of :mod:`samples.hf_families`."""
    return hf_families.build(family="gpt2", seed=seed)


def gpt2_port(*, seed: int = 0, wrong: dict[int, nn.Module] | None = None) -> nn.Module:
    """A second GPT-2 with the same weights, every MLP the port's :class:`GPT2PortMLP`
    (``wrong``: block → the activation module that block's MLP uses instead)."""
    model = gpt2_reference(seed=seed)
    for i, block in enumerate(model.transformer.h):
        block.mlp = GPT2PortMLP(block.mlp, (wrong or {}).get(i))
    return model.eval()


def gpt2_port_wrong_activation(*, block: int = bugs.DEFAULT_BLOCK) -> nn.Module:
    """The GPT-2 port whose ``gelu`` child in ``block`` is a SiLU."""
    return gpt2_port(wrong={block: nn.SiLU()})
