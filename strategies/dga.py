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

import numpy as np


class DelayedAveragingClient:
    """What one client knows: the newest global model it has received and its own updates since."""

    def __init__(self, delay: int, correction: bool = True) -> None:
        self.delay = delay
        self.correction = correction
        self.global_round = -1
        self._global: np.ndarray | None = None
        self._pending: dict[int, np.ndarray] = {}

    def receive_global(self, round_: int, params: np.ndarray) -> None:
        """The global model after round ``round_``: it already contains every average up to that round."""
        if round_ < self.global_round:
            return
        self.global_round = round_
        self._global = params.astype(np.float32, copy=True)
        self._pending = {t: d for t, d in self._pending.items() if t > round_}

    def record_sent(self, round_: int, update: np.ndarray) -> None:
        """Remember Δ_jᵗ exactly as the server will decode it (after compression), for the later correction."""
        if round_ > self.global_round:
            self._pending[round_] = update.astype(np.float32, copy=True)

    def can_start(self, round_: int) -> bool:
        """Staleness bound: round t needs the global model of round t − D − 1."""
        return self._global is not None and self.global_round >= round_ - self.delay - 1

    def start_params(self) -> np.ndarray:
        """The model a new local round starts from (see the module docstring)."""
        if self._global is None:
            raise RuntimeError("no global model received yet")
        params = self._global.copy()
        if self.correction:
            for t in sorted(self._pending):
                params += self._pending[t]
        return params

    @property
    def pending_rounds(self) -> list[int]:
        return sorted(self._pending)


def reply_early(ready: int, left: int, delay: int, round_s: float, round_trip_s: float | None) -> bool:
    """Whether a client should send its ``ready`` updates now, with ``left`` rounds still trainable before the
    staleness bound (the round in progress counted), rather than once it reaches the bound.

    One message at a time per client: a message brings the global model, the client trains and replies, the
    next message comes a round trip R later. With N = D + 1 rounds per global model and T seconds per round,
    replying at the bound gives N rounds per N·T + R. Replying with n = N − m ready and m left to train
    during the trip gives n rounds per (n − m)·T + R while m·T ≤ R, which is better exactly when R < N·T, and
    the full rate 1/T — the trip hidden — once m·T ≥ R. So: early only when R < N·T, at the first round
    boundary where the rounds left cover the trip (m = ⌈R/T⌉; more would only shorten the message) and do
    not outnumber the rounds ready (m ≤ n: a message leaving more than it carries makes the next one shorter
    still). Before R has been measured: at the bound."""
    if ready == 0 or round_trip_s is None or round_s <= 0 or round_trip_s >= (delay + 1) * round_s:
        return False
    return left <= min(math.ceil(round_trip_s / round_s), ready)


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
