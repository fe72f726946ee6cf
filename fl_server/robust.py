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
from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg

from strategies.rounds import Aggregator

AGGREGATE_NAMES = ("mean", "median", "trimmed-mean:BETA", "krum:F")


class AggregateError(ValueError):
    """An aggregation rule that cannot be used; ``str()`` is one line for the user."""


def _parameter(name: str, args: list[str], text: str) -> str:
    if len(args) != 1:
        raise AggregateError(f"malformed aggregation {text!r}; expected {name}:VALUE")
    return args[0]


def _trimmed_beta(text: str, args: list[str]) -> float:
    value = _parameter("trimmed-mean", args, text)
    try:
        beta = float(value)
    except ValueError:
        raise AggregateError(f"trimmed-mean BETA must be a number, got {value!r}") from None
    if not 0 <= beta < 0.5:
        raise AggregateError(f"trimmed-mean BETA must be in [0, 0.5), got {beta}")
    return beta


def _krum_f(text: str, args: list[str]) -> int:
    value = _parameter("krum", args, text)
    try:
        f = int(value)
    except ValueError:
        raise AggregateError(f"krum F must be an integer, got {value!r}") from None
    if f < 0:
        raise AggregateError(f"krum F must be at least 0, got {f}")
    return f


def make_aggregator(text: str) -> Aggregator | None:
    """The rule named by ``text``; None for ``mean`` (the engine's own streaming mean). Raises AggregateError."""
    name, *args = text.strip().lower().split(":")
    if name == "mean" and not args:
        return None
    if name == "median" and not args:
        return _median
    if name == "trimmed-mean":
        return partial(_trimmed_mean, beta=_trimmed_beta(text, args))
    if name == "krum":
        return partial(_krum, f=_krum_f(text, args))
    raise AggregateError(f"unknown aggregation {text!r}; choose one of: {', '.join(AGGREGATE_NAMES)}")


def _as_layers(updates: list[tuple[np.ndarray, int]]) -> list[tuple[list[np.ndarray], int]]:
    return [([update], num_examples) for update, num_examples in updates]


def _median(updates: list[tuple[np.ndarray, int]]) -> np.ndarray:
    return np.asarray(aggregate_median(_as_layers(updates))[0], dtype=np.float32)


def _trimmed_mean(updates: list[tuple[np.ndarray, int]], beta: float) -> np.ndarray:
    return np.asarray(aggregate_trimmed_avg(_as_layers(updates), beta)[0], dtype=np.float32)


def _krum(updates: list[tuple[np.ndarray, int]], f: int) -> np.ndarray:
    return np.asarray(aggregate_krum(_as_layers(updates), num_malicious=f, to_keep=0)[0], dtype=np.float32)
