"""Vocabulary: the words of docs/design.md as types, in one module that imports nothing of blockdiff.

Every other module takes its stage, sub-path, tolerance-target, router-format and
check-kind names from here, so a new word is added in one place and a typo is a type error
rather than a silently unmatched string.
"""

from __future__ import annotations

from typing import Literal, get_args

Stage = Literal["embed", "context", "block", "final_norm", "head"]
OutsideStage = Literal["embed", "context", "final_norm", "head"]
Subpath = Literal["attention", "ffn", "norm", "residual"]
ModuleSubpath = Literal["attention", "ffn", "norm"]
# A block's sub-path as recorded by capture: a module sub-path, or an MoE's router.
SiteSubpath = Literal["attention", "ffn", "norm", "router"]
Policy = Literal["fixed", "calibrated"]
Target = Literal["embed", "context", "attention", "ffn", "norm", "residual", "block", "final_norm", "head", "drift"]
RouterFormat = Literal["topk", "switch", "dense", "logits"]

STAGES: tuple[Stage, ...] = get_args(Stage)
OUTSIDE_STAGES: tuple[OutsideStage, ...] = get_args(OutsideStage)
SUBPATHS: tuple[Subpath, ...] = get_args(Subpath)
MODULE_SUBPATHS: tuple[ModuleSubpath, ...] = get_args(ModuleSubpath)
POLICIES: tuple[Policy, ...] = get_args(Policy)
TARGETS: tuple[Target, ...] = get_args(Target)
ROUTER_FORMATS: tuple[RouterFormat, ...] = get_args(RouterFormat)
# Stages whose sites run before the blocks.
BEFORE_BLOCKS: tuple[OutsideStage, ...] = ("embed", "context")

# The block-level check: the candidate block on the reference input with nothing frozen.
# Its tolerance target and report column are "block" ("whole" in the terminal table); a
# divergence it shows that no sub-path explains is blamed on the sub-path "unattributed".
BLOCK_TARGET: Target = "block"
UNATTRIBUTED = "unattributed"
# A sub-path whose experiment replays an argument that could not be kept (a dump holds only
# its type): reported with this status and a note, never judged on a wrong argument.
NOT_JUDGED = "not_judged"

# What a check compared (``Check.what``) for the checks whose kind matters downstream.
ROUTER_LOGITS = "router logits"
ROUTER_WEIGHTS = "router weights (tokens whose top-k agree)"
ROUTING_FLIPS = "routing flips"
EXPERTS = "experts (routing frozen at the reference's)"
# The candidate routes differently: another number of experts or of experts per token.
ROUTING_DIFFERS = "routing differs"
OFFLINE_DRIFT = "drift (offline)"
# The check of a sharded run's replicated tensors: the same bits on every rank.
REPLICAS = "replicas"
# What a backward check compares (blockdiff.backward): a call's input gradient, its output
# gradient, or one parameter's gradient (by its name relative to the module).
INPUT_GRADIENT = "input gradient"
OUTPUT_GRADIENT = "output gradient"
PARAMETER_GRADIENT = "parameter gradient: {}"
# Teacher-forced replacement (docs/design.md): a candidate's runs in which the reference's
# value is substituted for the runtime's at each site the run replaces, in execution order —
# every site's (local errors, the residual), or the block outputs' and the embedding's (each
# block whole on the reference's input). The rule is :func:`replaced_in`, shared by the
# sides that run a runtime (blockdiff.sides.replaced) and the dump writer for any other
# (blockdiff.dumpfile), which imports no torch.
EVERY_SITE = "every site"
BLOCK_OUTPUTS = "block outputs"
REPLACED_RUNS = (EVERY_SITE, BLOCK_OUTPUTS)
# The free-running candidate judged against its tolerance at a site: the "drift" target,
# calibrated against the reference's own free run at the candidate's precision. Its
# divergence, when no local check explains it, is blamed on the sub-path "drift".
DRIFT = "drift"
# The part of an MoE ffn a check judges (``Check.part``), by its kind.
# What an attention's experiment cache holds after a decode step, against the reference's
# own cache (blockdiff.decoding): a wrong write shows here first.
KV_KEYS = "kv cache: keys"
KV_VALUES = "kv cache: values"
KV_CACHE = "kv cache"
# What a state-space or convolution mixer's experiment cache holds after a decode step (a
# Hugging Face linear-attention cache layer: Mamba, Mamba2, Jamba's Mamba layers, LFM2's
# short convolutions), against the reference's own: each its own part.
CONV_STATE = "conv state"
SSM_STATE = "ssm state"
CACHE_PARTS = (KV_CACHE, CONV_STATE, SSM_STATE)
PART_OF = {
    ROUTER_LOGITS: "router", ROUTER_WEIGHTS: "router", ROUTING_FLIPS: "router", ROUTING_DIFFERS: "router",
    EXPERTS: "experts", KV_KEYS: KV_CACHE, KV_VALUES: KV_CACHE, CONV_STATE: CONV_STATE, SSM_STATE: SSM_STATE,
}


def reported_subpath(subpath: str | None) -> str:
    """The sub-path a block's site is reported under: its own, a router's under ``ffn``,
    the block's own call (``None``) under ``residual``."""
    if subpath is None:
        return "residual"
    return "ffn" if subpath == "router" else subpath


def replaced_in(run: str, stage: str, subpath: str | None) -> bool:
    """Whether a run replacing ``run`` (:data:`EVERY_SITE` or :data:`BLOCK_OUTPUTS`)
    substitutes the reference's value for the output of a site at ``stage`` and ``subpath``
    (``None`` or ``""``: a block's own call): every site but the head, after which nothing
    runs; or a block's own output and the embedding, so that each block runs whole on the
    reference's input."""
    if run == EVERY_SITE:
        return stage != "head"
    return stage == "embed" or (stage == "block" and not subpath)
