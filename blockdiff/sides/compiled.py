"""Compiled code in live sides: judge what ``torch.compile`` generated, never eager code
in its place (docs/design.md, "Judge what ran").

A live side whose model (or one of its modules) runs under ``torch.compile`` runs each
experiment's module compiled with that compile's own context (:func:`compiled_runnable`),
and a diff runs inside :func:`compiled_code_limits`, which keeps dynamo from silently
running eager code past its recompile limits.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn


def compiled_runnable(model: nn.Module, path: str, module: nn.Module, compiled: dict[str, Callable]) -> Callable:
    """What runs ``module`` (at ``path`` in ``model``) the way the model's own forward runs
    it: the module itself, or — inside a model or module under ``torch.compile`` — the
    module compiled with that compile's own backend and options, so that an experiment
    judges the generated code, not the eager module it was generated from. Compiled once
    per module, on first use, into ``compiled`` (the side's cache)."""
    if compile_context(module) is not None:
        return module  # compiled itself (`layers[i] = torch.compile(layer)`, `layer.compile()`)
    context = None
    parts = path.split(".") if path else []
    for depth in range(len(parts)):  # every ancestor; the innermost compiled one counts
        context = compile_context(model.get_submodule(".".join(parts[:depth]))) or context
    if context is None:
        return module
    found = compiled.get(path)
    if found is None:
        found = compiled[path] = context(module)
    return found


def compiled_forwards(model: nn.Module) -> list[str]:
    """The modules (``""``: the model) whose ``forward`` is a compiled function set on the
    instance — ``model.forward = torch.compile(model.forward)``, the way ports run — rather
    than a compiled module: the model's own run goes through the compiled function, while
    an experiment calls the modules inside it, eager code."""
    return [
        path for path, module in model.named_modules()
        if hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")
    ]


@contextlib.contextmanager
def compiled_code_limits(*models: nn.Module) -> Iterator[None]:
    """Compiled code that runs what blockdiff adds, room for the recompiles that causes, and
    no silent fallback to eager code.

    - By default dynamo does not guard on module hooks: a model compiled and run before
      blockdiff hooked it would keep running its old graph, without the hooks, and record
      nothing. Within a run, hooks are guarded; and when one of ``models`` holds compiled
      code, dynamo's caches are reset first (``torch.compiler.reset()``: other compiled
      functions of the process compile again on their next call).
    - Each experiment on a compiled module calls it with hooks or frozen modules of its
      own: a recompile per experiment. Past dynamo's recompile limit (8 per code object,
      shared by every block of a model) it would quietly run the eager code, and the
      experiment would judge code the candidate does not run. Within a run the limits are
      raised, and hitting one raises instead of falling back.
    """
    if not any(compile_context(module) is not None for model in models for module in model.modules()):
        yield  # no compiled code: nothing to guard (and dynamo is not imported)
        return
    from torch._dynamo import config

    torch.compiler.reset()
    # The names since torch 2.7, and before it.
    names = [("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")]
    limit, accumulated = (next(n for n in pair if hasattr(config, n)) for pair in names)
    settings = {limit: max(getattr(config, limit), 4096), accumulated: max(getattr(config, accumulated), 65536)}
    fail = next((n for n in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit") if hasattr(config, n)), None)
    if fail is not None:
        settings[fail] = True
    if hasattr(config, "skip_nnmodule_hook_guards"):
        settings["skip_nnmodule_hook_guards"] = False
    with config.patch(**settings):
        yield


def compile_context(module: nn.Module) -> Any:
    """The ``torch.compile`` context (backend and options) ``module`` runs under when it is
    compiled itself — an ``OptimizedModule``, or compiled in place with
    ``module.compile()`` — else ``None``."""
    if "torch._dynamo" not in sys.modules:
        return None  # nothing was ever compiled in this process
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    if isinstance(module, OptimizedModule):
        return module.dynamo_ctx
    compiled = module.__dict__.get("_compiled_call_impl")
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


__all__ = ["compile_context", "compiled_code_limits", "compiled_runnable"]
