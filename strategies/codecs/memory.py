"""Client-side memories around a compressor: v = compensate(u) before encoding, update(v, sent) after.

`sent` is decode(encode(v)), exactly what the server will see. The server holds no memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strategies.codecs.base import CompressorState, Vector, checked_state


class Memory:
    """No memory: the compressor sees each update as it is (none, TernGrad, int8, QSGD)."""

    def compensate(self, u: Vector) -> Vector:
        """The vector to encode this round."""
        return u

    def update(self, v: Vector, sent: Vector) -> None:
        """Take in what the server will decode from this round's payload."""

    def compressor_state(self, server_round: int, rng: np.random.Generator) -> CompressorState:
        """Inputs of this round's encode call."""
        return CompressorState(rng)

    def state_dict(self) -> dict[str, Vector]:
        """Copies of the arrays that must survive a restart."""
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_dict` returned; raises CodecError on other names or shapes."""
        checked_state(state, {})


class ResidualMemory(Memory):
    """Error feedback (Seide et al. 2014; Aji & Heafield 2017): what compressor C leaves out is sent later.

    v_t = u_t + e_{t−1},    e_t = v_t − C(v_t),    so  Σ_t C(v_t) + e_T = Σ_t u_t.
    """

    def __init__(self, size: int) -> None:
        self.residual = np.zeros(size, dtype=np.float32)

    def compensate(self, u: Vector) -> Vector:
        return u + self.residual

    def update(self, v: Vector, sent: Vector) -> None:
        self.residual = v - sent

    def state_dict(self) -> dict[str, Vector]:
        return {"residual": self.residual.copy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.residual = checked_state(state, {"residual": self.residual.shape})["residual"]
