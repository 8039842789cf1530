"""ONNX Runtime candidates: an exported graph as a side, localized like a PyTorch model.

A candidate spec ending in ``.onnx`` (or a factory returning an :class:`OnnxModel`) is
run by ONNX Runtime. Its sites are found through the module scopes the ``torch.onnx``
(dynamo) exporter writes on every node (``pkg.torch.onnx.name_scopes``): the nodes of
module ``blocks.2.ffn`` are those whose scope names it; the values they consume that
depend on the model's inputs are the site's arguments, the values they produce and
something outside uses are its output.

Experiments run **sub-graphs** of the candidate's graph: a module check runs the nodes
between the module's input value and its output value (``onnx.utils.Extractor``) on the
reference's activation; a block run with modules frozen cuts the graph at the frozen
modules' output values and feeds the reference's recorded outputs there. So an edited
node in the graph (an activation swapped, a scale changed, a residual add dropped) is
blamed on its (block, sub-path), as a bug in PyTorch code is.

Recording asks ONNX Runtime for every site's values as extra graph outputs. A value that
is a graph output cannot disappear into a fused kernel, so this can change what ORT's
optimizer fuses; :func:`capture_changes_outputs` measures it (the model's own outputs
with and without the extra ones), and the side's ``meta`` records the result
(``docs/architecture.md``, "ONNX Runtime candidates").
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import InputError, ModelSpecError, PairingError
from ..hookmap import Layout
from ..pairing import OPTIONAL_STAGES
from ..site import Site
from ..store import MemoryStore, SiteStore
from . import Judged, Judging, SideDefaults
from ..report import Note

SCOPES = "pkg.torch.onnx.name_scopes"
ONNX_SUFFIX = ".onnx"

_NUMPY_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, np.dtype(np.float64): torch.float64}


def is_onnx(spec: Any) -> bool:
    """Whether a side spec names an ONNX Runtime candidate: a path ending in ``.onnx`` or an
    :class:`OnnxModel`."""
    return isinstance(spec, OnnxModel) or (isinstance(spec, (str, Path)) and str(spec).lower().endswith(ONNX_SUFFIX))


def export_onnx(model: nn.Module, inputs: torch.Tensor | tuple, path: str | Path) -> Path:
    """Export ``model`` with the ``torch.onnx`` dynamo exporter, keeping every module's
    scope (``optimize=False``: the exporter's own optimizer folds modules that compute
    constants, such as a rotary table, out of the graph; ONNX Runtime folds them when it
    loads the graph anyway). Shapes are static: the graph runs on inputs shaped like
    ``inputs``."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    # A Hugging Face model would return its KV cache, which the exporter cannot trace.
    kwargs = {"use_cache": False} if hasattr(getattr(model, "config", None), "use_cache") else {}
    with torch.no_grad():
        program = torch.onnx.export(model.eval(), args, kwargs=kwargs, dynamo=True, optimize=False, verbose=False)
    assert program is not None  # the dynamo exporter always returns its program (None: the legacy one's)
    program.save(str(path))
    return Path(path)


class OnnxModel:
    """An ONNX graph and how ONNX Runtime runs it (what a candidate factory may return).

    Args:
        model: a path to a ``.onnx`` file, or an ``onnx.ModelProto``.
        providers: ONNX Runtime execution providers (default: the CPU's).
        optimization: ``onnxruntime.GraphOptimizationLevel`` for every session (default: all).
        label: how the report names it.
    """

    def __init__(self, model: Any, *, providers: list[str] | None = None, optimization: Any = None, label: str | None = None) -> None:
        try:
            import onnx
            import onnxruntime as ort
        except ImportError as exc:
            raise ModelSpecError(
                f"an ONNX candidate needs the onnx and onnxruntime packages ({exc}): pip install 'blockdiff[onnx]'",
                spec=str(model),
            ) from None

        self.path = None if isinstance(model, onnx.ModelProto) else Path(model)
        if self.path is not None and not self.path.is_file():
            raise ModelSpecError(f"{self.path}: no such ONNX file", spec=str(self.path))
        try:
            loaded = model if self.path is None else onnx.load(str(self.path))
            # Shapes of every intermediate value: what sub-graph extraction types its inputs with.
            self.proto = onnx.shape_inference.infer_shapes(loaded)
        except Exception as exc:  # protobuf's DecodeError, onnx's checker and inference errors
            raise ModelSpecError(
                f"{self.path or 'the ONNX model'} cannot be read as an ONNX model: {type(exc).__name__}: {exc}",
                spec=str(self.path or model),
            ) from None
        self.providers = providers or ["CPUExecutionProvider"]
        self.optimization = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimization is None else optimization
        self.label = label or (str(self.path) if self.path else self.proto.graph.name or "onnx model")
        self._extractor: Any = None
        self._sessions: dict[tuple, Any] = {}

    @property
    def input_names(self) -> list[str]:
        initializers = {t.name for t in self.proto.graph.initializer}
        return [i.name for i in self.proto.graph.input if i.name not in initializers]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.proto.graph.output]

    def session(self, inputs: tuple[str, ...] | None = None, outputs: tuple[str, ...] | None = None) -> Any:
        """An ORT session for the whole graph with ``outputs`` as its outputs (extra ones
        added), or — with ``inputs`` — for the sub-graph between those values. Cached."""
        key = (inputs, outputs)
        if key not in self._sessions:
            import onnxruntime as ort

            if inputs is None:
                proto = self.with_outputs(outputs or ())
            else:
                proto = self.extractor().extract_model(list(inputs), list(outputs or ()))
            options = ort.SessionOptions()
            options.graph_optimization_level = self.optimization
            options.log_severity_level = 3
            self._sessions[key] = ort.InferenceSession(proto.SerializeToString(), options, providers=self.providers)
        return self._sessions[key]

    def extractor(self) -> Any:
        if self._extractor is None:
            import onnx.utils

            self._extractor = onnx.utils.Extractor(self.proto)
        return self._extractor

    def with_outputs(self, names: Any) -> Any:
        """A copy of the graph with the values ``names`` added to its outputs (what recording
        asks ONNX Runtime to run)."""
        import onnx

        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)
        graph = self.proto.graph
        infos = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}
        known = set(self.output_names)
        proto.graph.output.extend(infos[name] for name in names if name not in known)
        return proto

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str], *, inputs: tuple[str, ...] | None = None) -> list[np.ndarray]:
        session = self.session(inputs, tuple(outputs))
        return session.run(list(outputs), feeds)

    def __repr__(self) -> str:
        return f"OnnxModel({self.label!r})"


# ---------------------------------------------------------------------------------------
# where each module of the layout is in the graph


@dataclass
class OnnxSite:
    """One module's place in the graph: the values it takes (those depending on the model's
    inputs) and the values it hands on, in the order the graph computes them."""

    module: str
    inputs: list[str]
    outputs: list[str]
    nodes: set[int] = field(default_factory=set)


def module_sites(proto: Any, modules: list[str], *, optional: frozenset[str] = frozenset()) -> dict[str, OnnxSite]:
    """Each module's :class:`OnnxSite`, from the exporter's node scopes (a node without
    one — inserted by a graph editor — takes its neighbours', :func:`attributed_scopes`).
    A module of ``optional`` no node belongs to (the exporter's optimizer folds a module
    that computes constants, such as a rotary table, into the graph's initializers) has
    no site.

    Raises:
        PairingError: a module no node of the graph belongs to (an export without module
            scopes, or one whose optimizer folded the module away).
    """
    graph = proto.graph
    scopes = attributed_scopes(proto)
    if not any(scopes):
        raise PairingError(
            "the ONNX graph has no module scopes (pkg.torch.onnx.name_scopes): export it with "
            "torch.onnx.export(..., dynamo=True) (blockdiff.onnxside.export_onnx)"
        )
    dynamic = _dynamic_values(proto)
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    graph_outputs = {o.name for o in graph.output}
    found = {}
    for module in modules:
        nodes = {i for i, s in enumerate(scopes) if module in s}
        if not nodes and module in optional:
            continue
        if not nodes:
            raise PairingError(
                f"{module}: no node of the ONNX graph belongs to this module (scope {module!r}); an export "
                "whose optimizer folded it away (export with optimize=False: blockdiff.onnxside.export_onnx)"
            )
        # Constant nodes are shared between scopes (the exporter makes each constant once).
        produced = [out for i in sorted(nodes) if graph.node[i].op_type != "Constant" for out in graph.node[i].output if out]
        mine = {out for i in nodes for out in graph.node[i].output}
        outputs = [
            v for v in produced
            if v in graph_outputs or any(c not in nodes for c in consumers.get(v, ()))
        ]
        inputs = []
        for i in sorted(nodes):
            for name in graph.node[i].input:
                if name and name not in mine and name in dynamic and name not in inputs:
                    inputs.append(name)
        found[module] = OnnxSite(module, inputs, outputs, nodes)
    return found


def attributed_scopes(proto: Any) -> list[list[str]]:
    """Every node's scopes (:func:`node_scopes`); a node that has none (a graph editor's,
    with no metadata) takes those its producers and consumers share — the deepest module
    all of them are inside — so a node inserted between two nodes of one module belongs to
    it. Repeated until nothing changes (a chain of inserted nodes)."""
    graph = proto.graph
    scopes = [node_scopes(node) for node in graph.node]
    if not any(scopes):
        return scopes
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.output:
            producer[name] = i
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(graph.node):
            if scopes[i] or node.op_type == "Constant":
                continue
            around = [producer[n] for n in node.input if n in producer] + [c for n in node.output for c in consumers.get(n, ())]
            around = [j for j in around if graph.node[j].op_type != "Constant"]  # shared between scopes
            known = [scopes[j] for j in around if scopes[j]]
            if not known or len(known) < len(around):
                continue
            shared = known[0]
            for other in known[1:]:
                n = 0
                while n < min(len(shared), len(other)) and shared[n] == other[n]:
                    n += 1
                shared = shared[:n]
            if shared:
                scopes[i] = list(shared)
                changed = True
    return scopes


def node_scopes(node: Any) -> list[str]:
    """The module paths a node is inside (the exporter's name scopes, less the node's own
    name at the end and the root)."""
    for prop in node.metadata_props:
        if prop.key == SCOPES:
            try:
                names = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [n for n in names[:-1] if n]
    return []


def _dynamic_values(proto: Any) -> set[str]:
    """The values that depend on the graph's inputs (the rest are constants)."""
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    dynamic = {i.name for i in graph.input if i.name not in initializers}
    for node in graph.node:  # nodes are in topological order
        if any(name in dynamic for name in node.input):
            dynamic.update(out for out in node.output if out)
    return dynamic


# ---------------------------------------------------------------------------------------
# the side


class _Unchanged:
    """What :meth:`OnnxSide.record` returns: ORT's outputs are its own arrays, never changed."""

    def changed(self) -> bool:
        return False


def _to_numpy(t: torch.Tensor, like: np.dtype | None = None) -> np.ndarray:
    arr = t.detach().cpu()
    if like is not None and arr.is_floating_point():
        arr = arr.to(_NUMPY_TO_TORCH.get(np.dtype(like), arr.dtype))
    return arr.contiguous().numpy()


class OnnxSide(SideDefaults):
    """An ONNX Runtime candidate under the reference's layout (the graph was exported from
    the same module tree, so the reference's module paths are its scopes)."""

    live = True
    not_streamed = "an ONNX Runtime candidate: its sites are one ORT run's extra outputs, kept in memory"

    def __init__(self, name: str, model: OnnxModel, layout: Layout, *, label: str | None = None) -> None:
        self.name = name
        self.model = model
        self.layout = layout
        self.store: SiteStore | None = None
        self._ran_on: Any = None  # the inputs record() ran on
        # The graph's own outputs in the recorded run (every site an extra output).
        self.graph_outputs: list[np.ndarray] | None = None
        modules = [path for _, path in layout.outside]
        for block in layout.blocks:
            modules.append(block.path)
            modules.extend(path for paths in block.subpaths.values() for path in paths)
        # A stage that computes constants (a rotary table) is folded away by the exporter's
        # optimizer: an optional stage, left out (the pairing says so, and so does the note).
        optional = frozenset(
            path for stage, path in layout.outside
            if stage in OPTIONAL_STAGES or stage in layout.hook_map.optional or path in layout.hook_map.optional
        )
        self.sites = module_sites(model.proto, modules, optional=optional)
        self.folded = [path for _, path in layout.outside if path not in self.sites]
        if self.folded:
            self.layout = replace(layout, outside=[(stage, path) for stage, path in layout.outside if path in self.sites])
        self._dtype = self._output_dtype()
        self.meta = {
            "model": label or model.label,
            "class": "ONNX Runtime",
            "device": "cpu",
            "dtype": str(self._dtype).removeprefix("torch."),
            "hook_map": layout.hook_map.name,
            "runtime": _runtime(model),
        }

    def _output_dtype(self) -> torch.dtype:
        import onnx

        elem = self.model.proto.graph.output[0].type.tensor_type.elem_type
        return {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.FLOAT16: torch.float16,
                onnx.TensorProto.DOUBLE: torch.float64, onnx.TensorProto.BFLOAT16: torch.bfloat16}.get(elem, torch.float32)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    # -- recording

    def feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        """The graph's inputs from blockdiff's model inputs: a tensor (the first graph
        input), a tuple (in order) or a dict (by name)."""
        names = self.model.input_names
        if isinstance(inputs, torch.Tensor):
            given = {names[0]: inputs}
        elif isinstance(inputs, tuple):
            given = dict(zip(names, inputs))
        else:
            given = {k: v for k, v in inputs.items() if k in names}
        missing = [n for n in names if n not in given]
        if missing:
            raise InputError(f"the ONNX graph takes {', '.join(names)}; missing {', '.join(missing)}")
        expected = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in self.model.proto.graph.input}
        for name, value in given.items():
            shape = list(value.shape)
            if all(expected[name]) and expected[name] != shape:
                raise InputError(
                    f"the ONNX graph's input {name} has the static shape {expected[name]}, the inputs {shape}: "
                    "export it on inputs of this shape, or give inputs of its shape (--batch/--seq)"
                )
        return {name: _to_numpy(value) for name, value in given.items()}

    def recorded_values(self) -> list[str]:
        """Every value recording asks for: each site's inputs and outputs."""
        return list(dict.fromkeys(v for s in self.sites.values() for v in [*s.inputs, *s.outputs]))

    def record(self, inputs: Any, store: SiteStore, *, hold: str | None = None, progress: Callable[[int, int], None] | None = None) -> _Unchanged:
        """One ORT run of the whole graph with every site's values as extra outputs; each
        site goes into ``store`` in the reference layout's anatomy."""
        self.store, self._ran_on = store, inputs
        own = list(self.model.output_names)
        wanted = [*own, *(v for v in self.recorded_values() if v not in own)]
        feeds = self.feeds(inputs)
        results = self.model.run(feeds, wanted)
        self.graph_outputs = results[: len(own)]
        values = dict(zip(wanted, results))
        values.update(feeds)
        recorded = self._sites(values)
        for done, site in enumerate(recorded, 1):
            store.add(site)
            if progress is not None:
                progress(done, len(recorded))
        return _Unchanged()

    def _sites(self, values: dict[str, np.ndarray]) -> list[Site]:
        """The recorded sites in the order their modules start in the graph (a block before
        its modules), keyed as the reference's hook map keys them."""
        # (stage, block index, sub-path, module path)
        entries: list[tuple[str, int | None, str | None, str]] = [(stage, None, None, path) for stage, path in self.layout.outside]
        for layout in self.layout.blocks:
            entries.append(("block", layout.index, None, layout.path))
            for name, paths in layout.subpaths.items():
                entries.extend(("block", layout.index, name, path) for path in paths)
        start = {path: (min(self.sites[path].nodes), -len(self.sites[path].nodes)) for *_, path in entries}
        entries.sort(key=lambda e: start[e[3]])
        counters: dict[tuple, int] = {}
        found = []
        for order, (stage, block, subpath, path) in enumerate(entries):
            where = self.sites[path]
            ordinal = counters.get((stage, block, subpath), 0)
            counters[(stage, block, subpath)] = ordinal + 1
            args = tuple(torch.from_numpy(np.asarray(values[v])) for v in where.inputs)
            outs = tuple(torch.from_numpy(np.asarray(values[v])) for v in where.outputs)
            found.append(Site(stage, block, subpath, path, 0, ordinal, args, {}, outs[0] if len(outs) == 1 else outs, order=order))
        return found

    # -- experiments

    def _feed(self, where: OnnxSite, call: Site, hidden: dict[str, torch.Tensor] | None) -> dict[str, np.ndarray]:
        """The sub-graph's inputs: the call's own arguments, the first replaced by the
        reference's hidden state (a module's other inputs, the candidate's own)."""
        feeds = {}
        for i, name in enumerate(where.inputs):
            value = call.args[i]
            if i == 0 and hidden and "primary" in hidden:
                value = hidden["primary"]
            feeds[name] = _to_numpy(value, call.args[i].numpy().dtype)
        return feeds

    def call_module(self, path: str, call: Site, hidden: dict[str, torch.Tensor] | None = None) -> Any:
        where = self.sites[path]
        outs = self.model.run(self._feed(where, call, hidden), where.outputs, inputs=tuple(where.inputs))
        tensors = tuple(torch.from_numpy(np.asarray(o)) for o in outs)
        return tensors[0] if len(tensors) == 1 else tensors

    def run_block(
        self, path: str, call: Site, hidden: dict[str, torch.Tensor] | None, modules: dict[str, str], frozen: dict | None
    ) -> tuple[torch.Tensor, dict[tuple[str, int], torch.Tensor]]:
        """The block's sub-graph, cut at each frozen module's output value, where the
        recorded output is fed instead; the value reaching each module comes back too."""
        block = self.sites[path]
        feeds = self._feed(block, call, hidden)
        by_key = {(s.subpath, s.ordinal): s for s in self._block_sites(call.block) if s.subpath is not None}
        for key, (recorded, own) in (frozen or {}).items():
            # The recorded output, in the dtype this graph's own value has there.
            where = self.sites[by_key[key].module]
            feeds[where.outputs[0]] = _to_numpy(recorded.primary_output(), own.primary_output().numpy().dtype)
        reach = {key: self.sites[s.module].inputs[0] for key, s in by_key.items() if self.sites[s.module].inputs}
        asked = [block.outputs[0], *[v for v in dict.fromkeys(reach.values()) if v not in feeds]]
        values = dict(zip(asked, self.model.run(feeds, asked, inputs=tuple(feeds))))
        values.update(feeds)
        reached = {key: torch.from_numpy(np.asarray(values[v])) for key, v in reach.items()}
        return torch.from_numpy(np.asarray(values[block.outputs[0]])), reached

    def _block_sites(self, index: int | None) -> list[Site]:
        if self.store is None or index is None:
            raise PairingError(f"the {self.name} has not recorded block {index}")
        return [s for s in self.store.block_sites(index) if s.subpath]

    def child_calls(self, path: str, call: Site, hidden: dict[str, torch.Tensor] | None = None) -> list[Site]:
        """No drill-down below a sub-path: graph nodes are not modules' children calls."""
        return []

    def localized(self, judging: Judging, judge: Callable[[], Judged]) -> Judged:
        """``judge()``, and a note saying whether recording every site as a graph output
        moved the graph's own outputs (:func:`capture_changes_outputs`)."""
        judged = judge()
        if self.folded:
            judging.notes.append(
                Note("onnx-folded", f"{', '.join(self.folded)}: no node of the ONNX graph belongs to it (the exporter's optimizer folded "
                "it into the graph's constants): left out of the candidate's sites")
            )
        moved = capture_changes_outputs(self.model, self, self._ran_on)
        judging.notes.append(
            Note("onnx-candidate", "ONNX Runtime candidate: sites found by the exporter's module scopes, experiments run as sub-graphs; "
            + ("recording every site as a graph output left the graph's outputs unchanged (bit for bit)" if moved == 0.0
               else f"recording every site as a graph output moved the graph's outputs by up to {moved:.3g} "
                    "(ORT fuses differently around values it must output): drift is measured on the recorded run"))
        )
        return judged



def _runtime(model: OnnxModel) -> str:
    import onnxruntime as ort

    return f"onnxruntime {ort.__version__} ({', '.join(model.providers)})"


def capture_changes_outputs(model: OnnxModel, side: OnnxSide, inputs: Any) -> float:
    """How far the graph's own outputs move when every site is also an output: the largest
    absolute difference (``0.0``: recording did not change what ORT computes), between a
    plain run and the side's recorded run (made here if the side has not recorded yet)."""
    if side.graph_outputs is None:
        side.record(inputs, MemoryStore())
    plain = model.run(side.feeds(inputs), model.output_names)
    captured = side.graph_outputs
    assert captured is not None  # record() keeps them
    return max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) for a, b in zip(plain, captured))


# -- the kind, as the factory asks for it

NAME = "onnx"


def claims(spec: Any) -> bool:
    """Whether ``spec`` is an ONNX graph: a path ending in ``.onnx``, or an :class:`OnnxModel`
    (what a candidate factory may return)."""
    return is_onnx(spec)


def opened(role: str, spec: Any, *, opened: Any, like: Any, label: str | None) -> OnnxSide:
    """The graph ``spec`` as a candidate, its sites found under the reference's (``like``) layout."""
    if role != "candidate" or like is None:
        raise InputError("the reference must be a PyTorch model; an ONNX Runtime model can only be the candidate")
    if not like.live:
        raise InputError("an ONNX Runtime candidate is localized against a live reference model, not a dump")
    return OnnxSide(role, spec if isinstance(spec, OnnxModel) else OnnxModel(spec), like.layout, label=label)


__all__ = [
    "OnnxModel", "OnnxSide", "export_onnx", "is_onnx", "module_sites", "node_scopes", "capture_changes_outputs",
    "NAME", "claims", "opened",
]
