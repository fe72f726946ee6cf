"""FedBuff (Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous Aggregation"), the server's
buffer. Clients train on the global model they last received and send Δ_i = w_i − w^{t_i}; the server adds each
arriving update to a buffer with a staleness weight and, once the buffer holds K updates, steps:

    s(τ) = 1 / √(1 + τ),    Δ̄ = (1/K) Σ_{i=1..K} s(τ_i) Δ_i,    w^{t+1} = w^t + η_g Δ̄,

where τ_i = t − t_i is how many server steps the model client i trained on is behind, and η_g is the server
learning rate (1 and τ = 0 everywhere: the unweighted mean of K fresh updates). A client contributes at most once
to a buffer. ``strategies.rounds`` decides who trains when; this is only the arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strategies.fedavg import FedAvgClient, FedAvgServer
from strategies.spec import Parameter, Spec, SpecError, label, parse_number
from strategies.strategy import Contribution, RoundSum, Strategy


def staleness_weight(staleness: int) -> float:
    """s(τ) = 1/√(1 + τ), the paper's polynomial staleness weight."""
    assert staleness >= 0, f"staleness must be ≥ 0, got {staleness}"  # strategies.rounds never counts a negative
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
        assert self.count > 0, "no update was added to this buffer"  # a step is taken with K ≥ 1 updates
        return (self.server_lr * self._sum / self.count).astype(np.float32)


@dataclass(frozen=True)
class FedBuffSettings:
    """``fedbuff:K`` (``fedbuff:K:slr=η``: the server learning rate η_g)."""

    buffer: int
    server_lr: float = 1.0
    name: str = "fedbuff"
    delay: int = 0

    @property
    def label(self) -> str:
        return label("fedbuff", self.buffer, *([] if self.server_lr == 1.0 else [f"slr={self.server_lr:g}"]))


def parse(spec: Spec, text: str) -> FedBuffSettings:
    if not spec.options:
        return FedBuffSettings(int(spec.value or 0))
    option = spec.options[0]
    value = parse_number(option.removeprefix("slr=")) if option.startswith("slr=") else None
    if len(spec.options) > 1 or value is None or not value > 0:
        raise SpecError(f"malformed strategy {text!r}; expected fedbuff:K or fedbuff:K:slr=η with η > 0")
    return FedBuffSettings(int(spec.value or 0), value)


class FedBuffServer(FedAvgServer):
    """A server step of K buffered updates, each weighted by its staleness τ = step − round (module docstring);
    the engine closes a step once K are in (``buffer``)."""

    def __init__(self, buffer: int, server_lr: float) -> None:
        self.buffer = buffer
        self.server_lr = server_lr

    def open(self, size: int) -> RoundSum:
        return StalenessBuffer(size, self.server_lr)

    def add(self, summed: RoundSum, update: np.ndarray, contribution: Contribution) -> None:
        assert isinstance(summed, StalenessBuffer)
        summed.add(update, contribution.step - contribution.round)


FEDBUFF = Strategy(
    "fedbuff",
    Parameter("a buffer of K ≥ 1 updates per server step", lambda k: k >= 1, integer=True),
    parse,
    lambda s: FedAvgClient(),
    lambda s, setup: FedBuffServer(s.buffer, s.server_lr),
    options=True,
    mean_only="weights updates by staleness",
)
