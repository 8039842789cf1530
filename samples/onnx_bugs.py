"""Planted bugs edited into an exported ONNX graph: what a faulty export or graph rewrite
does, for blockdiff to blame on the exact block and sub-path.

Each function returns an edited copy of a ``ModelProto`` exported by the ``torch.onnx``
dynamo exporter (``blockdiff.onnxside.export_onnx``), finding the nodes to edit by the
module scopes the exporter wrote on them:

- :func:`swap_activation`: the ffn's ``Sigmoid`` (of SiLU, x·σ(x)) becomes ``Tanh`` → ffn;
- :func:`scale_scores`: the attention scores are multiplied by ``factor`` before their
  softmax (a wrong 1/√d scale) → attention; with ``scoped=False`` the inserted node has no
  module scope, as graph-editing tools leave it;
- :func:`drop_residual`: the block's residual ``Add`` after attention passes only the
  attention's output on → residual.

"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from blockdiff.sides.onnx import module_sites, node_scopes


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    edited = onnx.ModelProto()
    edited.CopyFrom(proto)
    return edited


def _in(node: onnx.NodeProto, module: str) -> bool:
    return module in node_scopes(node)


def _first(proto: onnx.ModelProto, module: str, op: str) -> onnx.NodeProto:
    for node in proto.graph.node:
        if node.op_type == op and _in(node, module):
            return node
    raise ValueError(f"no {op} node in the scope of {module}")


def swap_activation(proto: onnx.ModelProto, ffn: str) -> onnx.ModelProto:
    """SiLU's sigmoid in module ``ffn`` (``blocks.1.ffn``) replaced by tanh."""
    edited = _copy(proto)
    _first(edited, ffn, "Sigmoid").op_type = "Tanh"
    return edited


def scale_scores(proto: onnx.ModelProto, attention: str, factor: float = 0.5, *, scoped: bool = True) -> onnx.ModelProto:
    """The attention scores of module ``attention`` scaled by ``factor`` before the softmax.
    ``scoped=False``: the inserted ``Mul`` has no module scope, as a graph editor writes it
    (blockdiff attributes it from the nodes around it)."""
    edited = _copy(proto)
    graph = edited.graph
    softmax = _first(edited, attention, "Softmax")
    name = f"{softmax.name}_planted_scale"
    graph.initializer.append(numpy_helper.from_array(np.array(factor, dtype=np.float32), name))
    scaled = helper.make_node("Mul", [softmax.input[0], name], [f"{name}_out"], name=name)
    if scoped:
        scaled.metadata_props.extend(softmax.metadata_props)  # the same module scope
    softmax.input[0] = scaled.output[0]
    index = list(graph.node).index(softmax)
    graph.node.insert(index, scaled)
    return edited


def drop_residual(proto: onnx.ModelProto, block: str, attention: str) -> onnx.ModelProto:
    """Block ``block``'s residual add around ``attention``: only the attention's output passes."""
    edited = _copy(proto)
    attn_out = module_sites(edited, [attention])[attention].outputs[0]
    for node in edited.graph.node:
        scopes = node_scopes(node)
        if node.op_type == "Add" and scopes and scopes[-1] == block and attn_out in node.input:
            node.op_type = "Identity"
            del node.input[:]
            node.input.append(attn_out)
            return edited
    raise ValueError(f"no residual Add of {attention}'s output in the scope of {block}")
