"""Checks an update must pass before it may enter an aggregate (pure numpy; the server applies them).

Malformed payloads — wrong size or shape for the model, NaN or Inf values, unknown wire types — are refused by
the codecs' decoders already (``strategies.codecs.MalformedUpdate``). This module adds the norm-outlier test: an
update Δ is refused when

    ‖Δ‖₂ > norm_factor · Q₃{ ‖Δ'‖₂ : Δ' among the last ``history`` accepted updates }

with Q₃ the upper quartile. A scaled or poisoned update stands out by orders of magnitude, while honest updates
shrink only slowly as training converges, so the short history follows them. The upper quartile, not the median:
with DGA and many local steps honest norms alternate by 20x — a round that continues the client's own model
(which has fit its partition) moves it little, the next, from a new average, much (digits, 300 steps a round,
D = 1: 9.1, 0.11, 2.1, 0.10, 1.4, 0.08) — and the median falls on the small ones. Until ``min_history`` norms
are known every update passes (there is nothing to compare with)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np

NORM_FACTOR = 10.0
HISTORY = 32
MIN_HISTORY = 3
NORM_CHUNK = 1 << 16  # entries summed in float64 at a time: no float64 copy of the whole update


def l2_norm(update: np.ndarray) -> float:
    """‖Δ‖₂ summed in float64 chunk by chunk (float32's sum of squares overflows from ~1e19; a whole float64 copy
    would double the update's memory on every check)."""
    flat = update.ravel()
    total = 0.0
    for start in range(0, flat.size, NORM_CHUNK):
        part = flat[start : start + NORM_CHUNK].astype(np.float64)
        total += float(part @ part)
    return math.sqrt(total)


class NormOutlierFilter:
    """Refuses updates whose L2 norm is far above the norms of the updates accepted recently."""

    def __init__(
        self,
        norm_factor: float = NORM_FACTOR,
        history: int = HISTORY,
        min_history: int = MIN_HISTORY,
        norms: Iterable[float] = (),
    ) -> None:
        # the server builds it with this module's constants: no setting reaches these
        assert norm_factor > 1, f"norm_factor must be greater than 1, got {norm_factor}"
        assert 1 <= min_history <= history, f"need 1 <= min_history <= history, got {min_history} and {history}"
        self.norm_factor = norm_factor
        self.min_history = min_history
        self.norms: deque[float] = deque(norms, maxlen=history)

    def check(self, update: np.ndarray) -> str | None:
        """The reason ``update`` is refused, or None after recording its norm as accepted."""
        norm = l2_norm(update)
        if len(self.norms) >= self.min_history:
            quartile = float(np.quantile(self.norms, 0.75))
            if norm > self.norm_factor * quartile:
                return (f"outlier: L2 norm {norm:.4g} is more than {self.norm_factor:g} x the recent norms' upper "
                        f"quartile {quartile:.4g}")  # fmt: skip
        self.norms.append(norm)
        return None
