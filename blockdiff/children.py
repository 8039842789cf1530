"""Children: which child call of the candidate's module goes with which of the reference's.

The step of a drill-down between running a divergent module on both sides with its
children's calls recorded (:meth:`~blockdiff.sides.live.LiveSide.child_calls`) and judging
them (:meth:`~blockdiff.experiments.Experiments.children_checks`). Two codebases name
their children as they like (HF's ``q_proj, k_proj, v_proj`` against Meta's fused
``wqkv``; GPT-2's ``mlp.act`` against a port's ``mlp.gelu``), so children pair, in order:

1. **by name**: the same path below the module and the same call count;
2. **by role**, among what is left on both sides:
   - activations (``nn.SiLU``, ``nn.GELU``, Hugging Face's ``transformers.activations``,
     or any parameter-free leaf that keeps its input's shape and is called once between
     two projections), norms, dropouts: by type, in the order they ran, when both sides
     have as many and their shapes agree;
   - projections (``nn.Linear``, HF ``Conv1D``, quantized Linears): in the order they
     ran, each pair reading and writing the same shapes;
3. **fused against split**: a projection whose output is the concatenation of several
   consecutive projections of the other side that read the same input (``wqkv`` against
   ``q_proj, k_proj, v_proj``; ``w13`` against ``gate_proj, up_proj``), judged as one.

What pairs nowhere is said by name (:attr:`Pairing.not_paired`), and so is a pair that
cannot be judged (:attr:`Pairing.not_judged`: no tensor output, no floating input, shapes
that differ): a drill-down never counts them as checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .site import Site

__all__ = ["ACTIVATION", "DROPOUT", "NORM", "PROJECTION", "ChildPair", "Pairing", "name_below", "pair_children", "roles", "typed_role"]

PROJECTION, ACTIVATION, NORM, DROPOUT = "projection", "activation", "norm", "dropout"

_ACTIVATIONS = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Hardsigmoid,
    nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.GLU, nn.PReLU,
)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


@dataclass
class ChildPair:
    """Reference children and the candidate children judged against them, as one check.

    One and one for a pairing by name or by role; several reference children against one
    fused candidate child (its output against theirs concatenated), or one fused
    reference child against several candidate children (their outputs concatenated).

    Attributes:
        ref, cand: the calls, in the order they ran on their side.
        by: ``"name"``, ``"role"`` or ``"fused"``.
        ref_names, cand_names: their paths below their module (``#N`` for a later call).
    """

    ref: list[Site]
    cand: list[Site]
    by: str
    ref_names: list[str]
    cand_names: list[str]

    @property
    def what(self) -> str:
        """The check's name: ``child down_proj``, ``child w1 (as gate_proj)``, ``child wqkv
        (as q_proj+k_proj+v_proj)``; a later call of a child paired by name: ``child act #1``."""
        cand, ref = "+".join(self.cand_names), "+".join(self.ref_names)
        if self.by == "name":
            name, call = cand.partition("#")[::2]
            return f"child {name}" + (f" #{call}" if call else "")
        return f"child {cand} (as {ref})"

    @property
    def order(self) -> int:
        """Where it ran among the reference's children (its first call)."""
        return min(s.order for s in self.ref)


@dataclass
class Pairing:
    """What a drill-down judges and what it cannot.

    Attributes:
        pairs: the pairs to judge, in the order the reference's children ran.
        not_paired: ``{"reference": [...], "candidate": [...]}``: children, by their path
            below their module, that pair with nothing on the other side.
        not_judged: pairs that cannot be judged, each ``NAME (why)``.
    """

    pairs: list[ChildPair] = field(default_factory=list)
    not_paired: dict[str, list[str]] = field(default_factory=lambda: {"reference": [], "candidate": []})
    not_judged: list[str] = field(default_factory=list)


def name_below(parent: str, site: Site) -> str:
    """A child call's name below its module: ``gate_proj``, ``act#1`` for its second call."""
    return site.module[len(parent) + 1 :] + (f"#{site.call}" if site.call else "")


def typed_role(module: Any) -> str | None:
    """The role ``module``'s type says: a projection, an activation, a dropout, a norm, or
    ``None`` (a module of no known type, or none at all)."""
    if not isinstance(module, nn.Module):
        return None
    name = type(module).__name__
    if isinstance(module, nn.Linear) or name == "Conv1D" or name.endswith("Linear"):
        return PROJECTION
    if isinstance(module, _ACTIVATIONS) or type(module).__module__.endswith(".activations") or name.endswith("Activation"):
        return ACTIVATION
    if isinstance(module, nn.modules.dropout._DropoutNd) or "Dropout" in name:
        return DROPOUT
    if isinstance(module, _NORMS) or "Norm" in name:
        return NORM
    return None


def roles(calls: list[Site], module_of: Callable[[str], Any]) -> dict[int, str | None]:
    """The role of each call of ``calls`` (one side's children, in the order they ran), by
    ``id``: its type's (:func:`typed_role`), else an activation when its module holds no
    parameter, is called once, keeps its input's shape and runs between two projections."""
    typed = {id(s): typed_role(module_of(s.module)) for s in calls}
    found = dict(typed)
    for s in calls:
        module = module_of(s.module)
        if typed[id(s)] is not None or not isinstance(module, nn.Module) or any(True for _ in module.parameters()):
            continue
        if sum(o.module == s.module for o in calls) != 1 or _shape(s.hidden_input()) is None:
            continue
        if _shape(s.hidden_input()) != _shape(s.primary_output()):
            continue
        before = any(typed[id(o)] == PROJECTION for o in calls if o.order < s.order)
        after = any(typed[id(o)] == PROJECTION for o in calls if o.order > s.order)
        if before and after:
            found[id(s)] = ACTIVATION
    return found


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.shape)


def _signature(site: Site) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    return _shape(site.hidden_input()), _shape(site.primary_output())


def _why_not_judged(ref: Site, cand: Site) -> str | None:
    """Why a pair cannot be judged: the reference child's call has no tensor output or no
    floating input, or the two read or write different shapes; ``None`` when it can."""
    ref_out, hidden = ref.primary_output(), ref.hidden_inputs()
    if ref_out is None:
        return "the reference's call returned no tensor"
    if not hidden:
        return "its call has no floating input"
    (ref_in, ref_shape), (cand_in, cand_shape) = _signature(ref), _signature(cand)
    if cand_in is not None and ref_in != cand_in:
        return f"input shape {list(cand_in)} in the candidate, {list(ref_in or ())} in the reference"
    if cand_shape is not None and _squeezed(cand_shape) != _squeezed(ref_shape or ()):
        return f"output shape {list(cand_shape)} in the candidate, {list(ref_shape or ())} in the reference"
    return None


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = list(shape)
    while dims and dims[0] == 1:
        dims.pop(0)
    return tuple(dims)


def pair_children(
    ref_parent: str,
    ref_calls: list[Site],
    cand_parent: str,
    cand_calls: list[Site],
    *,
    ref_module: Callable[[str], Any],
    cand_module: Callable[[str], Any],
) -> Pairing:
    """The children of the reference's module ``ref_parent`` (``ref_calls``, in the order
    they ran) paired with those of the candidate's ``cand_parent`` (see the module
    docstring). ``ref_module`` and ``cand_module`` give a child's module by its path
    (``None`` when unknown: such a child pairs by name only)."""
    found = Pairing()
    ref_left = {id(s): s for s in ref_calls}
    cand_left = {id(s): s for s in cand_calls}
    by_name = {(s.module[len(cand_parent) + 1 :], s.call): s for s in cand_calls}
    for rc in ref_calls:
        cc = by_name.get((rc.module[len(ref_parent) + 1 :], rc.call))
        if cc is not None:
            _add(found, ChildPair([rc], [cc], "name", [name_below(ref_parent, rc)], [name_below(cand_parent, cc)]))
            del ref_left[id(rc)], cand_left[id(cc)]

    role = {**roles(ref_calls, ref_module), **roles(cand_calls, cand_module)}
    ref_rest = [s for s in ref_calls if id(s) in ref_left]
    cand_rest = [s for s in cand_calls if id(s) in cand_left]

    def named(pair_by: str, refs: list[Site], cands: list[Site]) -> ChildPair:
        return ChildPair(refs, cands, pair_by, [name_below(ref_parent, s) for s in refs],
                         [name_below(cand_parent, s) for s in cands])

    for kind in (ACTIVATION, NORM, DROPOUT):
        a = [s for s in ref_rest if role[id(s)] == kind]
        b = [s for s in cand_rest if role[id(s)] == kind]
        if a and len(a) == len(b) and all(_signature(x) == _signature(y) for x, y in zip(a, b)):
            for x, y in zip(a, b):
                _add(found, named("role", [x], [y]))
                del ref_left[id(x)], cand_left[id(y)]

    a = [s for s in ref_rest if role[id(s)] == PROJECTION]
    b = [s for s in cand_rest if role[id(s)] == PROJECTION]
    i = j = 0
    while i < len(a) and j < len(b):
        if _signature(a[i]) == _signature(b[j]) and None not in _signature(a[i]):
            pair, i, j = named("role", [a[i]], [b[j]]), i + 1, j + 1
        elif (k := _fused(a, i, b[j])) > 1:
            pair, i, j = named("fused", a[i : i + k], [b[j]]), i + k, j + 1
        elif (k := _fused(b, j, a[i])) > 1:
            pair, i, j = named("fused", [a[i]], b[j : j + k]), i + 1, j + k
        else:
            break  # the order no longer tells: the rest pair with nothing
        _add(found, pair)
        for s in pair.ref:
            del ref_left[id(s)]
        for s in pair.cand:
            del cand_left[id(s)]

    found.pairs.sort(key=lambda p: p.order)
    found.not_paired = {
        "reference": [name_below(ref_parent, s) for s in ref_calls if id(s) in ref_left],
        "candidate": [name_below(cand_parent, s) for s in cand_calls if id(s) in cand_left],
    }
    return found


def _add(found: Pairing, pair: ChildPair) -> None:
    """``pair`` to judge, or (a pair by name or role that cannot be judged) why not."""
    if len(pair.ref) == 1 and len(pair.cand) == 1:
        why = _why_not_judged(pair.ref[0], pair.cand[0])
        if why is not None:
            found.not_judged.append(f"{'+'.join(pair.cand_names)} ({why})")
            return
    found.pairs.append(pair)


def _fused(split: list[Site], start: int, fused: Site) -> int:
    """How many projections of ``split`` from ``start`` on (at least two) ``fused``
    computes at once: each reads the same input tensor as the others and as wide as
    ``fused``'s, and their outputs side by side are ``fused``'s output; 0 when none."""
    fused_in, fused_out = _signature(fused)
    first = split[start].hidden_input()
    if fused_in is None or fused_out is None or first is None or _shape(first) != fused_in:
        return 0
    width = 0
    for k in range(start, len(split)):
        site = split[k]
        s_in, s_out = _signature(site)
        x = site.hidden_input()
        if s_in != fused_in or s_out is None or s_out[:-1] != fused_out[:-1] or x is None:
            return 0
        if not (x is first or torch.equal(x, first)):
            return 0
        width += s_out[-1]
        if width == fused_out[-1]:
            return k - start + 1 if k > start else 0
        if width > fused_out[-1]:
            return 0
    return 0
