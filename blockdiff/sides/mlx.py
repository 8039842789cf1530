"""MLX sides: an ``mlx.nn.Module`` (an mlx-lm model, or a user's own MLX port) as a
candidate, judged teacher-forced (:mod:`blockdiff.sides.replaced`, docs/runtimes.md).

Each site is a module of the MLX model at the reference's module path (mlx-lm names the
Hugging Face families' modules as transformers does: ``model.layers.2.self_attn``); a site
whose path the MLX tree lacks is not exposed (the rotary tables: mlx-lm computes them inside
its attention). During a run each site's module is wrapped: its input and output are
recorded and, in a replaced run, the output handed on is the reference's value. MLX
evaluates lazily, so what is recorded is what the graph computes; nothing is evaluated
until the run ends.

Needs ``mlx`` (``pip install "blockdiff[mlx]"``: ``mlx[cpu]`` and ``mlx-lm`` on Linux).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

import numpy as np
import torch

from ..errors import InputError
from ..site import SiteKey
from . import Judged, Judging, Side
from .replaced import RuntimeSide, Tap, Values, mirrored, settings_notes
from ..report import coded

# The settings of an mlx-lm model's arguments compared with the reference's config.
SETTINGS = ("rope_theta", "rms_norm_eps", "num_attention_heads", "num_key_value_heads")
# MLX dtypes by name, as torch dtypes.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _mlx() -> Any:
    try:
        import mlx.core as mx
    except ImportError:
        raise InputError('an MLX candidate needs mlx: pip install "blockdiff[mlx]"') from None
    return mx


def _child(parent: Any, name: str) -> Any:
    """A child of an MLX module (a dict of its children) or an item of a list of them."""
    if isinstance(parent, list):
        return parent[int(name)]
    return parent.get(name) if isinstance(parent, dict) else None


def _at(model: Any, path: str) -> tuple[Any, str, Any] | None:
    """(parent, name, module) of the module at ``path`` in an MLX tree, or ``None``."""
    parent, node = None, model
    for name in path.split("."):
        parent = node
        try:
            node = _child(node, name)
        except (IndexError, ValueError, TypeError):
            return None
        if node is None:
            return None
    return parent, path.rsplit(".", 1)[-1], node


def _put(parent: Any, name: str, module: Any) -> None:
    if isinstance(parent, list):
        parent[int(name)] = module
    else:
        parent[name] = module


class MlxSide(RuntimeSide):
    """An MLX model as a candidate: its sites at the reference's module paths."""

    def __init__(self, name: str, model: Any, reference: Side, *, label: str | None = None) -> None:
        super().__init__(name, reference)
        mx = _mlx()
        self.model = model
        self.layout, self.taps = mirrored(reference.layout, self._exposed, "mlx")
        dtypes = {str(value.dtype).rsplit(".", 1)[-1] for _, value in _parameters(model)}
        own = next(iter(dtypes)) if len(dtypes) == 1 else "float32"
        self._dtype = _DTYPES.get(own, torch.float32)
        embed = next((tap for tap in self.taps if tap.key.stage == "embed"), None)
        node = _at(model, embed.output) if embed is not None else None
        weight = getattr(node[2], "weight", None) if node is not None else None
        self.vocab_size = int(weight.shape[0]) if weight is not None else 1 << 62
        self.meta = {
            "model": label or type(model).__name__,
            "class": f"{type(model).__module__}.{type(model).__name__}",
            "device": "cpu",
            "dtype": own,
            "hook_map": "mlx (the reference's module paths)",
            "runtime": f"MLX {getattr(mx, '__version__', '')}".strip(),
        }

    def _exposed(self, path: str, key: SiteKey) -> Tap | None:
        return Tap(key, path, path, f"{path}:input") if _at(self.model, path) is not None else None

    @property
    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        found = {}
        for package in ("mlx", "mlx-lm"):
            try:
                found[package] = version(package)
            except PackageNotFoundError:
                pass
        return found

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """``judge()``, with a note for each number of the MLX model's arguments (mlx-lm's
        ``model.args``) that is not the reference config's: mlx-lm reads some settings under
        older names only (transformers 5 keeps ``rope_theta`` in ``rope_parameters``), and a
        default it falls back to shows as every attention diverging."""
        judged = judge()
        args = getattr(self.model, "args", None)
        own = {
            name: (f"model.args.{name}", float(value))
            for name in SETTINGS
            if isinstance(value := getattr(args, name, None), (int, float)) and not isinstance(value, bool)
        }
        judging.notes.extend(coded("runtime-setting", settings_notes(own, self.reference.attribute("config"), "the MLX model's")))
        return judged

    def replaced(self, inputs: Any, values: Values) -> dict[str, torch.Tensor]:
        mx = _mlx()
        recorded: dict[str, Any] = {}
        wrappers = [_wrapping(self.model, tap, recorded, values, mx) for tap in self.taps]  # found before any is wrapped
        with ExitStack() as wrapped:
            for wrapper in wrappers:
                wrapped.enter_context(wrapper)
            ids = mx.array(inputs.detach().cpu().numpy().astype(np.int32))
            self.model(ids)
        return {name: _torch(value, mx) for name, value in recorded.items()}


def _parameters(model: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())
    return list(flat)


def _torch(value: Any, mx: Any) -> torch.Tensor:
    dtype = _DTYPES.get(str(value.dtype).rsplit(".", 1)[-1], torch.float32)
    out = torch.from_numpy(np.array(value.astype(mx.float32) if value.dtype != mx.float32 else value))
    return out.to(dtype) if dtype != torch.float32 else out


class _wrapping:
    """The module of ``tap`` wrapped while a run lasts: its input and output recorded, its
    output replaced by ``values``' (the reference's) where given."""

    def __init__(self, model: Any, tap: Tap, recorded: dict[str, Any], values: Values, mx: Any) -> None:
        import mlx.nn as nn

        found = _at(model, tap.output)
        assert found is not None
        self.parent, self.name, self.inner = found
        outer = self

        class Wrapped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = outer.inner

            def __getattr__(self, name: str) -> Any:  # the model reads its modules' settings
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(outer.inner, name)

            def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                out = self.inner(x, *args, **kwargs)
                recorded[tap.output] = out[0] if isinstance(out, tuple) else out
                if tap.input is not None:
                    recorded[tap.input] = x
                value = values(tap.output)
                if value is None:
                    return out
                own = recorded[tap.output]
                if tuple(value.shape) != tuple(own.shape):
                    value = value.reshape(tuple(own.shape))
                given = mx.array(value.detach().float().cpu().numpy()).astype(own.dtype)
                return (given, *out[1:]) if isinstance(out, tuple) else given

        self.wrapper = Wrapped()

    def __enter__(self) -> "_wrapping":
        _put(self.parent, self.name, self.wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        _put(self.parent, self.name, self.inner)


# -- the kind, as the factory asks for it

NAME = "mlx"


def claims(spec: Any) -> bool:
    """Whether ``spec`` is an MLX module (read off its class: mlx is not imported for it)."""
    return any(cls.__module__.startswith("mlx.") for cls in type(spec).__mro__ if cls.__name__ == "Module")


def opened(role: str, spec: Any, *, opened: ExitStack, like: Side | None, label: str | None) -> MlxSide:
    if role != "candidate" or like is None:
        raise InputError("an MLX model is a candidate: the reference is a PyTorch model (or its dump)")
    return MlxSide(role, spec, like, label=label)


__all__ = ["MlxSide", "NAME", "claims", "opened"]
