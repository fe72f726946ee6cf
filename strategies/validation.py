"""Checks an update must pass before it may enter an aggregate (pure numpy; the server applies them).

Malformed payloads — wrong size or shape for the model, NaN or Inf values, unknown wire types — are refused by
the codecs' decoders already (``strategies.codecs.MalformedUpdate``). This module adds the norm-outlier test: an
update Δ is refused when

    ‖Δ‖₂ > norm_factor · median{ ‖Δ'‖₂ : Δ' among the last ``history`` accepted updates }

A scaled or poisoned update stands out by orders of magnitude, while honest updates shrink only slowly as
training converges, so the short history follows them. Until ``min_history`` norms are known every update
passes (there is nothing to compare with)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

NORM_FACTOR = 10.0
HISTORY = 32
MIN_HISTORY = 3


class NormOutlierFilter:
    """Refuses updates whose L2 norm is far above the median norm of the updates accepted recently."""

    def __init__(
        self,
        norm_factor: float = NORM_FACTOR,
        history: int = HISTORY,
        min_history: int = MIN_HISTORY,
        norms: Iterable[float] = (),
    ) -> None:
        if not norm_factor > 1:
            raise ValueError(f"norm_factor must be greater than 1, got {norm_factor}")
        if not 1 <= min_history <= history:
            raise ValueError(f"need 1 <= min_history <= history, got {min_history} and {history}")
        self.norm_factor = norm_factor
        self.min_history = min_history
        self.norms: deque[float] = deque(norms, maxlen=history)

    def check(self, update: np.ndarray) -> str | None:
        """The reason ``update`` is refused, or None after recording its norm as accepted."""
        norm = float(np.linalg.norm(update))
        if len(self.norms) >= self.min_history:
            median = float(np.median(self.norms))
            if norm > self.norm_factor * median:
                return f"outlier: L2 norm {norm:.4g} is more than {self.norm_factor:g} x the recent median {median:.4g}"
        self.norms.append(norm)
        return None
