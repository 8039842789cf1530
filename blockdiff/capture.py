"""Capture: forward hooks that record every site of a layout into a store.

Hooks are global state on someone else's model: :func:`capture` adds them and removes
every one in ``finally``, whatever happens in between. Recording hooks return ``None``
explicitly (anything else would replace the module's output) and keep copies, never
references, of inputs and outputs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from .hookmap import Layout
from .inputs import run_model
from .site import Site, snapshot
from .store import SiteStore


@contextmanager
def capture(model: nn.Module, layout: Layout, store: SiteStore) -> Iterator[SiteStore]:
    """Record every site of ``layout`` that runs inside the ``with`` body into ``store``.

    >>> with capture(model, layout, MemoryStore()) as store:   # doctest: +SKIP
    ...     model(ids)
    """
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    ordinals: dict[tuple, int] = {}
    open_sites: dict[str, list[Site]] = {}
    order = [0]
    handles = []

    def pre_hook(path: str, where: tuple[str, int | None, str | None]):
        stage, block, subpath = where

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            group = (stage, block, subpath)
            site = Site(
                stage=stage,
                block=block,
                subpath=subpath,
                module=path,
                call=calls.get(path, 0),
                ordinal=ordinals.get(group, 0),
                args=snapshot(args),
                kwargs=snapshot(kwargs),
                order=order[0],
            )
            calls[path] = site.call + 1
            ordinals[group] = site.ordinal + 1
            order[0] += 1
            open_sites.setdefault(path, []).append(site)
            return None

        return hook

    def post_hook(path: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            site = open_sites[path].pop()
            site.output = snapshot(output)
            store.add(site)
            return None

        return hook

    try:
        for path, where in layout.site_of().items():
            module = modules[path]
            handles.append(module.register_forward_pre_hook(pre_hook(path, where), with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook(path), with_kwargs=True))
        yield store
    finally:
        for handle in handles:
            handle.remove()


def record(model: nn.Module, layout: Layout, store: SiteStore, inputs: Any) -> Any:
    """Run ``model`` once on ``inputs`` under inference mode, recording into ``store``.

    Returns the model's output.
    """
    with capture(model, layout, store), torch.inference_mode():
        return run_model(model, inputs)
