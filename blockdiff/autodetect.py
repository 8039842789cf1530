"""Auto-detection: a hook map guessed from a model's module tree.

:func:`resolve` maps a model: with the map given, else the bundled map matching its class
name, else the guess of :func:`detect`; the guess is a :class:`~blockdiff.hookmap.HookMap`
like any other, with ``source == "auto-detected"``, so capture and localization treat it
the same. The rules are documented in ``docs/hook-maps.md``, "Auto-detection".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .errors import HookMapError
from .hookmap import AUTO_DETECTED, HookMap, Layout, apply_map, find


def resolve(model: nn.Module, hook_map: HookMap | None = None) -> Layout:
    """Apply a hook map to ``model``: every module it names must exist.

    Args:
        model: the model to map.
        hook_map: the map to use; when ``None``, the bundled map matching the model's
            class name, or else one guessed by :func:`detect` (``source`` says so).

    Raises:
        HookMapError: a named module does not exist, the block list is not a list, or no
            map was given, none matches and the anatomy cannot be guessed.

    >>> layout = resolve(model)                                  # doctest: +SKIP
    """
    if hook_map is None:
        try:
            hook_map = find(model)
        except HookMapError:
            hook_map = detect(model)
    return apply_map(model, hook_map)

# -- auto-detection ----------------------------------------------------------------------
#
# Rules (documented in docs/hook-maps.md, "Auto-detection"). Words are matched in the
# lower-cased last component of a module's path and in its lower-cased class name.
_NORM_NAME = re.compile(r"norm|(^|_)ln($|_|\d)")
_ATTENTION_WORDS = ("attn", "attention")
_FFN_WORDS = ("mlp", "ffn", "feed_forward", "feedforward", "experts", "moe")
_CONTEXT_WORDS = ("rotary", "rope")
# Children of a token mixer that project to queries, keys and values: one fused projection
# (``qkv``), or one each of q, k and v under any of these spellings.
_QKV_FUSED = {"qkv", "qkv_proj", "wqkv", "c_attn", "in_proj", "to_qkv", "query_key_value"}
_QKV_SPLIT = (
    {"q", "q_proj", "wq", "query", "to_q"},
    {"k", "k_proj", "wk", "key", "to_k"},
    {"v", "v_proj", "wv", "value", "to_v"},
)
# Positions of the probes' inputs: enough for a mixed position to show, cheap on any model.
_PROBE_POSITIONS = 4


def _role(path: str, module: nn.Module) -> str | None:
    """The sub-path a module inside a block plays, guessed from its name and class.

    Norms are tried first: ``post_attention_layernorm`` and ``pre_feedforward_layernorm``
    are norms, not attention or FFN. A module that computes nothing (:func:`computes_nothing`:
    litgpt's ``post_attention_norm = nn.Identity()`` when unconfigured) plays no role,
    whatever its name."""
    if computes_nothing(module):
        return None
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


def computes_nothing(module: nn.Module) -> bool:
    """Whether ``module`` is an identity by its type and holds no parameters: ``nn.Identity``
    (a slot a config left empty: litgpt's ``post_attention_norm``, ``post_mlp_norm``, or
    ``norm_1`` of a block without one) or a dropout (the identity in eval mode, where every
    run of blockdiff is). It is no site: no sub-path or stage owns it, so a model whose
    config leaves a slot empty pairs with one that has no such slot."""
    return isinstance(module, (nn.Identity, nn.modules.dropout._DropoutNd)) and not _has_parameters(module)


def passes_through(module: nn.Module) -> bool:
    """Whether ``module`` hands its input on unchanged whatever the mode, by its type: an
    ``nn.Identity``, or a TransformerLens hook point (``HookPoint``: the identity a user's
    hooks attach to) with no parameters. No drill-down child: it computes nothing to judge,
    and one side's hook points pair with nothing on the other's."""
    return (isinstance(module, nn.Identity) or type(module).__name__ == "HookPoint") and not _has_parameters(module)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_lists(model: nn.Module) -> list[str]:
    """Paths of the model's block lists: the longest ModuleList/Sequential whose children
    (two or more) share one class (subclasses count as their base), plus any other such
    list of the same class, or of its Encoder/Decoder twin (the second stack of an
    encoder-decoder). Lists inside another
    list's elements (MoE experts) and lists of parameterless modules are not candidates."""
    found: list[tuple[str, type, int]] = []
    mixed: list[tuple[str, type, int]] = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) < 2 or not _has_parameters(module):
                continue
            # One class; a subclass counts as its base (a block patched with a bug).
            bases = [c for c in {type(m) for m in children} if all(isinstance(m, c) for m in children)]
            if bases:
                found.append((path, bases[0], len(children)))
            elif _layer_kinds(children):
                mixed.append((path, nn.Module, len(children)))
    if not found:
        found = mixed  # a hybrid stack (Jamba: attention and Mamba layers interleaved)

    def nested(path: str) -> bool:
        return any(other != path and (other == "" or path.startswith(other + ".")) for other, _, _ in found)

    top = [entry for entry in found if not nested(entry[0])]
    if not top:
        return []
    _, cls, _ = max(top, key=lambda entry: entry[2])  # the first of the longest on a tie
    return [path for path, other, _ in top if _stack_family(other) == _stack_family(cls)]


def _layer_kinds(children: list[nn.Module]) -> bool:
    """Whether a list of modules of several classes is a hybrid stack of layers: every
    child holds parameters and its class name ends in ``Layer`` or ``Block``, the classes
    sharing one name prefix (``JambaAttentionDecoderLayer``, ``JambaMambaDecoderLayer``)."""
    names = [type(c).__name__ for c in children]
    if not all(n.endswith(("Layer", "Block")) and _has_parameters(c) for n, c in zip(names, children)):
        return False
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    return len(prefix) >= 3


def _stack_family(cls: type) -> str:
    """A block class's name without Encoder/Decoder: an encoder-decoder's two stacks
    (BartEncoderLayer, BartDecoderLayer) are of one family."""
    return cls.__name__.replace("Encoder", "").replace("Decoder", "")


def _classify_block(block: nn.Module, opened: set[str], probed: dict[tuple[str, type], bool]) -> dict[str, str]:
    """Relative path → role of the block's attention, FFN and norm modules: a module whose
    role is recognised is taken whole (its children belong to it); others, and those in
    ``opened``, are searched inside. A module with parameters in which nothing is
    recognised is a token mixer (attention) when it does what one does (:func:`_mixes_tokens`);
    ``probed`` keeps that answer per path and class, so every block of one class agrees
    and each is probed once."""
    found: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            rel = f"{prefix}{name}"
            role = None if rel in opened else _role(rel, child)
            if role is not None:
                found[rel] = role
                continue
            before = set(found)
            visit(rel + ".", child)
            inner = [p for p in found if p not in before]
            # Norms alone inside (Mamba2's gated norm) do not make a module recognised.
            if rel in opened or any(found[p] != "norm" for p in inner) or not _has_parameters(child):
                continue
            key = (rel, type(child))
            if key not in probed:
                probed[key] = _mixes_tokens(child)
            if probed[key]:
                for p in inner:
                    del found[p]
                found[rel] = "attention"

    visit("", block)
    return found


def _mixes_tokens(module: nn.Module) -> bool:
    """Whether an unnamed module is a token mixer: its output at one position changes with
    the input at another (run alone on a random ``[1, T, D]`` input, ``D`` read from its
    first projection); or, where it cannot run alone (it needs masks or rotary tables), its
    children project to queries, keys and values: a fused ``qkv``-like child, children
    named q, k and v, or a ``Linear`` with three times as many outputs as inputs."""
    width = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), None)
    if width is None:
        width = next((p.shape[-1] for p in module.parameters() if p.dim() >= 1), None)
    tensor = next(module.parameters())
    x = torch.randn(1, _PROBE_POSITIONS, width or 1, generator=torch.Generator().manual_seed(0))
    x = x.to(tensor.device, tensor.dtype) if tensor.is_floating_point() else x.to(tensor.device)
    first, last = x.clone(), x.clone()
    first[:, 0] += 1
    last[:, -1] += 1
    outputs = _probe(module, x, first, last)
    if outputs is not None and outputs[0].shape[:2] == x.shape[:2]:
        y, y_first, y_last = (out.float() for out in outputs)
        # Causal mixers carry the first position forward, bidirectional ones the last back too.
        return not (
            torch.allclose(y[:, 1:], y_first[:, 1:], rtol=1e-3, atol=1e-5)
            and torch.allclose(y[:, :-1], y_last[:, :-1], rtol=1e-3, atol=1e-5)
        )
    names = {name.lower() for name, _ in module.named_children()}
    if names & _QKV_FUSED or all(names & spelled for spelled in _QKV_SPLIT):
        return True
    return any(
        isinstance(child, nn.Linear) and child.out_features == 3 * child.in_features for child in module.children()
    )


def _probe(module: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor] | None:
    """``module`` called on each input alone (eval mode, no grad, the RNG untouched); the
    first tensor of each output, or ``None`` when it cannot run so (it needs other
    arguments, another shape, a device it is not on) or returns no floating tensor."""
    outputs = []
    with _quiet(module):
        for x in inputs:
            try:
                out = module(x)
            except Exception:  # the model's own code: any failure means "cannot be probed"
                return None
            while isinstance(out, (tuple, list)) and out:
                out = out[0]
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                return None
            outputs.append(out)
    return outputs


@contextmanager
def _quiet(module: nn.Module) -> Iterator[None]:
    """Run a probe in eval mode (no dropout), without autograd, with the global RNG state
    restored afterwards, and the module's training flags as they were."""
    modes = {m: m.training for m in module.modules()}
    devices = [t.device.index or 0 for t in module.parameters() if t.device.type == "cuda"][:1]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            module.eval()
            yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _classify_blocks(blocks: list[nn.Module]) -> list[dict[str, str]]:
    """Classify every block so that a path means the same in all blocks that have it.

    Blocks of two stacks differ (T5: ``layer.1`` is the FFN sub-layer of an encoder block
    and the cross-attention sub-layer of a decoder block). Where a path is taken whole with
    one role in one block but not in another block that has it, the path, or the ancestor
    taken in the other block, is searched inside everywhere instead, until all agree. A
    slot that computes nothing in a block (:func:`computes_nothing`: ModernBERT's first
    ``attn_norm`` is an ``nn.Identity``) counts as absent there: the path is optional."""
    names = [{rel for rel, m in b.named_modules() if rel and not computes_nothing(m)} for b in blocks]
    opened: set[str] = set()
    probed: dict[tuple[str, type], bool] = {}
    while True:
        found = [_classify_block(b, opened, probed) for b in blocks]
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
    names, ``ln_*``) by their names and classes, and a module none of these name is
    attention when it mixes positions or projects to q/k/v (:func:`_mixes_tokens`);
    outside the blocks, ``nn.Embedding`` modules and modules that look token ids up
    (``[B, T]`` integers to ``[B, T, D]``) are the embedding, a ``rotary``/``rope`` module
    the context, norms registered after a block list the final norm, and a ``Linear``
    whose ``out_features`` is the vocabulary, or a module after the blocks mapping
    ``[.., D]`` to ``[.., vocab]``, the head. Detection runs a few modules alone on small
    probe inputs (eval mode, no grad, the RNG state kept). The result has
    ``source == "auto-detected"``; check it with ``blockdiff arch`` before trusting a diff.

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
        here = list(found)  # this block's modules in registration order
        for rel, role in found.items():
            if rel not in seen:
                # Before those listed that come after it here: a module the first blocks
                # lack (an identity slot there) keeps its place.
                listed = subpaths.setdefault(role, [])
                after = [i for i, other in enumerate(listed) if other in found and here.index(other) > here.index(rel)]
                listed.insert(after[0] if after else len(listed), rel)
            seen[rel] = seen.get(rel, 0) + 1
    if "attention" not in subpaths and "ffn" not in subpaths:
        block_cls = type(next(modules[lists[0]].children())).__name__
        raise HookMapError(
            hint + f"the blocks in {lists[0] or 'the model'} ({block_cls}) have no module named or "
            "typed like attention (attn, attention) or a feed-forward (mlp, ffn, feed_forward, experts), "
            "nor one that mixes positions or projects to q/k/v",
            source=AUTO_DETECTED,
        )
    moe = _routers(blocks, subpaths.get("ffn", []))
    # A module some blocks lack (cross-attention in an encoder block) is optional.
    optional = tuple(rel for rel, count in seen.items() if count < len(blocks))

    def inside_blocks(path: str) -> bool:
        return any(path.startswith(p + ".") if p else True for p in lists)

    order = {path: i for i, path in enumerate(modules)}
    first_block = min(order[p] for p in lists)
    # Modules outside the blocks that do not hold them (the root does), in registration order.
    around = {
        p: m for p, m in modules.items() if p and not inside_blocks(p) and not any(b.startswith(p + ".") for b in lists)
    }
    outside: dict[str, list[str]] = {}
    lookups = _lookups({p: m for p, m in around.items() if order[p] < first_block})
    embeds = [p for p, m in around.items() if isinstance(m, nn.Embedding) or p in lookups]
    if embeds:
        outside["embed"] = embeds

    def contextual(path: str, module: nn.Module) -> bool:
        words = (path.rsplit(".", 1)[-1].lower(), type(module).__name__.lower())
        return any(w in text for w in _CONTEXT_WORDS for text in words)

    context = [p for p, m in around.items() if contextual(p, m)]
    if context:
        outside["context"] = context
    norms = [p for p, m in around.items() if order[p] > first_block and _role(p, m) == "norm"]
    if norms:
        outside["final_norm"] = norms
    vocab = configured_vocab_size(model)
    if vocab is None and embeds:
        vocab = max(lookups[p][0] if p in lookups else modules[p].num_embeddings for p in embeds)
    width = next((lookups[p][1] if p in lookups else modules[p].embedding_dim for p in embeds), None)
    heads = [
        p
        for p, m in around.items()
        if vocab is not None
        and (m.out_features == vocab if isinstance(m, nn.Linear) else order[p] > first_block and _projects_to(m, width, vocab))
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
        moe=moe,
    )


# -- routers ---------------------------------------------------------------------------
_ROUTER_WORDS = ("gate", "router")
# Tokens of a router probe: more than any top-k, so that k < E shows.
_ROUTER_PROBE_TOKENS = 8


def _routers(blocks: list[nn.Module], ffns: list[str]) -> dict[str, Any]:
    """The ``[blocks.moe]`` table of detected MoE blocks, or ``{}``.

    A router is a module inside an ffn named or typed ``gate``/``router`` whose output,
    run alone on ``[T, D]`` hidden states, reads as one of the router formats
    (:func:`router_format`). Every router found must have the same format; blocks without
    one (DeepSeek's dense first layers) are dense."""
    routers: dict[str, str] = {}
    for block in blocks:
        modules = dict(block.named_modules())
        for ffn in ffns:
            for rel, module in modules.items():
                if rel in routers or not rel.startswith(ffn + "."):
                    continue
                leaf, cls = rel.rsplit(".", 1)[-1].lower(), type(module).__name__.lower()
                if not any(w in leaf or w in cls for w in _ROUTER_WORDS) or not _has_parameters(module):
                    continue
                fmt = router_format(module)
                if fmt is not None:
                    routers[rel] = fmt
    formats = set(routers.values())
    if len(formats) != 1:
        return {}
    return {"router": list(routers), "format": formats.pop()}


def router_format(module: nn.Module) -> str | None:
    """The format of a router's output, read from a probe on ``[T, D]`` hidden states
    (``D`` the last dimension of its first 2-D parameter): ``topk`` for ``(logits [T, E],
    weights [T, k], indices [T, k])``, ``dense`` for ``(.., weights [T, E] zero off the
    chosen experts, logits [T, E])``; ``None`` for anything else (a dense gate
    projection, a router whose output blockdiff cannot read)."""
    weight = next((p for p in module.parameters() if p.dim() == 2), None)
    if weight is None:
        return None
    x = torch.randn(_ROUTER_PROBE_TOKENS, weight.shape[-1], generator=torch.Generator().manual_seed(0))
    with _quiet(module):
        try:
            out = module(x.to(weight.device, weight.dtype))
        except Exception:  # the model's own code: any failure means "not a router we read"
            return None
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    shapes = [tuple(t.shape) for t in tensors]
    if len(tensors) < 2 or any(len(shape) != 2 or shape[0] != _ROUTER_PROBE_TOKENS for shape in shapes):
        return None
    experts = shapes[0][1]
    if (
        len(tensors) == 3
        and tensors[0].is_floating_point()
        and not tensors[2].is_floating_point()
        and shapes[1] == shapes[2]
        and 1 <= shapes[1][1] < experts
    ):
        return "topk"
    weights, logits = tensors[-2], tensors[-1]
    if weights.is_floating_point() and logits.is_floating_point() and shapes[-2] == shapes[-1]:
        chosen = (weights != 0).sum(-1)
        if bool((chosen >= 1).all()) and int(chosen.max()) < shapes[-1][1]:
            return "dense"
    return None


def configured_vocab_size(model: nn.Module) -> int | None:
    """The vocabulary the model's configuration states: Hugging Face ``config.vocab_size``,
    TransformerLens ``cfg.d_vocab``."""
    for holder, name in (("config", "vocab_size"), ("cfg", "d_vocab")):
        value = getattr(getattr(model, holder, None), name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _role_candidates(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Modules that may be an embedding or a head by their role although they are no
    ``nn.Embedding`` or ``nn.Linear``: a 2-D parameter of their own, no norm, not inside
    another candidate."""
    chosen: dict[str, nn.Module] = {}
    for path, module in modules.items():
        if isinstance(module, (nn.Embedding, nn.Linear)) or _role(path, module) == "norm":
            continue
        if any(path.startswith(p + ".") for p in chosen):
            continue
        if any(p.dim() == 2 for p in module.parameters(recurse=False)):
            chosen[path] = module
    return chosen


def _lookups(modules: dict[str, nn.Module]) -> dict[str, tuple[int, int]]:
    """Path → (rows, width) of the modules among ``modules`` (those registered before the
    blocks) that are embeddings by their role: run alone on integer token ids ``[1, T]``
    they return ``[1, T, D]``, ``D`` the last dimension of a 2-D parameter of theirs with
    ``rows`` rows (TransformerLens's ``Embed``, ``W_E`` [vocab, d], and ``PosEmbed``)."""
    found: dict[str, tuple[int, int]] = {}
    for path, module in _role_candidates(modules).items():
        weight = next(p for p in module.parameters(recurse=False) if p.dim() == 2)
        ids = torch.zeros(1, _PROBE_POSITIONS, dtype=torch.long, device=weight.device)
        outputs = _probe(module, ids)
        if outputs is not None and tuple(outputs[0].shape) == (1, _PROBE_POSITIONS, weight.shape[-1]):
            found[path] = (int(weight.shape[0]), int(weight.shape[-1]))
    return found


def _projects_to(module: nn.Module, width: int | None, vocab: int) -> bool:
    """Whether ``module`` is a head by its role: it holds a 2-D parameter of shape
    ``[width, vocab]`` or ``[vocab, width]`` (TransformerLens's ``Unembed``, ``W_U``
    [d, vocab]) and maps a ``[1, T, width]`` hidden state to ``[1, T, vocab]``."""
    if isinstance(module, (nn.Embedding, nn.Linear)) or not _role_candidates({"": module}):
        return False
    weight = next(p for p in module.parameters(recurse=False) if p.dim() == 2)
    if vocab not in weight.shape or (width is not None and width not in weight.shape):
        return False
    width = width or int(weight.shape[0] if weight.shape[1] == vocab else weight.shape[1])
    x = torch.randn(1, _PROBE_POSITIONS, width, generator=torch.Generator().manual_seed(0))
    outputs = _probe(module, x.to(weight.device, weight.dtype if weight.is_floating_point() else x.dtype))
    return outputs is not None and tuple(outputs[0].shape) == (1, _PROBE_POSITIONS, vocab)
