"""Models have the right output shapes and sizes, are fully described by their flat parameter vector, are
seeded, and export to ONNX with the same outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from ml.catalog import MODELS
from ml.data import CHAR_VOCAB, SEQ_LEN, Dataset, load_dataset
from ml.models import ModelError, build_model, get_flat_params, param_layout, set_flat_params
from ml.onnx import OnnxClassifier, export_onnx


def image_set(side: int, num_classes: int = 10, channels: int = 1) -> Dataset:
    """Random normalized images of the given size; only shapes matter to the models."""
    rng = np.random.default_rng(side)
    x = rng.standard_normal((6, channels, side, side)).astype(np.float32)
    y = np.arange(6, dtype=np.int64) % num_classes
    return Dataset(f"images-{side}", "image", x, y, x, y, num_classes, None)


def text_set() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, len(CHAR_VOCAB), (6, SEQ_LEN), dtype=np.int64)
    y = rng.integers(0, len(CHAR_VOCAB), 6, dtype=np.int64)
    return Dataset("chars", "text", x, y, x, y, len(CHAR_VOCAB), np.zeros(6, np.int64))


DATASETS = {
    "digits": lambda: load_dataset("digits"),
    "28x28": lambda: image_set(28),
    "text": text_set,
}


@pytest.fixture(params=sorted(DATASETS))
def dataset(request: pytest.FixtureRequest) -> Dataset:
    return DATASETS[request.param]()


def logits(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x[:]))


def test_forward_gives_one_logit_per_class(dataset: Dataset) -> None:
    model = build_model(dataset, seed=0)
    out = logits(model, dataset.x_train[:5])
    assert out.shape == (5, dataset.num_classes) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_models_are_small_and_have_no_buffers(dataset: Dataset) -> None:
    model = build_model(dataset, seed=0)
    assert 30_000 <= sum(param.numel() for param in model.parameters()) <= 120_000  # fits a Pi 4 easily
    assert list(model.buffers()) == []


@pytest.mark.parametrize("side", [8, 9, 28, 32])
def test_image_model_takes_any_size_from_8(side: int) -> None:
    data = image_set(side, num_classes=4)
    assert logits(build_model(data, seed=0), data.x_train).shape == (6, 4)


@pytest.mark.parametrize(("side", "channels"), [(7, 1), (28, 3)])
def test_unsupported_images_raise_model_error(side: int, channels: int) -> None:
    with pytest.raises(ModelError, match="images must be 1 x H x W"):
        build_model(image_set(side, channels=channels), seed=0)


def test_flat_round_trip_is_exact(dataset: Dataset) -> None:
    source, target = build_model(dataset, seed=1), build_model(dataset, seed=2)
    flat = get_flat_params(source)
    assert flat.dtype == np.float32 and flat.ndim == 1
    assert sum(int(np.prod(shape)) for _, shape in param_layout(source)) == flat.size
    assert [name for name, _ in param_layout(source)] == [name for name, _ in source.named_parameters()]

    set_flat_params(target, flat)
    assert np.array_equal(get_flat_params(target), flat)
    assert torch.equal(logits(source, dataset.x_test), logits(target, dataset.x_test))


def test_flat_vectors_are_copies(dataset: Dataset) -> None:
    model = build_model(dataset, seed=0)
    flat = get_flat_params(model)
    before = flat.copy()
    flat += 1.0
    assert np.array_equal(get_flat_params(model), before)
    set_flat_params(model, flat)
    flat[:] = 0.0
    assert np.array_equal(get_flat_params(model), before + 1.0)


def test_set_flat_params_checks_the_length() -> None:
    model = build_model(load_dataset("digits"), seed=0)
    size = get_flat_params(model).size
    for bad in (
        np.zeros(size - 1, np.float32),
        np.zeros(size + 1, np.float32),
        np.zeros((1, size), np.float32),
    ):
        with pytest.raises(ModelError, match=f"the model needs \\({size},\\)"):
            set_flat_params(model, bad)


def test_seed_decides_the_initial_weights(dataset: Dataset) -> None:
    first = get_flat_params(build_model(dataset, seed=5))
    assert np.array_equal(first, get_flat_params(build_model(dataset, seed=5)))
    assert not np.array_equal(first, get_flat_params(build_model(dataset, seed=6)))


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(text_set(), seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_models_export_to_onnx(dataset: Dataset, tmp_path: Path) -> None:
    model = build_model(dataset, seed=0).eval()
    path = tmp_path / "model.onnx"
    sample = torch.from_numpy(dataset.x_train[:1])
    torch.onnx.export(model, (sample,), path, input_names=["x"], dynamic_axes={"x": {0: "batch"}}, dynamo=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {"x": dataset.x_test[:4]})
    np.testing.assert_allclose(exported, logits(model, dataset.x_test[:4]).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("model", "data", "low", "high"),
    [("resnet8", lambda: image_set(28), 70_000, 85_000), ("leaf-lstm", text_set, 800_000, 840_000)],
)
def test_the_papers_models_train_and_export(model: str, data, low: int, high: int, tmp_path: Path) -> None:
    """ResNet-8 (GroupNorm, no buffers) for images and LEAF's Shakespeare LSTM (embedding 8, 2 x LSTM 256): their
    size, a training step that lowers the loss on a fixed batch, and an ONNX export that answers as torch does."""
    dataset = data()
    net = build_model(dataset, seed=0, model=model)
    assert low <= sum(p.numel() for p in net.parameters()) <= high and list(net.buffers()) == []
    assert logits(net, dataset.x_train[:5]).shape == (5, dataset.num_classes)
    x, y = torch.from_numpy(dataset.x_train[:6]), torch.from_numpy(dataset.y_train[:6])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net.train()(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    path = export_onnx(net.eval(), dataset, tmp_path / f"{model}.onnx")
    np.testing.assert_allclose(
        OnnxClassifier(path, threads=1).predict_logits(dataset.x_test[:4]),
        logits(net, dataset.x_test[:4]).numpy(), rtol=1e-4, atol=1e-4,
    )  # fmt: skip


def test_a_model_that_does_not_fit_the_data_is_one_line() -> None:
    with pytest.raises(ModelError, match=r"^model 'leaf-lstm' takes text data and images-28 is image data"):
        build_model(image_set(28), seed=0, model="leaf-lstm")
    with pytest.raises(ModelError, match=r"^unknown model 'vgg': known models are auto, cnn, resnet8"):
        build_model(text_set(), seed=0, model="vgg")
    assert MODELS.keys() == {"cnn", "resnet8", "char-lstm", "leaf-lstm"}
