"""Robust aggregation, chosen with ``--aggregate`` (config field ``aggregate``):

- ``mean`` (default): FedAvg's example-weighted mean Σ n_k Δ_k / Σ n_k, streamed by the RoundEngine itself.
- ``median``: the coordinate-wise median, Δ̄[i] = median_k Δ_k[i] (Yin et al., ICML 2018).
- ``trimmed-mean:BETA``: per coordinate, drop the BETA fraction of largest and of smallest values, average the
  rest (Yin et al. 2018); 0 ≤ BETA < 0.5.
- ``krum:F``: the one update Δ_k minimising Σ_{j ∈ N_k} ‖Δ_k − Δ_j‖², N_k its n − F − 2 nearest neighbours,
  which tolerates F Byzantine clients out of n > 2F + 2 (Blanchard et al., NeurIPS 2017).

The rules are Flower's own (``flwr.server.strategy.aggregate``); this adapter hands them flat update vectors
as one-layer models. Unlike the mean they ignore the example counts and need every update of the round at
once, which the RoundEngine then keeps for the open round."""

from __future__ import annotations

from functools import partial

import numpy as np

from contract.flower import aggregate_krum, aggregate_median, aggregate_trimmed_avg
from strategies.rounds import Aggregator
from strategies.spec import Spec


def make_aggregator(spec: Spec) -> Aggregator | None:
    """The rule of a parsed ``--aggregate`` spec (``strategies.spec.parse_aggregate``); None for ``mean``, the
    engine's own streaming mean."""
    match spec.name:
        case "median":
            return _median
        case "trimmed-mean":
            return partial(_trimmed_mean, beta=spec.value)
        case "krum":
            return partial(_krum, f=int(spec.value))
    return None


def _as_layers(updates: list[tuple[np.ndarray, int]]) -> list[tuple[list[np.ndarray], int]]:
    return [([update], num_examples) for update, num_examples in updates]


def _median(updates: list[tuple[np.ndarray, int]]) -> np.ndarray:
    return np.asarray(aggregate_median(_as_layers(updates))[0], dtype=np.float32)


def _trimmed_mean(updates: list[tuple[np.ndarray, int]], beta: float) -> np.ndarray:
    return np.asarray(aggregate_trimmed_avg(_as_layers(updates), beta)[0], dtype=np.float32)


def _krum(updates: list[tuple[np.ndarray, int]], f: int) -> np.ndarray:
    return np.asarray(aggregate_krum(_as_layers(updates), num_malicious=f, to_keep=0)[0], dtype=np.float32)
