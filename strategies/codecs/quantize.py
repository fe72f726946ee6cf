"""Quantizers: 1-bit SGD (Seide 2014), TernGrad (Wen 2017), stochastic rounding (QSGD 2017; int8)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from strategies.codecs.base import (
    DENSE_HEADER,
    FORMAT_VERSION,
    Codec,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    Vector,
    check_finite,
    check_size,
    layout_info,
    matrix_shape,
    read_header,
)
from strategies.codecs.memory import Memory, ResidualMemory
from strategies.spec import Parameter

QUANTIZER_HEADER = struct.Struct("<BII")  # version, P, levels
QSGD_STYPE = "edgefl.qsgd.v1"
INT8_STYPE = "edgefl.int8.v1"
MAX_LEVELS = 32767
TERNARY_VALUES = np.array([0, 1, -1], dtype=np.float32)  # 2-bit codes 0, 1, 2; code 3 is invalid


@dataclass(frozen=True)
class Column:
    """A tensor as an m×n matrix at `start`; `quantized` when its columns have ≥ 3 entries."""

    start: int
    rows: int
    cols: int
    quantized: bool


@lru_cache(maxsize=32)
def onebit_plan(layout: Layout) -> tuple[Column, ...]:
    """Per tensor: 1 bit per entry + 2 float32 per column costs less than float32 exactly when m ≥ 3."""
    info = layout_info(layout)
    return tuple(
        Column(int(start), *matrix_shape(shape), quantized=matrix_shape(shape)[0] >= 3)
        for start, shape in zip(info.starts, info.shapes, strict=True)
    )


def onebit_payload_size(layout: Layout) -> int:
    """5 + 4·(2 scales per column of quantized tensors + entries of the others) + ⌈quantized entries / 8⌉."""
    plan = onebit_plan(layout)
    floats = sum(2 * c.cols if c.quantized else c.rows * c.cols for c in plan)
    bits = sum(c.rows * c.cols for c in plan if c.quantized)
    return DENSE_HEADER.size + 4 * floats + math.ceil(bits / 8)


class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014); pair it with error feedback (ResidualMemory).

    Each tensor viewed as a matrix [shape[0], prod(shape[1:])] (a 1-D tensor as one column) sends per column
    j the sign bit of every entry and two float32 scales, the mean of the non-negative and of the negative
    entries (the reconstruction that minimises the squared error given the signs; column sums are kept):
        C(v)_ij = a_j if v_ij ≥ 0 else b_j,   a_j = mean{v_ij ≥ 0},   b_j = mean{v_ij < 0}.
    Tensors with columns of fewer than 3 entries are sent as float32 (that is cheaper).
    Wire: header (version, P) + float32 per tensor in layout order (a then b, or the entries) + packed sign
    bits of the quantized tensors (1 = non-negative). Size: `onebit_payload_size`.
    """

    stype = "edgefl.onebit.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        floats, signs = [], []
        for column in onebit_plan(layout):
            entries = v[column.start : column.start + column.rows * column.cols]
            if not column.quantized:
                floats.append(entries)
                continue
            matrix = entries.reshape(column.rows, column.cols)
            positive = matrix >= 0
            count = positive.sum(axis=0)
            floats.append(np.where(positive, matrix, 0).sum(axis=0) / np.maximum(count, 1))
            floats.append(np.where(positive, 0, matrix).sum(axis=0) / np.maximum(column.rows - count, 1))
            signs.append(positive.ravel())
        bits = np.packbits(np.concatenate(signs)) if signs else np.zeros(0, dtype=np.uint8)
        header = DENSE_HEADER.pack(FORMAT_VERSION, v.size)
        return header + np.concatenate(floats).astype("<f4").tobytes() + bits.tobytes()

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        read_header(payload, DENSE_HEADER, layout, self.stype)
        check_size(payload, onebit_payload_size(layout), self.stype)
        plan = onebit_plan(layout)
        float_count = sum(2 * c.cols if c.quantized else c.rows * c.cols for c in plan)
        floats = np.frombuffer(payload, dtype="<f4", count=float_count, offset=DENSE_HEADER.size)
        check_finite(floats, "scales and dense entries", self.stype)
        packed = np.frombuffer(payload, dtype=np.uint8, offset=DENSE_HEADER.size + 4 * float_count)
        bits = np.unpackbits(packed).astype(bool)
        out = np.empty(layout_info(layout).size, dtype=np.float32)
        float_cursor = bit_cursor = 0
        for column in plan:
            size = column.rows * column.cols
            if column.quantized:
                a = floats[float_cursor : float_cursor + column.cols]
                b = floats[float_cursor + column.cols : float_cursor + 2 * column.cols]
                positive = bits[bit_cursor : bit_cursor + size].reshape(column.rows, column.cols)
                out[column.start : column.start + size] = np.where(positive, a, b).ravel()
                float_cursor, bit_cursor = float_cursor + 2 * column.cols, bit_cursor + size
            else:
                out[column.start : column.start + size] = floats[float_cursor : float_cursor + size]
                float_cursor += size
        return out


def pack_2bit(codes: np.ndarray) -> bytes:
    """Four 2-bit codes per byte, the first in the low bits."""
    padded = np.zeros(-(-codes.size // 4) * 4, dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | quads[:, 1] << 2 | quads[:, 2] << 4 | quads[:, 3] << 6).tobytes()


def unpack_2bit(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_2bit`."""
    return ((packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).ravel()[:count]


class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017), unbiased, no error feedback: per tensor t with s_t = max_i |v_i|,

        C(v)_i = s_t · sign(v_i) · b_i,   b_i ~ Bernoulli(|v_i| / s_t),   E[C(v)_i] = v_i.

    Wire: header (version, P) + T float32 s_t + P 2-bit codes (0 → 0, 1 → +s_t, 2 → −s_t) packed 4 per byte.
    Size: 5 + 4·T + ⌈P/4⌉.
    """

    stype = "edgefl.terngrad.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        info = layout_info(layout)
        magnitude = np.abs(v)
        scales = np.maximum.reduceat(magnitude, info.starts)
        sent = state.rng.random(v.size) * np.repeat(scales, info.sizes) < magnitude
        codes = (sent * (1 + (v < 0))).astype(np.uint8)
        return DENSE_HEADER.pack(FORMAT_VERSION, v.size) + scales.astype("<f4").tobytes() + pack_2bit(codes)

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        read_header(payload, DENSE_HEADER, layout, self.stype)
        info = layout_info(layout)
        tensors = info.sizes.size
        check_size(payload, DENSE_HEADER.size + 4 * tensors + math.ceil(info.size / 4), self.stype)
        scales = np.frombuffer(payload, dtype="<f4", count=tensors, offset=DENSE_HEADER.size)
        check_scales(scales, self.stype)
        packed = np.frombuffer(payload, dtype=np.uint8, offset=DENSE_HEADER.size + 4 * tensors)
        codes = unpack_2bit(packed, info.size)
        if (codes == 3).any():
            raise MalformedUpdate(f"{self.stype}: invalid ternary code 3 at index {int(np.argmax(codes == 3))}")
        return np.repeat(scales, info.sizes) * TERNARY_VALUES[codes]


def check_scales(scales: np.ndarray, stype: str) -> None:
    """Per-tensor scales must be finite and non-negative."""
    check_finite(scales, "scales", stype)
    if (scales < 0).any():
        raise MalformedUpdate(f"{stype}: negative scale {float(scales.min())}")


def level_dtype(levels: int) -> np.dtype:
    """The narrowest signed type that holds ±levels."""
    return np.dtype("i1") if levels <= 127 else np.dtype("<i2")


@dataclass(frozen=True)
class StochasticQuantizer(Compressor):
    """Unbiased stochastic rounding to L levels per tensor (QSGD, Alistarh et al. 2017; int8):

        C(v)_i = s_t · sign(v_i) · ξ_i / L,   ξ_i = ⌊x_i⌋ + Bernoulli(x_i − ⌊x_i⌋),   x_i = L·|v_i| / s_t,
        E[C(v)_i] = v_i,   with s_t = ‖v_t‖₂ (QSGD, norm "l2") or s_t = max|v_t| (int8, norm "max", L = 127).

    Wire: header (version, P, L) + T float32 s_t + P signed ±ξ_i in the narrowest type (int8 for L ≤ 127,
    else int16). Size: 9 + 4·T + P·(1 or 2).
    """

    stype: str = QSGD_STYPE
    levels: int = 16
    norm: Literal["l2", "max"] = "l2"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        info = layout_info(layout)
        magnitude = np.abs(v)
        if self.norm == "l2":
            scales = np.sqrt(np.add.reduceat(np.square(v, dtype=np.float64), info.starts)).astype(np.float32)
        else:
            scales = np.maximum.reduceat(magnitude, info.starts)
        per_entry = np.repeat(scales, info.sizes).astype(np.float64)
        x = np.divide(self.levels * magnitude, per_entry, out=np.zeros(v.size), where=per_entry > 0)
        x = np.minimum(x, self.levels)  # float rounding of ‖v‖ must not push x past L
        lower = np.floor(x)
        xi = lower + (state.rng.random(v.size) < x - lower)
        signed = np.where(v < 0, -xi, xi).astype(level_dtype(self.levels))
        header = QUANTIZER_HEADER.pack(FORMAT_VERSION, v.size, self.levels)
        return header + scales.astype("<f4").tobytes() + signed.tobytes()

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        (levels,) = read_header(payload, QUANTIZER_HEADER, layout, self.stype)
        if not 1 <= levels <= MAX_LEVELS:
            raise MalformedUpdate(f"{self.stype}: {levels} levels is outside [1, {MAX_LEVELS}]")
        info = layout_info(layout)
        tensors, dtype = info.sizes.size, level_dtype(levels)
        check_size(payload, QUANTIZER_HEADER.size + 4 * tensors + dtype.itemsize * info.size, self.stype)
        scales = np.frombuffer(payload, dtype="<f4", count=tensors, offset=QUANTIZER_HEADER.size)
        check_scales(scales, self.stype)
        xi = np.frombuffer(payload, dtype=dtype, offset=QUANTIZER_HEADER.size + 4 * tensors)
        if np.abs(xi.astype(np.int32)).max() > levels:
            raise MalformedUpdate(f"{self.stype}: a quantized value exceeds ±{levels} levels")
        with np.errstate(over="ignore"):  # rejected just below if not finite
            out = xi * np.repeat(scales / np.float32(levels), info.sizes)
        check_finite(out, "decoded entries", self.stype)
        return out


ONEBIT = Codec(
    "onebit", None, lambda spec, layout, seed, clients: (OneBit(), ResidualMemory(layout_info(layout).size)), OneBit()
)
TERNGRAD = Codec("terngrad", None, lambda spec, layout, seed, clients: (TernGrad(), Memory()), TernGrad())
INT8 = Codec(
    "int8",
    None,
    lambda spec, layout, seed, clients: (StochasticQuantizer(INT8_STYPE, 127, "max"), Memory()),
    StochasticQuantizer(INT8_STYPE, 127, "max"),
)
QSGD = Codec(
    "qsgd",
    Parameter(f"an integer number of levels in [1, {MAX_LEVELS}]", lambda x: 1 <= x <= MAX_LEVELS, integer=True),
    lambda spec, layout, seed, clients: (StochasticQuantizer(QSGD_STYPE, int(spec.value), "l2"), Memory()),
    StochasticQuantizer(),
)
