"""Types, errors and wire-format helpers shared by the update codecs.

Every payload starts with a little-endian struct header whose first two fields are the format version (uint8)
and the update length P (uint32); each codec appends its own counts. Decoders check, in this order: header
present, version, P against the layout, the payload is not larger than the dense float32 one, the header's
counts against the layout, the exact size the header implies, then the contents (indices, codes, finiteness).
Nothing is allocated or computed by a count before it is checked, so a decoder's memory stays under 4x the dense
model's and its time linear in the payload (PowerSGD's factor products: in the model's size times the rank,
which the payload bounds).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from contract.errors import PeerError
from strategies.spec import Parameter

if TYPE_CHECKING:
    from strategies.codecs.memory import Memory
    from strategies.codecs.registry import CodecSpec

Layout = tuple[tuple[str, tuple[int, ...]], ...]
"""(name, shape) per tensor, in order; the sizes sum to the update length P."""
Vector = npt.NDArray[np.float32]

FORMAT_VERSION = 1
DENSE_HEADER = struct.Struct("<BI")  # version, P


class CodecError(PeerError, ValueError):
    """A bad layout, update or saved state for a codec; str() is one human-readable line."""


class MalformedUpdate(CodecError):
    """A payload the server rejects; str() is the one-line reason the server logs."""


@dataclass
class CompressorState:
    """Per-client inputs of one encode call, owned by the client's memory (compressors keep no state).

    rng: this call's randomness (stochastic rounding, Bernoulli draws, DGC's threshold sample).
    density: fraction of entries a sparsifier sends this round (set by DGC's warm-up schedule).
    warm_start: PowerSGD's Q factor per tensor index; encode replaces each Q it uses.
    """

    rng: np.random.Generator
    density: float = 1.0
    warm_start: dict[int, Vector] = field(default_factory=dict)


class Compressor(Protocol):
    """Stateless encoder/decoder of one wire format, named by its `stype` (e.g. "edgefl.topk.v1").

    Decoders read everything they need from the header, so an instance with default parameters (what
    `server_compressor` returns) decodes payloads of any parameterization.
    """

    stype: str

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        """Compress the flat update v (length P of layout)."""
        ...

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        """Validate payload and return the dense update it carries; raises MalformedUpdate."""
        ...


@dataclass(frozen=True)
class Codec:
    """One row of the codec table (``strategies.codecs.registry.CODECS``), declared by the codec's own module:
    its name, the parameter it takes (None: none), the client's compressor and memory for a parsed spec, the
    layout, the client's seed and the number of clients, and the decoder the server uses for its wire type."""

    name: str
    parameter: Parameter | None
    make: Callable[[CodecSpec, Layout, int, int], tuple[Compressor, Memory]]
    decoder: Compressor


@dataclass(frozen=True)
class LayoutInfo:
    """Where each tensor of a layout sits in the flat update."""

    shapes: tuple[tuple[int, ...], ...]
    starts: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    size: int


@lru_cache(maxsize=64)
def layout_info(layout: Layout) -> LayoutInfo:
    """Offsets and sizes of the tensors of a layout; raises CodecError for an empty or degenerate layout."""
    if not layout:
        raise CodecError("the model layout has no tensors")
    for name, shape in layout:
        if any(int(dim) < 1 for dim in shape):
            raise CodecError(f"tensor {name!r} has shape {tuple(shape)}: every dimension must be ≥ 1")
    shapes = tuple(tuple(int(dim) for dim in shape) for _, shape in layout)
    sizes = np.array([math.prod(shape) for shape in shapes], dtype=np.int64)
    size = int(sizes.sum())
    if size >= 1 << 32:
        raise CodecError(f"the layout has P={size} entries, more than the uint32 header can carry")
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    sizes.flags.writeable = starts.flags.writeable = False
    return LayoutInfo(shapes, starts, sizes, size)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor viewed as a matrix [shape[0], prod(shape[1:])] (a conv kernel as [out, in·k·k])."""
    rows = shape[0] if shape else 1
    return rows, math.prod(shape[1:])


def dense_payload_size(size: int) -> int:
    """Bytes of the dense float32 payload of P = size entries: the bound no payload may exceed."""
    return DENSE_HEADER.size + 4 * size


def read_header(payload: bytes, header: struct.Struct, layout: Layout, stype: str) -> tuple:
    """Check what every payload shares (header, version, P, dense bound); return the codec's own fields."""
    if len(payload) < header.size:
        raise MalformedUpdate(f"{stype}: truncated payload of {len(payload)} bytes, its header needs {header.size}")
    version, size, *fields = header.unpack_from(payload)
    if version != FORMAT_VERSION:
        raise MalformedUpdate(f"{stype}: unsupported format version {version}, expected {FORMAT_VERSION}")
    expected_size = layout_info(layout).size
    if size != expected_size:
        raise MalformedUpdate(f"{stype}: header says P={size} but the model layout has P={expected_size}")
    limit = dense_payload_size(size)
    if len(payload) > limit:
        raise MalformedUpdate(f"{stype}: payload of {len(payload)} bytes is larger than dense float32 ({limit} bytes)")
    return tuple(fields)


def check_count(count: int, low: int, high: int, what: str, stype: str) -> None:
    """A count read from a header must fit the layout; checked before anything is sized by it."""
    if not low <= count <= high:
        raise MalformedUpdate(f"{stype}: {count} {what}, expected {low}..{high} for this layout")


def check_size(payload: bytes, expected: int, stype: str) -> None:
    """The payload must have exactly the size its header implies."""
    if len(payload) != expected:
        problem = "truncated" if len(payload) < expected else "oversized"
        raise MalformedUpdate(f"{stype}: {problem} payload of {len(payload)} bytes, its header implies {expected}")


def check_finite(values: np.ndarray, what: str, stype: str) -> None:
    """Reject NaN and Inf."""
    if not np.isfinite(values).all():
        raise MalformedUpdate(f"{stype}: {what} contain NaN or Inf")


def check_scale(scale: float, what: str, stype: str) -> None:
    """A header scale must be a positive finite number."""
    if not (math.isfinite(scale) and scale > 0):
        raise MalformedUpdate(f"{stype}: {what} must be positive and finite, got {scale}")


def checked_state(state: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Vector]:
    """Float32 copies of saved memory arrays, which must have exactly the expected names and shapes."""
    if set(state) != set(shapes):
        raise CodecError(f"codec state has arrays {sorted(state)}, expected {sorted(shapes)}")
    arrays = {name: np.array(state[name], dtype=np.float32) for name in shapes}
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise CodecError(f"codec state {name!r} has shape {arrays[name].shape}, expected {shape}")
    return arrays
