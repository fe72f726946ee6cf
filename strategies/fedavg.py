"""FedAvg's aggregation (McMahan et al. 2017): the example-weighted mean of client updates,

    Δ̄ᵗ = Σ_k n_k Δ_kᵗ / Σ_k n_k,    wᵗ = wᵗ⁻¹ + Δ̄ᵗ,

built incrementally as updates arrive so that the server holds one dense accumulator per open round, not one
vector per client. Its two halves (``FedAvgServer``, ``FedAvgClient``) are the base of every other strategy's
(``strategies.strategy``); server momentum (FedAvgM) acts on any strategy's step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from contract.errors import EdgeflError
from strategies.spec import SpecError
from strategies.strategy import PLAIN, Contribution, LocalObjective, Plain, RoundSum, Strategy

if TYPE_CHECKING:
    from strategies.codecs import CodecSpec


class CheckpointError(EdgeflError, ValueError):
    """A resumed run's checkpoint that does not fit this run's strategy or model; ``str()`` is one line for the
    user."""


class WeightedMean:
    """Running Σ n_k Δ_k and Σ n_k for one round."""

    def __init__(self, size: int) -> None:
        self._sum = np.zeros(size, dtype=np.float64)
        self.total_weight = 0.0

    def add(self, update: np.ndarray, weight: float) -> None:
        """Add one client's decoded update Δ_k with weight n_k, in float64 (float32's n_k·Δ_k overflows from
        ~3e38/n_k)."""
        self._sum += weight * update.astype(np.float64)
        self.total_weight += weight

    def mean(self) -> np.ndarray:
        # a round closes with at least one update, each of a positive weight (strategies.rounds checks num_examples)
        assert self.total_weight > 0, "no update was added to this round"
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
            raise SpecError(f"momentum β must be in (0, 1), got {beta}")
        self.beta = beta
        fresh = buffer is None or np.asarray(buffer).size == 0
        self.buffer = np.zeros(size, dtype=np.float32) if fresh else np.asarray(buffer, dtype=np.float32).copy()
        if self.buffer.shape != (size,):
            raise CheckpointError(f"momentum buffer has shape {self.buffer.shape}, the model needs ({size},)")

    def step(self, mean_update: np.ndarray) -> np.ndarray:
        """mᵗ for this round's Δ̄ᵗ: what `apply_update` adds to the global model."""
        self.buffer = (self.beta * self.buffer + mean_update).astype(np.float32)
        return self.buffer.copy()


def global_momentum(spec: CodecSpec, size: int, buffer: np.ndarray | None = None) -> ServerMomentum | None:
    """The server's momentum for an uplink codec spec (``gm=BETA``), None when it has none."""
    return None if spec.global_momentum is None else ServerMomentum(spec.global_momentum, size, buffer)


class FedAvgServer:
    """FedAvg's server half, the base of every other: updates weighted by their examples (``WeightedMean``), the
    mean applied as the step, nothing sent beside the model and no state beyond it (``strategies.strategy``)."""

    delay = 0
    buffer = 0

    def open(self, size: int) -> RoundSum:
        return WeightedMean(size)

    def add(self, summed: RoundSum, update: np.ndarray, contribution: Contribution) -> None:
        assert isinstance(summed, WeightedMean)
        summed.add(update, contribution.num_examples)

    def close(self, summed: RoundSum, mean: np.ndarray) -> np.ndarray:
        return mean

    def message_state(self, source: int) -> np.ndarray | None:
        return None

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def restore(self, state: dict[str, np.ndarray]) -> None:
        if state:
            raise CheckpointError(f"{type(self).__name__} keeps no state, the checkpoint holds {sorted(state)}")


class FedAvgClient:
    """FedAvg's client half, the base of every other: the newest global model it holds, from which each round
    starts (round t needs the global model of round t − D − 1; D = 0 here), and plain local SGD."""

    delay = 0

    def __init__(self) -> None:
        self.global_round = -1
        self._global: np.ndarray | None = None

    def receive_global(self, round_: int, params: np.ndarray, state: np.ndarray | None = None) -> None:
        """The global model after round ``round_`` (an older one than held changes nothing)."""
        if round_ < self.global_round:
            return
        self.global_round = round_
        self._global = params.astype(np.float32, copy=True)

    def record_sent(self, round_: int, update: np.ndarray) -> None:
        """FedAvg needs nothing of what it sent."""

    def can_start(self, round_: int) -> bool:
        return self._global is not None and self.global_round >= round_ - self.delay - 1

    def start_params(self) -> np.ndarray:
        assert self._global is not None, "no global model received yet"  # callers ask can_start first
        return self._global.copy()

    def objective(self, start: np.ndarray) -> LocalObjective:
        return PLAIN


FEDAVG = Strategy(
    "fedavg",
    None,
    lambda spec, text: Plain("fedavg"),
    lambda settings: FedAvgClient(),
    lambda settings, setup: FedAvgServer(),
)
