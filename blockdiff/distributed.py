"""Sharded runs: a candidate split across ranks, judged against a single-device reference.

Launched with ``torchrun`` (docs/design.md, "Sharded candidates"): every rank runs
blockdiff, every factory is called on every rank, and every experiment runs on every rank
in the same order (*lockstep*), because a sharded module's forward holds collectives that
all ranks must enter. What keeps the ranks in lockstep:

- **Tensors are recorded whole.** A ``DTensor`` is recorded as its full logical tensor
  (``full_tensor()``: gathered on every rank, once per recorded tensor, so each rank holds
  one full copy of each site); an ``AsyncCollectiveTensor`` (a collective's result) once
  the collective finished; a plain local shard by the layout its hook map declares
  (``shard_output``). Each record remembers the layout its tensor had, so that a replay
  hands a sharded module the reference's tensor in that layout (:func:`in_layout`).
- **Verdicts agree.** Every comparison's metrics are the worst over ranks
  (:func:`worst`), and every "is this the same call again?" shortcut must hold on every
  rank (:func:`everywhere`): whatever one rank decides to run, all run.
- **Replicas are compared.** A tensor every rank holds whole (a norm's output under tensor
  parallelism, an all-reduced sum) must be the same bits on every rank: the first site
  where replicas differ is a divergence naming the ranks (:func:`replica_disagreement`),
  since every later all-reduce mixes the bad replica into all ranks.

Rank 0 reports; a rank that fails makes every rank stop (:class:`FailureWatch`).
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch

from . import compare
from .compare import Metrics

# Seconds a collective may wait for the other ranks before it fails (a rank stuck in a
# model's own code); a rank that raises stops every rank sooner (FailureWatch).
TIMEOUT_ENV = "BLOCKDIFF_TIMEOUT"
DEFAULT_TIMEOUT = 600
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The attribute a recorded tensor's layout is kept under: (device mesh, placements).
LAYOUT_ATTR = "_blockdiff_layout"



def launched() -> bool:
    """Whether this process is one rank of a launch (``torchrun`` sets these variables).

    Raises:
        ValueError: ``WORLD_SIZE`` is not a number.
    """
    if not all(name in os.environ for name in _LAUNCH_ENV):
        return False
    try:
        return int(os.environ["WORLD_SIZE"]) > 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from None


def active() -> bool:
    """Whether a process group of more than one rank is initialised."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 outside a sharded run)."""
    import torch.distributed as dist

    return dist.get_rank() if active() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if active() else 1


def timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)))


def init_from_env() -> bool:
    """Initialise the default process group from a launcher's environment, before any
    factory runs: gloo for CPU tensors, NCCL for CUDA ones when CUDA is present (each rank
    on the GPU of its ``LOCAL_RANK``). ``False`` when not launched, or already initialised
    by the caller."""
    if not launched():
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=timeout())
    return True


@contextmanager
def lockstep() -> Iterator[bool]:
    """Within: comparisons and shortcuts agree across ranks (a no-op on one process).
    Yields whether the run is sharded.

    The state is one stack, ``compare.ACROSS_RANKS``: what a comparison's metrics become
    (:func:`worst` in lockstep, a rank's own within :func:`apart`); its top says which."""
    on = active()
    if on:
        _cpu_group()  # every rank here together: the one moment a group may be made
    with _across_ranks(worst if on else None):
        yield on


@contextmanager
def apart() -> Iterator[None]:
    """Within: each rank works on its own (a pipeline stage judges its own blocks), its
    comparisons its own; :func:`lockstep` again after."""
    with _across_ranks(_own):
        yield


@contextmanager
def _across_ranks(reduce: Any) -> Iterator[None]:
    if reduce is not None:
        compare.ACROSS_RANKS.append(reduce)
    try:
        yield
    finally:
        if reduce is not None:
            compare.ACROSS_RANKS.pop()


def _own(found: Metrics) -> Metrics:
    return found


def in_lockstep() -> bool:
    return bool(compare.ACROSS_RANKS) and compare.ACROSS_RANKS[-1] is worst


def worst(found: Metrics) -> Metrics:
    """The metrics of the rank whose comparison is worst (largest relative L2, NaN worst of
    all): every rank gets the same verdict, so every rank runs the same experiments next."""
    if not in_lockstep():
        return found
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, found, group=_cpu_group())
    return max(every, key=lambda m: (m.rel_l2 != m.rel_l2, m.rel_l2))  # NaN first


def everywhere(flag: bool) -> bool:
    """``flag`` on every rank (a logical and over ranks)."""
    if not in_lockstep():
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=_cpu_group())
    return bool(value.item())


def agreed_exit_code(code: int) -> int:
    """The largest exit code of every rank (a divergence one rank saw is every rank's)."""
    import torch.distributed as dist

    value = torch.tensor([code], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=_cpu_group())
    return int(value.item())


_groups: dict[str, Any] = {}


def _cpu_group() -> Any:
    """A process group that runs collectives on CPU tensors: the default one when its
    backend can (gloo, or ``cpu:gloo,cuda:nccl``), else a gloo group of every rank made
    once (a group the user initialised with NCCL alone). Made in :func:`lockstep`, which
    every rank enters together."""
    import torch.distributed as dist

    if "cpu" not in _groups:
        backend = str(dist.get_backend()).lower()
        _groups["cpu"] = None if ("gloo" in backend or backend == "mpi") else dist.new_group(backend="gloo")
    return _groups["cpu"]


def group_for(t: torch.Tensor) -> Any:
    return _cpu_group() if t.device.type == "cpu" else None


# -- recorded whole -----------------------------------------------------------------------


# The modules of the kinds of tensor recorded whole, and their names there: torch imports
# none of them itself, and no such tensor exists before its module is imported (which
# takes most of a second: a run that holds none never imports them).
_DISTRIBUTED_KINDS = (("torch.distributed.tensor", "DTensor"), ("torch.distributed._functional_collectives", "AsyncCollectiveTensor"))


def is_distributed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` or an ``AsyncCollectiveTensor``."""
    kinds = tuple(
        kind for module, name in _DISTRIBUTED_KINDS
        if (kind := getattr(sys.modules.get(module), name, None)) is not None
    )
    return bool(kinds) and isinstance(t, kinds)


def whole(t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The full logical tensor of a ``DTensor`` (gathered: a collective every rank enters),
    an ``AsyncCollectiveTensor`` once its collective finished: a new plain tensor (on
    ``device`` when given), with the layout it had under :data:`LAYOUT_ATTR` (a DTensor's
    mesh and placements)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, AsyncCollectiveTensor):
        plain = t.wait()
        return plain.to(device, copy=True) if device is not None else plain.clone()
    assert isinstance(t, DTensor)
    full = t.full_tensor()
    full = full.to(device, copy=True) if device is not None else full.clone()
    setattr(full, LAYOUT_ATTR, (t.device_mesh, tuple(t.placements)))
    return full


def gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A plain local shard made whole: the shards of every rank concatenated along ``dim``."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous(), group=group_for(t))
    return torch.cat(parts, dim=dim)


def declared_whole(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A plain local shard a hook map declares (``shard_output``/``shard_input``), made
    whole: gathered along ``dim``, remembering that layout."""
    full = gathered(t.detach(), dim)
    setattr(full, LAYOUT_ATTR, (None, dim))
    return full


def in_layout(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``t`` (a whole tensor) in the layout ``like`` was recorded from: this rank's part of
    it as a ``DTensor`` of the same mesh and placements, or as a plain local shard along
    the dimension a hook map declared (no communication: every rank holds ``t`` whole);
    ``t`` itself when ``like`` was recorded whole."""
    layout = getattr(like, LAYOUT_ATTR, None) if like is not None else None
    if layout is None:
        return t
    mesh, placements = layout
    if mesh is None:  # a declared plain shard: this rank's part along that dimension
        return t.chunk(world(), dim=placements)[rank()].contiguous()
    return laid_out(t, mesh, placements)


def laid_out(t: torch.Tensor, mesh: Any, placements: tuple) -> torch.Tensor:
    """``t`` (a whole tensor every rank holds) as a ``DTensor`` of ``mesh`` and
    ``placements``: this rank's part of it, with no communication."""
    from torch.distributed.tensor import DTensor, Shard

    local = t
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(mesh_dim), dim=placement.dim)[mesh.get_local_rank(mesh_dim)]
        elif getattr(placement, "reduce_op", None) == "sum":  # Partial: a split that sums to t
            local = local if mesh.get_local_rank(mesh_dim) == 0 else torch.zeros_like(local)
        # Replicate, and Partial avg/max/min: t itself on every rank reduces to t.
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def made_whole(t: torch.Tensor, module: torch.nn.Module, declared: int | None) -> torch.Tensor:
    """An output of a sharded module made whole: a ``DTensor`` or collective result as
    :func:`whole`; a plain local shard gathered along the dimension its hook map declares,
    or that its parallelization shows (:func:`local_output_dim`), remembering that layout
    (:func:`declared_whole`: what a record hands back to the module in a replay)."""
    if is_distributed(t):
        return whole(t)
    dim = local_output_dim(module, t) if declared is None else declared
    return t if dim is None else declared_whole(t, dim)


def sharded_layout(t: torch.Tensor | None) -> bool:
    """Whether ``t`` was recorded from a tensor each rank held a part of (a ``DTensor``
    sharded or partial on some mesh dimension, or a declared plain shard): a gradient
    reaching the whole tensor through :func:`in_layout` is then each rank's part of it,
    summed over ranks to be whole (:func:`summed`)."""
    layout = getattr(t, LAYOUT_ATTR, None) if t is not None else None
    if layout is None:
        return False
    mesh, placements = layout
    if mesh is None:
        return True
    from torch.distributed.tensor import Replicate

    return any(not isinstance(p, Replicate) for p in placements)


def summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank (a new tensor; a collective every rank enters)."""
    import torch.distributed as dist

    total = t.detach().clone()
    dist.all_reduce(total, group=group_for(total))
    return total


def local_output_dim(module: torch.nn.Module, t: torch.Tensor) -> int | None:
    """-1 when ``t``, an output of ``module``, is this rank's shard of its last dimension:
    a column-parallel ``Linear`` (weight ``Shard(0)``) or ``Embedding`` (weight
    ``Shard(1)``) returning local tensors, ``t`` as wide as the local weight is and not as
    the whole one (a column-parallel layer asked for replicated output is whole already).
    ``None`` otherwise (a row-parallel module's output is all-reduced whole)."""
    weight = getattr(module, "weight", None)
    if weight is None or not is_distributed(weight) or t.dim() == 0:
        return None
    from torch.distributed.tensor import Shard

    if len(weight.placements) != 1 or not isinstance(weight.placements[0], Shard):
        return None
    dim = {torch.nn.Linear: 0, torch.nn.Embedding: 1}.get(type(module))
    if dim is None or weight.placements[0].dim != dim:
        return None
    local, full = weight.to_local().shape[dim], weight.shape[dim]
    return -1 if t.shape[-1] == local != full else None


def replicas_message(ranks: list[int], rel_l2: float, *, of: str | None = None) -> str:
    """How a divergence between replicas reads: ``replicas disagree: rank 1 differs from
    rank 0 (rel_l2 1.45)``; ``of`` names what differs (``in the input gradient``)."""
    names = ", ".join(str(r) for r in ranks)
    many = len(ranks) > 1
    where = f" in the {of}" if of else ""
    return f"replicas disagree: rank{'s' if many else ''} {names} differ{'' if many else 's'} from rank 0{where} (rel_l2 {rel_l2:.3g})"


def every_rank(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (pickled across: small objects, or tensors the
    caller accepts to copy)."""
    import torch.distributed as dist

    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, obj, group=_cpu_group())
    return found


# -- stopping together --------------------------------------------------------------------


class FailureWatch:
    """Every rank stops when one fails, within a bounded time.

    A rank that raises announces it (:meth:`failed`: one key in a store every rank can
    reach, the first announcement wins) and says why; every other rank's watcher thread
    sees the key within ``poll`` seconds and ends its process with ``code``, silently,
    though it may be waiting in a collective the failed rank will never enter.
    """

    KEY = f"blockdiff/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # one per attempt

    def __init__(self, *, code: int, poll: float = 0.2) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        # A client of its own: the process group's store is not shared across threads.
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timeout(), wait_for_workers=False)
        self._watch_store = dist.TCPStore(host, port, is_master=False, timeout=timeout(), wait_for_workers=False)
        self._code = code
        self._poll = poll
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="blockdiff-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self._poll):
            try:
                if not self._watch_store.check([self.KEY]):
                    continue
                message = self._watch_store.get(self.KEY).decode()
            except Exception:  # the store went away: the run is over
                return
            if not message.startswith(f"rank {self.rank}:"):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(self._code)

    def failed(self, message: str) -> str:
        """Announce this rank's failure; returns the failure every rank reports (an earlier
        rank's, when another rank failed first and this one only followed)."""
        mine = f"rank {self.rank}: {message}"
        try:
            return self._store.compare_set(self.KEY, "", mine).decode()
        except Exception:
            return mine

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def finish() -> None:
    """The end of a launched run that did not fail: wait for every rank, then leave the
    process group."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=_cpu_group())
        _groups.clear()
        dist.destroy_process_group()


__all__ = [
    "launched",
    "active",
    "rank",
    "world",
    "init_from_env",
    "lockstep",
    "worst",
    "everywhere",
    "whole",
    "gathered",
    "in_layout",
    "laid_out",
    "sharded_layout",
    "summed",
    "declared_whole",
    "local_output_dim",
    "apart",
    "every_rank",
    "replicas_message",
    "FailureWatch",
    "finish",
    "agreed_exit_code",
    "made_whole",
]
