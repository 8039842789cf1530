"""Hooking: the one place blockdiff puts anything on someone else's model, and takes it off.

Hooks are global state on the user's model. Every recording, freezing or drill-down run
opens one :class:`Hooks` context; everything it adds — forward pre-hooks and hooks, an
instance ``forward`` that answers with recorded outputs, a wrapped in-place compiled call
(``module.compile()``) — is registered with it, and all of it is undone in ``finally``, in
reverse order, whatever happens in between (an instance ``forward`` the module already had
is put back). A hook that only records returns ``None`` (anything else would replace the
module's output).

>>> with Hooks() as hooks:                                   # doctest: +SKIP
...     hooks.before(module, lambda m, args, kwargs: None)
...     model(ids)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

_MISSING = object()


class Hooks:
    """Everything added to modules for one run, undone when the context closes."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Undo everything, last added first (idempotent)."""
        while self._undo:
            self._undo.pop()()

    def before(self, module: nn.Module, hook: Callable[[nn.Module, tuple, dict], None]) -> None:
        """``hook(module, args, kwargs)`` before each call of ``module``."""
        self._undo.append(module.register_forward_pre_hook(hook, with_kwargs=True).remove)

    def after(self, module: nn.Module, hook: Callable[[nn.Module, tuple, dict, Any], None]) -> None:
        """``hook(module, args, kwargs, output)`` after each call of ``module``."""
        self._undo.append(module.register_forward_hook(hook, with_kwargs=True).remove)

    def around(self, module: nn.Module, pre: Callable, post: Callable) -> None:
        """Both hooks, around ``module``'s calls. A module compiled in place
        (``module.compile()``) would run its own hooks inside its graph; its compiled call
        is wrapped instead, so the hooks run eagerly before and after it."""
        original = module.__dict__.get("_compiled_call_impl")
        if original is None:
            self.before(module, pre)
            self.after(module, post)
            return

        def recorded(*args: Any, **kwargs: Any) -> Any:
            pre(module, args, kwargs)
            output = original(*args, **kwargs)
            post(module, args, kwargs, output)
            return output

        module._compiled_call_impl = recorded
        self._undo.append(lambda: setattr(module, "_compiled_call_impl", original))

    def set_forward(self, module: nn.Module, forward: Callable) -> None:
        """``module.forward`` replaced, on the instance, by ``forward`` (see :meth:`replace_forward`)."""
        own = module.__dict__
        self._undo.append(functools.partial(_put_back, own, own.get("forward", _MISSING)))
        own["forward"] = forward

    def replace_forward(self, module: nn.Module, make: Callable[[Callable], Callable]) -> None:
        """``module.forward`` replaced, on the instance, by ``make(current forward)``.
        Set in the instance's own ``__dict__``, past any ``__setattr__`` of its class: a
        module may pass attributes on (TransformerLens 4's bridge components set an
        attribute their wrapped Hugging Face module has on that module, which the bridge's
        forward need not call); and a capture sets one on every site's module each run."""
        self.set_forward(module, make(module.forward))


def _put_back(own: dict, previous: Any) -> None:
    """An instance's ``forward`` as it was (none of its own: the class's again)."""
    if previous is _MISSING:
        own.pop("forward", None)
    else:
        own["forward"] = previous


class BufferCache:
    """A KV cache a model keeps in its own modules' buffers (a step adapter's
    ``cache_buffers``: keys first, then values), held apart from the model: what one
    experiment on ``module`` writes into while the model's own cache stays as its run left
    it. Made empty — zeros shaped like the buffers at hand — and swapped in around each
    run (:meth:`into`); whatever the run leaves in a buffer (written in place or assigned
    anew) is kept for the next run.

    Args:
        module: the module an experiment runs (its subtree's buffers of those names).
        names: the buffer names, e.g. ``("k_cache", "v_cache")``.
    """

    def __init__(self, module: nn.Module, names: tuple[str, ...]) -> None:
        self.names = tuple(names)
        self.tensors: dict[str, Any] = {}
        for rel, owner in module.named_modules():
            for name in self.names:
                held = owner._buffers.get(name, _MISSING)
                if held is not _MISSING:
                    self.tensors[f"{rel}.{name}" if rel else name] = None if held is None else held.new_zeros(held.shape)

    @staticmethod
    def held_by(module: nn.Module, names: tuple[str, ...]) -> bool:
        """Whether ``module`` or one of its children has a buffer of those names."""
        return any(name in owner._buffers for owner in module.modules() for name in names)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def into(self, module: nn.Module) -> "Hooks":
        """A :class:`Hooks` context for a run of ``module`` on this cache: the buffers
        swapped in, and on closing read back and the module's own put back."""
        hooks = Hooks()
        for full, tensor in self.tensors.items():
            rel, _, name = full.rpartition(".")
            owner = module.get_submodule(rel)
            own = owner._buffers[name]
            owner._buffers[name] = tensor

            def undo(owner: nn.Module = owner, name: str = name, full: str = full, own: Any = own) -> None:
                self.tensors[full] = owner._buffers[name]
                owner._buffers[name] = own

            hooks._undo.append(undo)
        return hooks

    def layer(self) -> tuple[Any, Any] | None:
        """(keys, values) of the first module holding both buffers, ``None`` while empty."""
        for full, keys in self.tensors.items():
            rel, _, name = full.rpartition(".")
            if name != self.names[0] or len(self.names) < 2:
                continue
            values = self.tensors.get(f"{rel}.{self.names[1]}" if rel else self.names[1])
            if keys is not None and values is not None and keys.numel():
                return keys, values
        return None


__all__ = ["BufferCache", "Hooks"]
