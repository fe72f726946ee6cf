"""What a client holds: a compressor, its memory, the model layout and a seed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from strategies.codecs.base import CodecError, Compressor, Layout, Vector, dense_payload_size, layout_info
from strategies.codecs.dense import NoCompression
from strategies.codecs.memory import Memory


@dataclass(frozen=True)
class Encoded:
    """One update as it leaves the client: its wire type and payload, and the update the server will decode
    from them (what DGA's correction subtracts later)."""

    stype: str
    payload: bytes
    decoded: Vector


class ClientCodec:
    """Encodes a client's update each round: v = memory.compensate(u); payload = compressor.encode(v);
    memory.update(v, decode(payload)). Build one with `make_client_codec`."""

    def __init__(self, compressor: Compressor, memory: Memory, layout: Layout, seed: int) -> None:
        if seed < 0:
            raise CodecError(f"codec seed must be ≥ 0, got {seed}")
        self.compressor = compressor
        self.memory = memory
        self.layout = layout
        self.seed = seed
        self.size = layout_info(layout).size

    def encode(self, u: np.ndarray, server_round: int) -> Encoded:
        """This round's flat update u encoded; updates the memory.

        server_round (1-based) drives DGC's sparsity warm-up and, with the seed, this round's randomness, so
        encodings are reproducible and no generator state needs saving. A payload larger than the dense
        float32 one (tiny layouts, τ below most |v_i|), which the server would reject, is replaced by it.
        """
        v = self.memory.compensate(self._checked(u))
        compressor, payload = self._compress(v, server_round)
        decoded = compressor.decode(payload, self.layout)
        self.memory.update(v, decoded)
        return Encoded(compressor.stype, payload, decoded)

    def compress(self, v: np.ndarray, server_round: int) -> tuple[str, bytes]:
        """(stype, payload) for v exactly as given: the memory supplies the compressor's inputs (DGC's density,
        PowerSGD's warm start) but no error feedback, for a caller that keeps its own (the downlink)."""
        compressor, payload = self._compress(self._checked(v), server_round)
        return compressor.stype, payload

    def _compress(self, v: Vector, server_round: int) -> tuple[Compressor, bytes]:
        """The compressor that encoded v (dense when the codec's payload would be larger) and its payload."""
        if server_round < 1:
            raise CodecError(f"server_round must be ≥ 1, got {server_round}")
        rng = np.random.default_rng([self.seed, server_round])
        state = self.memory.compressor_state(server_round, rng)
        payload = self.compressor.encode(v, self.layout, state)
        if len(payload) <= dense_payload_size(self.size):
            return self.compressor, payload
        dense = NoCompression()
        return dense, dense.encode(v, self.layout, state)

    def state_dict(self) -> dict[str, Vector]:
        """Copies of the memory's arrays (residual, momentum, velocity, warm-start factors)."""
        return self.memory.state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore `state_dict` output; raises CodecError when it does not fit this codec and layout."""
        self.memory.load_state_dict(state)

    def _checked(self, u: np.ndarray) -> Vector:
        """u as a finite float32 vector of length P."""
        u = np.asarray(u, dtype=np.float32)
        if u.shape != (self.size,):
            raise CodecError(f"update has shape {u.shape}, the model layout needs ({self.size},)")
        if not np.isfinite(u).all():
            raise CodecError("update contains NaN or Inf")
        return u
