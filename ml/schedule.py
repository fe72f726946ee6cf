"""The learning rate of each round (``--lr-schedule``), without torch: the server's strategy half and the device's
trainer read the same one."""

from __future__ import annotations

import math


def scheduled_lr(base: float, schedule: str, round_: int, rounds: int) -> float:
    """The learning rate of round ``round_`` (1-based) of ``rounds``: ``base`` throughout, or cosine annealing
    η_r = η · ½ (1 + cos(π (r − 1) / R)) (Loshchilov & Hutter 2017, per round instead of per step)."""
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * (round_ - 1) / rounds))
    return base
