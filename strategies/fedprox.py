"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith — MLSys 2020, "Federated Optimization in Heterogeneous
Networks"). Each client's K local steps minimise its loss plus a proximal term that keeps it near the global model
wᵗ it started from,

    h_k(w; wᵗ) = F_k(w) + μ/2 ‖w − wᵗ‖²,    so each step's gradient is ∇F_k(w) + μ (w − wᵗ),

and the server is FedAvg's example-weighted mean. μ is fixed for the run (``fedprox:MU``); μ = 0 is FedAvg. Flower's
own ``flwr.serverapp.strategy.FedProx`` is the same: FedAvg's aggregation, μ sent to the clients, the term added to
each client's loss (``tests/test_fedprox.py`` checks both halves against it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategies.fedavg import FedAvgClient, FedAvgServer
from strategies.spec import Parameter, label
from strategies.strategy import LocalObjective, Strategy


@dataclass(frozen=True)
class FedProxSettings:
    """``fedprox:MU``."""

    mu: float
    name: str = "fedprox"
    delay: int = 0
    buffer: int = 0

    @property
    def label(self) -> str:
        return label("fedprox", self.mu)


class FedProxClient(FedAvgClient):
    """FedAvg's client whose local steps carry the proximal term μ (w − wᵗ), wᵗ the round's start model."""

    def __init__(self, mu: float) -> None:
        super().__init__()
        self.mu = mu

    def objective(self, start: np.ndarray) -> LocalObjective:
        return LocalObjective(mu=self.mu, anchor=start)


FEDPROX = Strategy(
    "fedprox",
    Parameter("a proximal weight MU ≥ 0", lambda mu: mu >= 0),
    lambda spec, text: FedProxSettings(float(spec.value or 0.0)),
    lambda s: FedProxClient(s.mu),
    lambda s, setup: FedAvgServer(),
)
