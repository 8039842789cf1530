"""Sharded candidates: the sample model and a Hugging Face Llama split across ranks with
torch's own tensor-parallel API, an expert-parallel MoE, and planted distributed bugs.

Every factory runs on every rank, inside the process group blockdiff initialised from the
launcher's environment; each builds the clean single-device model (same seed, same
weights) and splits it over a one-dimensional device mesh of all ranks:

    torchrun --nproc-per-node 2 -m blockdiff diff samples/hf_llama.py:build samples/sharded.py:llama_tp
    torchrun --nproc-per-node 2 -m blockdiff diff samples/tinylm.py:build samples/sharded.py:tinylm_tp --cand-dtype bfloat16
    torchrun --nproc-per-node 2 -m blockdiff diff samples/sharded.py:tinylm_moe samples/sharded.py:expert_offset

:data:`BUGS` lists each planted bug with its reference and the (block, sub-path) blockdiff
must blame (block ``DEFAULT_BLOCK``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

try:  # imported as samples.sharded (tests) or loaded from its file path (CLI)
    from . import hf_llama, hf_moe, tinylm
except ImportError:  # pragma: no cover
    import hf_llama
    import hf_moe
    import tinylm

DEFAULT_BLOCK = 1


def mesh():
    """A one-dimensional device mesh of every rank (CUDA when the model runs there)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("a sharded sample needs a process group: run it under torchrun")
    return init_device_mesh("cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu", (dist.get_world_size(),))


def _plan(attention: str, ffn: str, *, row=None) -> dict:
    """The tensor-parallel plan of one block: q/k/v and gate/up column-parallel, o and down
    row-parallel (the Megatron split: one all-reduce after attention, one after the FFN)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    row = row or RowwiseParallel
    return {
        f"{attention}.q_proj": ColwiseParallel(),
        f"{attention}.k_proj": ColwiseParallel(),
        f"{attention}.v_proj": ColwiseParallel(),
        f"{attention}.o_proj": RowwiseParallel(),
        f"{ffn}.gate_proj": ColwiseParallel(),
        f"{ffn}.up_proj": ColwiseParallel(),
        f"{ffn}.down_proj": row(),
    }


def llama_tp(*, seed: int = 0, plan_of=None) -> nn.Module:
    """The sample Hugging Face Llama (``samples/hf_llama.py:build``) tensor-parallel over
    every rank with ``parallelize_module``. ``plan_of(index)`` gives a block's plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    model, where = hf_llama.build(seed=seed), mesh()
    for index, layer in enumerate(model.model.layers):
        parallelize_module(layer, where, (plan_of or (lambda i: _plan("self_attn", "mlp")))(index))
    return model


def mixtral_tp(*, seed: int = 0) -> nn.Module:
    """The sample Hugging Face Mixtral (``samples/hf_moe.py:build``) with tensor-parallel
    attention; its experts (fused 3-D weights) stay replicated on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, where = hf_moe.build(seed=seed), mesh()
    plan = {f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan["self_attn.o_proj"] = RowwiseParallel()
    for layer in model.model.layers:
        parallelize_module(layer, where, plan)
    return model


def tinylm_tp(*, seed: int = 0, plan_of=None) -> nn.Module:
    """The sample model (``samples/tinylm.py:build``) tensor-parallel over every rank: each
    rank computes its share of the attention heads and FFN columns."""
    from torch.distributed.tensor.parallel import parallelize_module

    model, where = tinylm.build(seed=seed), mesh()
    world = where.size()
    for index, block in enumerate(model.blocks):
        parallelize_module(block, where, (plan_of or (lambda i: _plan("attn", "ffn")))(index))
        block.attn.heads //= world  # the heads this rank computes
        block.attn.kv_heads //= world
    return model


def _local_sequence(x: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the sequence (dimension 1)."""
    return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


def _whole_sequence(x: torch.Tensor, order=None) -> torch.Tensor:
    """Every rank's slice of the sequence, concatenated in rank order (or ``order``)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat([parts[r] for r in (order(len(parts)) if order else range(len(parts)))], dim=1)


class SequenceParallelBlock(tinylm.Block):
    """A pre-norm block with Megatron-style sequence parallelism, written by hand around
    tensor-parallel attention and FFN: each rank normalizes its own slice of the sequence
    (the norms take and return plain local shards: ``samples/tinylm_sp.toml`` declares
    them), and the normalized slices are all-gathered before attention and FFN."""

    gather_order = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(_whole_sequence(self.attn_norm(_local_sequence(x)), self.gather_order), cos, sin)
        return x + self.ffn(_whole_sequence(self.ffn_norm(_local_sequence(x)), self.gather_order))


def tinylm_sp(*, seed: int = 0, block: int | None = None, order=None) -> nn.Module:
    """``tinylm_tp`` with sequence-parallel norms (diff it with ``--cand-hooks
    samples/tinylm_sp.toml``, which declares the norms' local shards)."""
    model = tinylm_tp(seed=seed)
    for index, layer in enumerate(model.blocks):
        layer.__class__ = SequenceParallelBlock
        if index == block:
            layer.gather_order = order
    return model


# -- planted bugs: tensor and sequence parallel --------------------------------------------


def _row_without_all_reduce():
    """A row-parallel style whose output skips the all-reduce: each rank's partial sum is
    taken as the complete one."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class PartialTakenAsComplete(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()  # a Partial DTensor's local value: this rank's share only

    return PartialTakenAsComplete()


def all_reduce_skipped(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """The FFN's row-parallel down projection in ``block`` skips its all-reduce."""
    return llama_tp(plan_of=lambda i: _plan("self_attn", "mlp", row=_row_without_all_reduce if i == block else None))


def kv_heads_swapped(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Grouped-query attention sharded with the key/value heads in the wrong order: in
    ``block`` each rank holds another rank's key and value heads for its query heads."""
    from torch.distributed.tensor import DTensor

    model = llama_tp()
    world, me = dist.get_world_size(), dist.get_rank()
    attention = model.model.layers[block].self_attn
    for name in ("k_proj", "v_proj"):
        weight = getattr(attention, name).weight
        local = weight.to_local()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        swapped = DTensor.from_local(parts[(me + 1) % world], weight.device_mesh, weight.placements, run_check=False)
        getattr(attention, name).weight = nn.Parameter(swapped, requires_grad=False)
    return model


def norm_on_one_rank(*, block: int = DEFAULT_BLOCK, rank: int = 1) -> nn.Module:
    """The post-attention norm of ``block`` has another epsilon on one rank only (a config
    value read differently there): that rank's replica of the norm's output differs."""
    model = llama_tp()
    if dist.get_rank() == rank:
        model.model.layers[block].post_attention_layernorm.variance_epsilon = 0.5
    return model


def sequence_gathered_reversed(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """In ``block`` the sequence slices are gathered in reverse rank order: the block's
    glue between its norms and the modules after them hands them a shuffled sequence."""
    return tinylm_sp(block=block, order=lambda world: range(world - 1, -1, -1))


# -- planted bugs: tensor parallel, backward only ------------------------------------------


class _PartialGradientTakenAsWhole(torch.autograd.Function):
    """Identity forward; backward takes this rank's share of the input gradient (a partial
    sum over the ranks' columns) as the whole one: Megatron's "copy to the tensor-parallel
    region" with its all-reduce left out of the backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(grad.to_local(), grad.device_mesh, [Replicate()], run_check=False)


def _column_without_backward_all_reduce():
    """A column-parallel style whose input's gradient is not all-reduced: the forward is
    bit for bit the clean one, each rank's input gradient only its own columns' share."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    class NoBackwardAllReduce(ColwiseParallel):
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
            return _PartialGradientTakenAsWhole.apply(x)

    return NoBackwardAllReduce()


def input_grad_not_all_reduced(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """The attention's column-parallel q/k/v projections in ``block`` leave the all-reduce
    out of their input's backward: the forward is the clean one, the attention's input
    gradient on each rank is its own heads' share."""
    def plan(index: int) -> dict:
        found = _plan("self_attn", "mlp")
        if index == block:
            found.update({f"self_attn.{name}": _column_without_backward_all_reduce() for name in ("q_proj", "k_proj", "v_proj")})
        return found

    return llama_tp(plan_of=plan)


class _GradientTimes(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, weight, factor):
        ctx.factor = factor
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class GradientScaledLinear(nn.Linear):
    """A row-parallel ``Linear`` whose weight gradient is multiplied by the world size (a
    gradient "averaged" over the tensor-parallel group, which never summed it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _GradientTimes.apply(self.weight, dist.get_world_size()), self.bias)


def row_weight_grad_scaled(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """The FFN's row-parallel down projection in ``block`` scales its weight gradient by
    the world size; its forward and every activation gradient are the clean ones."""
    model = llama_tp()
    model.model.layers[block].mlp.down_proj.__class__ = GradientScaledLinear
    return model


def _local_heads_norm(norm: nn.Module, where) -> None:
    """A per-head norm (Qwen3's q/k norms) run on this rank's local heads with its weight a
    replicated ``DTensor``: its gradient, each rank's partial sum over its own heads, is
    summed over the ranks as DTensor sums a replicated parameter's."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module

    def heads(mod, inputs, mesh):
        x = inputs[0]
        return (x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(2)], run_check=False),)

    distribute_module(norm, where, None, heads, lambda mod, out, mesh: out.to_local())


def qwen3_tp(*, seed: int = 0, heads_norms: bool = True) -> nn.Module:
    """The sample Hugging Face Qwen3 (``samples/hf_llama.py:build_qwen3``) tensor-parallel,
    its q/k norms on each rank's heads with replicated ``DTensor`` weights (``heads_norms``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    model, where = hf_llama.build_qwen3(seed=seed), mesh()
    for layer in model.model.layers:
        parallelize_module(layer, where, _plan("self_attn", "mlp"))
        if heads_norms:
            _local_heads_norm(layer.self_attn.q_norm, where)
            _local_heads_norm(layer.self_attn.k_norm, where)
    return model


def heads_norm_grads_not_reduced(*, block: int | None = None) -> nn.Module:
    """Qwen3 tensor-parallel with its q/k norms' weights left plain tensors (the plan covers
    the projections only): every rank's forward is right, but its gradient of a norm weight
    is the sum over its own heads alone, and nothing sums it over the ranks. Blamed at the
    last block, the first in backward order."""
    return qwen3_tp(heads_norms=False)


# -- context parallel ---------------------------------------------------------------------


class ContextParallelAttention(tinylm.Attention):
    """The sample's attention with its queries split over the ranks by sequence position:
    each rank projects and rotates the queries of its slice of the sequence (positions
    offset by where its slice starts), attends them to every key (the causal mask at
    those positions too), and the ranks' outputs are gathered along the sequence."""

    offset_positions = True  # a planted bug: every rank rotates its queries as if it held the first slice

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        chunk = s // dist.get_world_size()
        start = dist.get_rank() * chunk
        at = start if self.offset_positions else 0
        q = self.q_proj(x[:, start : start + chunk]).view(b, chunk, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos[at : at + chunk], sin[at : at + chunk]), self.rope(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        mask = torch.ones(chunk, s, dtype=torch.bool, device=x.device).triu(start + 1)
        probs = scores.masked_fill(mask, float("-inf")).float().softmax(-1).to(q.dtype)
        out = self.o_proj((probs @ v).transpose(1, 2).reshape(b, chunk, -1))
        return _whole_sequence(out)


def tinylm_cp(*, seed: int = 0, block: int | None = None) -> nn.Module:
    """The sample model with context-parallel attention in every block (``block``: the
    one whose queries are not offset to their positions)."""
    model = tinylm.build(seed=seed)
    for index, layer in enumerate(model.blocks):
        layer.attn.__class__ = ContextParallelAttention
        layer.attn.offset_positions = index != block
    return model


def positions_not_offset(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """Rotary positions not offset per rank under context parallelism, in ``block``: rank
    r's queries are rotated for positions 0.. instead of r·S/W..."""
    return tinylm_cp(block=block)


# -- expert parallel ----------------------------------------------------------------------


class ExpertParallelMoE(tinylm.MoE):
    """The sample MoE with its experts split across ranks: rank r keeps experts
    [r·E/W, (r+1)·E/W) only. Every rank routes every token (the router is replicated),
    runs its own experts on the tokens routed to them, and the ranks' outputs are summed
    (all-gather dispatch: one all-reduce per layer)."""

    def shard(self, rank: int, world: int) -> None:
        per = len(self.experts) // world
        self.first, self.total = rank * per, len(self.experts)
        self.experts = nn.ModuleList(list(self.experts)[self.first : self.first + per])

    def local_index(self, e: int) -> int:
        return e - self.first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, indices = self.router(flat)
        out = torch.zeros_like(flat)
        for e in range(self.first, self.first + len(self.experts)):
            token, slot = torch.where(indices == e)
            if token.numel():
                y = self.experts[self.local_index(e)](flat[token]) * weights[token, slot, None].to(flat.dtype)
                out.index_add_(0, token, y)
        return funcol.all_reduce(out, "sum", dist.group.WORLD).view(shape)


class OffsetOnOneRank(ExpertParallelMoE):
    """Rank 1 maps global expert e to local e − first + 1 (mod its count): its tokens run
    through its neighbour expert."""

    def local_index(self, e: int) -> int:
        return (e - self.first + (1 if dist.get_rank() == 1 else 0)) % len(self.experts)


def tinylm_moe(*, seed: int = 0) -> nn.Module:
    """The single-device reference of the expert-parallel sample (4 experts, top-2)."""
    return tinylm.build_moe(seed=seed, experts=4)


def tinylm_ep(*, seed: int = 0, moe: type = ExpertParallelMoE, block: int | None = None) -> nn.Module:
    """``tinylm_moe`` with its experts split across every rank."""
    model = tinylm_moe(seed=seed)
    for index, layer in enumerate(model.blocks):
        layer.ffn.__class__ = moe if block is None or index == block else ExpertParallelMoE
        layer.ffn.shard(dist.get_rank(), dist.get_world_size())
    return model


def expert_offset(*, block: int = DEFAULT_BLOCK) -> nn.Module:
    """An expert-index offset on one rank of the expert-parallel sample, in ``block``."""
    return tinylm_ep(moe=OffsetOnOneRank, block=block)


# -- pipeline parallel ----------------------------------------------------------------------


class PipelinedTinyLM(tinylm.TinyLM):
    """One pipeline stage of the sample model per rank: rank r holds blocks
    [r·B/W, (r+1)·B/W) (a ``ModuleDict`` keyed by their global index), the first rank the
    embedding, the last the final norm and head; the other modules are deleted. Each stage
    receives its input from the rank before (point-to-point), runs its blocks and sends
    its output on; the logits are broadcast from the last rank, so every rank's forward
    returns them."""

    feed_from: int | None = None  # a planted bug: the stage whose output the next stage receives

    def split(self, rank: int, world: int) -> None:
        per = len(self.blocks) // world
        self.stage, self.stages = rank, world
        self.blocks = nn.ModuleDict({str(i): self.blocks[i] for i in range(rank * per, (rank + 1) * per)})
        if rank != 0:
            del self.embed
        if rank != world - 1:
            del self.norm, self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, s = input_ids.shape
        shape = (b, s, self.cfg.hidden)
        if self.stage == 0:
            x = self.embed(input_ids)
        else:
            x = torch.empty(shape, dtype=_dtype(self))
            dist.recv(x, src=self.stage - 1)
        positions = torch.arange(s, device=input_ids.device)
        cos, sin = self.rotary(x, positions)
        inputs = x
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.stage < self.stages - 1:
            dist.send((inputs if self.feed_from == self.stage else x).contiguous(), dst=self.stage + 1)
            logits = torch.empty((b, s, self.cfg.vocab_size), dtype=_dtype(self))
        else:
            logits = self.lm_head(self.norm(x))
        dist.broadcast(logits, src=self.stages - 1)
        return logits


def _dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def tinylm_pp(*, seed: int = 0, feed_from: int | None = None) -> nn.Module:
    """The sample model (``samples/tinylm.py:build``) as a pipeline of one stage per rank
    (diff it with ``--cand-hooks samples/tinylm_pp.toml``: a stage holds only some of the
    modules the map names)."""
    model = tinylm.build(seed=seed)
    model.__class__ = PipelinedTinyLM
    model.feed_from = feed_from
    model.split(dist.get_rank(), dist.get_world_size())
    return model


def stage_fed_wrong_output(*, block: int | None = None) -> nn.Module:
    """The second stage is fed the first stage's *input* (the embedding) instead of its
    output: every block is right, the hand-over between ranks is not."""
    return tinylm_pp(feed_from=0)


# The sequence-parallel sample's hook map: its norms take and return local shards.
SP_HOOKS = "samples/tinylm_sp.toml"
PP_HOOKS = "samples/tinylm_pp.toml"
# planted bug → (its single-device reference, blamed block, sub-path, part of an MoE ffn, candidate hook map)
BUGS = {
    "all_reduce_skipped": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "ffn", None, None),
    "kv_heads_swapped": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "attention", None, None),
    "norm_on_one_rank": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "norm", None, None),
    "positions_not_offset": ("samples/tinylm.py:build", DEFAULT_BLOCK, "attention", None, None),
    "expert_offset": ("samples/sharded.py:tinylm_moe", DEFAULT_BLOCK, "ffn", "experts", None),
    "sequence_gathered_reversed": ("samples/tinylm.py:build", DEFAULT_BLOCK, "residual", None, SP_HOOKS),
    # at world size 2: the first block of the second stage
    "stage_fed_wrong_output": ("samples/tinylm.py:build", 2, "residual", None, PP_HOOKS),
}
# backward-only planted bug → (its single-device reference, blamed block, sub-path, what the first check compares)
BACKWARD_BUGS = {
    "input_grad_not_all_reduced": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "attention", "replicas"),
    "row_weight_grad_scaled": ("samples/hf_llama.py:build", DEFAULT_BLOCK, "ffn", "parameter gradient: down_proj.weight"),
}
# found, not planted → (reference, blamed block, sub-path, the gradient whose replicas split):
# the natural plan leaves Qwen3's per-head norm weights plain tensors, whose gradient each
# rank sums over its own heads only (the last block is the first blamed)
BACKWARD_FOUND = {
    "heads_norm_grads_not_reduced": ("samples/hf_llama.py:build_qwen3", 3, "attention", "parameter gradient: q_norm.weight"),
    # the expert-parallel sample is forward-only: nothing all-reduces its MoE's input
    # gradient, each rank's is its own experts' share (first seen at the router's output)
    "tinylm_ep": ("samples/sharded.py:tinylm_moe", 3, "ffn", "output gradient"),
}
# clean sharded samples whose backward is the model's → their single-device reference
BACKWARD_CLEAN = {
    "llama_tp": "samples/hf_llama.py:build", "tinylm_tp": "samples/tinylm.py:build", "qwen3_tp": "samples/hf_llama.py:build_qwen3",
}
# clean sharded sample → (its single-device reference, candidate hook map)
CLEAN = {
    "llama_tp": ("samples/hf_llama.py:build", None),
    "mixtral_tp": ("samples/hf_moe.py:build", None),
    "tinylm_tp": ("samples/tinylm.py:build", None),
    "tinylm_sp": ("samples/tinylm.py:build", SP_HOOKS),
    "tinylm_cp": ("samples/tinylm.py:build", None),
    "tinylm_ep": ("samples/sharded.py:tinylm_moe", None),
    "tinylm_pp": ("samples/tinylm.py:build", PP_HOOKS),
}
