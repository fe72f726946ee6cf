"""FedAvg's aggregation (McMahan et al. 2017): the example-weighted mean of client updates,

    Δ̄ᵗ = Σ_k n_k Δ_kᵗ / Σ_k n_k,    wᵗ = wᵗ⁻¹ + Δ̄ᵗ,

built incrementally as updates arrive so that the server holds one dense accumulator per open round, not one
vector per client."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from strategies.codecs import CodecSpec


class WeightedMean:
    """Running Σ n_k Δ_k and Σ n_k for one round."""

    def __init__(self, size: int) -> None:
        self._sum = np.zeros(size, dtype=np.float64)
        self.total_weight = 0.0

    def add(self, update: np.ndarray, weight: float) -> None:
        """Add one client's decoded update Δ_k with weight n_k."""
        self._sum += weight * update
        self.total_weight += weight

    def mean(self) -> np.ndarray:
        if self.total_weight <= 0:
            raise ValueError("no update was added to this round")
        return (self._sum / self.total_weight).astype(np.float32)


def apply_update(global_params: np.ndarray, mean_update: np.ndarray) -> np.ndarray:
    """wᵗ = wᵗ⁻¹ + Δ̄ᵗ in float32: the one place the global model moves, server and clients alike."""
    return (global_params + mean_update).astype(np.float32)


class ServerMomentum:
    """Global momentum on the aggregated update (FedAvgM, Hsu et al. 2019):

        mᵗ = β·mᵗ⁻¹ + Δ̄ᵗ,    wᵗ = wᵗ⁻¹ + mᵗ.

    This is Global Momentum Compression's update (Zhao et al. 2019: each worker sends C(e + g + β·mᵗ⁻¹) with
    mᵗ⁻¹ = wᵗ⁻² − wᵗ⁻¹ the global model's last step) with the momentum term, identical on every client, added
    by the server instead of compressed and sent. The momentum then follows the fleet's mean update, not each
    client's label skew, as local momentum in a sparse client's memory does (DGC's momentum correction)."""

    def __init__(self, beta: float, size: int, buffer: np.ndarray | None = None) -> None:
        """`buffer`: mᵗ⁻¹ of a resumed run (empty or None: zeros)."""
        if not 0 < beta < 1:
            raise ValueError(f"momentum β must be in (0, 1), got {beta}")
        self.beta = beta
        fresh = buffer is None or np.asarray(buffer).size == 0
        self.buffer = np.zeros(size, dtype=np.float32) if fresh else np.asarray(buffer, dtype=np.float32).copy()
        if self.buffer.shape != (size,):
            raise ValueError(f"momentum buffer has shape {self.buffer.shape}, the model needs ({size},)")

    def step(self, mean_update: np.ndarray) -> np.ndarray:
        """mᵗ for this round's Δ̄ᵗ: what `apply_update` adds to the global model."""
        self.buffer = (self.beta * self.buffer + mean_update).astype(np.float32)
        return self.buffer.copy()


def global_momentum(spec: CodecSpec, size: int, buffer: np.ndarray | None = None) -> ServerMomentum | None:
    """The server's momentum for an uplink codec spec (``gm=BETA``), None when it has none."""
    return None if spec.global_momentum is None else ServerMomentum(spec.global_momentum, size, buffer)
