"""The import path of blockdiff 0.4 for ONNX Runtime candidates: a factory may return a
``blockdiff.onnxside.OnnxModel``. The code lives in :mod:`blockdiff.sides.onnx`."""

from .sides.onnx import OnnxModel, OnnxSide, capture_changes_outputs, export_onnx, is_onnx, module_sites, node_scopes

__all__ = ["OnnxModel", "OnnxSide", "export_onnx", "is_onnx", "module_sites", "node_scopes", "capture_changes_outputs"]
