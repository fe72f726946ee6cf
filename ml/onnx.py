"""The model on the device as ONNX: export from torch, int8 dynamic quantization, and inference through
ONNX Runtime.

The export uses torch's TorchScript-based exporter (``dynamo=False``; the dynamo exporter needs onnxscript)
at opset ``OPSET`` with a dynamic batch axis. Both edgefl models export: the CNN (images, float32) and the
character LSTM (int64 character ids; its initial state is built from the input's batch size in the graph).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process
from torch import nn

from ml.data import Dataset

OPSET = 17  # supported by every onnxruntime >= 1.13 and by torch's TorchScript exporter (7..20)
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
EVAL_BATCH = 1000  # rows per session run in OnnxClassifier; the same as ml.trainer.evaluate's default


def export_onnx(model: nn.Module, dataset: Dataset, path: Path) -> Path:
    """Write ``model`` (the model for ``dataset``) as an ONNX graph with a dynamic batch axis; returns ``path``.

    One test row is the example input that fixes the graph's dtype and per-sample shape.
    """
    path = Path(path)
    example = torch.from_numpy(dataset.x_test[:1])
    with warnings.catch_warnings():
        # Both warnings concern choices made here on purpose: the legacy exporter (dynamo needs onnxscript)
        # and the LSTM's batch size, which the graph reads from its input because no initial state is passed.
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    return path


def quantize_int8(fp32_path: Path, int8_path: Path) -> Path:
    """Dynamic int8 quantization with onnxruntime: int8 weights (QInt8), activations quantized to uint8 at run
    time per tensor. Returns ``int8_path``.

    The graph first goes through onnxruntime's own quantization pre-processing (ONNX shape inference and graph
    optimization); symbolic shape inference is skipped, as the shapes are static but for the batch axis and it
    costs seconds of sympy import.
    """
    with tempfile.TemporaryDirectory(prefix="edgefl-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(prepared, Path(int8_path), weight_type=QuantType.QInt8)
    return Path(int8_path)


class OnnxClassifier:
    """An ONNX Runtime CPU session of an exported edgefl model (fp32 or int8)."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        """``threads``: intra-op threads of the session; 0 leaves onnxruntime's default (one per core)."""
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def predict_logits(self, x: np.ndarray) -> np.ndarray:
        """Class logits (N, classes) for a batch of inputs in the data set's layout and dtype."""
        runs = (
            self.session.run([OUTPUT_NAME], {INPUT_NAME: x[start : start + EVAL_BATCH]})[0]
            for start in range(0, len(x), EVAL_BATCH)
        )
        return np.concatenate(list(runs))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on (x, y), with the same loss function as ``ml.trainer.evaluate``."""
        logits = self.predict_logits(x)
        loss = float(nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)))
        return loss, float(np.mean(logits.argmax(axis=1) == y))
