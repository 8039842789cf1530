"""Compare a llama.cpp (GGUF) port of a Hugging Face Llama with blockdiff: the writer path.

UNTESTED AGAINST llama.cpp: blockdiff's tests do not build llama.cpp. What is tested
(tests/test_llamacpp_script.py) is this script's half — tensor files in llama.cpp's
layout and names, written from the PyTorch reference itself, converted into a dump that
``blockdiff diff`` compares. The llama.cpp half below follows llama.cpp's documented eval
callback (``cb_eval`` in ``llama_context_params``, as its ``examples/eval-callback`` uses
it) and its tensor names for Llama graphs; check both against your llama.cpp version.

1. Capture the reference on one sequence (llama.cpp evaluates one):
       blockdiff capture hf_model_dir --out ref.h5 --tokens ids.json      # [[1, 15043, ...]]
2. In llama.cpp, evaluate the same token ids once with an eval callback that writes
   every tensor named below as raw float32, ``DIR/NAME.f32``, and its shape (ggml's ne0,
   ne1, ...) as a line ``NAME ne0 ne1 ne2 ne3`` of ``DIR/shapes.txt``. A sketch (C++):

       static bool dump(ggml_tensor * t, bool ask, void * dir) {
           if (ask) return wanted(t->name);          // attn_norm-0, ffn_out-3, ...
           std::vector<float> out(ggml_nelements(t));
           ggml_backend_tensor_get(t, out.data(), 0, ggml_nbytes(t));   // F32 tensors only
           // write out to <dir>/<t->name>.f32; append "<name> ne[0] ne[1] ne[2] ne[3]" to shapes.txt
           return true;
       }
       ctx_params.cb_eval = dump; ctx_params.cb_eval_user_data = (void *) dir;

3. Convert and compare:
       python samples/llamacpp_dump.py DIR ref.h5 llamacpp.h5 --rope-theta 10000 --head-dim 128
       blockdiff diff ref.h5 llamacpp.h5

Tensor names (llama.cpp's Llama graph) → the reference's sites (the bundled Llama hook
map): ``inp_embd`` → embed, ``attn_norm-i`` → input_layernorm, ``attn_out-i`` → self_attn,
``ffn_norm-i`` → post_attention_layernorm, ``ffn_out-i`` → mlp, ``l_out-i`` → the block,
``result_norm`` → final norm, ``result_output`` → lm_head. llama.cpp applies the rotary
embedding inside its attention kernels, so the rotary tables (the reference's ``context``
site, which every dump must hold) are computed here from ``--rope-theta`` and
``--head-dim`` — that site compares this script's arithmetic, not llama.cpp's. A GGUF
quantized below float32 is compared on drift against fixed thresholds (or the floors the
reference stored with ``capture --floors``): expect drift everywhere; the first block
whose drift jumps is where to look.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from blockdiff.dumpfile import ForeignDumpWriter, reference_inputs

# (regular expression on the reference's module path, llama.cpp tensor name; {i}: the block)
NAMES = (
    (r"model\.embed_tokens", "inp_embd"),
    (r"model\.layers\.(\d+)\.input_layernorm", "attn_norm-{i}"),
    (r"model\.layers\.(\d+)\.self_attn", "attn_out-{i}"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm", "ffn_norm-{i}"),
    (r"model\.layers\.(\d+)\.mlp", "ffn_out-{i}"),
    (r"model\.layers\.(\d+)", "l_out-{i}"),
    (r"model\.norm", "result_norm"),
    (r"lm_head", "result_output"),
)


def tensor_name(module: str) -> str | None:
    """The llama.cpp tensor that holds what the reference's ``module`` computes."""
    for pattern, name in NAMES:
        found = re.fullmatch(pattern, module)
        if found:
            return name.format(i=found.group(1) if found.groups() else "")
    return None


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """``NAME.f32`` files and their ggml shapes from ``shapes.txt``, as numpy arrays in
    C order: ggml's ne0 (the fastest dimension) last, [n_tokens, n_embd] for activations."""
    found = {}
    for line in (folder / "shapes.txt").read_text().splitlines():
        name, *ne = line.split()
        dims = [int(n) for n in ne]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        found[name] = np.fromfile(folder / f"{name}.f32", dtype="<f4").reshape(dims[::-1])
    return found


def rotary(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """The default rotary tables (cos, sin) of Hugging Face Llama, float32, [1, seq, head_dim]."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1)[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def convert(folder: str | Path, reference: str | Path, out: str | Path, *, rope_theta: float, head_dim: int) -> None:
    """Write the dump ``out`` from llama.cpp's tensors in ``folder``, named by ``reference``."""
    tensors = read_tensors(Path(folder))
    ids = reference_inputs(reference)
    with ForeignDumpWriter(out, reference=reference, runtime="llama.cpp") as writer:
        writer.add_inputs(ids)
        for site in writer.sites():
            if site.stage == "context":
                writer.add(site.module, rotary(ids.shape[-1], head_dim, rope_theta), call=site.call)
                continue
            name = tensor_name(site.module)
            if name is None or name not in tensors:
                raise SystemExit(f"{site.module}: no llama.cpp tensor {name or '(no name known)'} in {folder}")
            writer.add(site.module, tensors[name].reshape(site.outputs[0]), call=site.call)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="llama.cpp tensors → a blockdiff candidate dump (see the module docstring)")
    parser.add_argument("folder", help="NAME.f32 files and shapes.txt written by the eval callback")
    parser.add_argument("reference", help="the reference dump (blockdiff capture ... --out ref.h5)")
    parser.add_argument("out", help="the candidate dump to write")
    parser.add_argument("--rope-theta", type=float, required=True)
    parser.add_argument("--head-dim", type=int, required=True)
    args = parser.parse_args(argv)
    convert(args.folder, args.reference, args.out, rope_theta=args.rope_theta, head_dim=args.head_dim)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
