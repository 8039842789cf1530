"""MoE: a router's recorded output read as routing decisions, and the routing-aware checks.

Routers differ in what they return; the hook map names the format:

- ``topk`` (Hugging Face Mixtral/Qwen-MoE routers, blockdiff's sample):
  ``(logits [.., E], weights [T, k], indices [T, k])``;
- ``switch`` (SwitchTransformers): ``(dispatch one-hot [.., E] after capacity,
  probs [.., 1], logits [.., E])``; top-1, the kept assignments are the dispatch's.
- ``dense`` (Llama 4: ``(scores [T, E], logits [T, E])``; NLLB-MoE: ``(mask, weights
  [T, E], logits [T, E])``): the last two tensors are the weights, zero off the chosen
  experts, and the logits. The chosen experts are the top-k logits, k the most experts
  any token has a weight for; an assignment whose weight is zero was dropped.
- ``logits`` (DBRX): the router returns only logits ``[T, E]``; the MoE module picks the
  top-k itself, k read from it when the hook map is resolved (``top_k``). The chosen
  experts are the top-k logits; the weights are blockdiff's reading (the softmax at the
  chosen experts, renormalized): the model's own weighting runs inside the MoE module
  and is judged with the experts.

Routing-aware localization judges a router on three things, none of which a routing flip
caused by precision can trip (docs/design.md, "MoE"): its logits; its weights on the tokens
whose top-k sets agree with the reference; and its flips, each explained only when the
reference's margin ``z_(k) − z_(k+1)`` is within the logit noise that precision causes.
The experts are judged with routing frozen at the reference's.

:func:`moe_checks` runs those experiments on a block pair; :func:`moe_statistics` gives the
routing statistics of both free-running sides (:mod:`blockdiff.moe_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .compare import metrics
from .errors import PairingError
from .experiments import check_shapes
from .moe_stats import Routing, moe_block_stats
from .report import Check, SubpathResult
from .site import Site, describe_key, iter_tensors, snapshot
from .tolerance import Threshold, Tolerance
from .vocab import EXPERTS, ROUTER_FORMATS, ROUTER_LOGITS, ROUTER_WEIGHTS, ROUTING_DIFFERS, ROUTING_FLIPS

if TYPE_CHECKING:
    from .experiments import Experiments
    from .hookmap import BlockLayout
    from .pairing import BlockPair
    from .sides import Side



@dataclass
class Decision:
    """One router call read as routing: the statistics' :class:`Routing` plus weights."""

    routing: Routing
    weights: torch.Tensor  # [T, k]

    @property
    def dense(self) -> torch.Tensor:
        """Weights scattered into [T, E] (zero for experts not chosen), float64."""
        r = self.routing
        dense = torch.zeros(r.logits.shape, dtype=torch.float64)
        return dense.scatter(1, r.indices.long(), self.weights.to(torch.float64))


def decision(
    output: Any, fmt: str, *, capacity: int | None = None, top_k: int | None = None, what: str = "router"
) -> Decision:
    """Read a router's recorded output (``top_k``: the experts per token of a ``logits``
    router).

    Raises:
        PairingError: the output does not have the tensors the format names.
    """
    tensors = [t.detach().cpu() for t in iter_tensors(output)]
    needed = {"dense": 2, "logits": 1}.get(fmt, 3)
    if len(tensors) < needed:
        raise PairingError(f"{what}: a {fmt!r} router returns {needed} tensors, found {len(tensors)}")
    if fmt == "topk":
        logits, weights, indices = tensors[:3]
        experts = logits.shape[-1]
        logits = logits.reshape(-1, experts)
        k = indices.shape[-1]
        return Decision(Routing(logits, indices.reshape(-1, k), capacity=capacity), weights.reshape(-1, k))
    if fmt == "switch":
        dispatch, probs, logits = tensors[:3]
        experts = logits.shape[-1]
        logits = logits.reshape(-1, experts)
        indices = logits.argmax(-1, keepdim=True)
        kept = dispatch.reshape(-1, experts).sum(-1, keepdim=True) > 0
        # Capacity counts per sequence: the dispatch is [batch, seq, E].
        groups = dispatch.shape[0] if dispatch.dim() == 3 else 1
        routing = Routing(logits, indices, capacity=capacity, kept=kept, groups=groups)
        return Decision(routing, probs.reshape(-1, 1))
    if fmt == "dense":
        dense_weights, logits = tensors[-2], tensors[-1]
        experts = logits.shape[-1]
        logits, dense_weights = logits.reshape(-1, experts), dense_weights.reshape(-1, experts)
        if dense_weights.shape != logits.shape:
            raise PairingError(f"{what}: a 'dense' router returns weights and logits of one shape, found "
                               f"{list(dense_weights.shape)} and {list(logits.shape)}")
        k = max(int((dense_weights != 0).sum(-1).max()), 1)
        indices = logits.float().topk(k, dim=-1).indices
        weights = dense_weights.gather(1, indices)
        kept = weights != 0
        routing = Routing(logits, indices, capacity=capacity, kept=None if bool(kept.all()) else kept)
        return Decision(routing, weights)
    if fmt == "logits":
        logits = tensors[-1]
        logits = logits.reshape(-1, logits.shape[-1])
        if top_k is None:
            raise PairingError(f"{what}: a 'logits' router needs the experts per token (top_k in [blocks.moe])")
        indices = logits.float().topk(top_k, dim=-1).indices
        weights = logits.float().softmax(-1).gather(1, indices)
        return Decision(Routing(logits, indices, capacity=capacity), weights / weights.sum(-1, keepdim=True))
    raise PairingError(f"{what}: unknown router format {fmt!r}; expected one of {', '.join(ROUTER_FORMATS)}")


def _topk_sets_agree(a: Routing, b: Routing) -> torch.Tensor:
    return (a.indices.sort(-1).values == b.indices.sort(-1).values).all(-1)


def margins(routing: Routing) -> torch.Tensor:
    """Per token, the reference's routing margin z_(k) − z_(k+1) (inf when k = E)."""
    k = routing.indices.shape[-1]
    z = routing.logits.to(torch.float64).sort(-1, descending=True).values
    if k >= z.shape[-1]:
        return torch.full((z.shape[0],), float("inf"), dtype=torch.float64)
    return z[:, k - 1] - z[:, k]


def routing_shape(decision: Decision) -> tuple[int, int]:
    """(experts, experts per token) of a routing decision."""
    return int(decision.routing.logits.shape[-1]), int(decision.routing.indices.shape[-1])


def routing_differs(reference: Decision, candidate: Decision, module: str) -> Check:
    """A divergence of the router part: the candidate routes to another number of experts,
    or of experts per token — the config bugs ported into MoE code."""
    (r_experts, r_k), (c_experts, c_k) = routing_shape(reference), routing_shape(candidate)
    differences = []
    if c_k != r_k:
        differences.append(f"top-{c_k} where the reference routes top-{r_k}")
    if c_experts != r_experts:
        differences.append(f"{c_experts} experts where the reference has {r_experts}")
    return Check(
        ROUTING_DIFFERS,
        module,
        None,
        Threshold(0.5, "fixed", None),
        value=1.0,
        metric="routing_differs",
        details={
            "reference": {"experts": r_experts, "top_k": r_k},
            "candidate": {"experts": c_experts, "top_k": c_k},
            "message": "the candidate routes " + " and ".join(differences),
        },
    )


def router_checks(
    reference: Decision,
    candidate: Decision,
    floor: Decision | None,
    *,
    module: str,
    tolerance: Tolerance,
    dtype: torch.dtype,
) -> list[Check]:
    """The router's three checks: logits, weights where top-k agree, flips by margin
    (a flip is explained when the reference's margin is within the logit noise, or when
    the reference's router at the candidate's precision makes the candidate's choice).

    Args:
        reference, candidate: the reference's router output and the candidate router's on
            the reference's input.
        floor: the reference's router in the candidate's precision (calibrated policy), or
            ``None`` (fixed policy).
    """
    r, c = reference.routing, candidate.routing
    if r.logits.shape[0] != c.logits.shape[0]:
        raise PairingError(f"{module}: candidate router sees {c.logits.shape[0]} tokens, reference {r.logits.shape[0]}")
    if r.logits.shape != c.logits.shape or r.indices.shape != c.indices.shape:
        return [routing_differs(reference, candidate, module)]

    def threshold(value: float | None) -> Threshold:
        return tolerance.threshold("ffn", dtype, value)

    checks = []
    logit_floor = metrics(r.logits, floor.routing.logits, dtype=dtype).rel_l2 if floor else None
    checks.append(Check(ROUTER_LOGITS, module, metrics(r.logits, c.logits, dtype=dtype), threshold(logit_floor)))

    agree = _topk_sets_agree(r, c)
    weight_floor = None
    if floor is not None:
        both = agree & _topk_sets_agree(r, floor.routing)
        weight_floor = metrics(reference.dense[both], floor.dense[both], dtype=dtype).rel_l2
    checks.append(
        Check(
            ROUTER_WEIGHTS,
            module,
            metrics(reference.dense[agree], candidate.dense[agree], dtype=dtype),
            threshold(weight_floor),
        )
    )

    # A flip is precision when the reference's margin is within the logit noise that the
    # candidate's precision causes: the floor's largest logit error (calibrated), or the
    # fixed relative threshold times the logits' RMS.
    ref_logits = r.logits.to(torch.float64)
    if floor is not None:
        noise = float((floor.routing.logits.to(torch.float64) - ref_logits).abs().max())
        mult = tolerance.multiplier_for(dtype)
    else:
        noise = threshold(None).value * float(ref_logits.pow(2).mean().sqrt())
        mult = 1.0
    allowed = mult * noise + 1e-12
    flipped = ~agree
    margin = margins(r)[flipped]
    # A flip the reference's own router makes at the candidate's precision is precision,
    # whatever its logit margin: group-limited, biased or sigmoid top-k decide on scores
    # the logits do not order (DeepSeek-V3, GLM-4-MoE).
    reproduced = (
        _topk_sets_agree(floor.routing, c)[flipped]
        if floor is not None and floor.routing.indices.shape == c.indices.shape
        else torch.zeros(margin.shape, dtype=torch.bool)
    )
    unexplained = (margin > allowed) & ~reproduced
    judged = margin[~reproduced]
    value = float((judged / allowed).max()) if judged.numel() else 0.0
    checks.append(
        Check(
            ROUTING_FLIPS,
            module,
            None,
            Threshold(1.0, "calibrated" if floor is not None else "fixed", None),
            value=value,
            metric="flip_margin_ratio",
            details={
                "tokens": int(agree.numel()),
                "flipped": int(flipped.sum()),
                "unexplained": int(unexplained.sum()),
                "reproduced_by_floor": int(reproduced.sum()),
                "margin_tolerance": allowed,
                "flipped_tokens": [int(t) for t in flipped.nonzero().flatten()],
                "flip_margins": [float(m) for m in margin],
            },
        )
    )
    return checks


# -- experiments and statistics of an MoE block -------------------------------------------


def side_decision(side: Side, layout: BlockLayout, router: Site, output: Any = None) -> Decision:
    """A router call of ``side`` read as routing (its recorded output, or ``output``), with
    the model's own expert capacity where it has one."""
    assert layout.moe is not None
    output = router.output if output is None else output
    top_k = layout.moe.get("top_k")
    routing = decision(output, layout.moe["format"], top_k=None if top_k is None else int(top_k), what=router.label)
    routing.routing.capacity = capacity_of(side, layout.moe.get("capacity"), routing.routing.logits.shape[0])
    return routing


def capacity_of(side: Side, path: str | None, tokens: int) -> int | None:
    """An MoE's own expert capacity: the attribute ``path`` names (an int, or a callable
    taking the token count), or ``None`` for dropless models."""
    if path is None:
        return None
    value = side.attribute(path)
    if callable(value):
        value = value(tokens)
    return None if value is None else int(value)


def moe_checks(exp: Experiments, pair: BlockPair, r_ffn: Site, c_ffn: Site) -> list[Check]:
    """An MoE ffn judged as router (logits, weights where top-k agree, flips by margin)
    and experts (the candidate MoE with routing frozen at the reference's)."""
    routers = pair.router_of(r_ffn)
    assert routers is not None and pair.ref_layout is not None and pair.cand_layout is not None
    r_router, c_router = routers
    r_layout, c_layout = pair.ref_layout, pair.cand_layout
    ref = side_decision(exp.ref, r_layout, r_router)
    out = exp.cand.call_module(c_router.module, c_router, r_router.hidden_inputs())
    cand = side_decision(exp.cand, c_layout, c_router, snapshot(out))
    # The router's whole output at the candidate's precision (what a dump stores).
    # (The candidate's own run, when it is the floor's: exp.floor_is_check.)
    floor_output = exp.with_floor(
        f"router:{describe_key(r_router.key)}",
        lambda side: snapshot(out if exp.floor_is_check(r_router, c_router) else side.call_module(r_router.module, r_router)),
    )
    floor = None if floor_output is None else side_decision(exp.ref, r_layout, r_router, floor_output)
    checks = router_checks(ref, cand, floor, module=c_router.module, tolerance=exp.tolerance, dtype=exp.dtype)
    if checks[0].what == ROUTING_DIFFERS:
        return checks  # the experts' math cannot run on a routing of another shape

    ref_out = r_ffn.primary_output()
    assert ref_out is not None

    def frozen_routing(side: Side, ffn: Site, router: Site, template: Site, hidden: dict | None) -> Any:
        rel = router.module[len(ffn.module) + 1 :]
        out, _ = side.run_block(ffn.module, ffn, hidden, {rel: "router"}, {("router", 0): (r_router, template)})
        return out

    out = frozen_routing(exp.cand, c_ffn, c_router, c_router, r_ffn.hidden_inputs())
    check_shapes(describe_key(c_ffn.key), "output", ref_out, out)
    experts_floor = exp.with_floor(
        f"experts:{describe_key(r_ffn.key)}",
        lambda side: metrics(
            ref_out, out if exp.floor_is_check(r_ffn, c_ffn) else frozen_routing(side, r_ffn, r_router, r_router, None),
            dtype=exp.dtype,
        ).rel_l2,
    )
    checks.append(exp.check("ffn", EXPERTS, c_ffn.module, ref_out, out, experts_floor))
    return checks


def moe_statistics(
    exp: Experiments, pair: BlockPair, ffn: SubpathResult | None, capacity_factors: tuple[float, ...]
) -> dict[str, Any]:
    """Routing statistics of one MoE block: both free-running sides and their agreement."""
    assert pair.ref_layout is not None and pair.cand_layout is not None
    key = min(pair.ref_routers, key=lambda k: k.ordinal)
    ref = side_decision(exp.ref, pair.ref_layout, pair.ref_routers[key])
    cand = side_decision(exp.cand, pair.cand_layout, pair.cand_routers[key])
    stats = moe_block_stats(ref.routing, cand.routing, capacity_factors=capacity_factors)
    local = None
    if ffn is not None:
        flips = next((c for c in ffn.checks if c.what == ROUTING_FLIPS), None)
        local = None if flips is None else flips.details
    return {
        "block": pair.index,
        "router": pair.cand_routers[key].module,
        "format": pair.cand_layout.moe["format"] if pair.cand_layout.moe else None,
        **stats,
        "local_flips": local,
    }


def routing_shapes_differ(exp: Experiments, pair: BlockPair) -> bool:
    """Whether the two sides' recorded routers route to another number of experts or of
    experts per token (then routing is not frozen across sides, and the router is blamed)."""
    assert pair.ref_layout is not None and pair.cand_layout is not None
    for key, r_router in pair.ref_routers.items():
        c_router = pair.cand_routers.get(key)
        if c_router is None:
            continue
        ref = side_decision(exp.ref, pair.ref_layout, r_router)
        cand = side_decision(exp.cand, pair.cand_layout, c_router)
        if routing_shape(ref) != routing_shape(cand):
            return True
    return False
