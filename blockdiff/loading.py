"""Loading: turn the CLI's model specs, dtype and device names into placed models.

A model spec is ``path/to/file.py:factory`` or ``package.module:factory``: a callable
returning an ``nn.Module``. The same spec may serve both sides; each side calls the
factory itself (a ``config.json``'s second side is a copy, below), so the two models are
separate objects.

A spec may also be a local Hugging Face model: a directory written by ``save_pretrained``
(loaded with ``from_pretrained(dir, local_files_only=True)``: nothing is downloaded), or a
``config.json`` (the model built from the config, with trained-looking weights drawn from
:data:`CONFIG_SEED`, so both sides built from one config get the same weights: the second
side is a copy of the first, bit for bit what building it again gives, without the drawing).

A checkpoint directory runs in its own dtype (its ``config.json``'s ``dtype``, or
``torch_dtype`` as older transformers wrote it) unless a dtype is asked for
(:func:`side_dtypes`); the model built from it says which dtype it was saved in
(:data:`~blockdiff.dtypes.CHECKPOINT_DTYPE`), and the report's header with it.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.util
import json
import sys
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .diskweights import ATTRIBUTE, attach, empty_model
from .dtypes import CHECKPOINT_DTYPE, DTYPES, dtype_name
from .errors import InputError, ModelSpecError, OptionsError
from .inputs import model_device, model_dtype
from .weights import trained_looking_

# Weight seed of models built from a config.json: fixed, so both sides agree.
CONFIG_SEED = 0

# The models built from a config.json, by the spec that built them (see build_model's like).
_FROM_CONFIG: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def parse_device(name: str) -> torch.device:
    """A device name; ``auto`` is CUDA when available, else the CPU.

    Raises:
        InputError: an unknown name, or CUDA asked for where there is none.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError(f"unknown device {name!r}; expected cpu, cuda, cuda:N, mps or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"device {name!r} asked for, but CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(
                f"device {name!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"device {name!r} asked for, but MPS is not available on this machine")
    return device


def parse_precision(text: str, default: torch.device) -> tuple[torch.dtype, torch.device]:
    """``DTYPE[@DEVICE]`` (``bfloat16``, ``float16@cuda:0``) as (dtype, device): how stored
    floors and baselines name a precision; the device defaults to ``default``."""
    from .dtypes import parse_dtype

    name, _, at = text.strip().partition("@")
    return parse_dtype(name), parse_device(at) if at else default


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """The factory a spec names.

    Raises:
        ModelSpecError: malformed spec, unknown file, module or attribute; a directory
            without ``config.json``.
    """
    hf = _hugging_face_factory(spec)
    if hf is not None:
        return hf
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr or not attr.isidentifier():
        _refuse_weights(spec)
        raise ModelSpecError(f"model spec {spec!r}: expected {ACCEPTED}", spec=spec)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target), spec)
    else:
        module = _import_module(target, spec)
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        close = difflib.get_close_matches(attr, names, n=3)
        guess = f"; did you mean {' or '.join(repr(n) for n in close)}?" if close else ""
        raise ModelSpecError(f"model spec {spec!r}: {target} has no attribute {attr!r}{guess}", spec=spec)
    if not callable(factory):
        raise ModelSpecError(f"model spec {spec!r}: {attr} is a {type(factory).__name__}, not callable", spec=spec)
    return factory


def _import_module(target: str, spec: str):
    """``target`` imported as ``python -m`` would import it: a package in the working
    directory is importable even from the console script, whose ``sys.path`` lacks it."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        top = target.split(".")[0]
        here = Path.cwd()
        held = (here / top).is_dir() or (here / f"{top}.py").is_file()
        if exc.name == top and str(here) not in sys.path and held:
            sys.path.insert(0, str(here))
            try:
                return importlib.import_module(target)
            except ImportError as again:
                exc = again  # type: ignore[assignment]
        where = "" if held else f" (the working directory holds no {top})"
        raise ModelSpecError(
            f"model spec {spec!r}: cannot import {target} ({exc}); a module is found on sys.path{where}: "
            "run from the directory that holds it, set PYTHONPATH, or name the file (path/to/file.py:factory)",
            spec=spec,
        ) from None
    except ImportError as exc:
        raise ModelSpecError(f"model spec {spec!r}: cannot import {target} ({exc})", spec=spec) from None


# What a model spec may be, as the errors say it.
ACCEPTED = (
    "path/to/file.py:factory or package.module:factory (a callable returning an nn.Module), "
    "a Hugging Face model directory or a config.json"
)
# Files that hold weights (or a pickled model), not code blockdiff can call.
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".gguf", ".npz", ".onnx")


def _refuse_weights(spec: str) -> None:
    """A checkpoint given as a model is refused with how to wrap it in a factory.

    Raises:
        ModelSpecError: ``spec`` names a weights file (by its suffix), or an existing file
            that is no Python source.
    """
    path = Path(spec)
    if path.suffix.lower() in WEIGHT_SUFFIXES or (path.is_file() and path.suffix != ".py"):
        raise ModelSpecError(
            f"model spec {spec!r}: a checkpoint holds weights, not a model; expected {ACCEPTED}, or an HDF5 "
            "dump. Wrap the checkpoint in a factory that builds the model and loads the weights into it, e.g. "
            f"in build.py: def build(): model = MyModel(); model.load_state_dict(torch.load({spec!r}, "
            "weights_only=True)); return model -- then pass build.py:build",
            spec=spec,
        )


def _hugging_face_factory(spec: str) -> Callable[[], nn.Module] | None:
    """A factory for a local Hugging Face model directory or config.json; ``None`` when
    ``spec`` is neither (then it is a ``file.py:factory`` or ``module:factory`` spec)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(
                f"model spec {spec!r}: {path} is a directory without config.json; expected a Hugging Face "
                "model directory (save_pretrained output)",
                spec=spec,
            )
        return lambda: _from_pretrained(path, spec)
    if path.suffix == ".json":
        if not path.is_file():
            raise ModelSpecError(f"model spec {spec!r}: no such file {path}", spec=spec)
        return lambda: _from_config(path, spec)
    return None


def _transformers(spec: str):
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            f"model spec {spec!r}: a Hugging Face model needs transformers (pip install blockdiff[hf])", spec=spec
        ) from None
    return transformers


def _config(transformers, path: Path, spec: str):
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # malformed JSON, unknown model_type, ...
        raise ModelSpecError(
            f"model spec {spec!r}: {path} is not a loadable Hugging Face config ({_first_line(exc)})",
            spec=spec,
        ) from exc


def _model_class(transformers, config):
    """The class the config names in ``architectures``, else the causal-LM auto class
    (or the base-model auto class for configs it does not know)."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _first_line(exc: BaseException) -> str:
    """``Type: message`` on one line (transformers' messages run over several)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _from_pretrained(path: Path, spec: str) -> nn.Module:
    transformers = _transformers(spec)
    cls = _model_class(transformers, _config(transformers, path, spec))
    hf_logging = transformers.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr is for the one-line error of the CLI
    try:
        return cls.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise ModelSpecError(
            f"model spec {spec!r}: cannot load the Hugging Face model in {path} ({_first_line(exc)})",
            spec=spec,
        ) from exc
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _without_weights(path: Path, spec: str) -> nn.Module:
    """The Hugging Face model in the directory ``path`` built from its config with its
    parameters on the meta device (:func:`~blockdiff.diskweights.empty_model`), naming
    its checkpoint (``blockdiff_checkpoint``): its weights are read when it runs."""
    transformers = _transformers(spec)
    config = _config(transformers, path, spec)
    cls = _model_class(transformers, config)
    try:
        with empty_model():
            model = cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)
    except Exception as exc:
        raise ModelSpecError(
            f"model spec {spec!r}: cannot build a model from {path / 'config.json'} ({_first_line(exc)})", spec=spec
        ) from exc
    setattr(model, ATTRIBUTE, str(path))
    return model


def _from_config(path: Path, spec: str) -> nn.Module:
    transformers = _transformers(spec)
    config = _config(transformers, path, spec)
    cls = _model_class(transformers, config)
    try:
        model = cls.from_config(config) if cls.__name__.startswith("AutoModel") else cls(config)
    except Exception as exc:
        raise ModelSpecError(
            f"model spec {spec!r}: cannot build a model from {path} ({_first_line(exc)})", spec=spec
        ) from exc
    model = model.float()
    # Norms computing x * (1 + w) (Gemma) are initialised to w = 0 by their model; their
    # trained-looking weights are drawn around 0, the others' around 1.
    offset = tuple(
        {
            type(m).__name__
            for m in model.modules()
            if "norm" in type(m).__name__.lower()
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1
            and not bool(m.weight.any())
        }
    )
    model = trained_looking_(model, seed=CONFIG_SEED, offset_norms=offset)
    _FROM_CONFIG[model] = str(path)
    return model


def checkpoint_dtype(spec: object) -> torch.dtype | None:
    """The dtype a checkpoint directory was saved in: its ``config.json``'s ``dtype``
    (``torch_dtype`` as transformers 4 wrote it), when that names a floating dtype
    blockdiff runs models in; ``None`` for any other spec, or a config naming none.

    >>> checkpoint_dtype("samples/tinylm.py:build") is None
    True
    """
    if not isinstance(spec, (str, Path)) or not Path(spec).is_dir():
        return None
    try:
        config = json.loads((Path(spec) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return DTYPES.get(name.lower().removeprefix("torch.")) if isinstance(name, str) else None


def side_dtypes(
    reference: object, candidate: object, asked: tuple[torch.dtype | None, torch.dtype | None]
) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes the two sides run in, from the dtypes ``asked`` (``None``: not asked):
    the reference's, else its checkpoint's own (:func:`checkpoint_dtype`), else float32;
    the candidate's, else its own checkpoint's when it is one given apart, else the
    reference's. So a directory saved in bfloat16 runs in bfloat16 against a float32 one,
    and ``--cand-dtype`` alone still compares precisions of one model."""
    ref = asked[0] or checkpoint_dtype(reference) or torch.float32
    own = checkpoint_dtype(candidate) if candidate is not None and candidate != reference else None
    return ref, asked[1] or own or ref


def _import_file(path: Path, spec: str):
    """Import a .py file; inside a package (``__init__.py`` beside it) by its dotted name,
    so its relative imports work."""
    if not path.is_file():
        raise ModelSpecError(f"model spec {spec!r}: no such file {path}", spec=spec)
    path = path.resolve()
    parts = [path.stem]
    root = path.parent
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        if len(parts) > 1:
            return importlib.import_module(name)
        loaded = importlib.util.spec_from_file_location(name, path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module
        loaded.loader.exec_module(module)
        return module
    except ModelSpecError:
        raise
    except Exception as exc:  # the user's file raised while importing
        raise ModelSpecError(
            f"model spec {spec!r}: importing {path.name} raised {type(exc).__name__}: {exc}", spec=spec
        ) from exc


def build_model(
    spec: str, *, device: torch.device, dtype: torch.dtype, like: object = None, from_disk: bool = False
) -> object:
    """Call the spec's factory and place what it returns on ``device`` in ``dtype``, eval
    mode, when it is an ``nn.Module``; anything else comes back as it is (an ONNX Runtime
    model is run as it was exported; :func:`~blockdiff.sides.factory.open_side` says what
    it accepts).

    Args:
        like: the other side's model. When the same ``config.json`` built it and it is
            still as built (float32, on the CPU), the model is a copy of it: its weights
            are drawn from :data:`CONFIG_SEED`, so the copy is bit for bit what building
            again gives, without the drawing (seconds for a model of 100M parameters).
            Any other spec is built again: a factory is the user's code, and a saved
            model's loader may draw what its files lack.
        from_disk: a Hugging Face directory is built without weights, and a model
            naming its checkpoint (``blockdiff_checkpoint``) reads its weights from it a
            block at a time (:mod:`blockdiff.diskweights`).

    Raises:
        ModelSpecError: the factory raised.
    """
    factory = load_factory(spec)
    if from_disk and Path(spec).is_dir():
        factory = functools.partial(_without_weights, Path(spec), spec)
    if _built_from_config(like, spec):
        model = copy.deepcopy(like)
    else:
        try:
            model = factory()
        except ModelSpecError:
            raise
        except Exception as exc:
            raise ModelSpecError(
                f"model spec {spec!r}: the factory raised {type(exc).__name__}: {exc}", spec=spec
            ) from exc
    if not isinstance(model, nn.Module):
        return model
    saved = checkpoint_dtype(spec)
    if saved is not None:  # the report's header says it, cast or not (modelinfo.describe)
        setattr(model, CHECKPOINT_DTYPE, dtype_name(saved))
    if reads_from_disk(model):
        if not from_disk:
            raise unread(spec, model)
        return attach(model, getattr(model, ATTRIBUTE), dtype=dtype, device=device).eval()
    return place(model, device=device, dtype=dtype).eval()


def unread(what: str, model: nn.Module) -> OptionsError:
    """The refusal of a model without weights run without a budget to read them with."""
    return OptionsError(
        "{what} has no weights in memory (its parameters are on the meta device) and names its checkpoint "
        "{checkpoint}: give {max_memory} to read them from disk a block at a time",
        what=what, checkpoint=getattr(model, ATTRIBUTE),
    )


def reads_from_disk(model: nn.Module) -> bool:
    """Whether ``model`` is built without weights (its parameters on the meta device) and
    names the checkpoint they are in (``model.blockdiff_checkpoint``: a Hugging Face
    directory of safetensors files)."""
    return getattr(model, ATTRIBUTE, None) is not None and all(
        p.device.type == "meta" for p in model.parameters()
    )


def _built_from_config(model: object, spec: str) -> bool:
    """Whether ``model`` is what the ``config.json`` ``spec`` builds, as it built it."""
    if not isinstance(model, nn.Module) or _FROM_CONFIG.get(model) != str(Path(spec)):
        return False
    return model_dtype(model) == torch.float32 and model_device(model).type == "cpu"


def dispatched(model: nn.Module) -> bool:
    """Whether a loader placed the model's modules itself (accelerate's ``device_map``,
    CPU or disk offload): its hooks move weights in at each call, and the model cannot be
    moved as a whole."""
    return getattr(model, "hf_device_map", None) is not None or any(
        hasattr(module, "_hf_hook") for module in model.modules()
    )


def place(model: nn.Module, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``model`` on ``device`` in ``dtype``, moved and cast only where it is not already.

    A model a loader dispatched (:func:`dispatched`) is used as it comes. Moving and
    casting are separate positional ``.to`` calls, which every ``nn.Module`` subclass
    accepts (TransformerLens's ``HookedTransformer.to`` takes no keywords).
    """
    if dispatched(model):
        if model_dtype(model) != dtype:
            raise ModelSpecError(
                f"the model was placed by its loader (accelerate device_map or offload) in "
                f"{dtype_name(model_dtype(model))}, not {dtype_name(dtype)}; blockdiff does not move or cast "
                f"such a model: load it in {dtype_name(dtype)} (torch_dtype=...), or ask for "
                f"{dtype_name(model_dtype(model))} (--ref-dtype/--cand-dtype)"
            )
        return model
    if model_device(model) != device:
        model = model.to(device)
    if model_dtype(model) != dtype:
        model = model.to(dtype)
    return model


DUMP_SUFFIXES = (".h5", ".hdf5")


def is_dump(spec: str) -> bool:
    """Whether a CLI model argument names an HDF5 dump rather than a model.

    A path ending in .h5/.hdf5 is a dump whether or not it exists (reading a missing one
    then says "no such file"); any other existing file that is HDF5 is one too.
    """
    path = Path(spec)
    if path.suffix.lower() in DUMP_SUFFIXES:
        return True
    if ":" in spec or not path.is_file():
        return False
    import h5py

    try:
        return bool(h5py.is_hdf5(path))
    except Exception:
        return False
