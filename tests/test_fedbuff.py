"""FedBuff: the staleness weight and the buffer against hand-computed numbers, and the round engine's
asynchronous steps (no Flower)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from contract.settings import ConfigError, build_config
from strategies.fedbuff import FedBuffServer, StalenessBuffer, staleness_weight
from strategies.rounds import RoundEngine
from tests.test_rounds import LAYOUT, _update


def test_the_staleness_weight_is_one_over_the_root_of_one_plus_tau() -> None:
    assert [staleness_weight(t) for t in (0, 3, 8)] == [1.0, 0.5, pytest.approx(1 / 3)]
    with pytest.raises(AssertionError):  # strategies.rounds never counts a negative staleness
        staleness_weight(-1)


def test_a_step_is_the_server_lr_times_the_staleness_weighted_sum_over_k() -> None:
    """K = 3, η_g = 0.6: updates 3, 6, 9 with staleness 0, 3, 8 → 0.6 · (3·1 + 6·½ + 9·⅓) / 3 = 1.8."""
    buffer = StalenessBuffer(2, server_lr=0.6)
    for value, tau in ((3.0, 0), (6.0, 3), (9.0, 8)):
        buffer.add(np.full(2, value, np.float32), tau)
    assert buffer.count == 3
    np.testing.assert_allclose(buffer.mean(), [1.8, 1.8], rtol=1e-6)


def test_the_engine_steps_on_every_k_updates_and_weights_the_stale_ones() -> None:
    """3 clients, K = 2. Clients 1 and 2 close step 1; client 3, still on the start model, lands in step 2 with
    τ = 1 next to client 1's fresh update: w₂ = w₁ + (1·s(0) + 8·s(1)) / 2."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=3, strategy=FedBuffServer(2, 1.0))
    for client in (1, 2, 3):
        request = engine.next_request(client)
        assert request is not None and (request.next_round, request.global_round) == (1, 0)
    engine.receive(1, [_update([2, 2, 2, 2], 1)])
    assert engine.close_rounds(now=0) == []
    assert engine.next_request(1) is None  # it gave step 1 its update: nothing until the model moves
    engine.receive(2, [_update([4, 4, 4, 4], 1)])
    (step,) = engine.close_rounds(now=0)
    assert (step.round, sorted(step.clients), step.closed_by) == (1, [1, 2], "buffer")
    np.testing.assert_allclose(engine.global_params, [3, 3, 3, 3])
    assert engine.next_request(3) is None  # in flight: it trains on the start model still
    request = engine.next_request(1)
    assert request is not None and (request.next_round, request.global_round) == (2, 1)
    assert engine.receive(3, [_update([8, 8, 8, 8], 1)]) == []  # stale by one step, not late
    assert engine.next_request(3) is None  # it already gave step 2 an update
    engine.receive(1, [_update([1, 1, 1, 1], 2)])
    (step,) = engine.close_rounds(now=0)
    assert sorted(step.clients) == [1, 3]
    np.testing.assert_allclose(engine.global_params, 3 + (1 + 8 / math.sqrt(2)) / 2, rtol=1e-6)


def test_fedbuff_settings_that_cannot_work_are_one_line() -> None:
    with pytest.raises(ConfigError, match="more than the 2 clients"):
        build_config(strategy="fedbuff:3", clients=4, clients_per_round="2")
    with pytest.raises(ConfigError, match="aggregate mean"):
        build_config(strategy="fedbuff:2", aggregate="median")
    config = build_config(strategy="fedbuff:2:slr=0.5")
    assert config.strategy == "fedbuff:2:slr=0.5" and config.client_job().strategy_spec.delay == 0


def test_a_refused_update_still_answers_its_step() -> None:
    """K = 2 of 3 clients, client 1's update refused: the step waits, as client 3 may still fill it. K = 2 of 2:
    the step closes on client 2's alone (it could never gather K), client 1 is sent the newest model, and the next
    step takes both."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=2, num_clients=3, strategy=FedBuffServer(2, 1.0))
    for client in (1, 2, 3):
        assert engine.next_request(client) is not None
    engine.receive(1, [_update([1, 1, 1, 1], 1, n=0)])
    engine.receive(2, [_update([4, 4, 4, 4], 1)])
    assert engine.close_rounds(now=0) == []
    engine.receive(3, [_update([2, 2, 2, 2], 1)])
    (step,) = engine.close_rounds(now=0)
    assert (sorted(step.clients), step.closed_by) == ([2, 3], "buffer")

    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=2, num_clients=2, strategy=FedBuffServer(2, 1.0))
    assert engine.next_request(1) is not None and engine.next_request(2) is not None
    (refused,) = engine.receive(1, [_update([1, 1, 1, 1], 1, n=0)])
    assert refused.invalid
    engine.receive(2, [_update([4, 4, 4, 4], 1)])
    (step,) = engine.close_rounds(now=0)
    assert (step.clients, step.closed_by) == ([2], "all") and not engine.stuck
    np.testing.assert_allclose(engine.global_params, [4, 4, 4, 4])
    request = engine.next_request(1)
    assert request is not None and (request.next_round, request.global_round) == (2, 1)
    assert engine.next_request(2) is not None
    engine.receive(1, [_update([2, 2, 2, 2], 2)])
    engine.receive(2, [_update([2, 2, 2, 2], 2)])
    (step,) = engine.close_rounds(now=0)
    assert (sorted(step.clients), step.closed_by) == ([1, 2], "buffer") and engine.done
    np.testing.assert_allclose(engine.global_params, [6, 6, 6, 6])


def test_updates_that_arrive_together_fill_one_step_each() -> None:
    """K = 1 and both clients' updates settled before the loop closes a step (pulled in one call): each step takes
    K of them, the second enters step 2 with τ = 1 (FedBuff's buffer holds K updates), not step 1 with two."""
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=3, num_clients=2, strategy=FedBuffServer(1, 1.0))
    for client in (1, 2):
        engine.next_request(client)
    assert engine.receive(1, [_update([2, 2, 2, 2], 1)]) == []
    assert engine.receive(2, [_update([4, 4, 4, 4], 1)]) == []
    first, second = engine.close_rounds(now=0)
    assert (first.round, first.clients, first.closed_by) == (1, [1], "buffer")
    assert (second.round, second.clients, second.closed_by) == (2, [2], "buffer")
    np.testing.assert_allclose(engine.global_params, 2 + 4 * staleness_weight(1), rtol=1e-6)
