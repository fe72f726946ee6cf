"""``edgefl edge bench MODEL``: inference speed and accuracy of the model on this device in torch eager, ONNX
Runtime fp32 and ONNX Runtime int8 (dynamic quantization), and whether the three agree.

MODEL is a run folder (the model is rebuilt from its config.toml and loaded from its checkpoint.npz) or a
data set name (a freshly initialised model, for a quick look). Latency is the wall time of one batch-1 call
(p50, p95), throughput the samples per second in batches of 64; each of the six measurements gets a sixth of
the time budget after a few warm-up calls. Accuracy is on a fixed, seeded subset of the test set.

Agreement, and why these tolerances:

- fp32 vs torch: max |Δlogit| ≤ 1e-4. Both compute in float32 with different kernels, so they differ only
  by rounding and summation order: float32 keeps about 7 significant digits, logits are of order 10, and the
  rounding accumulated over the hundreds to thousands of terms behind each logit stays near 1e-5 (measured
  here: at most 1e-5 for the trained CNN and LSTM). 1e-4 leaves a margin of 10 and still catches a real
  difference between the graphs (a wrong op or weight), which moves logits by 1e-2 or more.
- int8 vs fp32: top-1 agreement ≥ 97% and accuracy within 2 points. Dynamic quantization rounds weights to
  int8 (per tensor) and activations to uint8 at run time; measured here on trained models that moves a
  sample's logits by 0.3% of their range (median; 1% at the 99th percentile), so only samples whose two best
  classes are that close can flip: 0.1-0.8% of them for the CNN on digits and Fashion-MNIST and the LSTM.
  97% allows several times that; flips go both ways, so accuracy moves less than agreement does, and a change
  of more than 2 points would mean quantization broke a layer, not rounding.
"""

from __future__ import annotations

import copy
import os
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from contract.devices import TrainStep, profile_record
from contract.kernels import DEVICE, KernelSpeeds, dgemm_gflops, nbody_s_per_step
from contract.run_folder import RunFolder
from contract.settings import ConfigError, load_config
from ml.catalog import AUTO, resolve_model
from ml.data import DATASET_NAMES, HF_PREFIX, DataError, Dataset, load_dataset
from ml.models import ModelError, build_model, set_flat_params
from ml.onnx import EVAL_BATCH, OnnxClassifier, export_onnx, quantize_int8
from ml.trainer import seconds_per_step

if TYPE_CHECKING:
    from edge.devices import DeviceCaps

FP32_MAX_LOGIT_DIFF = 1e-4
INT8_MIN_TOP1_AGREEMENT = 0.97
INT8_MAX_ACCURACY_DELTA = 0.02
THROUGHPUT_BATCH = 64
EVAL_SAMPLES = 2000
WARMUP_CALLS = 3
MIN_TIMED_CALLS = 5
FRESH_MODEL_SEED = 0

Predict = Callable[[np.ndarray], np.ndarray]


class BenchError(DataError):
    """MODEL is not something ``edgefl edge bench`` can load; str(e) is one clear line."""


@dataclass(frozen=True)
class BenchTarget:
    """The model to benchmark, its data set, and a one-line description of where it came from."""

    model: nn.Module
    dataset: Dataset
    label: str
    model_name: str  # ml.catalog's name, resolved from auto


@dataclass(frozen=True)
class BackendResult:
    backend: str
    latency_p50_ms: float
    latency_p95_ms: float
    throughput: float  # samples/s at THROUGHPUT_BATCH
    accuracy: float
    size_bytes: int


@dataclass(frozen=True)
class BenchReport:
    target: str
    threads: int
    eval_samples: int
    test_samples: int
    results: tuple[BackendResult, ...]  # torch, onnxruntime fp32, onnxruntime int8
    fp32_max_logit_diff: float
    int8_top1_agreement: float
    int8_accuracy_delta: float  # int8 accuracy minus fp32 accuracy

    @property
    def fp32_agrees(self) -> bool:
        return self.fp32_max_logit_diff <= FP32_MAX_LOGIT_DIFF

    @property
    def int8_agrees(self) -> bool:
        return (
            self.int8_top1_agreement >= INT8_MIN_TOP1_AGREEMENT
            and abs(self.int8_accuracy_delta) <= INT8_MAX_ACCURACY_DELTA
        )


def load_target(spec: str, data_dir: str | None = None, model: str = AUTO) -> BenchTarget:
    """A run folder's trained model, or a fresh ``model`` (``ml.catalog``) for a data set name (``data_dir`` as in
    ``load_dataset``)."""
    path = Path(spec)
    if path.is_dir():
        return _run_target(path)
    if spec in DATASET_NAMES or spec.startswith(HF_PREFIX):
        dataset = load_dataset(spec, data_dir)
        name = resolve_model(model, dataset.kind, dataset.name).name
        label = f"fresh {name} for {dataset.name}"
        return BenchTarget(build_model(dataset, FRESH_MODEL_SEED, model), dataset, label, name)
    if path.exists() or "/" in spec:
        raise BenchError(f"{spec} is not a run folder: {'it is a file' if path.exists() else 'no such folder'}")
    raise BenchError(
        f"{spec!r} is neither a run folder nor a data set: give a run folder or one of {', '.join(DATASET_NAMES)}"
    )


def _run_target(run_dir: Path) -> BenchTarget:
    """The global model of the run in ``run_dir``, rebuilt from its config.toml and checkpoint.npz."""
    folder = RunFolder(run_dir)
    missing = [path.name for path in (folder.config_path, folder.checkpoint_path) if not path.is_file()]
    if missing:
        raise BenchError(f"{run_dir} is not a run folder with a model: it has no {' and no '.join(missing)}")
    try:
        config = load_config(folder.config_path)
    except ConfigError as err:
        raise BenchError(f"{run_dir}: {err}") from None
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed, config.model)
    try:
        checkpoint = folder.read_checkpoint()
        if checkpoint is None:
            raise FileNotFoundError(f"{folder.checkpoint_path} does not exist")
        set_flat_params(model, checkpoint.params)
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, ModelError) as err:
        raise BenchError(f"{folder.checkpoint_path} does not hold this run's model: {err}") from None
    label = f"run {run_dir} (global model after round {checkpoint.round})"
    return BenchTarget(model, dataset, label, config.step_key[0])


def device_figures(target: BenchTarget, batch_size: int, name: str, cap: DeviceCaps) -> dict:
    """This device's own figures, as a device profile file holds them (``contract.devices.profile_record``): DGEMM
    and a local step of the target's model at ``batch_size`` on one thread of its training core, CPython's n-body
    on a messaging core (``cap``'s roles: an emulated device's; on a real device, where nothing is capped, its own
    cores)."""
    if batch_size < 1:
        raise BenchError(f"--batch-size must be at least 1, got {batch_size}")
    thread = threading.get_native_id()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cap.place_thread("train", thread)
        dgemm = dgemm_gflops()
        model = copy.deepcopy(target.model).train()
        step_s = seconds_per_step(model, target.dataset, batch_size, 0.01, 0.0, FRESH_MODEL_SEED, DEVICE.window_s)
        cap.place_thread("agent", thread)
        nbody = nbody_s_per_step()
    finally:
        torch.set_num_threads(previous_threads)
    step = TrainStep(target.model_name, target.dataset.name, batch_size, step_s)
    cores = cap.shares.cores if cap.path is not None else os.cpu_count() or 1
    return profile_record(name, KernelSpeeds(dgemm, nbody), step, cores)


def run_bench(target: BenchTarget, seconds: float, threads: int = 1) -> BenchReport:
    """Time and evaluate the three back ends on ``threads`` CPU threads within about ``seconds`` of timing
    (the model is put in eval mode)."""
    dataset, model = target.dataset, target.model.eval()
    # A seeded subset, so that every back end and every run sees the same samples.
    rows = np.sort(np.random.default_rng(0).permutation(len(dataset.y_test))[:EVAL_SAMPLES])
    x, y = dataset.x_test[rows], dataset.y_test[rows]
    budget_s = seconds / 6
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
            fp32_path = export_onnx(model, dataset, Path(tmp) / "model.onnx")
            int8_path = quantize_int8(fp32_path, Path(tmp) / "model.int8.onnx")
            backends: list[tuple[str, Predict, int]] = [
                ("torch eager", lambda batch: _torch_logits(model, batch), _param_bytes(model)),
                ("onnxruntime fp32", OnnxClassifier(fp32_path, threads).predict_logits, fp32_path.stat().st_size),
                ("onnxruntime int8", OnnxClassifier(int8_path, threads).predict_logits, int8_path.stat().st_size),
            ]
            logits = [predict(x) for _, predict, _ in backends]
            results = tuple(
                _measure(name, predict, size, x, y, eval_logits, budget_s)
                for (name, predict, size), eval_logits in zip(backends, logits, strict=True)
            )
    finally:
        torch.set_num_threads(previous_threads)
    torch_logits, fp32_logits, int8_logits = logits
    return BenchReport(
        target=target.label,
        threads=threads,
        eval_samples=len(y),
        test_samples=len(dataset.y_test),
        results=results,
        fp32_max_logit_diff=float(np.max(np.abs(fp32_logits - torch_logits))),
        int8_top1_agreement=float(np.mean(int8_logits.argmax(axis=1) == fp32_logits.argmax(axis=1))),
        int8_accuracy_delta=results[2].accuracy - results[1].accuracy,
    )


@torch.inference_mode()
def _torch_logits(model: nn.Module, x: np.ndarray) -> np.ndarray:
    """Logits of torch eager, in chunks of EVAL_BATCH rows like OnnxClassifier."""
    return np.concatenate(
        [model(torch.from_numpy(x[start : start + EVAL_BATCH])).numpy() for start in range(0, len(x), EVAL_BATCH)]
    )


def _param_bytes(model: nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def _measure(
    name: str, predict: Predict, size: int, x: np.ndarray, y: np.ndarray, logits: np.ndarray, budget_s: float
) -> BackendResult:
    latencies = _call_times(predict, [x[i : i + 1] for i in range(len(x))], budget_s)
    batches = [x[i : i + THROUGHPUT_BATCH] for i in range(0, len(x) - THROUGHPUT_BATCH + 1, THROUGHPUT_BATCH)]
    batch_times = _call_times(predict, batches, budget_s)
    return BackendResult(
        backend=name,
        latency_p50_ms=float(np.percentile(latencies, 50) * 1e3),
        latency_p95_ms=float(np.percentile(latencies, 95) * 1e3),
        throughput=THROUGHPUT_BATCH * len(batch_times) / float(np.sum(batch_times)),
        accuracy=float(np.mean(logits.argmax(axis=1) == y)),
        size_bytes=size,
    )


def _call_times(predict: Predict, inputs: list[np.ndarray], budget_s: float) -> np.ndarray:
    """Wall time of each call of ``predict`` on ``inputs`` in turn (cycling), after WARMUP_CALLS untimed calls,
    until ``budget_s`` is spent and at least MIN_TIMED_CALLS were timed."""
    for batch in inputs[:WARMUP_CALLS]:
        predict(batch)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < MIN_TIMED_CALLS or time.perf_counter() < deadline:
        batch = inputs[len(times) % len(inputs)]
        start = time.perf_counter()
        predict(batch)
        times.append(time.perf_counter() - start)
    return np.asarray(times)


def format_report(report: BenchReport) -> str:
    """The report as a table plus the two agreement checks, one line each."""
    threads = f"{report.threads} thread" + ("s" if report.threads != 1 else "")
    lines = [
        f"{report.target}, {threads}",
        f"{'back end':<18}{'p50 ms':>9}{'p95 ms':>9}{f'batch-{THROUGHPUT_BATCH} samples/s':>22}"
        f"{'accuracy':>10}{'size kB':>9}",
    ]
    for result in report.results:
        lines.append(
            f"{result.backend:<18}{result.latency_p50_ms:>9.3f}{result.latency_p95_ms:>9.3f}"
            f"{result.throughput:>22,.0f}{result.accuracy:>10.4f}{result.size_bytes / 1e3:>9.1f}"
        )
    lines += [
        f"accuracy on {report.eval_samples} of {report.test_samples} test samples (a fixed, seeded subset)",
        f"fp32 vs torch: max |Δlogit| {report.fp32_max_logit_diff:.1e} (tolerance {FP32_MAX_LOGIT_DIFF:.0e}): "
        + ("ok" if report.fp32_agrees else "DISAGREE"),
        f"int8 vs fp32: top-1 agreement {report.int8_top1_agreement:.1%} (at least {INT8_MIN_TOP1_AGREEMENT:.0%}), "
        f"accuracy {100 * report.int8_accuracy_delta:+.1f} points (within {100 * INT8_MAX_ACCURACY_DELTA:.0f}): "
        + ("ok" if report.int8_agrees else "DISAGREE"),
    ]
    return "\n".join(lines)
