"""Does recording an ONNX Runtime candidate change what ORT runs?

Recording asks ORT for every site's values as extra graph outputs. For the sample model
and a tiny Hugging Face Llama (exported with blockdiff.onnxside.export_onnx), this prints
the graph ORT runs after its optimizations (ORT_ENABLE_ALL, CPU) without and with those
outputs — node count and the ops that differ — and the largest difference of the model's
own outputs. Run: python benchmarks/onnx_capture.py
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blockdiff import resolve  # noqa: E402
from blockdiff.sides.onnx import OnnxModel, OnnxSide, capture_changes_outputs, export_onnx  # noqa: E402
from samples import hf_llama, tinylm  # noqa: E402


# ORT's fused CPU kernels a recorded value could keep from forming.
FUSED = ("QuickGelu", "FusedMatMul", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def optimized_ops(proto: onnx.ModelProto, folder: Path) -> collections.Counter:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return collections.Counter(node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node)


def main() -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, build in (("tinylm", tinylm.build), ("hf llama", hf_llama.build)):
            model = build()
            candidate = OnnxModel(export_onnx(model, ids, folder / "model.onnx"))
            side = OnnxSide("candidate", candidate, resolve(model, None))
            extra = [v for v in side.recorded_values() if v not in candidate.output_names]
            plain = optimized_ops(candidate.proto, folder)
            recorded = optimized_ops(candidate.with_outputs(extra), folder)
            changed = {op: (plain[op], recorded[op]) for op in sorted(plain | recorded) if plain[op] != recorded[op]}
            moved = capture_changes_outputs(candidate, side, ids)
            print(f"{name}: {len(extra)} extra outputs; optimized graph {sum(plain.values())} → "
                  f"{sum(recorded.values())} nodes; ops that differ (without, with): {changed or 'none'}; "
                  f"fused kernels { {op: n for op, n in plain.items() if op in FUSED} }; "
                  f"the model's outputs move by {moved}")


if __name__ == "__main__":
    main()
