"""The model as ONNX: export from torch, the evaluation graph with its parameters as inputs, int8 dynamic
quantization, and inference through ONNX Runtime.

The export uses torch's TorchScript-based exporter (``dynamo=False``; the dynamo exporter needs onnxscript)
at opset ``OPSET`` with a dynamic batch axis. Both edgefl models export: the CNN (images, float32) and the
character LSTM (int64 character ids; its initial state is built from the input's batch size in the graph).
torch is imported by the two exports only: the server evaluates and writes its model without it
(``ml.model_card`` keeps the evaluation graph).
"""

from __future__ import annotations

import io
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ml.catalog import ModelError
from ml.data import Dataset
from strategies.codecs.base import Layout

if TYPE_CHECKING:
    from torch import nn

OPSET = 17  # supported by every onnxruntime >= 1.13 and by torch's TorchScript exporter (7..20)
INPUT_NAME = "input"
OUTPUT_NAME = "logits"
EVAL_BATCH = 1000  # rows per session run in OnnxClassifier; the same as ml.trainer.evaluate's default


def export_onnx(model: nn.Module, dataset: Dataset, path: Path) -> Path:
    """Write ``model`` (the model for ``dataset``) as an ONNX graph with a dynamic batch axis; returns ``path``.

    One test row is the example input that fixes the graph's dtype and per-sample shape.
    """
    path = Path(path)
    _export(model, dataset, str(path))
    return path


def evaluation_graph(model: nn.Module, dataset: Dataset) -> bytes:
    """``model`` as an ONNX graph whose parameters are graph inputs, each named as in ``ml.models.param_layout``
    (no buffers: the models have none), for ``with_parameters``. Nothing is folded into constants: folding would
    replace the LSTM's parameters by the exporter's own tensors (its gates reordered and concatenated)."""
    graph = io.BytesIO()
    _export(model, dataset, graph, export_params=False, do_constant_folding=False)
    inputs = {value.name for value in onnx.load_from_string(graph.getvalue()).graph.input} - {INPUT_NAME}
    if inputs != {name for name, _ in model.named_parameters()}:
        raise ModelError(f"the evaluation graph's inputs are not the model's parameters: {sorted(inputs)}")
    return graph.getvalue()


def _export(model: nn.Module, dataset: Dataset, sink: str | io.BytesIO, **options: bool) -> None:
    import torch

    example = torch.from_numpy(dataset.x_test[:1])
    with warnings.catch_warnings():
        # Both warnings concern choices made here on purpose: the legacy exporter (dynamo needs onnxscript)
        # and the LSTM's batch size, which the graph reads from its input because no initial state is passed.
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
        warnings.filterwarnings("ignore", message="Exporting a model to ONNX with a batch_size other than 1")
        torch.onnx.export(
            model,
            (example,),
            sink,
            dynamo=False,
            opset_version=OPSET,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            **options,
        )


def with_parameters(graph: bytes, flat: np.ndarray, layout: Layout) -> bytes:
    """The evaluation graph ``graph`` with the flat parameter vector ``flat`` (``layout``'s order) baked in as
    initializers: an ONNX model like ``export_onnx``'s, with the constant weights onnxruntime's optimizations need (fed
    as inputs instead, the CNN's evaluation takes about twice the CPU). Raises ModelError when ``flat`` does not fit
    ``layout``."""
    flat = np.asarray(flat, dtype=np.float32)
    expected = sum(int(np.prod(shape)) for _, shape in layout)
    if flat.ndim != 1 or flat.size != expected:
        raise ModelError(f"parameter vector has shape {flat.shape}, the model needs ({expected},)")
    model = onnx.load_from_string(graph)
    at = 0
    for name, shape in layout:
        size = int(np.prod(shape))
        model.graph.initializer.append(numpy_helper.from_array(flat[at : at + size].reshape(shape), name))
        at += size
    kept = [value for value in model.graph.input if value.name == INPUT_NAME]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model.SerializeToString()


def inference_session(model: str | bytes, threads: int = 0) -> ort.InferenceSession:
    """A CPU session of an ONNX model (a path or its bytes) with ``threads`` intra-op threads (0: onnxruntime's
    default, one per core) and one inter-op thread. With one, onnxruntime makes no thread of its own: the work
    runs on the thread that calls ``run`` (at that thread's priority)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def scores(logits: np.ndarray, y: np.ndarray) -> tuple[float, int]:
    """Summed cross-entropy (torch's ``cross_entropy``, summed in float64) and the count of correct predictions of
    class ``logits`` (N, classes) for labels ``y``."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=1))
    loss = log_sum - shifted[np.arange(len(y)), y]
    return float(loss.sum()), int((logits.argmax(axis=1) == y).sum())


def quantize_int8(fp32_path: Path, int8_path: Path) -> Path:
    """Dynamic int8 quantization with onnxruntime: int8 weights (QInt8), activations quantized to uint8 at run
    time per tensor. Returns ``int8_path``.

    The graph first goes through onnxruntime's own quantization pre-processing (ONNX shape inference and graph
    optimization); symbolic shape inference is skipped, as the shapes are static but for the batch axis and it
    costs seconds of sympy import.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory(prefix="edgefl-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(prepared, Path(int8_path), weight_type=QuantType.QInt8)
    return Path(int8_path)


class OnnxClassifier:
    """An ONNX Runtime CPU session of an exported edgefl model (fp32 or int8)."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        """``threads``: intra-op threads of the session; 0 leaves onnxruntime's default (one per core)."""
        self.session = inference_session(str(path), threads)

    def predict_logits(self, x: np.ndarray) -> np.ndarray:
        """Class logits (N, classes) for a batch of inputs in the data set's layout and dtype."""
        runs = (
            self.session.run([OUTPUT_NAME], {INPUT_NAME: x[start : start + EVAL_BATCH]})[0]
            for start in range(0, len(x), EVAL_BATCH)
        )
        return np.concatenate(list(runs))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Mean cross-entropy and accuracy on (x, y), with the same loss function as ``ml.trainer.evaluate``."""
        loss, correct = scores(self.predict_logits(x), y)
        return loss / len(y), correct / len(y)
