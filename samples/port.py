"""A port checked against its reference: Hugging Face Llama weights copied into tinylm.

:func:`port_llama` moves the weights of a ``LlamaForCausalLM`` into
:class:`samples.tinylm.TinyLM` the way a port is usually done: the reference's state dict
is written with ``safetensors`` to a file and read back under tinylm's names
(:func:`tinylm_name`). :func:`llama_config` gives the HF config whose math matches a
tinylm :class:`~samples.tinylm.Config` (RMSNorm eps, rope_theta, rotate-half RoPE, grouped
KV heads repeated per group, SiLU gate, tied head), so the two implementations compute
the same function and blockdiff can check the port block by block. Factories:
:func:`reference` and :func:`port`, and a planted bug on either side
(:func:`port_gelu_for_silu`, :func:`port_rope_sign_flipped`,
:func:`reference_attention_scale`).

The two sides spell their rotary tables differently (tinylm: ``[seq, head_dim]``, HF:
``[1, seq, head_dim]``, the same values), and blockdiff compares a stage's outputs only
when their shapes are equal. :data:`REFERENCE_HOOKS` and :data:`PORT_HOOKS` are the two
bundled maps without their ``context`` stage, to pass to :func:`blockdiff.diff`;
:func:`write_hooks` writes them as TOML for the CLI's ``--ref-hooks`` / ``--cand-hooks``:

    blockdiff diff samples/port.py:reference samples/port.py:port \
        --ref-hooks llama-no-context.toml --cand-hooks tinylm-no-context.toml

Needs ``transformers``.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import replace
from pathlib import Path

from torch import nn

from blockdiff.hookmap import HookMap, bundled
from blockdiff.weights import trained_looking_

try:  # imported as samples.port (tests) or loaded from its file path (CLI)
    from . import bugs, tinylm
except ImportError:  # pragma: no cover
    import bugs
    import tinylm

# HF Llama state-dict name → tinylm name (``{i}`` is the block index).
NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.layers.{i}.input_layernorm.weight": "blocks.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blocks.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blocks.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blocks.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blocks.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blocks.{i}.attn.o_proj.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blocks.{i}.ffn.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blocks.{i}.ffn.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blocks.{i}.ffn.down_proj.weight",
}
_PATTERNS = [
    (re.compile("^" + re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), tiny) for hf, tiny in NAMES.items()
]


def tinylm_name(hf_name: str) -> str:
    """The tinylm parameter name of an HF Llama parameter.

    Raises:
        KeyError: a parameter tinylm has no place for (a bias, an untied head).
    """
    for pattern, tiny in _PATTERNS:
        found = pattern.match(hf_name)
        if found:
            return tiny.format(i=found.group(1)) if found.groups() else tiny
    raise KeyError(f"tinylm has no parameter for HF Llama's {hf_name!r}")


def llama_config(cfg: tinylm.Config | None = None):
    """The ``LlamaConfig`` whose model computes what tinylm with ``cfg`` computes."""
    import transformers

    cfg = cfg or tinylm.Config()
    if cfg.residual != "pre":
        raise ValueError(f"HF Llama blocks are pre-norm; tinylm config has residual={cfg.residual!r}")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.blocks,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )


def tinylm_config(hf_config) -> tinylm.Config:
    """The tinylm config of an HF ``LlamaConfig``.

    Raises:
        ValueError: the HF model computes something tinylm cannot (biases, another
            activation, an untied head, scaled RoPE).
    """
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    problems = []
    if hf_config.hidden_act != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} (tinylm: silu)")
    if hf_config.attention_bias or hf_config.mlp_bias:
        problems.append("biases in attention or MLP (tinylm has none)")
    if not hf_config.tie_word_embeddings:
        problems.append("an untied head (tinylm ties it to the embedding)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (tinylm: default)")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head_dim * hf_config.num_attention_heads != hf_config.hidden_size:
        problems.append(f"head_dim={head_dim} × {hf_config.num_attention_heads} heads != hidden size")
    if problems:
        raise ValueError("cannot port this Llama into tinylm: " + "; ".join(problems))
    return tinylm.Config(
        vocab_size=hf_config.vocab_size,
        hidden=hf_config.hidden_size,
        heads=hf_config.num_attention_heads,
        kv_heads=hf_config.num_key_value_heads,
        intermediate=hf_config.intermediate_size,
        blocks=hf_config.num_hidden_layers,
        eps=hf_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def port_llama(hf_model: nn.Module, *, into: tinylm.TinyLM | None = None) -> tinylm.TinyLM:
    """Copy a ``LlamaForCausalLM``'s weights into tinylm through a safetensors file.

    Args:
        hf_model: the reference.
        into: a tinylm to load the weights into (e.g. one with a planted bug); a new
            one built from the HF config when ``None``. Its config must match.

    Returns:
        The tinylm, in eval mode, with the reference's weights (in the reference's dtype).

    Raises:
        ValueError: the configs do not match, or a parameter has no counterpart.
    """
    from safetensors.torch import load_file, save_file

    cfg = tinylm_config(hf_model.config)
    model = into if into is not None else tinylm.TinyLM(cfg)
    if replace(model.cfg, residual="pre") != cfg:
        raise ValueError(f"tinylm config {model.cfg} does not match the reference's {cfg}")
    # safetensors refuses tensors that share memory: the tied head is written once, as the
    # embedding, and tied again on tinylm's side.
    seen: set[int] = set()
    state = {}
    for name, tensor in hf_model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().contiguous()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "reference.safetensors"
        save_file(state, str(path))
        loaded = load_file(str(path))
    mapped = {tinylm_name(name): tensor for name, tensor in loaded.items()}
    mapped["lm_head.weight"] = mapped["embed.weight"]
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    if missing or unexpected:
        raise ValueError(f"port incomplete: tinylm parameters not loaded {missing}, unused {unexpected}")
    return model.eval()


def _without_context(hook_map: HookMap) -> HookMap:
    outside = {stage: paths for stage, paths in hook_map.outside.items() if stage != "context"}
    return replace(hook_map, name=hook_map.name + "-no-context", outside=outside)


def _bundled(name: str) -> HookMap:
    return next(m for m in bundled() if m.name == name)


REFERENCE_HOOKS = _without_context(_bundled("llama"))
PORT_HOOKS = _without_context(_bundled("tinylm"))


def _toml(hook_map: HookMap) -> str:
    def value(v) -> str:
        return json.dumps(v[0] if len(v) == 1 else list(v))

    lines = [f"name = {json.dumps(hook_map.name)}", f"match = {json.dumps(list(hook_map.match))}"]
    if hook_map.prefix:
        lines.append(f"prefix = {json.dumps(hook_map.prefix)}")
    lines.append(f"optional = {json.dumps(list(hook_map.optional))}")
    lines += ["[outside]", *(f"{k} = {value(v)}" for k, v in hook_map.outside.items())]
    lines += ["[blocks]", f"path = {value(hook_map.blocks)}", "[blocks.subpaths]"]
    lines += [f"{k} = {value(v)}" for k, v in hook_map.subpaths.items()]
    if hook_map.moe:
        lines += ["[blocks.moe]", *(f"{k} = {json.dumps(v)}" for k, v in hook_map.moe.items())]
    return "\n".join(lines) + "\n"


def write_hooks(folder: str | Path) -> tuple[Path, Path]:
    """Write :data:`REFERENCE_HOOKS` and :data:`PORT_HOOKS` as TOML files in ``folder``,
    for ``blockdiff diff ... --ref-hooks REF --cand-hooks PORT``; returns their paths."""
    folder = Path(folder)
    paths = folder / "llama-no-context.toml", folder / "tinylm-no-context.toml"
    for path, hook_map in zip(paths, (REFERENCE_HOOKS, PORT_HOOKS)):
        path.write_text(_toml(hook_map), encoding="utf-8")
    return paths


# -- factories (the reference, the port, and a planted bug on either side) ------------------


def reference(*, seed: int = 0) -> nn.Module:
    """HF ``LlamaForCausalLM`` configured like tinylm's default config, trained-looking weights."""
    import transformers

    model = transformers.LlamaForCausalLM(llama_config())
    return trained_looking_(model, seed=seed).eval()


def port(*, seed: int = 0) -> tinylm.TinyLM:
    """tinylm with :func:`reference`'s weights."""
    return port_llama(reference(seed=seed))


def port_gelu_for_silu(*, block: int = bugs.DEFAULT_BLOCK) -> tinylm.TinyLM:
    """The port with GELU for SiLU in ``block``'s FFN."""
    return port_llama(reference(), into=bugs.gelu_for_silu(block=block))


def port_rope_sign_flipped(*, block: int = bugs.DEFAULT_BLOCK) -> tinylm.TinyLM:
    """The port with the rotary rotation's sign flipped in ``block``'s attention."""
    return port_llama(reference(), into=bugs.rope_sign_flipped(block=block))


def reference_attention_scale(*, block: int = bugs.DEFAULT_BLOCK) -> nn.Module:
    """The HF reference scaling ``block``'s attention scores by 1/d instead of 1/sqrt(d)."""
    model = reference()
    attn = model.model.layers[block].self_attn
    attn.scaling = 1.0 / attn.head_dim
    return model
