"""Models have the right output shapes and sizes, are fully described by their flat parameter vector, are
seeded, and export to ONNX with the same outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from ml.data import CHAR_VOCAB, SEQ_LEN, Dataset, load_dataset
from ml.models import ModelError, build_model, get_flat_params, param_layout, set_flat_params


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
