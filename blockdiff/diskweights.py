"""Weights read from disk when a module runs: a model larger than memory, a block at a time.

A model built without weights (its parameters on the ``meta`` device, its buffers real:
:func:`empty_model`) gets a :class:`DiskWeights`: its parameters are split into *units* —
each block of its largest ``nn.ModuleList``, and each other module that holds parameters
(the embedding, the final norm, the head) — and a unit's tensors are read from the
checkpoint's safetensors files the moment one of its modules is called, after the unit
read before it was released. A forward pass, a block's experiments and a drill-down into
one child all read what they run, whatever calls them; the model never holds more than one
unit's weights.

Tensors are read with ``pread`` by name (through ``model.safetensors.index.json`` for a
sharded checkpoint), then cast and moved: pages of a memory-mapped file count in the
process's resident memory as long as they stay mapped, read ones don't. A released unit's
memory is read into again by the next unit's tensors of the same shape and dtype (new
memory is filled a tenth as fast: its pages fault in one by one); a tensor to be cast goes
through a buffer kept up to ``SCRATCH`` bytes.
A loaded parameter takes the place of its meta tensor with :func:`torch.utils.swap_tensors`,
so every holder of the parameter (tied weights, blockdiff's pairing) sees it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .errors import ModelSpecError

SCRATCH = 64 << 20  # bytes: a tensor read to be cast goes through a buffer kept up to this size
INDEX = "model.safetensors.index.json"
READ_PROGRESS = "weights read from disk"  # the progress bar's line: MB so far (no total)
SINGLE = "model.safetensors"
ATTRIBUTE = "blockdiff_checkpoint"  # a factory's meta model says where its weights are

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Stored:
    """One tensor of a checkpoint: its file, byte range, dtype and shape."""

    file: Path
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Checkpoint:
    """The safetensors files of a Hugging Face checkpoint directory (one file, or shards
    and their index), read by tensor name.

    Raises:
        ModelSpecError: no safetensors in the directory, an index naming a missing file,
            a file whose header is not safetensors' (damaged, truncated).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelSpecError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ModelSpecError(
                f"{self.folder}: no {SINGLE} nor {INDEX}; reading weights from disk needs a checkpoint saved "
                "as safetensors (save_pretrained)"
            )
        self.tensors: dict[str, Stored] = {}
        for name in files:
            self.tensors.update(_header(self.folder / name))
        self.bytes_read = 0
        self.seconds = 0.0
        self._scratch = torch.empty(0, dtype=torch.uint8)  # what a cast is read into, kept

    def read(
        self, name: str, *, dtype: torch.dtype, device: torch.device, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor ``name``, in ``dtype`` on ``device``; read into ``into`` (a CPU tensor
        of that dtype and shape) when given: memory already touched is filled ten times
        faster than new memory, whose pages fault in one by one."""
        stored = self.tensors[name]
        started = time.perf_counter()
        cast = stored.dtype.is_floating_point and stored.dtype != dtype
        if into is not None and not cast:
            raw = into.view(-1).view(torch.uint8)
        elif into is not None and stored.nbytes <= SCRATCH:
            if self._scratch.numel() < stored.nbytes:
                self._scratch = torch.empty(stored.nbytes, dtype=torch.uint8)
            raw = self._scratch[: stored.nbytes]
        else:
            raw = torch.empty(stored.nbytes, dtype=torch.uint8)
        self._fill(raw, stored, name)
        self.bytes_read += stored.nbytes
        tensor = raw.view(stored.dtype).reshape(stored.shape)
        if into is not None:
            if cast:
                into.copy_(tensor)
            self.seconds += time.perf_counter() - started
            return into
        if cast:
            tensor = tensor.to(dtype)
        self.seconds += time.perf_counter() - started
        return tensor.to(device)

    def _fill(self, raw: torch.Tensor, stored: Stored, name: str) -> None:
        with open(stored.file, "rb", buffering=0) as f:
            view = memoryview(raw.numpy())  # type: ignore[arg-type]
            done = 0
            while done < stored.nbytes:
                got = os.preadv(f.fileno(), [view[done:]], stored.start + done)
                if got <= 0:
                    raise ModelSpecError(f"{stored.file}: ends inside tensor {name}")
                done += got



def _header(path: Path) -> dict[str, Stored]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise ModelSpecError(f"{path}: no such file (named by the checkpoint's index)") from None
    except (OSError, ValueError, struct.error) as exc:
        raise ModelSpecError(f"{path}: not a safetensors file ({exc})") from None
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (8 + length + int(offset) for offset in entry["data_offsets"])
            stored = Stored(path, start, end, _DTYPES[entry["dtype"]], tuple(int(n) for n in entry["shape"]))
        except (KeyError, TypeError, ValueError):
            raise ModelSpecError(f"{path}: tensor {name} has a header safetensors does not write ({entry})") from None
        if end > size:
            raise ModelSpecError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        found[name] = stored
    return found


@contextlib.contextmanager
def empty_model() -> Iterator[None]:
    """Within it, every parameter a module registers is put on the ``meta`` device (no
    memory); buffers stay where they are made (a rotary embedding's frequencies are computed,
    not stored)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass(frozen=True)
class Converted:
    """A parameter transformers makes of several checkpoint tensors as it loads (a Mixtral
    checkpoint's ``experts.N.w1``/``w3`` fused into ``experts.gate_up_proj``): its
    ``converter`` (transformers' ``WeightConverter``) and the (pattern, tensor name) it
    collects, in the order transformers collects them."""

    converter: Any
    sources: tuple[tuple[str, str], ...]


@dataclass
class Unit:
    """Modules whose weights are read and released together: a block, or one module
    outside the blocks."""

    name: str
    params: dict[str, nn.Parameter]  # the model's parameter name -> the parameter
    recipes: dict[str, str | Converted]  # the same name -> its checkpoint tensor, or how it is made


class DiskWeights:
    """``model``'s parameters read from ``checkpoint`` a unit at a time (see the module's
    docstring), in ``dtype`` on ``device``.

    Raises:
        ModelSpecError: a parameter the checkpoint does not hold, or holds in another shape.
    """

    def __init__(self, model: nn.Module, checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.checkpoint, self.dtype, self.device = model, checkpoint, dtype, device
        self.units = _units(model, checkpoint)
        self.resident: Unit | None = None
        self.on_read: Callable[[Unit], None] | None = None
        self._handles: list[Any] = []
        self._hook()

    def _hook(self) -> None:
        for unit, modules in self._modules_by_unit():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(lambda *_, unit=unit: self.hold(unit)))

    def _modules_by_unit(self) -> Iterator[tuple[Unit, list[nn.Module]]]:
        """Each unit's modules: those inside it, and any other that holds one of its
        parameters (a head tied to the embedding runs on the embedding's unit)."""
        by_name = dict(self.model.named_modules())
        for unit in self.units:
            held = {id(p) for p in unit.params.values()}
            yield unit, [
                m for name, m in by_name.items()
                if name == unit.name or name.startswith(unit.name + ".")
                or any(id(p) in held for p in m._parameters.values() if p is not None)
            ]

    def unit_of(self, path: str) -> Unit | None:
        """The unit holding the module ``path`` (or inside it)."""
        return next(
            (u for u in self.units if path == u.name or path.startswith(u.name + ".") or u.name.startswith(path + ".")),
            None,
        )

    def copy(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """A copy of the model whose weights are read from the same checkpoint in ``dtype``
        on ``device`` (a noise floor's: the reference's code at the candidate's precision);
        nothing is read until it runs."""
        self.release()
        for handle in self._handles:
            handle.remove()
        try:
            copied = copy.deepcopy(self.model, {id(self): None})
        finally:
            self._hook()
        return _attached(copied, self.checkpoint, dtype=dtype, device=device)

    def hold(self, unit: Unit) -> None:
        """``unit``'s weights in memory, the unit held before released."""
        if self.resident is unit:
            return
        spare = self._spare(unit)
        for name, param in unit.params.items():
            kept = spare.get((param.shape, self._dtype_of(param))) if isinstance(unit.recipes[name], str) else None
            into = kept.pop() if kept else None
            value = self._read(name, unit.recipes[name], param, into)
            torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=False))
        self.resident = unit
        if self.on_read is not None:
            self.on_read(unit)

    def _dtype_of(self, param: nn.Parameter) -> torch.dtype:
        return self.dtype if param.is_floating_point() else param.dtype

    def _spare(self, unit: Unit) -> dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]]:
        """The unit held before released, its tensors that no one else holds kept for
        ``unit``'s parameters of the same shape and dtype to be read into (on a CPU), the
        others freed: never more memory than one of the two units."""
        held, self.resident = self.resident, None
        wanted: dict[tuple[torch.Size, torch.dtype], int] = {}
        for param in unit.params.values():
            key = (param.shape, self._dtype_of(param))
            wanted[key] = wanted.get(key, 0) + 1
        spare: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        for param in held.params.values() if held is not None else ():
            empty = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
            torch.utils.swap_tensors(param, empty)  # ``empty`` holds what was read
            key = (empty.shape, empty.dtype)
            if self.device.type == "cpu" and wanted.get(key, 0) > 0 and _alone(empty):
                wanted[key] -= 1
                spare.setdefault(key, []).append(empty.data)
        return spare

    def _read(self, name: str, recipe: str | Converted, param: nn.Parameter, into: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self._dtype_of(param)
        if isinstance(recipe, str):
            return self.checkpoint.read(recipe, dtype=dtype, device=self.device, into=into)
        converter = copy.deepcopy(recipe.converter)  # it collects what it converts: one per parameter
        for pattern, key in recipe.sources:
            converter.add_tensor(name, key, pattern, functools.partial(self.checkpoint.read, key, dtype=dtype, device=self.device))
        made = converter.convert(name, model=self.model, config=getattr(self.model, "config", None))
        value = made.get(name)
        value = value[0] if isinstance(value, list) else value
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
            found = "nothing" if not isinstance(value, torch.Tensor) else f"shape {list(value.shape)}"
            raise ModelSpecError(
                f"{self.checkpoint.folder}: transformers' conversion of {', '.join(k for _, k in recipe.sources[:2])}, ... "
                f"made {found} for {name}, the model's parameter {list(param.shape)}"
            )
        return value.to(dtype)

    def release(self) -> None:
        """The unit held freed."""
        self._spare(Unit("", {}, {}))

    def close(self) -> None:
        """The unit held freed, the hooks taken off, the model no longer reading from disk
        (its parameters left on the meta device): a later run attaches it again."""
        self.release()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if getattr(self.model, "blockdiff_disk_weights", None) is self:
            del self.model.blockdiff_disk_weights


def _alone(tensor: torch.Tensor) -> bool:
    """Whether no other tensor shares ``tensor``'s memory (none to see it overwritten)."""
    try:
        return tensor.is_contiguous() and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) == 2
    except (AttributeError, RuntimeError):  # a torch without the count: nothing is reused
        return False


def unit_bytes(unit: Unit, dtype: torch.dtype) -> int:
    """The bytes ``unit`` takes read in ``dtype`` (its floating tensors cast)."""
    return sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size()) for p in unit.params.values())


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's ``nn.ModuleList`` holding the most parameters (its blocks)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return None
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def _units(model: nn.Module, checkpoint: Checkpoint) -> list[Unit]:
    """The model's units, each parameter with its recipe (:func:`_recipes`).

    Raises:
        ModelSpecError: a parameter the checkpoint does not hold, or holds in another shape.
    """
    found = _blocks(model)
    prefixes = [f"{found[0]}.{i}" for i in range(len(found[1]))] if found else []
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    recipes = _recipes(model, checkpoint)
    units: dict[str, Unit] = {}
    for key, names in aliases.items():
        param = params[key]
        filled = next((n for n in names if n in recipes), None)
        if filled is None:
            raise ModelSpecError(f"{checkpoint.folder}: the checkpoint holds no tensor {names[0]}")
        name = filled
        recipe = recipes[name]
        if isinstance(recipe, str) and checkpoint.tensors[recipe].shape != tuple(param.shape):
            raise ModelSpecError(
                f"{checkpoint.folder}: tensor {recipe} has shape {list(checkpoint.tensors[recipe].shape)}, "
                f"the model's parameter {list(param.shape)}"
            )
        owner = next((p for p in prefixes if names[0].startswith(p + ".")), names[0].rsplit(".", 1)[0])
        unit = units.setdefault(owner, Unit(owner, {}, {}))
        unit.params[name], unit.recipes[name] = param, recipe
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(units.values(), key=lambda u: order.get(u.name, len(order)))


def _recipes(model: nn.Module, checkpoint: Checkpoint) -> dict[str, str | Converted]:
    """Each parameter name the checkpoint fills, with the tensor it is (the same name, or
    the one transformers renames into it) or how transformers makes it of several
    (:class:`Converted`), as ``from_pretrained`` reads the checkpoint: transformers' own
    conversion mapping for the model (``get_model_conversion_mapping``)."""
    recipes: dict[str, str | Converted] = {name: name for name in checkpoint.tensors}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return recipes
    if not isinstance(model, PreTrainedModel):
        return recipes
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    expected = {name: True for name, _ in model.named_parameters(remove_duplicate=False)}
    collected: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if renamed not in expected and key in expected:
            renamed, pattern = key, None
        if renamed not in expected:
            continue
        if pattern is None:
            recipes[renamed] = key
        else:
            collected.setdefault(renamed, []).append((pattern, key))
    for name, sources in collected.items():
        recipes[name] = Converted(by_pattern[sources[0][0]], tuple(sources))
    return recipes


def attach(model: nn.Module, folder: str | os.PathLike, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``model`` (its parameters on the meta device) reading its weights from the
    checkpoint ``folder`` a unit at a time, in ``dtype`` on ``device``; its buffers cast
    and moved as ``model.to(device).to(dtype)`` would."""
    return _attached(model, Checkpoint(folder), dtype=dtype, device=device)


def _attached(model: nn.Module, checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    cast: dict[int, nn.Parameter] = {}  # tied parameters stay one parameter
    for path, module in model.named_modules():
        for name, buffer in module._buffers.items():
            stored = f"{path}.{name}" if path else name
            if buffer is not None and stored in checkpoint.tensors and name not in module._non_persistent_buffers_set:
                buffer = checkpoint.read(stored, dtype=buffer.dtype, device=buffer.device)  # a buffer saved with the weights
            if buffer is not None:
                module._buffers[name] = buffer.to(device=device, dtype=dtype if buffer.is_floating_point() else None)
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
                module._parameters[name] = cast[id(param)]
    model.blockdiff_disk_weights = DiskWeights(model, checkpoint, dtype=dtype, device=device)  # type: ignore[assignment]
    return model


def disk_weights(model: Any) -> DiskWeights | None:
    return getattr(model, "blockdiff_disk_weights", None)


@contextlib.contextmanager
def held(model: Any, path: str) -> Iterator[None]:
    """Within it, the unit of ``model`` holding the module ``path`` is in memory (when the
    model reads its weights from disk; otherwise nothing happens): what reads weights
    without calling the module (the conversion diagnosis)."""
    weights = disk_weights(model)
    unit = None if weights is None else weights.unit_of(path)
    if weights is not None and unit is not None:
        weights.hold(unit)
    yield


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def parse_size(text: str) -> int:
    """Bytes from ``1GiB``, ``1.5 GB``, ``800MiB``, ``512M``, ``2g`` or a plain number.

    Raises:
        ValueError: anything else.
    """
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if found is None:
        raise ValueError(f"{text!r} is not a size (e.g. 1GiB, 800MB, 2G)")
    number, prefix, binary, _ = found.groups()
    power = " kmgt".index(prefix or " ")
    base = 1024 if binary or not found.group(4) else 1000
    return int(float(number) * base**power)


def _largest(weights: DiskWeights, dtype: torch.dtype | None = None) -> tuple[str, int]:
    """The largest unit's name and bytes (in ``dtype`` when given)."""
    unit = max(weights.units, key=lambda u: unit_bytes(u, dtype or weights.dtype))
    return unit.name, unit_bytes(unit, dtype or weights.dtype)


def resident(ref: Any, cand: Any) -> list[tuple[str, str, int]]:
    """What the weights read from disk hold at most at once: (side, unit, bytes) for the
    reference, the candidate and — the candidate in another dtype — the reference's noise
    floor (the reference's blocks read in the candidate's dtype). A model held whole is
    not the budget's (:func:`held_whole`)."""
    ref_weights, cand_weights = disk_weights(ref), disk_weights(cand)
    held = [(side, *_largest(w)) for side, w in (("the reference", ref_weights), ("the candidate", cand_weights)) if w is not None]
    cand_dtype = cand_weights.dtype if cand_weights is not None else None
    if ref_weights is not None and cand_dtype is not None and cand_dtype != ref_weights.dtype:
        held.append(("the reference's noise floor", *_largest(ref_weights, cand_dtype)))
    return held


def held_whole(ref: Any, cand: Any) -> list[tuple[str, int]]:
    """(side, bytes) of each model held in memory whole (a factory's with its weights)."""
    return [
        (side, sum(t.numel() * t.element_size() for t in model.parameters()))
        for side, model in (("the reference", ref), ("the candidate", cand))
        if isinstance(model, nn.Module) and disk_weights(model) is None
    ]


def refusal(budget: int, ref: Any, cand: Any) -> str | None:
    """Why ``budget`` bytes cannot hold the weights a diff of ``ref`` and ``cand`` holds at
    once (:func:`resident`), or ``None``; written with ``{max_memory}`` for the option."""
    held = resident(ref, cand)
    for side, unit, nbytes in held:
        if nbytes > budget:
            return (
                f"{{max_memory}} {_size(budget)} is below what one unit of {side} needs: {unit} takes {_size(nbytes)}"
            )
    total = sum(nbytes for _, _, nbytes in held)
    if total > budget:
        return (
            f"{{max_memory}} {_size(budget)} cannot hold a block of each side at once: "
            + ", ".join(f"{side}'s {unit} {_size(nbytes)}" for side, unit, nbytes in held)
            + f" ({_size(total)})"
        )
    return None


def peak_memory() -> int:
    """The process's peak resident memory so far, in bytes: Linux's ``VmHWM`` (this
    program's own; ``ru_maxrss`` also counts the process that started it, when that one
    was larger at the fork), else ``ru_maxrss``."""
    import resource
    import sys

    found = _kib("/proc/self/status", "VmHWM:")
    if found is not None:
        return found
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def note(budget: int, ref: Any, cand: Any) -> str:
    """What a diff under ``budget`` read and held, for its report."""
    held = resident(ref, cand)
    read = [w.checkpoint for w in (disk_weights(ref), disk_weights(cand)) if w is not None]
    seconds = sum(c.seconds for c in read)
    nbytes = sum(c.bytes_read for c in read)
    rate = f" at {nbytes / seconds / 1e6:.0f} MB/s" if seconds else ""
    whole = "".join(
        f"; {side} is held whole, {_size(n)}{', over the budget' if n > budget else ''}" for side, n in held_whole(ref, cand)
    )
    return (
        f"weights read from disk a block at a time (max_memory {_size(budget)}): at most "
        f"{_size(sum(n for _, _, n in held))} of weights at once ("
        + ", ".join(f"{side}'s {unit} {_size(n)}" for side, unit, n in held)
        + f"){whole}; {_size(nbytes)} read{rate}; the process's peak resident memory {_size(peak_memory())}"
    )


def checkpoint_bytes(spec: Any) -> int:
    """The bytes of the weights in a Hugging Face directory ``spec`` (its safetensors or
    ``.bin`` files), 0 for any other spec."""
    path = Path(str(spec)) if isinstance(spec, (str, os.PathLike)) else None
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))


def available_memory() -> int | None:
    """The memory this machine has available now (``MemAvailable``), when it says."""
    return _kib("/proc/meminfo", "MemAvailable:")


def _kib(path: str, field: str) -> int | None:
    """Bytes of a ``field:  N kB`` line of a Linux ``/proc`` file, when there is one."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def too_large(reference: Any, candidate: Any) -> str | None:
    """Why two checkpoint directories cannot both be loaded whole here, or ``None``."""
    total = checkpoint_bytes(reference) + checkpoint_bytes(candidate if candidate is not None else reference)
    available = available_memory()
    if not total or available is None or total <= available:
        return None
    return (
        f"the two models' weights take {_size(total)} and this machine has {_size(available)} available: "
        "read them from disk a block at a time with {max_memory} (e.g. 2GiB: docs/larger-than-memory.md)"
    )
