"""Seeded, deterministic client partitions through flwr-datasets' partitioners, on a small ``datasets.Dataset``
of labels plus a row-index column, so that a partition is just an array of training-row indices.

Importing flwr-datasets costs ~215 MB (HF datasets, pyarrow, pandas): a device's agent computes its partition
with ``ml.data.one_partition``, in a short-lived child process, and never holds them."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import datasets
import numpy as np
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    NaturalIdPartitioner,
    Partitioner,
    PathologicalPartitioner,
)

from ml.rows import DataError, Dataset, check_split, one_line
from strategies.spec import Spec, label

_DIRICHLET_MIN_PARTITION_SIZE = 10


def partition_indices(dataset: Dataset, spec: Spec, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split the training rows into ``num_partitions`` disjoint, sorted int64 index arrays.

    The same (dataset, spec, num_partitions, seed) always gives the same partitions. Schemes (``spec``, parsed
    once with the run's record: ``RunConfig.partition_spec``): ``iid`` (IidPartitioner after a seeded shuffle),
    ``dirichlet:ALPHA`` (per-class Dirichlet(ALPHA) shares), ``pathological:K`` (K classes per client, the first
    one round-robin, the rest seeded random) and ``natural`` (one natural owner id per client, see
    ``_natural_partitions``).
    """
    kind, param, scheme = spec.name, spec.value or 0.0, label(spec.name, spec.value)
    num_samples = len(dataset.y_train)
    check_split(dataset, spec, num_partitions)
    try:
        if kind == "natural":
            return _natural_partitions(dataset.natural_ids, num_partitions, seed)
        table = datasets.Dataset.from_dict({"label": dataset.y_train, "index": np.arange(num_samples)})
        with warnings.catch_warnings():  # the Dirichlet partitioner warns at each of its retries; its error says it
            warnings.simplefilter("ignore", UserWarning)
            return _load_partitions(_label_partitioner(kind, param, num_partitions, seed, table), range(num_partitions))
    except ValueError as err:  # the partitioners' own checks, e.g. too few samples of a class
        raise DataError(
            f"cannot split {dataset.name} into {num_partitions} partitions by {scheme!r}: {one_line(err)}"
        ) from err


class _PathologicalPartitioner(PathologicalPartitioner):
    """flwr-datasets' PathologicalPartitioner, selecting each partition by an index array.

    flwr-datasets 0.6.1 selects by a list of numpy integers, which ``datasets`` fingerprints one element at a
    time through dill (about 1.5 s for Fashion-MNIST); an array is hashed at once. Same partitions.
    """

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """The rows of partition ``partition_id``."""
        self._check_num_partitions_correctness_if_needed()
        self._determine_partition_id_to_indices_if_needed()
        return self.dataset.select(np.asarray(self._partition_id_to_indices[partition_id], dtype=np.int64))


def _label_partitioner(kind: str, param: float, num_partitions: int, seed: int, table: datasets.Dataset) -> Partitioner:
    """The flwr-datasets partitioner for a label-based scheme, attached to ``table``."""
    if kind == "iid":
        partitioner: Partitioner = IidPartitioner(num_partitions)
        table = table.shuffle(seed=seed)
    elif kind == "dirichlet":
        min_size = min(_DIRICHLET_MIN_PARTITION_SIZE, table.num_rows // num_partitions)
        partitioner = DirichletPartitioner(num_partitions, "label", param, min_size, shuffle=False, seed=seed)
    else:
        partitioner = _PathologicalPartitioner(
            num_partitions, "label", int(param), class_assignment_mode="first-deterministic", seed=seed
        )
    partitioner.dataset = table.with_format("arrow")
    return partitioner


def _load_partitions(partitioner: Partitioner, partition_ids: Iterable[int]) -> list[np.ndarray]:
    """The sorted row indices of each requested partition."""
    return [np.sort(np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)) for pid in partition_ids]


def _natural_partitions(natural_ids: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """One natural id per client, through NaturalIdPartitioner.

    Rule: rank the ids by sample count (most first; ties broken by a seeded shuffle), keep the top
    ``num_partitions`` and give them to the clients in a seeded random order. With as many partitions as ids,
    every id is used.
    """
    ids, counts = np.unique(natural_ids, return_counts=True)
    if num_partitions > len(ids):
        raise DataError(f"{num_partitions} partitions but only {len(ids)} natural ids; use at most {len(ids)}")
    rng = np.random.default_rng(seed)
    by_count = np.lexsort((rng.permutation(len(ids)), -counts))
    chosen = rng.permutation(ids[by_count[:num_partitions]])
    rows = np.flatnonzero(np.isin(natural_ids, chosen))
    table = datasets.Dataset.from_dict({"natural_id": natural_ids[rows], "index": rows})
    partitioner = NaturalIdPartitioner(partition_by="natural_id")
    partitioner.dataset = table.with_format("arrow")
    # range(num_partitions) is evaluated first and makes the partitioner build its lazy pid -> natural-id map.
    partition_of_id = {
        int(partitioner.partition_id_to_natural_id[pid]): pid for pid in range(partitioner.num_partitions)
    }
    return _load_partitions(partitioner, [partition_of_id[int(natural_id)] for natural_id in chosen])
