"""The sample model (samples/tinylm.py, pre-norm, dense) written again in JAX, writing a
candidate dump blockdiff compares with the PyTorch reference.

The foreign-runtime path end to end: the reference's weights exported to safetensors, the
reference captured to a dump, this port run on the dump's own token ids, and every site of
the reference written with :mod:`blockdiff.dumpfile` (no torch here):

    python -c "from samples import tinylm; from safetensors.torch import save_model; \\
               save_model(tinylm.build(), 'tinylm.safetensors')"
    blockdiff capture samples/tinylm.py:build --out ref.h5
    python samples/jax_tinylm.py tinylm.safetensors ref.h5 jax.h5 --teacher-forced
    blockdiff diff ref.h5 jax.h5

``--teacher-forced`` runs the port three times (:class:`~blockdiff.dumpfile.TeacherForcedWriter`):
with every site's value replaced by the reference's as it is computed, with the block
outputs replaced, and free; the diff then judges each sub-path by its local error. Without
it the port runs once, free, and is judged on drift only
(:class:`~blockdiff.dumpfile.ForeignDumpWriter`).

``--bug gelu@2`` (the ffn of block 2 uses GELU) or ``--bug scale@1`` (block 1's attention
scores scaled by 1/head_dim instead of 1/sqrt(head_dim)) plants a bug, which the
comparison must find in that block and sub-path.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from blockdiff.dumpfile import ForeignDumpWriter, TeacherForcedWriter, reference_inputs

jax.config.update("jax_default_matmul_precision", "highest")  # float32 matmuls, as torch on CPU


@dataclass(frozen=True)
class Config:
    """tinylm's defaults (samples/tinylm.py: Config)."""

    heads: int = 4
    kv_heads: int = 2
    eps: float = 1e-6
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class Bug:
    """A planted bug: ``kind`` (``gelu``: the ffn activation; ``scale``: the attention
    score scale) in block ``block``."""

    kind: str
    block: int

    @classmethod
    def parse(cls, text: str) -> "Bug":
        kind, _, block = text.partition("@")
        if kind not in ("gelu", "scale") or not block.isdigit():
            raise ValueError(f"--bug: expected gelu@BLOCK or scale@BLOCK, got {text!r}")
        return cls(kind, int(block))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def rotary(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def attention(w: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: Config, *, scale_bug: bool) -> jax.Array:
    b, s, hidden = x.shape
    head_dim = hidden // cfg.heads
    q = (x @ w["q_proj"].T).reshape(b, s, cfg.heads, head_dim).transpose(0, 2, 1, 3)
    k = (x @ w["k_proj"].T).reshape(b, s, cfg.kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = (x @ w["v_proj"].T).reshape(b, s, cfg.kv_heads, head_dim).transpose(0, 2, 1, 3)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    group = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scale = 1.0 / head_dim if scale_bug else head_dim**-0.5
    scores = (q @ k.transpose(0, 1, 3, 2)) * scale
    scores = jnp.where(jnp.triu(jnp.ones((s, s), dtype=bool), 1), -jnp.inf, scores)
    out = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
    return out @ w["o_proj"].T


def swiglu(w: dict, x: jax.Array, *, gelu_bug: bool) -> jax.Array:
    gate = x @ w["gate_proj"].T
    act = jax.nn.gelu(gate, approximate=False) if gelu_bug else jax.nn.silu(gate)
    return (act * (x @ w["up_proj"].T)) @ w["down_proj"].T


def params_from(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """tinylm's state dict (``embed.weight``, ``blocks.0.attn.q_proj.weight``, ...) as nested
    parameters; the tied head is whichever of its two names the export kept."""
    w = {k: jnp.asarray(v) for k, v in weights.items()}
    embed = w.get("embed.weight", w.get("lm_head.weight"))
    count = 1 + max(int(k.split(".")[1]) for k in w if k.startswith("blocks."))

    def sub(prefix: str, names: tuple[str, ...]) -> dict[str, jax.Array]:
        return {n: w[f"{prefix}.{n}.weight"] for n in names}

    blocks = [
        {
            "attn_norm": w[f"blocks.{i}.attn_norm.weight"],
            "ffn_norm": w[f"blocks.{i}.ffn_norm.weight"],
            "attn": sub(f"blocks.{i}.attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            "ffn": sub(f"blocks.{i}.ffn", ("gate_proj", "up_proj", "down_proj")),
        }
        for i in range(count)
    ]
    return {"embed": embed, "head": w.get("lm_head.weight", embed), "norm": w["norm.weight"], "blocks": blocks}


# What the forward does with each site's value: ``at(module, value, *inputs)`` returns what
# it goes on with (the value itself, or in a teacher-forced run the reference's).
At = Callable[..., Any]


def unchanged(module: str, value: Any, *inputs: Any) -> Any:
    return value


def forward(params: dict, ids: np.ndarray, cfg: Config = Config(), bug: Bug | None = None, *, at: At = unchanged) -> Any:
    """The model's forward, handing each of the reference's sites (tinylm's hook map: embed,
    rotary, blocks.i and its norms, attn, ffn; norm, lm_head) to ``at`` with its hidden
    input as it is computed, and going on with what ``at`` returns. Returns the logits."""
    x = at("embed", params["embed"][jnp.asarray(ids)])
    head_dim = x.shape[-1] // cfg.heads
    cos, sin = at("rotary", rotary(ids.shape[-1], head_dim, cfg.rope_theta))
    for i, w in enumerate(params["blocks"]):
        here = bug is not None and bug.block == i
        p = f"blocks.{i}"
        h = at(f"{p}.attn_norm", rms_norm(x, w["attn_norm"], cfg.eps), x)
        a = at(f"{p}.attn", attention(w["attn"], h, cos, sin, cfg, scale_bug=here and bug.kind == "scale"), h)
        h = at(f"{p}.ffn_norm", rms_norm(x + a, w["ffn_norm"], cfg.eps), x + a)
        f = at(f"{p}.ffn", swiglu(w["ffn"], h, gelu_bug=here and bug.kind == "gelu"), h)
        x = at(p, x + a + f, x)
    h = at("norm", rms_norm(x, params["norm"], cfg.eps), x)
    return at("lm_head", h @ params["head"].T, h)


def write_dump(weights: str, reference: str, out: str, *, bug: Bug | None = None, teacher_forced: bool = False) -> None:
    """Run the port on the reference dump's token ids, writing every site into ``out``: one
    free run, or (``teacher_forced``) its three runs, the reference's values substituted."""
    ids = reference_inputs(reference)
    params = params_from(load_file(weights))
    runtime = f"jax {jax.__version__} {jax.default_backend()}" + (f" (bug {bug.kind}@{bug.block})" if bug else "")

    def run_into(dump: ForeignDumpWriter) -> None:  # each site written, the port going on with what comes back
        forward(params, ids, bug=bug, at=lambda module, value, *inputs: dump.substitute(module, value, args=inputs))

    if not teacher_forced:
        with ForeignDumpWriter(out, reference=reference, runtime=runtime) as writer:
            writer.add_inputs(ids)
            run_into(writer)
        return
    with TeacherForcedWriter(out, reference=reference, runtime=runtime) as forced:
        forced.add_inputs(ids)
        for run in forced.runs():  # every site replaced, the block outputs replaced, free
            run_into(run)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("weights", help="the reference's weights (safetensors)")
    parser.add_argument("reference", help="the reference dump (blockdiff capture ... --out ref.h5)")
    parser.add_argument("out", help="the candidate dump to write")
    parser.add_argument("--bug", type=Bug.parse, help="plant a bug: gelu@BLOCK or scale@BLOCK")
    parser.add_argument(
        "--teacher-forced", action="store_true",
        help="write the runs with the reference's values substituted (judged by local errors, not drift)",
    )
    args = parser.parse_args(argv)
    write_dump(args.weights, args.reference, args.out, bug=args.bug, teacher_forced=args.teacher_forced)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
