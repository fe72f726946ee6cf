"""Delayed Gradient Averaging (Zhu, Lin, Lu, Han — NeurIPS 2021), client-side bookkeeping.

Gradient form (per step, K = 1), worker j at iteration i with delay D:

    w_{i,j} ← w_{i,j} − η ( ∇w_{i,j} − ∇w_{i−D,j} + avg∇w_{i−D} )

i.e. the local step plus a correction that swaps the worker's own stale gradient for the stale average. With
K local steps per round (the FL form), client j sends its round-t update Δ_jᵗ, keeps training, and when the
global model of round a ≥ t arrives it is as if it had applied w_j ← w_j − Δ_jᵗ + Δ̄ᵗ for every round up to a:

    w_j = w_globalᵃ + Σ_{t > a} Δ_jᵗ          (with correction)
    w_j = w_globalᵃ                           (without correction: the paper's ablation, plain delayed SGD)

The client may start round t only once it knows the global model of round t − D − 1 (the staleness bound).
With D = 0 this is FedAvg: every round starts from the newest global model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from strategies.fedavg import FedAvgClient, FedAvgServer
from strategies.spec import Parameter, Spec, SpecError, label
from strategies.strategy import Strategy

MAX_DELAY = 64


@dataclass(frozen=True)
class DGASettings:
    """``dga:D`` (``dga:D:nocorrection``: the paper's ablation, stale averages applied uncorrected)."""

    delay: int
    correction: bool = True
    name: str = "dga"
    buffer: int = 0

    @property
    def label(self) -> str:
        return label("dga", self.delay, *([] if self.correction else ["nocorrection"]))


def parse(spec: Spec, text: str) -> DGASettings:
    if spec.options not in ((), ("nocorrection",)):
        raise SpecError(f"malformed strategy {text!r}; expected dga:D or dga:D:nocorrection")
    return DGASettings(int(spec.value or 0), not spec.options)


def with_flags(text: str | None, delay: int | None, correction: bool) -> str:
    """``--strategy`` with the separate ``--delay D`` / ``--no-correction`` flags folded in (``dga`` + ``--delay 2``
    is ``dga:2``); raises SpecError when the strategy is not DGA, or names another delay than ``--delay``."""
    text = (text or "dga").strip().lower()
    name, *values = text.split(":")
    if name != "dga":
        raise SpecError(f"strategy {name!r} takes no delay and no correction switch (only dga:D does)")
    if delay is not None and values and values[0] != str(delay):
        raise SpecError(f"--strategy {text} and --delay {delay} name two delays; give one of them")
    if text == "dga" and delay is not None:
        text = f"dga:{delay}"
    return text if correction or text.endswith(":nocorrection") else f"{text}:nocorrection"


class DelayedAveragingClient(FedAvgClient):
    """What one client knows: the newest global model it has received and its own updates since."""

    def __init__(self, delay: int, correction: bool = True) -> None:
        super().__init__()
        self.delay = delay
        self.correction = correction
        self._pending: dict[int, np.ndarray] = {}

    def receive_global(self, round_: int, params: np.ndarray, state: np.ndarray | None = None) -> None:
        """The global model after round ``round_``: it already contains every average up to that round."""
        if round_ < self.global_round:
            return
        super().receive_global(round_, params)
        self._pending = {t: d for t, d in self._pending.items() if t > round_}

    def record_sent(self, round_: int, update: np.ndarray) -> None:
        """Remember Δ_jᵗ exactly as the server will decode it (after compression), for the later correction."""
        if round_ > self.global_round:
            self._pending[round_] = update.astype(np.float32, copy=True)

    def start_params(self) -> np.ndarray:
        """The model a new local round starts from (see the module docstring)."""
        params = super().start_params()
        if self.correction:
            for t in sorted(self._pending):
                params += self._pending[t]
        return params

    @property
    def pending_rounds(self) -> list[int]:
        return sorted(self._pending)


class DGAServer(FedAvgServer):
    """DGA's server is FedAvg's mean; only the schedule differs: round t's updates may come from clients that
    started it from the global model of round t − D − 1."""

    def __init__(self, delay: int) -> None:
        self.delay = delay


DGA = Strategy(
    "dga",
    Parameter(f"a whole number of rounds D in 0..{MAX_DELAY}", lambda d: 0 <= d <= MAX_DELAY, integer=True),
    parse,
    lambda s: DelayedAveragingClient(s.delay, s.correction),
    lambda s, setup: DGAServer(s.delay),
    options=True,
)


def dga_sgd_step(
    params: np.ndarray,
    grad: np.ndarray,
    stale_own_grad: np.ndarray | None,
    stale_avg_grad: np.ndarray | None,
    lr: float,
) -> np.ndarray:
    """One step of the paper's pseudocode: ``W = W − lr·(g − G[i−D] + avg_g)``; before D steps have passed
    there is nothing stale to swap and the step is plain local SGD."""
    if stale_own_grad is None or stale_avg_grad is None:
        return params - lr * grad
    return params - lr * (grad - stale_own_grad + stale_avg_grad)


def regime_bounds(path_s: float, round_s: float, in_flight: int = 2) -> tuple[float, int]:
    """What DGA can do where a message path takes R = ``path_s`` seconds and a round's training T = ``round_s``:
    at most 1 + R/T times FedAvg's rounds per second (FedAvg's round is T + R, DGA's at best T), and the delay D
    that hides R: ⌈R/T⌉ with two messages in flight per client (``strategies.rounds``), 2⌈R/T⌉ − 1 with one (a
    client replies, then waits a whole path for the next message to answer)."""
    rounds = math.ceil(path_s / round_s)
    return 1 + path_s / round_s, rounds if in_flight >= 2 else 2 * rounds - 1
