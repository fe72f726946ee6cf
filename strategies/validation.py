"""How far one client may move a round's aggregate (pure numpy; the round engine applies it).

Malformed payloads — wrong size or shape for the model, NaN or Inf values, unknown wire types — are refused by
the codecs' decoders already (``strategies.codecs.MalformedUpdate``). This module bounds the rest: client k's
update Δ_k is clipped (norm bounding, Sun et al. 2019, "Can You Really Backdoor Federated Learning?") to a bound
set by the *other* clients alone,

    Δ_k ← Δ_k · min(1, B_k / ‖Δ_k‖₂),    B_k = norm_factor · med_{j ≠ k} max{ ‖Δ_j‖₂ : j's last ``per_client`` },

so that no client can widen its own bound (its norms never enter it: no ratchet), and fewer than half the other
clients cannot widen it either (a median over clients, each counted once whatever it sent). Each client's
recent norms are kept as clipped. Its largest, not its median, stands for it: with DGA and many local steps
honest norms alternate by 20x — a round that continues the client's own model (which has fit its partition)
moves it little, the next, from a new average, much (digits, 300 steps a round, D = 1: 9.1, 0.11, 2.1, 0.10,
1.4, 0.08) — and a client's large ones are its honest reach.

The factor is 2: no client moves a round's aggregate by more than twice what a typical other client's update can
(``bench/adaptive_attackers.py``, two attackers of eight from round 1 on, digits, Dirichlet 0.3, 3 seeds: at 10 an
update of the honest direction at the bound cost 87 points and wrecked the model; at 2 it costs 2.3 points and
0.8 % of honest updates are clipped in a clean run; at 1.5, 0.7 points and 3.9 %). What a bound cannot stop is an
update within it that points against the others': two sign-flipped attackers of eight still outweigh six honest,
heterogeneous updates (the same bench: −36 to −51 points at 2, with Flower's robust rules −9 to −13).

Before any other client's norm is known (a run's first replies) there is no bound; the round engine holds such
updates until their round closes, and bounds each by that round's other updates (``bound`` with ``beside``). A
round with no other client at all (one client, or a quorum of one) bounds its update by the global model's own
norm: no update moves the model by more than its size."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

NORM_FACTOR = 2.0
PER_CLIENT = 4  # recent norms kept per client
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


@dataclass(frozen=True)
class Clipped:
    """An update as it may enter the aggregate: ``update`` scaled to ``bound`` when its ``norm`` was above it."""

    update: np.ndarray
    norm: float  # ‖Δ_k‖₂ as sent
    bound: float | None  # B_k (None: no other client to bound it by, and a model of norm 0)

    @property
    def clipped(self) -> bool:
        return self.bound is not None and self.norm > self.bound

    @property
    def reason(self) -> str:
        return f"clipped: L2 norm {self.norm:.4g} to {self.bound:.4g}, {NORM_FACTOR:g}x the other clients' (median)"


class InfluenceBound:
    """Each client's recent norms, and the bound the others' set for it."""

    def __init__(
        self, norm_factor: float = NORM_FACTOR, per_client: int = PER_CLIENT, history: np.ndarray | None = None
    ) -> None:
        """``history``: (client, norm) rows as ``history_rows`` gave them (a resumed run's; a plain list of norms,
        as checkpoints kept them before, counts as one unknown client's)."""
        # the server builds it with this module's constants: no setting reaches these
        assert norm_factor > 1, f"norm_factor must be greater than 1, got {norm_factor}"
        assert per_client >= 1, f"per_client must be at least 1, got {per_client}"
        self.norm_factor = norm_factor
        self.per_client = per_client
        self.norms: dict[int, deque[float]] = {}
        rows = np.zeros((0, 2)) if history is None else np.asarray(history, dtype=np.float64)
        if rows.ndim == 1:  # a checkpoint from before norms were kept per client: no client's own
            rows = np.stack([np.full(rows.size, -1.0), rows], axis=1)
        for client, norm in rows:
            self.record(int(client), float(norm))

    def record(self, client: int, norm: float) -> None:
        self.norms.setdefault(client, deque(maxlen=self.per_client)).append(norm)

    def bound(self, client: int, beside: Mapping[int, float] | None = None) -> float | None:
        """B_k for ``client`` from the other clients' recent norms and ``beside`` (other clients' norms not recorded
        yet: a held round's); None when no other client has a norm."""
        reach = {other: max(norms) for other, norms in self.norms.items() if other != client and norms}
        for other, norm in (beside or {}).items():
            if other != client:
                reach[other] = max(reach.get(other, 0.0), norm)
        return self.norm_factor * float(np.median(list(reach.values()))) if reach else None

    def clip(self, client: int, update: np.ndarray, bound: float | None) -> Clipped:
        """``update`` scaled to ``bound`` when above it, its clipped norm recorded as the client's."""
        norm = l2_norm(update)
        if bound is not None and norm > bound:
            update = (update.astype(np.float64) * (bound / norm)).astype(np.float32)
        self.record(client, norm if bound is None else min(norm, bound))
        return Clipped(update, norm, bound)

    def history_rows(self) -> np.ndarray:
        """(client, norm) rows, oldest first per client: what a checkpoint keeps."""
        rows = [(client, norm) for client, norms in self.norms.items() for norm in norms]
        return np.array(rows, dtype=np.float64).reshape(-1, 2)


def model_bound(params: np.ndarray) -> float | None:
    """The bound when no other client has a norm: the global model's own norm (None for a model of norm 0)."""
    norm = l2_norm(params)
    return norm if norm > 0 else None
