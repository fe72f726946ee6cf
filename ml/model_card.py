"""What the server takes from a torch model, kept on disk so that the ServerApp never imports torch (~2.6 s of
CPU before its first round): the seeded start parameters, their layout and the evaluation graph
(``ml.onnx.evaluation_graph``), one ``ModelCard``.

A card is cached in ``ml.data.cache_dir()/models``, keyed by everything it is made from: the model, the data's
kind, per-example shape, dtype and classes, the seed, torch's version and the source of the modules that build it
(``SOURCES``: a change to a model's code, or to the export and its opset, makes a new card). On a miss it is built
in a short-lived child process, which alone imports torch (and this module imports neither torch nor onnxruntime),
and written whole (a temporary file renamed); a cache that cannot be written is skipped. ``edgefl run``'s pre-run
check fills it, so the ServerApp finds it there."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ml.catalog import AUTO, resolve_model
from ml.data import Dataset, cache_dir, cached_arrays
from strategies.codecs.base import Layout

SOURCES = ("models.py", "onnx.py", "model_card.py")  # in ml/: the code a card is made by (onnx.py: the opset too)


@dataclass(frozen=True, eq=False)
class ModelCard:
    """A model as the server needs it, without torch."""

    params: np.ndarray  # float32 (P,): ml.models.get_flat_params of the model build_model makes
    layout: Layout  # ml.models.param_layout: each parameter's name and shape, in the flat vector's order
    graph: bytes  # ml.onnx.evaluation_graph: the model's ONNX graph with its parameters as inputs


def model_card(dataset: Dataset, seed: int, model: str = AUTO) -> ModelCard:
    """The card of the model ``model`` (a name in ``ml.catalog.MODELS``, or ``auto``) for ``dataset`` seeded with
    ``seed``: read from the cache, else built in a child process (raises ModelError if the model does not fit)."""
    arrays = cached_arrays(card_path(dataset, seed, model), lambda: _arrays(_build_in_child(dataset, seed, model)))
    layout = tuple((name, tuple(shape)) for name, shape in json.loads(str(arrays["layout"])))
    return ModelCard(arrays["params"], layout, arrays["graph"].tobytes())


def _build_in_child(dataset: Dataset, seed: int, model: str) -> ModelCard:
    """``build_card`` in a short-lived child process, the one that imports torch; it is sent the data's shape only."""
    one_row = np.arange(1)  # all the build reads of the data: its kind, classes, and one example's shape and dtype
    shape_only = replace(
        dataset, x_train=dataset.x_train.subset(one_row), y_train=dataset.y_train[:1],
        x_test=dataset.x_test.subset(one_row), y_test=dataset.y_test[:1], natural_ids=None,
    )  # fmt: skip
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(build_card, shape_only, seed, model).result()


def build_card(dataset: Dataset, seed: int, model: str) -> ModelCard:
    """The card made with torch: the model ``ml.models.build_model`` builds, exported."""
    from ml.models import build_model, get_flat_params, param_layout
    from ml.onnx import evaluation_graph

    built = build_model(dataset, seed, model)
    return ModelCard(get_flat_params(built), param_layout(built), evaluation_graph(built, dataset))


def card_path(dataset: Dataset, seed: int, model: str) -> Path:
    """Where the card of (``dataset``, ``seed``, ``model``) is cached: its file name holds the model's name and a
    digest of everything the card is made from."""
    name = resolve_model(model, dataset.kind, dataset.name).name
    made_from = [name, dataset.kind, list(dataset.x_train.shape[1:]), str(dataset.x_test[:1].dtype),
                 dataset.num_classes, seed, version("torch")]  # fmt: skip
    key = hashlib.sha256(json.dumps(made_from).encode())
    for source in SOURCES:
        key.update((Path(__file__).parent / source).read_bytes())
    return cache_dir() / "models" / f"{name}-{key.hexdigest()[:24]}.npz"


def _arrays(card: ModelCard) -> dict[str, np.ndarray]:
    """``card`` as the arrays of its cache entry."""
    layout = np.array(json.dumps(card.layout))
    return {"params": card.params, "layout": layout, "graph": np.frombuffer(card.graph, np.uint8)}
