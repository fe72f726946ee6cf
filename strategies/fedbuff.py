"""FedBuff (Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous Aggregation"), the server's
buffer. Clients train on the global model they last received and send Δ_i = w_i − w^{t_i}; the server adds each
arriving update to a buffer with a staleness weight and, once the buffer holds K updates, steps:

    s(τ) = 1 / √(1 + τ),    Δ̄ = (1/K) Σ_{i=1..K} s(τ_i) Δ_i,    w^{t+1} = w^t + η_g Δ̄,

where τ_i = t − t_i is how many server steps the model client i trained on is behind, and η_g is the server
learning rate (1 and τ = 0 everywhere: the unweighted mean of K fresh updates). A client contributes at most once
to a buffer. ``strategies.rounds`` decides who trains when; this is only the arithmetic."""

from __future__ import annotations

import math

import numpy as np


def staleness_weight(staleness: int) -> float:
    """s(τ) = 1/√(1 + τ), the paper's polynomial staleness weight."""
    if staleness < 0:
        raise ValueError(f"staleness must be ≥ 0, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness)


class StalenessBuffer:
    """Running Σ s(τ_i) Δ_i and the count of one server step's updates."""

    def __init__(self, size: int, server_lr: float = 1.0) -> None:
        self._sum = np.zeros(size, dtype=np.float64)
        self.server_lr = server_lr
        self.count = 0

    def add(self, update: np.ndarray, staleness: int) -> None:
        self._sum += staleness_weight(staleness) * update
        self.count += 1

    def mean(self) -> np.ndarray:
        """η_g Δ̄: what the server step adds to the global model."""
        if self.count == 0:
            raise ValueError("no update was added to this buffer")
        return (self.server_lr * self._sum / self.count).astype(np.float32)
