"""The decoded idx files cached on disk (``ml.data._read_idx``): what a load reads from the cache is what it reads
from the idx files, whole or a device's rows; a changed file is decoded again; a cache that cannot be written is
skipped; a broken file is refused, not cached."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_data import write_idx, write_mnist_dir

from contract.settings import parse_partition
from ml.data import DataError, load_dataset, load_partition
from ml.partition import partition_indices
from tests.conftest import REPO


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "edgefl" / "idx"


def test_a_cached_load_is_the_decoded_one(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    arrays = write_mnist_dir(data, np.random.default_rng(3), gz=True)
    first = load_dataset("mnist", str(data))
    assert len(list(cache.glob("*.counts.npy"))) == 4 and len(list(cache.glob("*.npy"))) == 8
    assert not list(cache.glob("*partial*"))
    (images,) = cache.glob("train-images-idx3-ubyte.gz-*[0-9a-f].npy")
    np.testing.assert_array_equal(np.load(images), arrays["train-images-idx3-ubyte"])
    counts = np.load(images.with_name(f"{images.stem}.counts.npy"))  # the histogram the normalization comes from
    np.testing.assert_array_equal(counts, np.bincount(arrays["train-images-idx3-ubyte"].ravel(), minlength=256))
    rows = partition_indices(first, parse_partition("iid"), 3, seed=0)[2]
    part = load_partition("mnist", str(data), parse_partition("iid"), 3, 0, 2)  # read from the cache
    np.testing.assert_array_equal(part.x_train.raw, first.x_train.raw[rows])
    assert (part.x_train.mean, part.x_train.std) == (first.x_train.mean, first.x_train.std)

    np.save(images, np.zeros((30, 28, 28), np.uint8))  # what a load returns now comes from the cache
    assert not load_dataset("mnist", str(data)).x_train.raw.any()


def test_a_cache_without_its_histogram_is_read_whole_once(tmp_path: Path, cache: Path) -> None:
    """A cache written before histograms were kept beside it: read whole once (the histogram needs every byte),
    its histogram saved; the rows are the same either way."""
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_dir(data, np.random.default_rng(6), gz=False)
    first = load_dataset("mnist", str(data))
    for counts in cache.glob("*.counts.npy"):
        counts.unlink()
    again = load_dataset("mnist", str(data))
    assert len(list(cache.glob("*.counts.npy"))) == 4
    np.testing.assert_array_equal(again.x_train.raw, first.x_train.raw)
    assert (again.x_train.mean, again.x_train.std) == (first.x_train.mean, first.x_train.std)


def test_a_changed_file_is_decoded_again(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_dir(data, np.random.default_rng(1), gz=False)
    load_dataset("mnist", str(data))
    changed = write_mnist_dir(data, np.random.default_rng(2), gz=False)
    os.utime(data / "train-images-idx3-ubyte", ns=(1, 1))  # a new modification time, whatever the clock's grain
    np.testing.assert_array_equal(load_dataset("mnist", str(data)).x_train.raw, changed["train-images-idx3-ubyte"])


def test_an_unwritable_cache_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    data = tmp_path / "mnist"
    data.mkdir()
    arrays = write_mnist_dir(data, np.random.default_rng(4), gz=True)
    np.testing.assert_array_equal(load_dataset("mnist", str(data)).x_test.raw, arrays["t10k-images-idx3-ubyte"])


def test_a_truncated_file_is_refused_and_not_cached(tmp_path: Path, cache: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_dir(data, np.random.default_rng(5), gz=False)
    images = data / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated"):
        load_dataset("mnist", str(data))
    assert not list(cache.glob("train-images*"))


def test_a_devices_rows_come_from_the_cache_without_mapping_the_whole_split(tmp_path: Path, cache: Path) -> None:
    """A device's peak resident memory grows by its rows, not by the cached split: pages of a mapped file that a
    fancy index touches count in VmHWM (a map of Fashion-MNIST's cache took an agent from 308 to 359 MB; here the
    map grew the peak 56.6 MiB for 5.6 MiB of rows, reading the cache a MB at a time 18.6, ~13 of it the reading
    code's own first use)."""
    data = tmp_path / "mnist"
    data.mkdir()
    rng = np.random.default_rng(5)
    write_idx(data / "train-images-idx3-ubyte", rng.integers(0, 256, (60_000, 28, 28)))  # 44.9 MiB, as Fashion-MNIST
    write_idx(data / "train-labels-idx1-ubyte", np.arange(60_000) % 10)
    write_idx(data / "t10k-images-idx3-ubyte", rng.integers(0, 256, (10, 28, 28)))
    write_idx(data / "t10k-labels-idx1-ubyte", np.arange(10) % 10)
    load_dataset("mnist", str(data))  # decoded and cached, in this process
    measured = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os
            from contract.settings import parse_partition
            from ml.data import load_partition
            def hwm_mb():
                line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
                return int(line.split()[1]) / 1024
            before = hwm_mb()
            part = load_partition("mnist", {str(data)!r}, parse_partition("iid"), 8, 0, 3)
            print(hwm_mb() - before, part.x_train.raw.nbytes / 2**20)
        """)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(cache.parents[1])},
        timeout=120, check=True,
    )  # fmt: skip
    grown_mb, rows_mb = map(float, measured.stdout.split())
    split_mb = 60_000 * 28 * 28 / 2**20
    assert rows_mb == pytest.approx(split_mb / 8, rel=0.01)
    assert grown_mb < rows_mb + split_mb / 2, f"the peak grew {grown_mb:.1f} MiB for {rows_mb:.1f} MiB of rows"
