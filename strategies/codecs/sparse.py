"""Sparse formats: top-k (Aji & Heafield 2017) and threshold quantization (Strom 2015), both with residuals.

A sparse section is k strictly increasing indices in the narrowest type (uint16 when P ≤ 65536, else uint32)
followed by per-entry data. Indices are validated strictly increasing, hence unique.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from strategies.codecs.base import (
    FORMAT_VERSION,
    Codec,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    Vector,
    check_count,
    check_finite,
    check_scale,
    check_size,
    layout_info,
    read_header,
)
from strategies.codecs.memory import ResidualMemory
from strategies.spec import Parameter

SPARSE_HEADER = struct.Struct("<BIIf")  # version, P, count, scale (top-k, DGC) or τ (threshold)
Indices = npt.NDArray[np.unsignedinteger]


def index_dtype(size: int) -> np.dtype:
    """The narrowest little-endian type that holds every index of a P = size update."""
    return np.dtype("<u2") if size <= 1 << 16 else np.dtype("<u4")


def sparse_values_bytes(count: int, size: int) -> int:
    """Bytes of `count` (index, float16 value) pairs in a P = size update."""
    return count * (index_dtype(size).itemsize + 2)


def pack_sparse(indices: np.ndarray, values: Vector, size: int) -> tuple[float, bytes]:
    """(scale, indices + float16 values/scale) with scale = max|values|, so every stored value is in [−1, 1].

    Scaling keeps float16's 11-bit relative precision for small updates, which would otherwise be subnormal.
    """
    peak = np.abs(values).max() if values.size else np.float32(0)
    scale = np.float32(peak if peak > 0 else 1)
    body = indices.astype(index_dtype(size)).tobytes() + (values / scale).astype("<f2").tobytes()
    return float(scale), body


def unpack_sparse(
    payload: bytes, offset: int, count: int, scale: float, size: int, stype: str
) -> tuple[Indices, Vector]:
    """Validated indices and float32 values of a section written by `pack_sparse`."""
    check_scale(scale, "scale", stype)
    dtype = index_dtype(size)
    indices = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
    check_indices(indices, size, stype)
    stored = np.frombuffer(payload, dtype="<f2", count=count, offset=offset + count * dtype.itemsize)
    with np.errstate(over="ignore"):  # an overflowing product is rejected just below
        values = stored.astype(np.float32) * np.float32(scale)
    check_finite(values, "values", stype)
    return indices, values


def check_indices(indices: Indices, size: int, stype: str) -> None:
    """Indices must lie in [0, P) and strictly increase (no repeats)."""
    if indices.size == 0:
        return
    if int(indices.max()) >= size:
        raise MalformedUpdate(f"{stype}: index {int(indices.max())} out of range for P={size}")
    steps = np.diff(indices.astype(np.int64))
    if (steps == 0).any():
        raise MalformedUpdate(f"{stype}: index {int(indices[1:][steps == 0][0])} is repeated")
    if (steps < 0).any():
        raise MalformedUpdate(f"{stype}: indices are not in increasing order")


def scatter(indices: Indices, values: Vector, size: int) -> Vector:
    """The dense vector with `values` at `indices`."""
    dense = np.zeros(size, dtype=np.float32)
    dense[indices] = values
    return dense


class SparseCompressor(Compressor):
    """Formats that carry (indices, values): the server adds them in O(count), never densifying."""

    def _entries(self, payload: bytes, layout: Layout) -> tuple[Indices, Vector]:
        """The validated (indices, values) of ``payload``; raises MalformedUpdate."""
        raise NotImplementedError

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        return scatter(*self._entries(payload, layout), layout_info(layout).size)


@dataclass(frozen=True)
class TopK(SparseCompressor):
    """Top-k sparsification (Aji & Heafield 2017); pair it with error feedback (ResidualMemory).

    Sends C(v)_i = v_i for the k = max(1, round(ratio·P)) entries of largest |v_i|, 0 elsewhere.
    Wire: header (version, P, k, scale) + k sorted indices + k float16 v_i/scale.
    Size: 13 + k·(index bytes + 2).
    """

    ratio: float = 0.01
    stype = "edgefl.topk.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        k = max(1, round(self.ratio * v.size))
        indices = np.sort(np.argpartition(np.abs(v), v.size - k)[v.size - k :])
        scale, body = pack_sparse(indices, v[indices], v.size)
        return SPARSE_HEADER.pack(FORMAT_VERSION, v.size, k, scale) + body

    def _entries(self, payload: bytes, layout: Layout) -> tuple[Indices, Vector]:
        count, scale = read_header(payload, SPARSE_HEADER, layout, self.stype)
        size = layout_info(layout).size
        check_count(count, 1, size, "entries", self.stype)
        check_size(payload, SPARSE_HEADER.size + sparse_values_bytes(count, size), self.stype)
        return unpack_sparse(payload, SPARSE_HEADER.size, count, scale, size, self.stype)


@dataclass(frozen=True)
class Threshold(SparseCompressor):
    """Threshold quantization (Strom 2015); pair it with error feedback (ResidualMemory).

    Sends C(v)_i = τ·sign(v_i) where |v_i| ≥ τ, 0 elsewhere.
    Wire: header (version, P, count, τ) + count sorted indices + packed sign bits (1 = negative).
    Size: 13 + count·index bytes + ⌈count/8⌉.
    """

    tau: float = 1e-3
    stype = "edgefl.threshold.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        indices = np.flatnonzero(np.abs(v) >= np.float32(self.tau))
        signs = np.packbits(v[indices] < 0).tobytes()
        header = SPARSE_HEADER.pack(FORMAT_VERSION, v.size, indices.size, self.tau)
        return header + indices.astype(index_dtype(v.size)).tobytes() + signs

    def _entries(self, payload: bytes, layout: Layout) -> tuple[Indices, Vector]:
        count, tau = read_header(payload, SPARSE_HEADER, layout, self.stype)
        size = layout_info(layout).size
        check_count(count, 0, size, "entries", self.stype)
        index_bytes = count * index_dtype(size).itemsize
        check_size(payload, SPARSE_HEADER.size + index_bytes + math.ceil(count / 8), self.stype)
        check_scale(tau, "threshold τ", self.stype)
        indices = np.frombuffer(payload, dtype=index_dtype(size), count=count, offset=SPARSE_HEADER.size)
        check_indices(indices, size, self.stype)
        packed = np.frombuffer(payload, dtype=np.uint8, offset=SPARSE_HEADER.size + index_bytes)
        negative = np.unpackbits(packed, count=count).astype(bool)
        return indices, np.where(negative, -np.float32(tau), np.float32(tau))


TOPK = Codec(
    "topk",
    Parameter("a ratio in (0, 1)", lambda x: 0 < x < 1),
    lambda spec, layout, seed, clients: (TopK(spec.value), ResidualMemory(layout_info(layout).size)),
    TopK(),
)
THRESHOLD = Codec(
    "threshold",
    Parameter("a threshold τ > 0", lambda x: x > 0),
    lambda spec, layout, seed, clients: (Threshold(spec.value), ResidualMemory(layout_info(layout).size)),
    Threshold(),
)
