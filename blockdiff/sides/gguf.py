"""GGUF sides: a ``.gguf`` file run by llama.cpp (through llama-cpp-python) as a candidate,
judged teacher-forced (:mod:`blockdiff.sides.replaced`, docs/runtimes.md).

llama.cpp names the tensors of its compute graph (``attn_norm-2``, ``attn_out-2``,
``ffn_out-2``, ``l_out-2``; read in its graph builder, ``src/models/llama.cpp``); its
context takes an eval callback (``cb_eval``) that the scheduler calls after each tensor it
asked for is computed, before anything reads it. There each site's tensor is read and, in a
replaced run, overwritten in place with the reference's value (ggml's
``ggml_backend_tensor_get``/``_set`` through ctypes, on the library llama-cpp-python ships).
:data:`ARCHITECTURES` maps an architecture's tensor names to the reference's anatomy.

The run: one sequence per row of token ids (the reference's), every token's logits,
the KV cache in float32 and flash attention off (llama.cpp's defaults — an F16 cache and
F16 K/V copies in its flash-attention path — put a clean float32 file 3.5e-4 from its
reference; float32 here: ~5e-7), one thread, no extra (AMX) buffer types (llama.cpp #20824:
Q8_0 weights in the AMX buffer crash).

Needs llama-cpp-python (``pip install "blockdiff[llamacpp]"``: a source build of llama.cpp).
"""

from __future__ import annotations

import ctypes
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InputError
from ..site import SiteKey
from . import Judged, Judging, Side
from .replaced import RuntimeSide, Tap, Values, mirrored, settings_notes
from ..report import Note, coded

# An architecture's tensor names for the reference's anatomy, ``{i}`` the block: the site
# whose output each tensor is, and the tensor that is its hidden input. ``embed`` has
# several names across llama.cpp releases (``inp_embd``, ``embd``): the first one the graph
# has is taken. Sub-path keys are (sub-path, ordinal) in the order the reference calls them.
LLAMA = {
    "embed": ("embd", None),
    "block": ("l_out-{i}", "{previous}"),
    ("norm", 0): ("attn_norm-{i}", "{previous}"),
    ("attention", 0): ("attn_out-{i}", "attn_norm-{i}"),
    ("norm", 1): ("ffn_norm-{i}", "ffn_inp-{i}"),
    ("ffn", 0): ("ffn_out-{i}", "ffn_norm-{i}"),
    "final_norm": ("result_norm", "{last}"),
    "head": ("result_output", "result_norm"),
}
# The GGUF architectures (``general.architecture``) whose graphs name their tensors so.
ARCHITECTURES: dict[str, dict[Any, tuple[str, str | None]]] = {"llama": LLAMA}
# Other names llama.cpp releases give a tensor of the map.
ALIASES = {"inp_embd": "embd"}

# GGUF metadata keys → the Hugging Face config's name for the same number.
SETTINGS = {
    "{arch}.rope.freq_base": "rope_theta",
    "{arch}.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "{arch}.attention.head_count": "num_attention_heads",
    "{arch}.attention.head_count_kv": "num_key_value_heads",
}

GGML_TYPE_F32 = 0
# File types whose weights are a float type, as the torch dtype they compute in.
PRECISIONS = {"BF16": torch.bfloat16, "F16": torch.float16}
# llama.cpp's file types (``general.file_type``: enum llama_ftype), by number.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


class _Tensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml.h), as far as the callback reads it."""

    _fields_ = [
        ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8),
    ]


def _llama() -> Any:
    try:
        import llama_cpp
        from llama_cpp import llama_cpp as api
    except ImportError:
        raise InputError('a GGUF candidate needs llama-cpp-python: pip install "blockdiff[llamacpp]"') from None
    return llama_cpp, api


_QUIET: Any = None
_GGML: Any = None


def _ggml() -> Any:
    """ggml's tensor functions from the library llama-cpp-python ships (once)."""
    global _GGML
    if _GGML is None:
        llama_cpp, _ = _llama()
        lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        for name in ("ggml_backend_tensor_get", "ggml_backend_tensor_set"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
        lib.ggml_is_contiguous.restype = ctypes.c_bool
        _GGML = lib
    return _GGML


class Model:
    """A GGUF file loaded by llama.cpp: what the side needs of it, read once."""

    def __init__(self, path: str | Path) -> None:
        global _QUIET
        llama_cpp, api = _llama()
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such GGUF file")
        if _QUIET is None:  # llama.cpp logs every load to stderr
            _QUIET = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *args: None)
            api.llama_log_set(_QUIET, None)
            api.llama_backend_init()
        params = api.llama_model_default_params()
        params.use_extra_bufts = False
        self.api = api
        self.version = getattr(llama_cpp, "__version__", "")
        self.handle = api.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.handle:
            raise InputError(f"{self.path}: llama.cpp could not load it (not a GGUF file, or an architecture this llama.cpp lacks)")
        self.architecture = self._meta("general.architecture")
        self.file_type = self._meta("general.file_type")
        self.vocab_size = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.handle))
        self.hidden = api.llama_model_n_embd(self.handle)
        self.blocks = api.llama_model_n_layer(self.handle)

    def _meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = self.api.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else ""

    def settings(self) -> dict[str, float]:
        """The numbers llama.cpp reads from the file's metadata that a conversion can get
        wrong without changing a weight, by the reference config's name for them."""
        found = {}
        for mine, theirs in SETTINGS.items():
            text = self._meta(mine.format(arch=self.architecture))
            try:
                found[theirs] = float(text)
            except ValueError:
                continue
        return found

    def close(self) -> None:
        if self.handle:
            self.api.llama_model_free(self.handle)
            self.handle = None


class GgufSide(RuntimeSide):
    """A GGUF file in llama.cpp as a candidate: its named graph tensors as the reference's
    sites (:data:`ARCHITECTURES`)."""

    def __init__(self, name: str, model: Model, reference: Side, *, label: str | None = None) -> None:
        super().__init__(name, reference)
        self.model = model
        names = ARCHITECTURES.get(model.architecture)
        if names is None:
            raise InputError(
                f"{model.path}: llama.cpp architecture {model.architecture!r} has no tensor map in blockdiff "
                f"(mapped: {', '.join(sorted(ARCHITECTURES))}); add one to blockdiff.sides.gguf.ARCHITECTURES"
            )
        self.names = names
        ref_vocab = _reference_vocabulary(reference)
        if ref_vocab is not None and ref_vocab != model.vocab_size:
            raise InputError(f"the GGUF's vocabulary is {model.vocab_size} tokens, the reference's {ref_vocab}: not the same model")
        ref_hidden = _reference_hidden(reference)
        if ref_hidden is not None and ref_hidden != model.hidden:
            raise InputError(f"the GGUF's hidden size is {model.hidden}, the reference's {ref_hidden}: not the same model")
        self.layout, self.taps = mirrored(reference.layout, self._exposed, f"llama.cpp {model.architecture}")
        self.vocab_size = model.vocab_size
        weights = FILE_TYPES.get(int(model.file_type), model.file_type) if model.file_type.isdigit() else model.file_type
        self.meta = {
            "model": label or str(model.path),
            "class": f"llama.cpp {model.architecture} ({weights} weights)",
            "device": "cpu",
            "dtype": "float32",
            "hook_map": f"llama.cpp {model.architecture} tensor names",
            "runtime": f"llama.cpp (llama-cpp-python {model.version})",
            "gguf": str(model.path),
            "weights": weights,
        }
        # Weights of a float type run in it (llama.cpp's matrix products round the
        # activations to it): judged against the reference's own code at that precision.
        # Quantized weights: no reference code computes so; judged on fixed thresholds.
        self._dtype = PRECISIONS.get(str(weights), torch.float32)
        self.meta["dtype"] = str(self._dtype).removeprefix("torch.")
        self.quantized = str(weights) not in ("F32", *map(str, PRECISIONS))

    def _exposed(self, path: str, key: SiteKey) -> Tap | None:
        if key.stage == "block" and key.subpath is None:
            entry = self.names.get("block")
        elif key.stage == "block":
            entry = self.names.get((key.subpath, key.ordinal))
        else:
            entry = self.names.get(key.stage)
        if entry is None:
            return None
        block = key.block if key.block is not None else 0
        previous = self.names["embed"][0] if block == 0 else self.names["block"][0].format(i=block - 1)
        last = self.names["block"][0].format(i=self.model.blocks - 1)

        def named(template: str | None) -> str | None:
            if template is None:
                return None
            return template.format(i=block, previous=previous, last=last) if "{" in template else template

        output = named(entry[0])
        assert output is not None
        return Tap(key, output, output, named(entry[1]))

    @property
    def versions(self) -> dict[str, str]:
        return {"llama-cpp-python": self.model.version}

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """``judge()``, with a note for each number of the file's metadata that is not the
        reference config's (a wrong rotary base shows as every attention diverging)."""
        judged = judge()
        weights = self.meta["weights"]
        if self.quantized:
            judging.notes.append(
                Note("gguf-quantized", f"the GGUF's weights are {weights}: blockdiff cannot run the reference's code at that precision, so "
                "each check is judged against fixed float32 thresholds (expect every sub-path above them; "
                "--rank N ranks them by error over threshold, the block that hurts most first)")
            )
        elif self._dtype != torch.float32:
            judging.notes.append(
                Note("gguf-precision", f"the GGUF's weights are {weights}: each check is judged against the reference's own code in "
                f"{self.meta['dtype']} (calibrated floors)")
            )
        own = {
            name: (next(k for k, v in SETTINGS.items() if v == name).format(arch=self.model.architecture), value)
            for name, value in self.model.settings().items()
        }
        judging.notes.extend(coded("runtime-setting", settings_notes(own, self.reference.attribute("config"), "the GGUF's metadata says")))
        return judged

    def replaced(self, inputs: Any, values: Values) -> dict[str, torch.Tensor]:
        ids = inputs.detach().cpu().to(torch.int64)
        if ids.dim() == 1:
            ids = ids[None]
        rows, tokens = ids.shape
        wanted = {name for tap in self.taps for name in (tap.output, tap.input) if name is not None}
        recorded: dict[str, np.ndarray] = {}
        ggml = _ggml()
        failure: list[BaseException] = []

        def seen(pointer: int, ask: bool, _: Any) -> bool:
            tensor = ctypes.cast(pointer, ctypes.POINTER(_Tensor)).contents
            name = tensor.name.decode(errors="replace")
            name = ALIASES.get(name, name)
            if ask:
                return name in wanted
            try:
                if tensor.type != GGML_TYPE_F32 or not ggml.ggml_is_contiguous(pointer):
                    return True
                shape = [int(n) for n in tensor.ne]
                out = np.empty(shape[::-1], dtype=np.float32)
                ggml.ggml_backend_tensor_get(pointer, out.ctypes.data, 0, out.nbytes)
                recorded[name] = out
                given = values(name)
                if given is not None:
                    new = np.ascontiguousarray(given.detach().to(torch.float32).cpu().numpy()).reshape(out.shape)
                    ggml.ggml_backend_tensor_set(pointer, new.ctypes.data, 0, new.nbytes)
            except BaseException as exc:  # never raise through C: stop the graph, raise after
                failure.append(exc)
                return False
            return True

        callback = self.model.api.ggml_backend_sched_eval_callback(seen)
        self._decode(ids, callback)
        if failure:
            raise failure[0]
        return {name: torch.from_numpy(value.reshape(rows, tokens, -1)) for name, value in recorded.items()}

    def _decode(self, ids: torch.Tensor, callback: Any) -> None:
        api, rows, tokens = self.model.api, ids.shape[0], ids.shape[1]
        params = api.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = max(rows * tokens, 32)
        params.n_seq_max = rows
        params.n_threads = params.n_threads_batch = 1
        params.type_k = params.type_v = GGML_TYPE_F32
        params.flash_attn_type = 0  # disabled
        params.cb_eval = callback
        params.cb_eval_user_data = None
        context = api.llama_init_from_model(self.model.handle, params)
        if not context:
            raise InputError(f"llama.cpp could not make a context for {rows} sequences of {tokens} tokens")
        batch = api.llama_batch_init(rows * tokens, 0, 1)
        try:
            for n, (row, position) in enumerate((r, p) for r in range(rows) for p in range(tokens)):
                batch.token[n] = int(ids[row, position])
                batch.pos[n] = position
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = row
                batch.logits[n] = 1
            batch.n_tokens = rows * tokens
            status = api.llama_decode(context, batch)
            if status != 0:
                raise InputError(f"llama.cpp's decode of the GGUF failed (status {status})")
        finally:
            api.llama_batch_free(batch)
            api.llama_free(context)


def _reference_vocabulary(reference: Side) -> int | None:
    found = getattr(reference.attribute("config"), "vocab_size", None)
    return int(found) if isinstance(found, int) else None


def _reference_hidden(reference: Side) -> int | None:
    found = getattr(reference.attribute("config"), "hidden_size", None)
    return int(found) if isinstance(found, int) else None


# -- the kind, as the factory asks for it

NAME = "gguf"


def claims(spec: Any) -> bool:
    """Whether ``spec`` is a GGUF file (a path ending in ``.gguf``) or a ``llama_cpp.Llama``."""
    if isinstance(spec, (str, Path)):
        return str(spec).lower().endswith(".gguf")
    return type(spec).__name__ == "Llama" and type(spec).__module__.startswith("llama_cpp")


def opened(role: str, spec: Any, *, opened: ExitStack, like: Side | None, label: str | None) -> GgufSide:
    if role != "candidate" or like is None:
        raise InputError("a GGUF file is a candidate: the reference is a PyTorch model (or its dump)")
    path = spec if isinstance(spec, (str, Path)) else getattr(spec, "model_path", None)
    if path is None:
        raise InputError("a llama_cpp.Llama without its model_path cannot be opened again")
    model = Model(path)
    opened.callback(model.close)
    return GgufSide(role, model, like, label=label or str(path))


__all__ = ["ARCHITECTURES", "GgufSide", "LLAMA", "NAME", "claims", "opened"]
