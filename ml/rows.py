"""The records a data set is kept in (``Rows``: uint8 as stored; ``Dataset``), and ``DataError``: what
``ml.data`` loads and ``ml.partition`` splits, without either one's imports."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from contract.errors import EdgeflError
from strategies.spec import Spec, label


class DataError(EdgeflError):
    """A user-facing data problem; str(e) is one clear line."""


@dataclass(frozen=True, eq=False)
class Rows:
    """Examples kept in the compact type they are stored in (uint8: a quarter of float32); indexing gives them
    as the model takes them — images normalized to float32 (N, 1, H, W), x = (raw / divisor − mean) / std with
    the training split's mean and standard deviation; text as int64 character ids (``divisor`` 0)."""

    raw: np.ndarray
    divisor: float = 0.0
    mean: float = 0.0
    std: float = 1.0

    def __getitem__(self, index: Any) -> np.ndarray:
        rows = self.raw[index]
        if not self.divisor:
            return rows.astype(np.int64)
        return ((rows[..., None, :, :].astype(np.float32) / self.divisor - self.mean) / self.std).astype(np.float32)

    def __len__(self) -> int:
        return len(self.raw)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.raw), 1, *self.raw.shape[1:]) if self.divisor else self.raw.shape

    def subset(self, index: np.ndarray) -> Rows:
        """These rows only, still compact."""
        return replace(self, raw=self.raw[index])


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded data set: features as ``Rows`` (images, or text as character ids), labels as int64."""

    name: str
    kind: str  # "image" or "text"
    x_train: Rows
    y_train: np.ndarray  # int64 (N,)
    x_test: Rows
    y_test: np.ndarray
    num_classes: int  # classes, or vocabulary size for text
    natural_ids: np.ndarray | None  # per-train-sample natural owner id (int64), None if the set has none


def one_line(err: Exception) -> str:
    """An exception's message with its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(str(err).split())


def check_split(dataset: Dataset, spec: Spec, num_partitions: int) -> None:
    """Refuse a split of ``dataset`` by ``spec`` into ``num_partitions`` that cannot be made, before it is tried
    (the split itself runs where flwr-datasets is imported: a child process, ``ml.data.one_partition``)."""
    scheme = label(spec.name, spec.value)
    if num_partitions < 1:
        raise DataError(f"number of partitions must be at least 1, got {num_partitions}")
    if num_partitions > len(dataset.y_train):
        raise DataError(
            f"{num_partitions} partitions but {dataset.name} has only {len(dataset.y_train)} training samples"
        )
    if spec.name == "pathological" and (spec.value or 0.0) > dataset.num_classes:
        raise DataError(f"{scheme!r}: K must be at most {dataset.num_classes}, the classes of {dataset.name}")
    if spec.name == "natural" and dataset.natural_ids is None:
        raise DataError(f"{dataset.name} has no natural owner ids; the natural scheme needs e.g. shakespeare")
