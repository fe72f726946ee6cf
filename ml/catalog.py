"""The models a run may name (``--model``), and which data each fits: one table, without torch, so that a run's
settings are checked when they are parsed. ``ml.models`` builds them.

``auto`` is the data set's small model: the CNN for images, the character LSTM for text. The partition schemes a
run may name (``PARTITIONS``) are here too, so that ``ml.data`` and ``ml.partition`` read the same table."""

from __future__ import annotations

from dataclasses import dataclass

from contract.errors import EdgeflError
from strategies.spec import Parameter

AUTO = "auto"


class ModelError(EdgeflError):
    """A model that does not exist or does not fit the data; str(e) is one clear line."""


@dataclass(frozen=True)
class ModelInfo:
    """One row of the table: the data kind it takes and what it is."""

    name: str
    kind: str  # "image" or "text": ml.data.Dataset.kind
    about: str


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("cnn", "image", "two 3x3 convolutions and two dense layers, ~106k parameters on 28x28"),
        ModelInfo(
            "resnet8", "image",
            "ResNet-8 (He et al. 2016: three stages of one basic block, 16/32/64 channels) with GroupNorm "
            "instead of BatchNorm (Hsieh et al. 2020, for non-IID data), ~78k parameters, ~10x the CNN's step",
        ),
        ModelInfo("char-lstm", "text", "embedding 8, one LSTM layer of 128: ~84k parameters"),
        ModelInfo(
            "leaf-lstm", "text",
            "LEAF's Shakespeare model (Caldas et al. 2018; also McMahan et al. 2017's and the DGA paper's): "
            "embedding 8, two LSTM layers of 256, ~820k parameters",
        ),
    )
}  # fmt: skip
DEFAULT_MODEL = {"image": "cnn", "text": "char-lstm"}
DATASET_KINDS = {"digits": "image", "fashion-mnist": "image", "mnist": "image", "shakespeare": "text"}


def resolve_model(name: str, kind: str, dataset: str) -> ModelInfo:
    """The model ``name`` (or ``auto``) for data of ``kind`` from the data set ``dataset``; raises ModelError for
    an unknown model or one that does not take that data."""
    if name == AUTO:
        return MODELS[DEFAULT_MODEL[kind]]
    info = check_model_name(name)
    if info.kind != kind:
        raise ModelError(
            f"model {name!r} takes {info.kind} data and {dataset} is {kind} data: use one of "
            f"{', '.join(m for m, i in MODELS.items() if i.kind == kind)}"
        )
    return info


def check_model_name(name: str) -> ModelInfo:
    """The row of ``name``; raises ModelError for a name not in the table."""
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}: known models are {AUTO}, {', '.join(MODELS)}") from None


def check_model_for(name: str, dataset: str) -> None:
    """Raise ModelError when ``name`` is unknown, or does not fit the built-in data set ``dataset`` (a hub data
    set's kind is known once it is loaded: ``ml.models.build_model`` checks it then)."""
    if name != AUTO:
        check_model_name(name)
    if dataset in DATASET_KINDS:
        resolve_model(name, DATASET_KINDS[dataset], dataset)


# The partition schemes a run may name (``--partition``, ``ml.partition``): NAME or NAME:VALUE.
PARTITIONS: dict[str, Parameter | None] = {
    "iid": None,
    "dirichlet": Parameter("a concentration ALPHA > 0", lambda alpha: alpha > 0),
    "pathological": Parameter("a whole number K ≥ 1 of classes per client", lambda k: k >= 1, integer=True),
    "natural": None,
}
