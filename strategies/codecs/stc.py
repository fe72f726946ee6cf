"""Sparse Ternary Compression (Sattler et al. 2019, "Robust and Communication-Efficient Federated Learning from
Non-IID Data", Algorithm 1): top-k, ternarized to one magnitude, positions Golomb (Rice) coded.

    k = max(1, round(p·P)),   T = the k entries of largest |v_i|,   μ = (1/k)·Σ_{i∈T} |v_i|
    STC(v)_i = μ·sign(v_i) for i ∈ T, 0 elsewhere

Pair it with error feedback (ResidualMemory) on the client; the server's broadcast keeps its own (see
``strategies.downlink``), so STC compresses both directions as the paper does. A client that has missed rounds
gets the chain of the broadcast deltas since the round it holds, or the dense model when that is smaller (the
paper's caching rule for clients that skip rounds).

Wire ``edgefl.stc.v1``: header (version, P, k, μ, b) + the k positions as gaps d_0 = i_0,
d_j = i_j − i_{j−1} − 1, each Rice coded with parameter b (quotient ⌊d/2^b⌋ in unary as that many 1 bits and a
0, then the b low bits, most significant first), zero-padded to a byte + k sign bits (1 = negative), zero-padded.
The paper's optimal b for density p (positions at random are geometric gaps; φ the golden ratio):

    b* = 1 + ⌊log2( log(φ − 1) / log(1 − p) )⌋

capped at the most k positions among P can use (``max_rice_bits``: a density below 1/P would ask for more).
A decoder refuses a larger b, and a stream longer than k such codes can take (``max_stream_bits``), before it
reads a bit, so a payload costs the server no more than its own length.

Size: 14 + ⌈Σ_j (⌊d_j/2^b⌋ + 1 + b) / 8⌉ + ⌈k/8⌉, about k·(b* + 3)/8 bytes: ~5x fewer than top-k's
(uint32 index, float16) pairs for the same k (1,220 against 6,367 bytes at 1 % of a 105.8k-entry model).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from strategies.codecs.base import (
    FORMAT_VERSION,
    Codec,
    CompressorState,
    Layout,
    MalformedUpdate,
    Vector,
    check_count,
    layout_info,
    read_header,
)
from strategies.codecs.memory import ResidualMemory
from strategies.codecs.sparse import Indices, SparseCompressor, index_dtype
from strategies.spec import Parameter

STC_HEADER = struct.Struct("<BIIfB")  # version, P, k, μ, Rice parameter b
MAX_RICE_BITS = 31
DECODE_CHUNK = 4096  # positions decoded at once: a few 32 KiB temporary arrays
GOLDEN_RATIO = (1 + math.sqrt(5)) / 2


def rice_parameter(density: float) -> int:
    """b* = 1 + ⌊log2(log(φ − 1) / log(1 − p))⌋ for density p, clamped to [0, 31]."""
    assert 0 < density < 1, f"density must be in (0, 1), got {density}"  # the codec's spec is checked when parsed
    best = 1 + math.floor(math.log2(math.log(GOLDEN_RATIO - 1) / math.log1p(-density)))
    return min(max(best, 0), MAX_RICE_BITS)


def rice_encode(indices: Indices, bits: int) -> bytes:
    """The strictly increasing `indices` as Rice-coded gaps with parameter `bits`, zero-padded to a byte."""
    gaps = np.diff(indices.astype(np.int64), prepend=-1) - 1
    quotients, remainders = gaps >> bits, gaps & ((1 << bits) - 1)
    lengths = quotients + 1 + bits
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    stream = np.zeros(int(lengths.sum()), dtype=np.uint8)
    ones = np.repeat(starts, quotients) + _ranks(quotients)
    stream[ones] = 1
    if bits:
        shifts = np.arange(bits - 1, -1, -1)
        low = (remainders[:, None] >> shifts) & 1
        stream[(starts + quotients + 1)[:, None] + np.arange(bits)] = low
    return np.packbits(stream).tobytes()


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, …, c−1 for each count c, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if counts.size else 0) - np.repeat(ends - counts, counts)


def max_rice_bits(count: int, size: int) -> int:
    """The largest Rice parameter b worth using for k = count positions among P = size: once 2^b > P/k the
    quotients add up to less than k, so a larger b only lengthens every code. Encoders use no more, decoders
    refuse more."""
    return (size // count).bit_length()


def max_stream_bits(count: int, bits: int, size: int) -> int:
    """The most bits k = count positions among P = size take Rice coded with parameter b = bits: their gaps add up
    to at most P − k, so their quotients to at most ⌊(P − k)/2^b⌋, plus 1 + b bits per code."""
    return ((size - count) >> bits) + count * (1 + bits)


@lru_cache(maxsize=MAX_RICE_BITS + 2)
def rice_automaton(bits: int) -> tuple[tuple[int, ...], npt.NDArray[np.uint8]]:
    """The Rice decoder for parameter b = bits as an automaton read a byte at a time. Its state between two bytes
    is how many remainder bits the code under way has yet to read (0: the ones of a quotient, or a new code). For
    state s and byte v, at 256·s + v: the state after the byte (times 256, so that the next lookup is
    ``step[state | byte]``), and the mask of the byte's bits that end a quotient (the first bit is the highest)."""
    states = np.repeat(np.arange(bits + 1), 256)
    values = np.tile(np.arange(256), bits + 1)
    ends = np.zeros_like(states)
    for shift in range(7, -1, -1):
        ending = (states == 0) & ((values >> shift) & 1 == 0)
        ends |= ending << shift
        states = np.where(states > 0, states - 1, np.where(ending, bits, 0))
    return tuple((states << 8).tolist()), ends.astype(np.uint8)


def rice_decode(stream: bytes, count: int, bits: int, size: int, stype: str) -> Indices:
    """The `count` positions Rice coded in `stream`, which they must fill up to a zero padding of less than a byte;
    raises MalformedUpdate for codes that run past its end, a position at or past P = size, or a byte or non-zero
    bits after the codes. Time linear in the stream: one table lookup per byte (``rice_automaton``), the rest in
    numpy; memory: a byte per bit of the stream and 8 per position, then 12 per position (3x the dense model's at
    most)."""
    step, ends_of = rice_automaton(bits)
    data = np.frombuffer(stream, dtype=np.uint8)
    walk = accumulate(stream, lambda state, byte: step[state | byte], initial=0)  # the state before each byte
    states = np.fromiter(walk, dtype=np.uint16, count=data.size + 1)
    quotient_ends = np.unpackbits(ends_of[states[:-1] | data])  # a 1 at every bit that ends a quotient
    del states
    found = int(np.count_nonzero(quotient_ends))
    if found < count:
        raise MalformedUpdate(f"{stype}: truncated payload: position code {found} of {count} runs past its end")
    if found >= count + 8:  # each code after the count takes a bit at least: a whole byte after the codes
        raise MalformedUpdate(f"{stype}: oversized payload: a byte or more after the {count} position codes")
    ends = np.flatnonzero(quotient_ends)[:count]
    del quotient_ends
    digits = np.unpackbits(data)
    stop = int(ends[-1]) + 1 + bits
    if stop > digits.size:
        raise MalformedUpdate(f"{stype}: truncated payload: position code {count - 1} of {count} runs past its end")
    if digits.size - stop >= 8:
        raise MalformedUpdate(f"{stype}: oversized payload: a byte or more after the {count} position codes")
    if digits[stop:].any():
        raise MalformedUpdate(f"{stype}: non-zero padding after the position codes")
    # The codes a chunk at a time (the temporary arrays stay small), each chunk turned into its positions in place:
    # a gap is the code's quotient (its ones before its 0) with the remainder's bits shifted in, the highest first.
    previous, position = -1 - bits, -1  # where the code before a chunk ends its quotient, and its position
    for first in range(0, count, DECODE_CHUNK):
        chunk = ends[first : first + DECODE_CHUNK]
        gaps = np.diff(chunk, prepend=previous) - (1 + bits)
        for offset in range(1, bits + 1):
            gaps <<= 1
            gaps |= digits[offset:][chunk]
        gaps += 1
        np.cumsum(gaps, out=gaps)
        gaps += position
        if gaps[-1] >= size:
            raise MalformedUpdate(
                f"{stype}: position {int(gaps[np.searchsorted(gaps, size)])} out of range for P={size}"
            )
        previous, position = int(chunk[-1]), int(gaps[-1])
        chunk[:] = gaps
    del digits  # freed before the copy below
    return ends.astype(index_dtype(size))


def stc_payload_size(indices: Indices, bits: int) -> int:
    """14 + ⌈Σ_j (⌊d_j/2^b⌋ + 1 + b)/8⌉ + ⌈k/8⌉ for the positions `indices`."""
    gaps = np.diff(indices.astype(np.int64), prepend=-1) - 1
    stream_bits = int((gaps >> bits).sum()) + indices.size * (1 + bits)
    return STC_HEADER.size + math.ceil(stream_bits / 8) + math.ceil(indices.size / 8)


@dataclass(frozen=True)
class SparseTernary(SparseCompressor):
    """STC with density p: the k largest |v_i| sent as ±μ (see the module docstring for the wire format)."""

    density: float = 0.01
    stype = "edgefl.stc.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        k = max(1, round(self.density * v.size))
        indices = np.sort(np.argpartition(np.abs(v), v.size - k)[v.size - k :])
        mu = float(np.abs(v[indices]).mean())
        bits = min(rice_parameter(self.density), max_rice_bits(k, v.size))
        signs = np.packbits(v[indices] < 0).tobytes()
        return STC_HEADER.pack(FORMAT_VERSION, v.size, k, mu, bits) + rice_encode(indices, bits) + signs

    def _entries(self, payload: bytes, layout: Layout) -> tuple[Indices, Vector]:
        """Every count is checked against the layout, and the payload's length against them, before a bit is
        decoded: the stream is at most ~2 bits per model entry, the decoder's time linear in it and its memory
        under 4x the dense model's (``rice_decode``)."""
        count, mu, bits = read_header(payload, STC_HEADER, layout, self.stype)
        size = layout_info(layout).size
        check_count(count, 1, size, "entries", self.stype)
        if not (math.isfinite(mu) and mu >= 0):
            raise MalformedUpdate(f"{self.stype}: magnitude μ must be finite and ≥ 0, got {mu}")
        if bits > max_rice_bits(count, size):
            raise MalformedUpdate(f"{self.stype}: Rice parameter b={bits} is above {max_rice_bits(count, size)}, the "
                                  f"most {count} positions among P={size} can use")  # fmt: skip
        sign_bytes = math.ceil(count / 8)
        signs_at = len(payload) - sign_bytes
        least, most = count * (1 + bits), max_stream_bits(count, bits, size)
        if 8 * (signs_at - STC_HEADER.size) < least:
            need = STC_HEADER.size + math.ceil(least / 8) + sign_bytes
            raise MalformedUpdate(f"{self.stype}: truncated payload of {len(payload)} bytes, {count} positions coded "
                                  f"with b={bits} need at least {need}")  # fmt: skip
        if signs_at - STC_HEADER.size > math.ceil(most / 8):
            cap = STC_HEADER.size + math.ceil(most / 8) + sign_bytes
            raise MalformedUpdate(f"{self.stype}: oversized payload of {len(payload)} bytes, {count} positions among "
                                  f"P={size} coded with b={bits} take at most {cap}")  # fmt: skip
        indices = rice_decode(payload[STC_HEADER.size : signs_at], count, bits, size, self.stype)
        signs = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, offset=signs_at))
        if signs[count:].any():
            raise MalformedUpdate(f"{self.stype}: non-zero padding after the sign bits")
        return indices, np.where(signs[:count].astype(bool), -np.float32(mu), np.float32(mu))


STC = Codec(
    "stc",
    Parameter("a density p in (0, 1)", lambda x: 0 < x < 1),
    lambda spec, layout, seed, clients: (SparseTernary(spec.value), ResidualMemory(layout_info(layout).size)),
    SparseTernary(),
)
