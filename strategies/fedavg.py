"""FedAvg's aggregation (McMahan et al. 2017): the example-weighted mean of client updates,

    Δ̄ᵗ = Σ_k n_k Δ_kᵗ / Σ_k n_k,    wᵗ = wᵗ⁻¹ + Δ̄ᵗ,

built incrementally as updates arrive so that the server holds one dense accumulator per open round, not one
vector per client."""

from __future__ import annotations

import numpy as np


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
