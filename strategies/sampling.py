"""Partial participation: which of a run's N clients (its partitions) train each round.

Round t's M clients are a uniform sample without replacement, drawn from the run's seed and t alone: the
partitions ordered by the SHA-256 of ``"{seed}/{t}/{partition}"``, the first M taken. Hash keys are a random
permutation that every end computes alike on any platform and library version (the server and each device
derive the sample independently; numpy's generators promise no such stability across versions), and a round's
sample does not depend on what happened before it (a resumed run samples exactly as the first would have).

DGA with gaps: a client sampled in round t starts it from the newest global model it holds, which must be that
of round t − D − 1 or newer (the staleness bound holds per round, not per client), plus its own updates to rounds
after that model (the correction). Rounds it sat out add nothing to its correction: their averages are already
in the global model it is sent. A client with no update of its own in flight — every round it trained is closed
— has nothing to correct, and is sent round t's request with the newest global model once round t − 1 has
closed, as in FedAvg: started D rounds early from an older model, its update would be applied D rounds stale
with no correction, and delayed full-model updates w_t = w_{t−1} + Δ(w_{t−D−1}) oscillate (with 100 clients,
10 a round and D = 2, non-IID Fashion-MNIST fell from 0.81 to 0.61 in ``bench/simulation.py``). A client
sampled in consecutive rounds still trains them back to back, its own earlier update in flight and corrected.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

from strategies.spec import SpecError

ALL = "all"


def parse_clients_per_round(text: str, population: int) -> int:
    """``all``, a count M (1 ≤ M ≤ N) or a fraction of N with a decimal point (0 < f ≤ 1, rounded up to at
    least one client) as the number of clients per round; raises SpecError."""
    text = text.strip().lower()
    if text == ALL:
        return population
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"clients-per-round must be 'all', a count or a fraction, got {text!r}") from None
    if "." in text or "e" in text:
        if not 0 < value <= 1:
            raise SpecError(f"clients-per-round as a fraction must be in (0, 1], got {text!r}")
        return max(1, math.ceil(value * population - 1e-9))
    if not value.is_integer() or value < 1:
        raise SpecError(f"clients-per-round must be a positive count, got {text!r}")
    if value > population:
        raise SpecError(f"clients-per-round {int(value)} is more than the run's {population} clients")
    return int(value)


@lru_cache(maxsize=256)
def _sample(seed: int, population: int, per_round: int, round_: int) -> frozenset[int]:
    if per_round == population:
        return frozenset(range(population))
    key = [hashlib.sha256(f"{seed}/{round_}/{p}".encode()).digest() for p in range(population)]
    return frozenset(sorted(range(population), key=key.__getitem__)[:per_round])


class Sampler:
    """The seeded per-round sample of ``per_round`` of ``population`` partitions (every one when equal)."""

    def __init__(self, seed: int, population: int, per_round: int) -> None:
        if not 1 <= per_round <= population:
            raise SpecError(f"per_round must be in 1..{population}, got {per_round}")
        self.seed = seed
        self.population = population
        self.per_round = per_round

    @property
    def everyone(self) -> bool:
        return self.per_round == self.population

    def clients(self, round_: int) -> frozenset[int]:
        """The partitions that train round ``round_`` (1-based)."""
        return _sample(self.seed, self.population, self.per_round, round_)

    def trains(self, partition: int, round_: int) -> bool:
        return self.everyone or partition in self.clients(round_)

    def next_round(self, partition: int, first: int, last: int) -> int | None:
        """The first round in ``first..last`` that ``partition`` trains, or None."""
        return next((t for t in range(first, last + 1) if self.trains(partition, t)), None)

    def count(self, partition: int, first: int, last: int) -> int:
        """How many rounds in ``first..last`` ``partition`` trains."""
        return sum(self.trains(partition, t) for t in range(first, last + 1))
