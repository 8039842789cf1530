"""Routing statistics of MoE blocks, per side and side by side.

This module sits in the *compare* step of the pipeline for MoE blocks: capture has recorded
each side's router logits and the expert indices the model really used; these pure
functions turn them into the per-expert loads, entropies, capacity drops and the agreement
between reference and candidate that end up in the report's ``moe`` list.

All math runs in float64 on CPU tensors, whatever the dtype and device of the inputs. Every
returned value is plain Python (``int``, ``float``, ``bool``, ``None``, ``list``, ``dict``
with string keys), so a report can be written with :func:`json.dumps` directly.

Notation: T tokens, E experts, k = top-k, p = softmax(router logits) in float64.

Capacity is applied to the T tokens given, as one capacity group. Models whose capacity
counts per sequence (SwitchTransformers counts along each batch row) should be passed one
sequence at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Routing", "side_stats", "agreement", "moe_block_stats"]

_INF = float("inf")
_DEFAULT_MARGIN_BINS = (0.0, 1e-3, 1e-2, 1e-1, 1.0, _INF)


@dataclass
class Routing:
    """What one side's router decided for T tokens.

    Attributes:
        logits: ``[T, E]`` router logits, any float dtype (converted to float64).
        indices: ``[T, k]`` integer expert indices the model really used, distinct within a
            token; ``indices[:, 0]`` is taken as the highest-weight expert (``torch.topk``
            returns them in that order).
        capacity: the model's own expert capacity (e.g. SwitchTransformers'
            ``expert_capacity``), or ``None`` for a dropless model.
        kept: optional ``[T, k]`` bool tensor, which assignments the model's own dispatch
            kept. When given, it is the truth for the after-capacity counts and drop rates.
        groups: how many equal, consecutive groups of tokens the capacity applies to
            separately (SwitchTransformers counts capacity per sequence: the batch size).
    """

    logits: torch.Tensor
    indices: torch.Tensor
    capacity: int | None = None
    kept: torch.Tensor | None = None
    groups: int = 1


@dataclass
class _Checked:
    """A validated :class:`Routing`, as float64/int64/bool CPU tensors."""

    logits: torch.Tensor  # [T, E] float64
    indices: torch.Tensor  # [T, k] int64
    capacity: int | None
    kept: torch.Tensor | None  # [T, k] bool
    groups: int = 1

    @property
    def tokens(self) -> int:
        return self.logits.shape[0]

    @property
    def experts(self) -> int:
        return self.logits.shape[1]

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]


def _shape(t: torch.Tensor) -> str:
    return "[" + ",".join(str(n) for n in t.shape) + "]"


def _check(r: Routing, label: str) -> _Checked:
    """Validate one side and convert it; raise ``ValueError`` naming expected vs found."""
    if not isinstance(r.logits, torch.Tensor) or not isinstance(r.indices, torch.Tensor):
        raise ValueError(f"{label}: logits and indices must be torch tensors")
    logits, indices = r.logits, r.indices
    if logits.dim() != 2:
        raise ValueError(f"{label}: logits should have shape [T, E], found {_shape(logits)}")
    if not logits.is_floating_point():
        raise ValueError(f"{label}: logits should be a float tensor, found {logits.dtype}")
    tokens, experts = logits.shape
    if tokens == 0:
        raise ValueError(f"{label}: logits have no tokens (shape {_shape(logits)})")
    if experts < 2:
        raise ValueError(f"{label}: expected at least 2 experts, found E={experts}")
    if indices.dim() != 2 or indices.shape[0] != tokens:
        raise ValueError(
            f"{label}: indices should have shape [T={tokens}, k], found {_shape(indices)}"
        )
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise ValueError(f"{label}: indices should be an integer tensor, found {indices.dtype}")
    k = indices.shape[1]
    if not 1 <= k <= experts:
        raise ValueError(f"{label}: expected 1 <= k <= E={experts}, found k={k}")
    indices = indices.detach().cpu().to(torch.int64)
    bad = (indices < 0) | (indices >= experts)
    if bool(bad.any()):
        t, s = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{label}: expert indices should lie in [0, {experts}), "
            f"found {int(indices[t, s])} at token {t}, slot {s}"
        )
    if k > 1:
        ordered = indices.sort(dim=1).values
        dup = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(dup.any()):
            t = int(dup.nonzero()[0, 0])
            raise ValueError(
                f"{label}: expected {k} distinct experts per token, "
                f"found {indices[t].tolist()} at token {t}"
            )
    capacity = r.capacity
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(
                f"{label}: capacity should be a non-negative int or None, found {capacity!r}"
            )
    kept = r.kept
    if kept is not None:
        if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool:
            found = kept.dtype if isinstance(kept, torch.Tensor) else type(kept).__name__
            raise ValueError(f"{label}: kept should be a bool tensor, found {found}")
        if tuple(kept.shape) != tuple(indices.shape):
            raise ValueError(
                f"{label}: kept should have the shape of indices {_shape(indices)}, "
                f"found {_shape(kept)}"
            )
        kept = kept.detach().cpu()
    groups = r.groups
    if not isinstance(groups, int) or groups < 1 or indices.shape[0] % groups:
        raise ValueError(f"{label}: groups must divide the {indices.shape[0]} tokens, found {groups!r}")
    return _Checked(
        logits=logits.detach().cpu().to(torch.float64),
        indices=indices,
        capacity=capacity,
        kept=kept,
        groups=groups,
    )


def _counts(c: _Checked) -> torch.Tensor:
    return torch.bincount(c.indices.reshape(-1), minlength=c.experts)


def _entropy(q: torch.Tensor) -> torch.Tensor:
    """−Σ q ln q over the last dim, in nats, with 0 ln 0 = 0."""
    return torch.special.entr(q).sum(dim=-1)


def _first_come_kept(indices: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """Which assignments fit when each expert takes the first ``capacity`` that arrive.

    Arrival order is token order, and within a token the order of ``indices[t]``: the
    flattened row-major order of ``indices``. A stable sort by expert keeps that order
    inside each expert's group, so an assignment's rank in its group is its arrival rank.
    """
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    per_expert = torch.bincount(flat, minlength=experts)
    group_start = torch.cumsum(per_expert, dim=0) - per_expert
    rank_sorted = torch.arange(flat.numel()) - group_start[flat[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return (rank < capacity).reshape(indices.shape)


def _after_capacity(c: _Checked, kept: torch.Tensor) -> dict:
    """Counts and drop rates once the assignments not in ``kept`` are dropped."""
    total = c.tokens * c.top_k
    counts_after = torch.bincount(c.indices[kept], minlength=c.experts)
    return {
        "counts_after": [int(n) for n in counts_after],
        # Σ_e max(0, c_e − C) when ``kept`` comes from first-come; the model's own count
        # of dropped assignments otherwise.
        "assignment_drop_rate": float(total - int(kept.sum())) / total,
        "token_drop_rate": float(int((~kept.any(dim=1)).sum())) / c.tokens,
    }


def _cf_key(cf: float) -> str:
    return str(float(cf))


def _side_stats(c: _Checked, capacity_factors: tuple[float, ...]) -> dict:
    tokens, experts, k = c.tokens, c.experts, c.top_k
    ln_e = math.log(experts)
    p = torch.softmax(c.logits, dim=-1)
    routing_entropy = float(_entropy(p).mean())
    counts = _counts(c)
    load = counts.to(torch.float64) / (tokens * k)
    load_h = float(_entropy(load))

    out: dict = {
        "tokens": tokens,
        "experts": experts,
        "top_k": k,
        "counts": [int(n) for n in counts],
        "routing_entropy": routing_entropy,
        "routing_entropy_norm": routing_entropy / ln_e,
        "load_entropy": load_h / ln_e,
        "effective_experts": math.exp(load_h),
        "max_load": float(load.max()),
        "min_load": float(load.min()),
        "capacity": c.capacity,
    }

    if c.capacity is not None:
        simulated = torch.cat(
            [_first_come_kept(part, experts, c.capacity) for part in c.indices.chunk(c.groups)]
        )
    else:
        simulated = torch.ones_like(c.indices, dtype=torch.bool)  # dropless drops nothing
    if c.kept is not None:
        out["dispatch"] = "model"
        out.update(_after_capacity(c, c.kept))
        out["simulated_matches_model"] = bool(torch.equal(simulated, c.kept))
    else:
        out["dispatch"] = "simulated" if c.capacity is not None else "dropless"
        out.update(_after_capacity(c, simulated))
        out["simulated_matches_model"] = None

    if c.capacity is None:
        counterfactual = {}
        for cf in capacity_factors:
            # Megatron-Core's get_capacity: ceil((num_tokens / num_experts) * factor) with
            # num_tokens = T·k; the same expression keeps float rounding identical.
            cap = math.ceil((tokens * k / experts) * float(cf))
            kept = _first_come_kept(c.indices, experts, cap)
            counterfactual[_cf_key(cf)] = {"capacity": cap, **_after_capacity(c, kept)}
        out["counterfactual"] = counterfactual
    else:
        out["counterfactual"] = None
    return out


def _check_factors(capacity_factors) -> tuple[float, ...]:
    factors = tuple(capacity_factors)
    for cf in factors:
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0:
            raise ValueError(f"capacity factors should be positive numbers, found {cf!r}")
        if math.isinf(cf):
            raise ValueError(f"capacity factors should be finite, found {cf!r}")
    keys = [_cf_key(cf) for cf in factors]
    if len(set(keys)) != len(keys):
        raise ValueError(f"capacity factors should be distinct, found {list(factors)}")
    return factors


def side_stats(r: Routing, *, capacity_factors=(1.0, 1.25)) -> dict:
    """Routing statistics of one side of one MoE block.

    Args:
        r: the side's router logits and the expert indices it used.
        capacity_factors: for a dropless model (``r.capacity is None``), the capacity
            factors cf of the counterfactual capacities ``C = ceil((T·k / E) · cf)``
            (Megatron-Core's rule). Ignored when the model has its own capacity.

    Returns:
        A dict with

        - ``tokens``, ``experts``, ``top_k``: T, E, k.
        - ``counts``: per-expert assignment counts c_e before capacity (E ints).
        - ``routing_entropy``: mean over tokens of −Σ p ln p, in nats;
          ``routing_entropy_norm``: the same divided by ln E.
        - ``load_entropy``: H(c/Σc) / ln E; ``effective_experts``: exp(H(c/Σc)).
        - ``max_load``, ``min_load``: largest and smallest c_e / Σc.
        - ``capacity``: the model's own capacity, or ``None`` when dropless.
        - ``dispatch``: where the after-capacity numbers come from: ``"model"`` (``r.kept``),
          ``"simulated"`` (first come by position up to ``capacity``) or ``"dropless"``.
        - ``counts_after``: per-expert counts after capacity (equal to ``counts`` when
          dropless and ``kept`` is not given).
        - ``assignment_drop_rate``: dropped assignments / (T·k), which is
          Σ_e max(0, c_e − C) / (T·k) for the simulation.
        - ``token_drop_rate``: fraction of tokens left with no expert at all.
        - ``simulated_matches_model``: with ``kept`` given, whether the first-come
          simulation (or, when dropless, keeping everything) reproduces it exactly;
          ``None`` otherwise.
        - ``counterfactual``: when dropless, ``{str(float(cf)): {"capacity",
          "counts_after", "assignment_drop_rate", "token_drop_rate"}}`` per capacity
          factor; ``None`` when the model has its own capacity.

        First come by position: tokens take places in order t = 0..T−1 and, within a
        token, in the order of ``indices[t]``; an expert takes the first C that arrive.

    Raises:
        ValueError: malformed shapes, dtypes, expert indices, capacity or factors.

    Example:
        >>> r = Routing(logits=torch.zeros(8, 2), indices=torch.zeros(8, 1, dtype=torch.long),
        ...             capacity=3)
        >>> s = side_stats(r)
        >>> s["counts"], s["counts_after"], s["assignment_drop_rate"]
        ([8, 0], [3, 0], 0.625)
    """
    factors = _check_factors(capacity_factors)
    return _side_stats(_check(r, "routing"), factors)


def _margins(c: _Checked) -> torch.Tensor:
    """z_(k) − z_(k+1) of the sorted logits per token; +inf when k = E (no rival)."""
    if c.top_k == c.experts:
        return torch.full((c.tokens,), _INF, dtype=torch.float64)
    z = torch.topk(c.logits, c.top_k + 1, dim=-1, sorted=True).values
    return z[:, c.top_k - 1] - z[:, c.top_k]


def _check_bins(margin_bins) -> list[float]:
    edges = [float(e) for e in margin_bins]
    if len(edges) < 2:
        raise ValueError(f"margin bins need at least 2 edges, found {len(edges)}")
    if any(math.isnan(e) for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"margin bins should be strictly increasing, found {edges}")
    return edges


def _agreement(ref: _Checked, cand: _Checked, edges: list[float]) -> dict:
    tokens, k = ref.tokens, ref.top_k
    same_set = (ref.indices.sort(dim=1).values == cand.indices.sort(dim=1).values).all(dim=1)
    # Indices are distinct within a token, so counting matching pairs counts the overlap.
    overlap = (ref.indices[:, :, None] == cand.indices[:, None, :]).any(dim=2).sum(dim=1)
    top1 = ref.indices[:, 0] == cand.indices[:, 0]

    margins = _margins(ref)
    flipped = ~same_set
    bins = []
    for i, (low, high) in enumerate(zip(edges, edges[1:])):
        last = i == len(edges) - 2
        # [low, high), the last bin closed on the right as numpy.histogram does.
        inside = (margins >= low) & ((margins <= high) if last else (margins < high))
        bins.append(
            {
                "low": None if math.isinf(low) else low,
                "high": None if math.isinf(high) else high,
                "tokens": int(inside.sum()),
                "flipped": int((inside & flipped).sum()),
            }
        )

    f_r = _counts(ref).to(torch.float64) / (tokens * k)
    f_c = _counts(cand).to(torch.float64) / (tokens * k)
    log_r = torch.log_softmax(ref.logits, dim=-1)
    log_c = torch.log_softmax(cand.logits, dim=-1)
    p_r = log_r.exp()
    # 0 · ln(0 / q) = 0: an expert the reference never picks adds nothing, even at q = 0.
    kl = torch.where(p_r > 0, p_r * (log_r - log_c), torch.zeros_like(p_r)).sum(dim=-1)

    flipped_tokens = flipped.nonzero().reshape(-1)
    return {
        "tokens": tokens,
        "top_k": k,
        "topk_agreement": float(int(same_set.sum())) / tokens,
        "mean_overlap": float(overlap.to(torch.float64).mean()) / k,
        "top1_agreement": float(int(top1.sum())) / tokens,
        "flipped_tokens": [int(t) for t in flipped_tokens],
        "flip_margins": [float(m) for m in margins[flipped_tokens]],
        "flips_by_margin": bins,
        "load_delta": 0.5 * float((f_r - f_c).abs().sum()),
        "mean_kl": float(kl.mean()),
    }


def agreement(
    ref: Routing,
    cand: Routing,
    *,
    margin_bins=_DEFAULT_MARGIN_BINS,
) -> dict:
    """How far the candidate's routing agrees with the reference's, token by token.

    A token *flips* when its top-k expert set (from ``indices``, order ignored) differs
    between the sides. The reference's margin z_(k) − z_(k+1) (its logits sorted
    descending, z_(k) the k-th largest; +inf when k = E) says how close the token was to
    a tie: a flip at a small margin is what precision alone can cause.

    Args:
        ref: the reference side.
        cand: the candidate side; its logits and indices must have the reference's shapes.
        margin_bins: increasing bin edges for the reference margins. Bins are
            ``[low, high)``, the last one closed ``[low, high]`` (as ``numpy.histogram``);
            margins outside all bins are counted in none.

    Returns:
        A dict with

        - ``tokens``, ``top_k``: T and k.
        - ``topk_agreement``: fraction of tokens whose top-k sets are identical.
        - ``mean_overlap``: mean over tokens of |S_r ∩ S_c| / k.
        - ``top1_agreement``: fraction of tokens with ``ref.indices[t, 0] ==
          cand.indices[t, 0]``. Indices are not sorted: column 0 is taken to be the
          highest-weight expert, as ``torch.topk`` returns it.
        - ``flipped_tokens``: indices of the tokens whose sets differ, ascending.
        - ``flip_margins``: the reference margins of those tokens, in the same order.
        - ``flips_by_margin``: one dict per bin, ``{"low", "high", "tokens", "flipped"}``:
          the bin edges (an infinite edge written ``None``), the reference tokens whose
          margin falls in the bin, and how many of those flipped.
        - ``load_delta``: ½ Σ_e |f_r − f_c| with f = counts / Σ counts (before capacity).
        - ``mean_kl``: mean over tokens of KL(p_r ‖ p_c), in nats.

    Raises:
        ValueError: either side is malformed, or the sides' shapes differ.

    Example:
        >>> ref = Routing(torch.tensor([[2.0, 0.0], [0.0, 0.5]]), torch.tensor([[0], [1]]))
        >>> cand = Routing(torch.tensor([[2.0, 0.0], [0.5, 0.0]]), torch.tensor([[0], [0]]))
        >>> a = agreement(ref, cand)
        >>> a["topk_agreement"], a["flipped_tokens"], a["flip_margins"]
        (0.5, [1], [0.5])
    """
    edges = _check_bins(margin_bins)
    r, c = _check_pair(ref, cand)
    return _agreement(r, c, edges)


def _check_pair(ref: Routing, cand: Routing) -> tuple[_Checked, _Checked]:
    r = _check(ref, "reference routing")
    c = _check(cand, "candidate routing")
    for name, a, b in (("logits", r.logits, c.logits), ("indices", r.indices, c.indices)):
        if a.shape != b.shape:
            raise ValueError(
                f"routing {name}: candidate has shape {_shape(b)}, reference {_shape(a)}"
            )
    return r, c


def moe_block_stats(ref: Routing, cand: Routing, *, capacity_factors=(1.0, 1.25)) -> dict:
    """Routing statistics of one MoE block: each side, and their agreement.

    Args:
        ref: the reference side.
        cand: the candidate side, with the reference's shapes.
        capacity_factors: counterfactual capacity factors for dropless sides, as in
            :func:`side_stats`.

    Returns:
        ``{"reference": side_stats(ref), "candidate": side_stats(cand),
        "agreement": agreement(ref, cand)}`` with the default margin bins.

    Raises:
        ValueError: either side is malformed, or the sides' shapes differ.
    """
    factors = _check_factors(capacity_factors)
    r, c = _check_pair(ref, cand)
    return {
        "reference": _side_stats(r, factors),
        "candidate": _side_stats(c, factors),
        "agreement": _agreement(r, c, _check_bins(_DEFAULT_MARGIN_BINS)),
    }
