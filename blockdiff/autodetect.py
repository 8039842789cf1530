"""Auto-detection: a hook map guessed from a model's module tree.

:func:`~blockdiff.hookmap.resolve` falls back on :func:`detect` when no map is given and
no bundled map matches the model's class; the guess is a :class:`~blockdiff.hookmap.HookMap`
like any other, with ``source == "auto-detected"``, so capture and localization treat it
the same. The rules are documented in ``docs/hook-maps.md``, "Auto-detection".
"""

from __future__ import annotations

import re

from torch import nn

from .errors import HookMapError
from .hookmap import AUTO_DETECTED, HookMap

# -- auto-detection ----------------------------------------------------------------------
#
# Rules (documented in docs/hook-maps.md, "Auto-detection"). Words are matched in the
# lower-cased last component of a module's path and in its lower-cased class name.
_NORM_NAME = re.compile(r"norm|(^|_)ln($|_|\d)")
_ATTENTION_WORDS = ("attn", "attention")
_FFN_WORDS = ("mlp", "ffn", "feed_forward", "feedforward", "experts", "moe")
_CONTEXT_WORDS = ("rotary", "rope")


def _role(path: str, module: nn.Module) -> str | None:
    """The sub-path a module inside a block plays, guessed from its name and class.

    Norms are tried first: ``post_attention_layernorm`` and ``pre_feedforward_layernorm``
    are norms, not attention or FFN."""
    leaf = path.rsplit(".", 1)[-1].lower()
    cls = type(module).__name__.lower()
    if "norm" in cls or _NORM_NAME.search(leaf):
        return "norm"
    if not _has_parameters(module):
        return None  # dropouts, activations, rotary tables: nothing to attribute
    if any(w in leaf or w in cls for w in _ATTENTION_WORDS):
        return "attention"
    if any(w in leaf or w in cls for w in _FFN_WORDS):
        return "ffn"
    return None


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_lists(model: nn.Module) -> list[str]:
    """Paths of the model's block lists: the longest ModuleList/Sequential whose children
    (two or more) share one class (subclasses count as their base), plus any other such
    list of the same class (the second stack of an encoder-decoder). Lists inside another
    list's elements (MoE experts) and lists of parameterless modules are not candidates."""
    found: list[tuple[str, type, int]] = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            # One class; a subclass counts as its base (a block patched with a bug).
            bases = [c for c in {type(m) for m in children} if all(isinstance(m, c) for m in children)]
            if len(children) >= 2 and bases and _has_parameters(module):
                found.append((path, bases[0], len(children)))

    def nested(path: str) -> bool:
        return any(other != path and (other == "" or path.startswith(other + ".")) for other, _, _ in found)

    top = [entry for entry in found if not nested(entry[0])]
    if not top:
        return []
    _, cls, _ = max(top, key=lambda entry: entry[2])  # the first of the longest on a tie
    return [path for path, other, _ in top if other is cls]


def _classify_block(block: nn.Module, opened: set[str]) -> dict[str, str]:
    """Relative path → role of the block's attention, FFN and norm modules: a module whose
    role is recognised is taken whole (its children belong to it); others, and those in
    ``opened``, are searched inside."""
    found: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            rel = f"{prefix}{name}"
            role = None if rel in opened else _role(rel, child)
            if role is not None:
                found[rel] = role
            else:
                visit(rel + ".", child)

    visit("", block)
    return found


def _classify_blocks(blocks: list[nn.Module]) -> list[dict[str, str]]:
    """Classify every block so that a path means the same in all blocks that have it.

    Blocks of two stacks differ (T5: ``layer.1`` is the FFN sub-layer of an encoder block
    and the cross-attention sub-layer of a decoder block). Where a path is taken whole with
    one role in one block but not in another block that has it, the path, or the ancestor
    taken in the other block, is searched inside everywhere instead, until all agree."""
    names = [{rel for rel, _ in b.named_modules() if rel} for b in blocks]
    opened: set[str] = set()
    while True:
        found = [_classify_block(b, opened) for b in blocks]
        conflicts: set[str] = set()
        for here in found:
            for rel, role in here.items():
                for other, other_names in zip(found, names):
                    if rel not in other_names or other.get(rel) == role:
                        continue
                    parts = rel.split(".")
                    ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
                    conflicts.add(next((a for a in ancestors if a in other), rel))
        if not conflicts:
            return found
        opened |= conflicts


def detect(model: nn.Module) -> HookMap:
    """Guess a hook map for a model no bundled map matches.

    The block list is the longest ModuleList/Sequential of same-class modules; inside a
    block, modules are sorted into attention (``attn``/``attention``), ffn
    (``mlp``/``ffn``/``feed_forward``/``experts``/``moe``) and norm (``norm`` classes and
    names, ``ln_*``) by their names and classes; outside the blocks, ``nn.Embedding``
    modules are the embedding, a ``rotary``/``rope`` module the context, norms registered
    after a block list the final norm, and a ``Linear`` whose ``out_features`` is the
    vocabulary the head. The result has ``source == "auto-detected"``; check it with
    ``blockdiff arch`` before trusting a diff.

    Raises:
        HookMapError: no block list, or blocks with neither attention nor FFN modules;
            the message points to ``--hooks FILE.toml``.
    """
    cls_name = type(model).__name__
    hint = (
        f"no hook map matches model class {cls_name}; write one and pass it with --hooks FILE.toml "
        "(format: docs/hook-maps.md). Auto-detection failed: "
    )
    lists = _block_lists(model)
    if not lists:
        raise HookMapError(
            hint + "no block list (a ModuleList or Sequential of two or more modules of one class)",
            source=AUTO_DETECTED,
        )
    modules = dict(model.named_modules())
    blocks = [block for path in lists for block in modules[path].children()]
    subpaths: dict[str, list[str]] = {}
    seen: dict[str, int] = {}
    for found in _classify_blocks(blocks):
        for rel, role in found.items():
            if rel not in seen:
                subpaths.setdefault(role, []).append(rel)
            seen[rel] = seen.get(rel, 0) + 1
    if "attention" not in subpaths and "ffn" not in subpaths:
        block_cls = type(next(modules[lists[0]].children())).__name__
        raise HookMapError(
            hint + f"the blocks in {lists[0] or 'the model'} ({block_cls}) have no module named or "
            "typed like attention (attn, attention) or a feed-forward (mlp, ffn, feed_forward, experts)",
            source=AUTO_DETECTED,
        )
    # A module some blocks lack (cross-attention in an encoder block) is optional.
    optional = tuple(rel for rel, count in seen.items() if count < len(blocks))

    def inside_blocks(path: str) -> bool:
        return any(path.startswith(p + ".") if p else True for p in lists)

    order = {path: i for i, path in enumerate(modules)}
    first_block = min(order[p] for p in lists)
    outside: dict[str, list[str]] = {}
    embeds = [p for p, m in modules.items() if isinstance(m, nn.Embedding) and p and not inside_blocks(p)]
    if embeds:
        outside["embed"] = embeds

    def contextual(path: str, module: nn.Module) -> bool:
        words = (path.rsplit(".", 1)[-1].lower(), type(module).__name__.lower())
        return any(w in text for w in _CONTEXT_WORDS for text in words)

    context = [p for p, m in modules.items() if p and not inside_blocks(p) and contextual(p, m)]
    if context:
        outside["context"] = context
    norms = [
        p
        for p, m in modules.items()
        if p and not inside_blocks(p) and order[p] > first_block and _role(p, m) == "norm"
    ]
    if norms:
        outside["final_norm"] = norms
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    token_embeds = [modules[p] for p in embeds]
    if vocab is None and token_embeds:
        vocab = max(m.num_embeddings for m in token_embeds)
    heads = [
        p
        for p, m in modules.items()
        if isinstance(m, nn.Linear) and vocab is not None and m.out_features == vocab and not inside_blocks(p)
    ]
    if heads:
        outside["head"] = heads[-1:]
    return HookMap(
        name="auto",
        source=AUTO_DETECTED,
        match=(cls_name,),
        outside={k: tuple(v) for k, v in outside.items()},
        optional=optional,
        blocks=tuple(lists),
        subpaths={k: tuple(v) for k, v in subpaths.items()},
        description=f"guessed from the module tree of {cls_name}",
    )
