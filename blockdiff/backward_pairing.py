"""Backward pairing: which part of the candidate goes with which of the reference's.

The backward (:mod:`blockdiff.backward`) judges a module's parameter gradients and drills
into its children; both need the candidate's parts paired with the reference's, as the
forward pairs them (:class:`GradientPairing`): parameters by
:func:`~blockdiff.conversion.paired_parameters` (the same name, else the same place among
the weights of one shape), then through the children as
:func:`~blockdiff.children.pair_children` pairs them (by name, role and order, a fused child
against split ones: ``wqkv.weight`` as ``q_proj.weight+k_proj.weight+v_proj.weight``, side
by side along the dimension their outputs are). A sharded candidate's ranks judge only the
pairs every rank has (:meth:`GradientPairing.on_every_rank`).

A block's backward runs with some of its modules' calls answered by their reference
counterparts, each call paired with the reference's site of it: the reference's own module
(:func:`answered_by`, the residual), the reference's routing decision
(:func:`frozen_routing`), or its own code, probed for whether it is what the reference's
module would compute (:func:`probed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from . import distributed
from .children import ChildPair, Pairing, pair_children
from .conversion import paired_parameters
from .experiments import _module_of, same_arguments
from .report import Check
from .sides import GradientRuns, Hidden, Replaced, Side
from .site import Site, for_replay, hidden_states, iter_tensors, map_structure, primary_tensor, replace_primary, with_hidden

T = TypeVar("T")


@dataclass
class ParameterPair:
    """Candidate parameters judged against reference parameters as one gradient (names
    below their modules): one and one, or a fused weight against split ones side by side
    along ``dim`` (``wqkv.weight`` against ``q_proj.weight``, ``k_proj.weight`` and
    ``v_proj.weight`` along dimension 0)."""

    cand: list[str]
    ref: list[str]
    dim: int | None = None

    @property
    def name(self) -> str:
        """How a check names it: ``weight``; ``w2.weight (as down_proj.weight)``; ``wqkv.weight
        (as q_proj.weight+k_proj.weight+v_proj.weight)``."""
        mine, theirs = "+".join(self.cand), "+".join(self.ref)
        return mine if mine == theirs else f"{mine} (as {theirs})"


class GradientPairing:
    """The pairings of one backward diff's module checks, between the reference and the
    candidate (each with its backward, ``ref_runs`` and ``cand_runs``). The child calls of
    the module being judged are recorded once, for its parameters' pairing and its
    drill-down alike, and let go after it (:meth:`forget`)."""

    def __init__(self, ref: Side, cand: Side, ref_runs: GradientRuns, cand_runs: GradientRuns) -> None:
        self.ref, self.cand = ref, cand
        self.ref_runs, self.cand_runs = ref_runs, cand_runs
        self._child_calls: dict[tuple, list[Site]] = {}

    def forget(self) -> None:
        """The module judged is done: its child calls are let go."""
        self._child_calls.clear()

    def parameters(
        self, r: Site, c: Site, hidden: Hidden, expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
    ) -> tuple[list[ParameterPair], dict[str, list[str]]]:
        """Which of the candidate module's parameter gradients (``got``, by name below it)
        goes with which of the reference's (``expected``): by
        :func:`~blockdiff.conversion.paired_parameters`; what is left, through the children
        (:meth:`children`): a child pair's own weights by ``paired_parameters``, a fused
        child's weight against its split counterparts' side by side. Returns the pairs, in
        the reference's order, and what pairs with nothing, by side (``{"reference": [...],
        "candidate": [...]}``)."""
        ref_module, cand_module = self.ref_runs.module(r.module), self.cand_runs.module(c.module)
        pairs: list[ParameterPair] = []
        taken: tuple[set[str], set[str]] = (set(), set())

        def add(mine: list[str], theirs: list[str], dim: int | None) -> None:
            if any(n not in got or n in taken[0] for n in mine) or any(n not in expected or n in taken[1] for n in theirs):
                return
            if dim is None and held(cand_module, mine[0], got[mine[0]]).shape != held(ref_module, theirs[0], expected[theirs[0]]).shape:
                return  # (a weight held in another layout: a local shard, a transposed copy)
            pairs.append(ParameterPair(mine, theirs, dim))
            taken[0].update(mine)
            taken[1].update(theirs)

        for mine, theirs in paired_parameters(ref_module, cand_module):
            add([mine], [theirs], None)
        left = any(n not in taken[0] for n in got) and any(n not in taken[1] for n in expected)
        # The candidate's child calls are collective on a sharded side: every rank runs them
        # when any rank has weights left to pair (an expert-parallel rank holds other experts).
        if not distributed.everywhere(not left):
            for pair in self.children(r, self.calls(self.ref_runs, r.module, r, None), c, hidden).pairs:
                if any(s.call for s in (*pair.ref, *pair.cand)):  # a later call: its weights are its first call's
                    continue
                refs = [(s.module[len(r.module) + 1:], self.ref_runs.module(s.module)) for s in pair.ref]
                cands = [(s.module[len(c.module) + 1:], self.cand_runs.module(s.module)) for s in pair.cand]
                if len(refs) == 1 and len(cands) == 1:
                    (ref_rel, ref_child), (cand_rel, cand_child) = refs[0], cands[0]
                    for mine, theirs in paired_parameters(ref_child, cand_child):
                        add([f"{cand_rel}.{mine}"], [f"{ref_rel}.{theirs}"], None)
                    continue
                # A fused child against split ones: each weight of the one beside the same
                # weight of the others, along the dimension their outputs are side by side in.
                one, many = (cands[0], refs) if len(cands) == 1 else (refs[0], cands)
                for name, _ in one[1].named_parameters():
                    parts = [f"{rel}.{name}" for rel, _ in many]
                    cand_names, ref_names = ([f"{one[0]}.{name}"], parts) if len(cands) == 1 else (parts, [f"{one[0]}.{name}"])
                    shapes = [tuple(held(cand_module, n, got[n]).shape) for n in cand_names if n in got]
                    wanted = [tuple(held(ref_module, n, expected[n]).shape) for n in ref_names if n in expected]
                    if len(shapes) == len(cand_names) and len(wanted) == len(ref_names):
                        dim = _fused_dim(*(shapes + wanted if len(shapes) == 1 else wanted + shapes))
                        if dim is not None:
                            add(cand_names, ref_names, dim)
        order = {name: i for i, name in enumerate(expected)}
        pairs.sort(key=lambda p: order[p.ref[0]])
        pairs, apart = self.on_every_rank(pairs, lambda p: (tuple(p.cand), tuple(p.ref)))
        for left_out in apart:
            taken[0].difference_update(left_out.cand)
            taken[1].difference_update(left_out.ref)
        return pairs, {
            "reference": [n for n in expected if n not in taken[1]], "candidate": [n for n in got if n not in taken[0]],
        }

    def children(self, r: Site, ref_calls: list[Site], c: Site, hidden: Hidden) -> Pairing:
        """The reference module's child calls ``ref_calls`` (at ``r``) paired with the
        candidate module's at ``c`` on the activations ``hidden``, as the forward's
        drill-down pairs them (:func:`~blockdiff.children.pair_children`)."""
        return pair_children(
            r.module, ref_calls, c.module, self.calls(self.cand_runs, c.module, c, hidden),
            ref_module=_module_of(self.ref), cand_module=_module_of(self.cand),
        )

    def calls(self, runs: GradientRuns, path: str, call: Site, hidden: Hidden | None) -> list[Site]:
        """The child calls of module ``path`` at ``call`` (its activations ``hidden``, or its
        own) on the side ``runs`` runs the backward of, recorded once for a pairing."""
        key = (id(runs), path, call.call, None if hidden is None else tuple(sorted((k, id(t)) for k, t in hidden.items())))
        if key not in self._child_calls:
            self._child_calls[key] = runs.backward_child_calls(path, call, hidden)
        return self._child_calls[key]

    def drill_down(
        self, r: Site, c: Site, hidden: Hidden, grad: torch.Tensor, into: Check,
        judged: Callable[[ChildPair, dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]], Check | str],
    ) -> None:
        """The backward's drill-down: each innermost child the reference's module calls at
        ``r`` (its backward from ``grad``: the reference's ``child_gradients``) paired with
        the candidate's children at ``c`` (:meth:`children`: a fused child against split
        ones too), and each pair judged by ``judged(pair, gradients)`` — ``gradients``: each
        reference child call's input and output gradient, by ``id`` of its site — in the
        order they ran, into ``into.children``. What pairs with nothing, and pairs that
        cannot be judged (``judged`` says why), that no gradient reaches or that not every
        rank calls, are recorded beside them (``children_not_paired``,
        ``children_not_judged``)."""
        found = self.ref_runs.child_gradients(r.module, r, hidden, grad)
        gradients = {id(s): (expected, out_grad) for s, expected, out_grad in found}
        pairing = self.children(r, [s for s, _, _ in found], c, hidden)
        checks: list[Check] = []
        not_judged = list(pairing.not_judged)
        pairs, apart = self.on_every_rank(pairing.pairs, lambda p: (tuple(p.ref_names), tuple(p.cand_names)))
        not_judged += [f"{'+'.join(pair.cand_names)} (not called on every rank)" for pair in apart]
        for pair in pairs:
            check = judged(pair, gradients)
            if isinstance(check, Check):
                checks.append(check)
            else:
                not_judged.append(f"{'+'.join(pair.cand_names)} ({check})")
        into.children = checks
        into.children_not_paired = pairing.not_paired
        into.children_not_judged = not_judged

    def on_every_rank(self, items: list[T], key: Callable[[T], Any]) -> tuple[list[T], list[T]]:
        """``items`` (pairs to judge) split into those every rank of a sharded candidate
        has, in rank 0's order, and the rest: each check is collective (its metrics are the
        worst rank's), so every rank judges the same list. An expert-parallel rank calls
        only the experts its tokens were routed to. Outside a launched run, all of them."""
        if not self.cand.lockstep:
            return items, []
        every = distributed.every_rank([key(item) for item in items])
        common = set(every[0]).intersection(*map(set, every[1:]))
        order = {k: n for n, k in enumerate(every[0])}
        kept = sorted((item for item in items if key(item) in common), key=lambda item: order[key(item)])
        return kept, [item for item in items if key(item) not in common]


def answered_by(ref: Side, side: Side, cast: torch.dtype | None, block: str, sites: list[tuple[Site, Site]]) -> Replaced:
    """For a backward of ``side``'s block ``block``: each of its sub-path modules
    answering with ``ref``'s own module (forward and backward) run on what reached it, with
    the reference's other arguments of that call. ``sites``: (reference site, ``side``'s
    site of that call, whose output gives the structure and dtypes)."""

    def answer(r: Site, own: Site, template: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
        reached = hidden_states(args, kwargs, side.layout.options(own.module).activations).get("primary")
        found = ref.call_module(r.module, r, None if reached is None else {"primary": reached})
        if r.subpath == "router":  # the whole routing decision: logits, weights, indices
            return _like(found, template)
        out, like = primary_tensor(found), primary_tensor(template)
        if out is None or like is None:
            return original(*args, **kwargs)
        return replace_primary(template, out.to(device=like.device, dtype=like.dtype).reshape(like.shape))

    return _per_call(side, cast, block, sites, answer)


def probed(side: Side, cast: torch.dtype | None, block: str, sites: list[Site], shares: dict[tuple[str, int], bool]) -> Replaced:
    """For a whole-block backward of ``side``'s block ``block``: each sub-path module's call
    (``sites``, the reference's) runs its own code, and ``shares`` says, by (module, call),
    whether that call is the one :func:`answered_by` would make in its place with ``side``
    as the reference (this very module on what reached it, with the reference's other
    arguments cast to ``cast``): the same arguments bit for bit, and an output holding its
    primary tensor alone, of the recorded output's dtype and shape."""

    def answer(r: Site, own: Site, template: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
        out = original(*args, **kwargs)
        reached = hidden_states(args, kwargs, side.layout.options(own.module).activations).get("primary")
        got, like = primary_tensor(out), primary_tensor(template)
        same = (
            reached is not None and got is not None and like is not None
            and got.dtype == like.dtype and got.shape == like.shape
            and len(list(iter_tensors(out))) == 1 == len(list(iter_tensors(template)))
            and same_arguments(with_hidden(r.args, r.kwargs, {"primary": reached}, r.activations), (args, kwargs), cast)
        )
        shares[(r.module, r.call)] = shares.get((r.module, r.call), True) and same
        return out

    return _per_call(side, cast, block, [(s, s) for s in sites], answer)


def frozen_routing(side: Side, cast: torch.dtype | None, block: str, routers: list[tuple[Site, Site]]) -> Replaced:
    """For a backward of ``side``'s block ``block``: each router answering with the
    reference's recorded decision (logits, weights, indices), cast like ``side``'s own
    output of that call; no gradient flows through it. ``routers``: (reference router
    site, ``side``'s router site of that call)."""
    return _per_call(side, cast, block, routers, lambda r, own, template, original, args, kwargs: _like(r.output, template))


def _per_call(
    side: Side, cast: torch.dtype | None, block: str, sites: list[tuple[Site, Site]],
    answer: Callable[[Site, Site, Any, Callable, tuple, dict], Any],
) -> Replaced:
    """For a backward run of ``side``'s block ``block`` (its replayed floating arguments cast
    to ``cast``), by module path relative to it:
    a ``forward`` replacement that answers each call of ``sites`` — (reference site,
    ``side``'s site of that call) — with ``answer(reference site, side's site, its recorded
    output as a template, the original forward, args, kwargs)``, and runs its own code for any
    other call. Calls are counted apart in the forward and in each recomputation
    (activation checkpointing reruns the block's code inside the backward)."""
    by_module: dict[str, dict[int, tuple[Site, Site]]] = {}
    for r, own in sites:
        by_module.setdefault(own.module, {})[own.call] = (r, own)
    device = side.device

    def make(calls: dict[int, tuple[Site, Site]]) -> Callable[[Callable], Callable]:
        def wrapped(original: Callable) -> Callable:
            count: dict[int, int] = {}

            def forward(*args: Any, **kwargs: Any) -> Any:
                task = torch._C._current_graph_task_id()
                call = count[task] = count.get(task, -1) + 1
                if call not in calls:  # not a site (the map's `calls`): its own code
                    return original(*args, **kwargs)
                r, own = calls[call]
                return answer(r, own, for_replay(own.output, device=device, dtype=cast), original, args, kwargs)

            return forward

        return wrapped

    return {path[len(block) + 1:]: make(calls) for path, calls in by_module.items()}


def _like(answer: Any, template: Any) -> Any:
    """``answer``'s tensors, in order, each moved and cast like the tensor of ``template``
    in its place (gradients flow through the casts), in ``answer``'s structure."""
    own = iter(list(iter_tensors(template)))

    def cast(t: torch.Tensor) -> torch.Tensor:
        like = next(own, None)
        if like is None:
            return t
        dtype = like.dtype if t.is_floating_point() and like.is_floating_point() else t.dtype
        return t.to(device=like.device, dtype=dtype)

    return map_structure(answer, cast)


def held(module: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The gradient ``t`` of ``module``'s parameter ``name`` as the weights' pairing holds
    that parameter (:func:`~blockdiff.conversion.weights`): a Hugging Face ``Conv1D``'s
    weight (``[in, out]``) transposed, as ``nn.Linear`` holds it; any other as it is."""
    owner, _, leaf = name.rpartition(".")
    try:
        found = module.get_submodule(owner) if owner else module
    except AttributeError:
        return t
    return t.T if leaf == "weight" and type(found).__name__ == "Conv1D" and t.dim() == 2 else t


def _fused_dim(whole: tuple[int, ...], *parts: tuple[int, ...]) -> int | None:
    """The one dimension along which ``parts`` side by side make ``whole``'s shape (the
    others equal), ``None`` when there is none or more than one."""
    if len(parts) < 2 or any(len(p) != len(whole) for p in parts):
        return None
    found = [
        d for d in range(len(whole))
        if sum(p[d] for p in parts) == whole[d] and all(p[k] == whole[k] for p in parts for k in range(len(whole)) if k != d)
    ]
    return found[0] if len(found) == 1 else None


def side_by_side(tensors: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """``tensors`` concatenated along ``dim`` (one tensor: itself)."""
    return tensors[0] if len(tensors) == 1 or dim is None else torch.cat(tensors, dim=dim)


def summed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` added up in float32 (one tensor: itself)."""
    if len(tensors) == 1:
        return tensors[0]
    total = tensors[0].float()
    for t in tensors[1:]:
        total = total + t.to(total.device).float()
    return total


__all__ = ["GradientPairing", "ParameterPair", "answered_by", "frozen_routing", "held", "probed", "side_by_side", "summed"]
