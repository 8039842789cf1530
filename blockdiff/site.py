"""Sites: one captured module call, and the helpers that read and rebuild its structures.

A :class:`Site` holds what a module received (positional and keyword arguments) and what
it returned, as snapshots: tensors are copied when recorded, because some models change a
module's output in place after the hooks have run. An argument that is not plain data (a
flex-attention ``BlockMask``, a config, a callable) is an :class:`Opaque` marker naming its
type and, in memory, holding the object itself: replayed as the side's own object. A KV
cache is never held nor replayed (``None``); an object a dump could not keep cannot be
replayed faithfully, and replaying it raises :class:`NotReplayable` (the check is then
not judged, never falsely blamed).

Sites are paired between reference and candidate by :attr:`Site.key`:
``(stage, block, subpath, ordinal)``, where *ordinal* counts the calls of that sub-path
within the block in execution order. Module paths may differ between two codebases; the
anatomy does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, NamedTuple

import torch

from .distributed import in_layout, is_distributed, whole
from .errors import BlockdiffError


# Argument names under which implementations pass the hidden state, tried in order when
# a call has no positional argument (HF Llama-family attention is called keyword-only).
HIDDEN_KWARGS = ("hidden_states", "hidden_state", "x", "input", "inputs", "input_ids")
# Keyword arguments that carry activations besides the main hidden state: the encoder
# output an encoder-decoder's cross-attention reads (HF T5, BART, Whisper).
SECONDARY_HIDDEN = ("encoder_hidden_states", "key_value_states")
# Positional arguments after the hidden state are activations too when they look like one:
# a floating tensor with the hidden state's number of dimensions and last dimension. HF
# T5Stack passes the encoder output to each decoder T5Block positionally (argument 3),
# nn.MultiheadAttention takes query, key and value positionally. Masks, position biases
# ([batch, heads, q, k]) and rotary tables ([seq, head_dim]) do not match, and stay the
# side's own. Such an activation's role is ``"arg<i>"``, ``i`` its position.
POSITIONAL_ROLE = "arg{}"
# A hook map may name more activation keywords per module (``activations``, see
# hookmap.ModuleOptions): TransformerLens attention takes query_input, key_input and
# value_input. Each is a role under its own name; the first one passed is also the
# hidden state ("primary") when there is no positional one. ``None``: the map names
# none (the rules above); ``()``: the map says the module takes no activation at all
# (TransformerLens' positional embedding reads only the number of tokens from its input).


@dataclass(frozen=True)
class Opaque:
    """Marker for a recorded argument that is not plain data.

    Attributes:
        type_name: the object's class name (what a dump keeps).
        value: the object itself, held while the record is in memory, and replayed as it
            is; ``None`` for a KV cache (never replayed) and for a marker read from a dump.
        cache: whether it is a KV cache (replayed as ``None``: a recorded cache must never
            feed a later call).
    """

    type_name: str
    value: Any = field(default=None, compare=False, repr=False)
    cache: bool = field(default=False, compare=False)


class NotReplayable(BlockdiffError):
    """A recorded argument that is not plain data was not kept (a dump holds only its
    type): the call cannot be replayed faithfully."""

    # What the note on a check it kept from being judged advises.
    advice = (
        "a dump keeps only the type of such an argument; localize in memory, without --stream/--save-dumps, to judge it"
    )

    def __init__(self, type_name: str) -> None:
        super().__init__(f"a {type_name} argument was recorded by type only and cannot be replayed")
        self.type_name = type_name


# Types a structure holds as themselves (map_structure's fast path; subclasses take the long one).
# Types a record holds as they are (map_structure returns them unchanged).
PLAIN_TYPES = frozenset({bool, int, float, str, Opaque, torch.dtype, torch.device})


def _is_cache(obj: Any) -> bool:
    return any(cls.__name__.endswith("Cache") for cls in type(obj).__mro__)


@dataclass(slots=True)
class Site:
    """One captured call of a module of the hook map.

    Attributes:
        stage: ``embed``, ``context``, ``block``, ``final_norm`` or ``head``.
        block: block index for ``block`` sites, else ``None``.
        subpath: ``attention``, ``ffn`` or ``norm`` for modules inside a block; ``None``
            for the block's own call and for sites outside blocks.
        module: the module's path in ``named_modules()``.
        call: how many times this module had been called before in the same forward.
        ordinal: index among the sites of the same (stage, block, subpath).
        args, kwargs, output: snapshots of the call.
        order: position of the call's start among all sites of the forward.
        activations: keyword arguments the hook map names as activations of this
            module, ``()`` for none at all, ``None`` when it names none (see
            :func:`hidden_states`).
    """

    stage: str
    block: int | None
    subpath: str | None
    module: str
    call: int
    ordinal: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    order: int = 0
    activations: tuple[str, ...] | None = None

    @property
    def key(self) -> "SiteKey":
        return SiteKey(self.stage, self.block, self.subpath, self.ordinal)

    @property
    def label(self) -> str:
        """Human-readable site name: ``block 2 attention (model.layers.2.self_attn)``."""
        return describe_site(self.key, self.module)

    def hidden_input(self) -> torch.Tensor | None:
        """The tensor this call received as its hidden state (see :func:`hidden_location`)."""
        return hidden_states(self.args, self.kwargs, self.activations).get("primary")

    def hidden_inputs(self) -> dict[str, torch.Tensor]:
        """Every activation this call received, by role (see :func:`hidden_states`)."""
        return hidden_states(self.args, self.kwargs, self.activations)

    def primary_output(self) -> torch.Tensor | None:
        return primary_tensor(self.output)


class SiteKey(NamedTuple):
    """What pairs a reference site with a candidate site: the anatomy, not the module path
    (which may differ between two codebases)."""

    stage: str
    block: int | None
    subpath: str | None
    ordinal: int

    @classmethod
    def of_block(cls, index: int) -> "SiteKey":
        """The key of block ``index``'s own call."""
        return cls("block", index, None, 0)


def describe_site(key: tuple, module: str) -> str:
    """A site's name from its key and module: ``block 2 attention (model.layers.2.self_attn)``."""
    return f"{describe_key(key)} ({module})"


def describe_key(key: tuple) -> str:
    stage, block, subpath, ordinal = key
    if stage == "block":
        text = f"block {block}" + (f" {subpath}" if subpath else "")
    else:
        text = stage
    return text + (f" #{ordinal}" if ordinal else "")


def map_structure(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict, keeping the structure.

    Objects that are not plain data become :class:`Opaque` markers, so nothing a model
    passes by reference (a cache, a config) is ever held or replayed.
    """
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common cases first: a site pays for each test
        return fn(obj)
    if obj is None or kind in PLAIN_TYPES:
        return obj
    if kind is tuple:
        return tuple([fn(v) if type(v) is torch.Tensor else v if v is None else map_structure(v, fn) for v in obj])
    if kind is dict:  # a call's keywords: tensors and None, mostly (no call for those)
        return {k: fn(v) if type(v) is torch.Tensor else v if v is None else map_structure(v, fn) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (bool, int, float, str, Opaque, torch.dtype, torch.device)):
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_structure(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_structure(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: map_structure(v, fn) for k, v in obj.items()}
    # HF ModelOutput and similar dataclass-like containers behave as ordered dicts.
    if hasattr(obj, "to_tuple") and hasattr(obj, "keys"):
        return {k: map_structure(obj[k], fn) for k in obj.keys()}
    if _is_cache(obj):
        return Opaque(type(obj).__name__, cache=True)
    return Opaque(type(obj).__name__, obj)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors of a nested structure in order."""
    found: list[torch.Tensor] = []
    map_structure(obj, found.append)
    return iter(found)


# The two ways a tensor is copied: into the record (recorded_copy) and out of it, into a
# module call (replayed_copy). Nothing else copies or casts activations.


def recorded_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` for the record: detached and copied to the CPU; a ``DTensor`` or an
    ``AsyncCollectiveTensor`` as its full logical tensor (:func:`~blockdiff.distributed.whole`)."""
    if is_distributed(t):
        return whole(t.detach(), "cpu")
    t = t.detach()
    return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


def replayed_copy(
    t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None, *, layout: torch.Tensor | None = None
) -> torch.Tensor:
    """A recorded tensor for a module call: a copy on ``device``, cast to ``dtype`` when
    both are floating point; in the sharded layout ``layout`` (or ``t`` itself) was
    recorded from, when it was recorded from a ``DTensor`` (:func:`~blockdiff.distributed.in_layout`).

    Always a copy: models change tensors they are handed in place (HF Falcon adds the
    attention output into the MLP output), which must never reach a recorded site.
    """
    if dtype is not None and t.is_floating_point() and dtype.is_floating_point:
        copy = t.to(device=device, dtype=dtype, copy=True)
    else:
        copy = t.to(device=device, copy=True)
    return in_layout(copy, t if layout is None else layout)


def snapshot(obj: Any) -> Any:
    """Copy a structure for the record: tensors detached and cloned to the CPU."""
    return map_structure(obj, recorded_copy)


def for_replay(
    obj: Any, *, device: torch.device | str, dtype: torch.dtype | None = None, keep: Collection[int] = (),
    cache: Any = None,
) -> Any:
    """Move a recorded structure to ``device``; floating tensors cast to ``dtype`` if given.

    :class:`Opaque` markers become the objects they hold; a recorded cache is never
    replayed: it becomes ``cache`` (``None``, or the experiment's own cache at a decode
    step). Tensors whose ``id`` is in ``keep`` (copies made for this call already) are
    passed as they are.

    Raises:
        NotReplayable: a marker that holds no object (read from a dump) and is no cache.
    """
    return _unwrap_opaque(map_structure(obj, lambda t: t if id(t) in keep else replayed_copy(t, device, dtype)), cache)


def holds_cache(call: "Site") -> bool:
    """Whether a recorded call was handed a KV cache (a marker, never the cache)."""
    found: list[bool] = []
    map_opaque((call.args, call.kwargs), lambda marker: found.append(marker.cache))
    return any(found)


def map_opaque(obj: Any, fn: Callable[[Opaque], Any]) -> Any:
    """``obj`` (a recorded structure) with every :class:`Opaque` marker replaced by
    ``fn(marker)``; tensors and plain values as they are."""
    if isinstance(obj, Opaque):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_opaque(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_opaque(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: map_opaque(v, fn) for k, v in obj.items()}
    return obj


def _unwrap_opaque(obj: Any, cache: Any = None) -> Any:
    def unwrap(marker: Opaque) -> Any:
        if marker.cache:
            return cache
        if marker.value is None:
            raise NotReplayable(marker.type_name)
        return marker.value

    return map_opaque(obj, unwrap)


def primary_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor of an output: a module's main result (HF attention returns
    ``(attn_output, attn_weights)``, Falcon blocks return tuples)."""
    return next(iter_tensors(obj), None)


def hidden_location(args: tuple, kwargs: dict, names: tuple[str, ...] | None = None) -> tuple[str, Any] | None:
    """Where a call passes its hidden state: the first positional tensor argument, or
    else the first of ``names`` (the hook map's activations of the module), then of
    :data:`HIDDEN_KWARGS`, present as a tensor; nowhere when ``names`` is ``()``."""
    if names == ():
        return None
    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0)
    for name in (*(names or ()), *HIDDEN_KWARGS):
        if isinstance(kwargs.get(name), torch.Tensor):
            return ("kwarg", name)
    return None


def hidden_states(args: tuple, kwargs: dict, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The activations a call receives, by role: ``"primary"`` (see :func:`hidden_location`),
    each of :data:`SECONDARY_HIDDEN` and of ``names`` (the hook map's activations of the
    module) passed as a tensor, under its own name, and positional arguments that look
    like the hidden state, as ``"arg<i>"`` (see :data:`POSITIONAL_ROLE`)."""
    found: dict[str, torch.Tensor] = {}
    loc = hidden_location(args, kwargs, names)
    if loc is None:
        return found
    primary = args[loc[1]] if loc[0] == "arg" else kwargs[loc[1]]
    found["primary"] = primary
    # A named activation keeps its role even when it is the primary: the other side
    # replaces it by name.
    names = names or ()
    for name in (*SECONDARY_HIDDEN, *names):
        if isinstance(kwargs.get(name), torch.Tensor) and (loc[1] != name or name in names):
            found[name] = kwargs[name]
    for i, value in enumerate(args):
        if loc != ("arg", i) and _like_hidden(value, primary):
            found[POSITIONAL_ROLE.format(i)] = value
    return found


def _like_hidden(value: Any, primary: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and primary.is_floating_point()
        and value.dim() == primary.dim() >= 2
        and value.shape[-1] == primary.shape[-1]
    )


def with_hidden(
    args: tuple, kwargs: dict, hidden: dict[str, torch.Tensor], names: tuple[str, ...] | None = None
) -> tuple[tuple, dict]:
    """A copy of the call with its activations replaced, role by role (roles the call
    does not have are ignored).

    ``names`` are the hook map's activations of the called module: one that ``hidden``
    does not hold by name takes its hidden state. A Hugging Face attention's one hidden
    state is what TransformerLens passes as each of ``query_input``, ``key_input`` and
    ``value_input``. With ``names`` ``()`` the module takes no activation: the call is
    returned as it is.
    """
    args, kwargs = tuple(args), dict(kwargs)
    if names == ():
        return args, kwargs
    loc = hidden_location(args, kwargs, names)
    if "primary" in hidden:
        named = {n: hidden["primary"] for n in names or () if isinstance(kwargs.get(n), torch.Tensor)}
        hidden = {**named, **hidden}
    for role, tensor in hidden.items():
        if role == "primary":
            if loc is None:
                continue
            if loc[0] == "arg":
                args = (tensor, *args[1:])
            else:
                kwargs[loc[1]] = tensor
        elif role.startswith("arg") and role[3:].isdigit():
            i = int(role[3:])
            if i < len(args) and isinstance(args[i], torch.Tensor):
                args = (*args[:i], tensor, *args[i + 1:])
        elif isinstance(kwargs.get(role), torch.Tensor):
            kwargs[role] = tensor
    return args, kwargs


def replace_primary(output: Any, tensor: torch.Tensor) -> Any:
    """``output`` with its primary tensor replaced, keeping tuple/list structure, so a
    replacing forward hook hands the caller what it expects."""
    if isinstance(output, torch.Tensor):
        return tensor
    if isinstance(output, tuple) and not hasattr(output, "_fields") and output:
        return (replace_primary(output[0], tensor), *output[1:])
    if isinstance(output, list) and output:
        return [replace_primary(output[0], tensor), *output[1:]]
    if isinstance(output, dict) and output:
        first = next(iter(output))
        return {**output, first: replace_primary(output[first], tensor)}
    if hasattr(output, "to_tuple") and hasattr(output, "keys"):
        first = next(iter(output.keys()))
        output[first] = replace_primary(output[first], tensor)
        return output
    return tensor
