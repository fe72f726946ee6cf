"""The default codec `none`: the dense float32 update, bit for bit."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from strategies.codecs.base import (
    DENSE_HEADER,
    FORMAT_VERSION,
    Codec,
    Compressor,
    CompressorState,
    Layout,
    Vector,
    check_finite,
    check_size,
    dense_payload_size,
    layout_info,
    read_header,
)
from strategies.codecs.memory import Memory


def dense_payload(v: Vector) -> bytes:
    """The `none` payload of v: header (version u8, P u32) + P little-endian float32."""
    return DENSE_HEADER.pack(FORMAT_VERSION, v.size) + v.astype("<f4", copy=False).tobytes()


class NoCompression(Compressor):
    """Lossless: decode(encode(v)) == v bitwise.

    Wire: header (version u8, P u32) + P little-endian float32.  Size: 5 + 4·P bytes.
    """

    stype = "edgefl.none.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        return dense_payload(v)

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        return self._values(payload, layout).astype(np.float32)

    def _values(self, payload: bytes, layout: Layout) -> npt.NDArray[np.float32]:
        """A read-only view of the validated float32 values."""
        read_header(payload, DENSE_HEADER, layout, self.stype)
        check_size(payload, dense_payload_size(layout_info(layout).size), self.stype)
        values = np.frombuffer(payload, dtype="<f4", offset=DENSE_HEADER.size)
        check_finite(values, "values", self.stype)
        return values


NONE = Codec("none", None, lambda spec, layout, seed, clients: (NoCompression(), Memory()), NoCompression())
