"""Robust aggregation, chosen with ``--aggregate`` (config field ``aggregate``):

- ``mean`` (default): FedAvg's example-weighted mean Σ n_k Δ_k / Σ n_k, streamed by the RoundEngine itself.
- ``median``: the coordinate-wise median, Δ̄[i] = median_k Δ_k[i] (Yin et al., ICML 2018).
- ``trimmed-mean:BETA``: per coordinate, drop the BETA fraction of largest and of smallest values, average the
  rest (Yin et al. 2018); 0 ≤ BETA < 0.5.
- ``krum:F``: the one update Δ_k minimising Σ_{j ∈ N_k} ‖Δ_k − Δ_j‖², N_k its n − F − 2 nearest neighbours,
  which tolerates F Byzantine clients out of n > 2F + 2 (Blanchard et al., NeurIPS 2017).
- ``centered-clip:TAU``: centered clipping (Karimireddy, He & Jaggi, "Learning from History for Byzantine Robust
  Optimization", ICML 2021) around the previous round's aggregate v (the first round's: the coordinate-wise
  median), ``CC_ITERATIONS`` times

      v ← v + (1/n) Σ_k (Δ_k − v) · min(1, τ / ‖Δ_k − v‖₂),    τ = TAU · med_k ‖Δ_k − v‖₂,

  so that a client moves the aggregate by at most τ/n from where the run was heading, whichever way it points
  (the round's own spread sets τ: no scale to tune). Flower has no such rule; this one is edgefl's.

Any of them but the mean may be followed by ``:nnm`` (``centered-clip:1:nnm``): nearest-neighbour mixing first
(Allouah et al., "Fixing by Mixing", AISTATS 2023) replaces each update by the mean of its n − f nearest updates (itself
included, L2), f = ⌊``NNM_BYZANTINE_FRACTION`` · n⌋,

    Δ_k ← (1 / (n − f)) Σ_{j ∈ N_k} Δ_j,

which pulls heterogeneous honest updates together and leaves an update far from them (a sign flip) mixed only with
its own kind, so that the rule after it meets a round as homogeneous as an iid one.

The first three are Flower's own (``flwr.server.strategy.aggregate``); this adapter hands them flat update vectors
as one-layer models. Unlike the mean they ignore the example counts and need every update of the round at
once, which the RoundEngine then keeps for the open round. Centered clipping keeps its centre from round to
round, in the run's checkpoint too (``rule_state``, ``restore_rule``)."""

from __future__ import annotations

from functools import partial

import numpy as np

from contract.flower import aggregate_krum, aggregate_median, aggregate_trimmed_avg
from strategies.fedavg import CheckpointError
from strategies.rounds import Aggregator
from strategies.spec import MIXING, Spec
from strategies.validation import l2_norm

NNM_BYZANTINE_FRACTION = 0.25  # f / n: each update is mixed with its n − f nearest


def make_aggregator(spec: Spec) -> Aggregator | None:
    """The rule of a parsed ``--aggregate`` spec (``strategies.spec.parse_aggregate``); None for ``mean``, the
    engine's own streaming mean."""
    rule = _rule(spec)
    return Mixed(rule) if rule is not None and MIXING in spec.options else rule


def rule_state(rule: Aggregator | None) -> dict[str, np.ndarray]:
    """What ``rule`` carries from round to round, for the run's checkpoint (empty for a rule that carries nothing)."""
    return rule.state() if isinstance(rule, (CenteredClip, Mixed)) else {}


def restore_rule(rule: Aggregator | None, state: dict[str, np.ndarray]) -> None:
    """``rule`` as ``rule_state`` saved it; a state for a rule that carries none is refused in one line."""
    if isinstance(rule, (CenteredClip, Mixed)):
        rule.restore(state)
    elif state:
        raise CheckpointError(
            f"the checkpoint holds an aggregation rule's state ({', '.join(state)}); this rule keeps none"
        )


def _rule(spec: Spec) -> Aggregator | None:
    match spec.name:
        case "median":
            return _median
        case "trimmed-mean":
            return partial(_trimmed_mean, beta=spec.value)
        case "krum":
            return partial(_krum, f=int(spec.value))
        case "centered-clip":
            return CenteredClip(spec.value)
    return None


def nearest_neighbour_mixing(updates: list[tuple[np.ndarray, int]]) -> list[tuple[np.ndarray, int]]:
    """Each update replaced by the mean of its n − f nearest in L2 (itself first), its example count kept."""
    stack = np.stack([update.astype(np.float64) for update, _ in updates])
    keep = len(updates) - int(NNM_BYZANTINE_FRACTION * len(updates))
    squared = np.einsum("ij,ij->i", stack, stack)
    distances = squared[:, None] + squared[None, :] - 2 * stack @ stack.T
    np.fill_diagonal(distances, -np.inf)  # itself first, whatever the rounding
    nearest = np.argsort(distances, axis=1, kind="stable")[:, :keep]
    return [(stack[row].mean(axis=0).astype(np.float32), n) for row, (_, n) in zip(nearest, updates, strict=True)]


class Mixed:
    """A robust rule with nearest-neighbour mixing before it (``RULE:nnm``); stateless itself."""

    def __init__(self, rule: Aggregator) -> None:
        self.rule = rule

    def __call__(self, updates: list[tuple[np.ndarray, int]]) -> np.ndarray:
        return self.rule(nearest_neighbour_mixing(updates))

    def state(self) -> dict[str, np.ndarray]:
        return rule_state(self.rule)

    def restore(self, state: dict[str, np.ndarray]) -> None:
        restore_rule(self.rule, state)


def _as_layers(updates: list[tuple[np.ndarray, int]]) -> list[tuple[list[np.ndarray], int]]:
    return [([update], num_examples) for update, num_examples in updates]


def _median(updates: list[tuple[np.ndarray, int]]) -> np.ndarray:
    return np.asarray(aggregate_median(_as_layers(updates))[0], dtype=np.float32)


def _trimmed_mean(updates: list[tuple[np.ndarray, int]], beta: float) -> np.ndarray:
    return np.asarray(aggregate_trimmed_avg(_as_layers(updates), beta)[0], dtype=np.float32)


def _krum(updates: list[tuple[np.ndarray, int]], f: int) -> np.ndarray:
    return np.asarray(aggregate_krum(_as_layers(updates), num_malicious=f, to_keep=0)[0], dtype=np.float32)


CC_ITERATIONS = 3  # the paper's l: a few steps from the previous centre suffice


class CenteredClip:
    """The centered-clipping rule's state: its centre v, the last round's aggregate."""

    def __init__(self, tau_factor: float) -> None:
        self.tau_factor = tau_factor
        self.centre: np.ndarray | None = None

    def __call__(self, updates: list[tuple[np.ndarray, int]]) -> np.ndarray:
        deltas = [update.astype(np.float64) for update, _ in updates]
        centre = np.median(np.stack(deltas), axis=0) if self.centre is None else self.centre
        for _ in range(CC_ITERATIONS):
            offsets = [delta - centre for delta in deltas]
            norms = [l2_norm(offset) for offset in offsets]
            tau = self.tau_factor * float(np.median(norms))
            clipped = [o * min(1.0, tau / n) for o, n in zip(offsets, norms, strict=True) if n > 0]
            centre = centre + sum(clipped, np.zeros_like(centre)) / len(deltas)
        self.centre = centre
        return centre.astype(np.float32)

    def state(self) -> dict[str, np.ndarray]:
        return {} if self.centre is None else {"centre": self.centre.copy()}

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self.centre = np.asarray(state["centre"], dtype=np.float64) if "centre" in state else None
