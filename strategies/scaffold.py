"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh — ICML 2020, "Stochastic Controlled Averaging for
Federated Learning"). The server keeps a control variate c, and one c_i per client; client i's K local steps
correct its drift from the others,

    y ← y − η_l (g_i(y) − c_i + c),

and its variate is refreshed by the paper's option II,

    c_i⁺ = c_i − c + (x − y) / (K η_l),    Δc_i = c_i⁺ − c_i,

where x is the global model the round started from. The server applies FedAvg's mean of Δy_i = y_i − x and

    c ← c + (1/N) Σ_{i∈S} Δc_i        (N: all clients, S: those whose update the round took).

Where each variate lives: c_i⁺ − c_i depends only on Δy_i, K, η_l and the c the client was sent, all of which the
server has, so the server keeps every c_i (by partition) and computes Δc_i from the update it decodes; a client is
sent its correction c − c_i with each global model (``message_state``). The uplink stays one vector, a client's
variate survives its agent's restart, its node's rejoin or a new device, and no client can set c except through an
update that passed validation. With heavy-ball momentum β on the client, K steps move the model by about
K η_l / (1 − β) mean gradients, so the estimate is (x − y)(1 − β) / (K η_l) (β = 0: option II as written).

Memory: the server holds c and one float32 model-sized vector per client that has trained (4·P bytes each)."""

from __future__ import annotations

import numpy as np

from strategies.fedavg import CheckpointError, FedAvgClient, FedAvgServer, WeightedMean
from strategies.strategy import Contribution, LocalObjective, Plain, RoundSum, ServerSetup, Strategy

VARIATE = "c"  # the server's c in ``state()``; each client's c_i is "c/<partition>"


class ScaffoldSum(WeightedMean):
    """A round's example-weighted Σ Δy_i, and each client's Δc_i (summed when the round closes, in the order of the
    clients' partitions, so that c does not depend on the order the updates arrived in)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.changes: dict[int, np.ndarray] = {}


class ScaffoldServer(FedAvgServer):
    """The server's c and every c_i; the step is FedAvg's mean (η_g = 1)."""

    def __init__(self, setup: ServerSetup) -> None:
        self.setup = setup
        self.variate = np.zeros(setup.size, dtype=np.float32)
        self.client_variates: dict[int, np.ndarray] = {}

    def open(self, size: int) -> RoundSum:
        return ScaffoldSum(size)

    def add(self, summed: RoundSum, update: np.ndarray, contribution: Contribution) -> None:
        """Δy_i into the mean; c_i⁺ = c_i − c + (x − y)(1 − β)/(K η_l) with x − y = −Δy_i, and Δc_i = c_i⁺ − c_i."""
        assert isinstance(summed, ScaffoldSum)
        summed.add(update, contribution.num_examples)
        setup = self.setup
        scale = (1.0 - setup.momentum) / (setup.local_steps * setup.lr_at(contribution.round))
        summed.changes[contribution.source] = -scale * update.astype(np.float64) - self.variate  # Δc_i = c_i⁺ − c_i

    def close(self, summed: RoundSum, mean: np.ndarray) -> np.ndarray:
        """c ← c + (1/N) Σ Δc_i, and each contributing client's c_i ← c_i⁺ = c_i + Δc_i."""
        assert isinstance(summed, ScaffoldSum)
        total = np.zeros(self.variate.size, dtype=np.float64)
        for source in sorted(summed.changes):
            change = summed.changes[source]
            total += change
            own = self.client_variates.get(source)
            self.client_variates[source] = (change if own is None else own + change).astype(np.float32)
        self.variate = (self.variate + total / self.setup.clients).astype(np.float32)
        return mean

    def message_state(self, source: int) -> np.ndarray | None:
        """The client's correction c − c_i (None before anything was learnt: zero)."""
        own = self.client_variates.get(source)
        if own is None and not self.variate.any():
            return None
        return self.variate if own is None else (self.variate - own).astype(np.float32)

    def state(self) -> dict[str, np.ndarray]:
        return {VARIATE: self.variate, **{f"{VARIATE}/{source}": c for source, c in self.client_variates.items()}}

    def restore(self, state: dict[str, np.ndarray]) -> None:
        for key, value in state.items():
            name, _, source = key.partition("/")
            if name != VARIATE or value.shape != (self.setup.size,) or (source and not source.isdigit()):
                raise CheckpointError(
                    f"SCAFFOLD's checkpoint holds {key!r} of shape {value.shape}, not a control variate"
                )
            if source:
                self.client_variates[int(source)] = value.astype(np.float32)
            else:
                self.variate = value.astype(np.float32)


class ScaffoldClient(FedAvgClient):
    """FedAvg's client whose every local step adds the correction c − c_i sent with the global model."""

    def __init__(self) -> None:
        super().__init__()
        self.drift: np.ndarray | None = None

    def receive_global(self, round_: int, params: np.ndarray, state: np.ndarray | None = None) -> None:
        if round_ < self.global_round:
            return
        super().receive_global(round_, params)
        self.drift = None if state is None else state.astype(np.float32, copy=True)

    def objective(self, start: np.ndarray) -> LocalObjective:
        return LocalObjective(drift=self.drift)


SCAFFOLD = Strategy(
    "scaffold",
    None,
    lambda spec, text: Plain("scaffold"),
    lambda s: ScaffoldClient(),
    lambda s, setup: ScaffoldServer(setup),
    mean_only="counts every update a round takes in its control variate (a robust rule's dropped ones too)",
)
