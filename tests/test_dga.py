"""DGA's client bookkeeping: the correction arithmetic by hand, the staleness bound, D = 0 against a textbook
FedAvg, and the FL form against the paper's per-step pseudocode."""

import numpy as np
import pytest

from strategies.codecs import make_client_codec, parse_codec
from strategies.dga import DelayedAveragingClient, DGAServer, dga_sgd_step, regime_bounds
from strategies.rounds import RoundEngine, Update

LAYOUT = (("w", (3,)),)


def test_correction_swaps_own_update_for_the_average_by_hand() -> None:
    client = DelayedAveragingClient(delay=2)
    client.receive_global(0, np.array([1.0, 1.0, 1.0], dtype=np.float32))
    client.record_sent(1, np.array([0.5, 0.0, 0.0], dtype=np.float32))
    client.record_sent(2, np.array([0.0, 0.25, 0.0], dtype=np.float32))
    # Local model = global_0 + Δ¹ + Δ².
    np.testing.assert_array_equal(client.start_params(), [1.5, 1.25, 1.0])
    # The global model of round 1 arrives: average of round 1 was [0.1, 0.1, 0.1].
    client.receive_global(1, np.array([1.1, 1.1, 1.1], dtype=np.float32))
    # w ← w − Δ¹ + Δ̄¹  =  [1.5−0.5+0.1, 1.25+0.1, 1.0+0.1]
    np.testing.assert_allclose(client.start_params(), [1.1, 1.35, 1.1], rtol=0, atol=1e-6)
    assert client.pending_rounds == [2]


def test_without_correction_the_client_restarts_from_the_stale_global() -> None:
    client = DelayedAveragingClient(delay=2, correction=False)
    client.receive_global(0, np.zeros(3, dtype=np.float32))
    client.record_sent(1, np.ones(3, dtype=np.float32))
    np.testing.assert_array_equal(client.start_params(), np.zeros(3))


def test_staleness_bound() -> None:
    client = DelayedAveragingClient(delay=2)
    assert not client.can_start(1)  # nothing received yet
    client.receive_global(0, np.zeros(3, dtype=np.float32))
    assert client.can_start(3) and not client.can_start(4)
    client.receive_global(1, np.zeros(3, dtype=np.float32))
    assert client.can_start(4)
    client.receive_global(0, np.ones(3, dtype=np.float32))  # an older model arriving late is ignored
    assert client.global_round == 1


def _quadratic_grad(w: np.ndarray, target: np.ndarray) -> np.ndarray:
    return (w - target).astype(np.float32)


def _run_engine(delay: int, correction: bool, rounds: int, targets: list[np.ndarray], lr: float) -> np.ndarray:
    """Drive RoundEngine with in-process DGA clients doing K = 1 plain SGD steps on f_j = ½‖w − t_j‖²,
    clients running ahead as far as the staleness bound allows."""
    w0 = np.zeros(3, dtype=np.float32)
    engine = RoundEngine(w0, LAYOUT, rounds=rounds, num_clients=len(targets), strategy=DGAServer(delay))
    clients = [DelayedAveragingClient(delay, correction) for _ in targets]
    codecs = [make_client_codec(parse_codec("none"), LAYOUT, seed=0) for _ in targets]
    next_round = [1] * len(targets)
    while not engine.done:
        for j, target in enumerate(targets):
            request = engine.next_request(j)
            if request is None:
                continue
            if request.global_params is not None:
                clients[j].receive_global(request.global_round, request.global_params)
            contributions = []
            while next_round[j] <= rounds and clients[j].can_start(next_round[j]):
                start = clients[j].start_params()
                update = (-lr * _quadratic_grad(start, target)).astype(np.float32)
                encoded = codecs[j].encode(update, next_round[j])
                stype, payload = encoded.stype, encoded.payload
                clients[j].record_sent(next_round[j], update)
                contributions.append(Update(next_round[j], stype, payload, 1))
                next_round[j] += 1
                if delay == 0:
                    break
            assert not engine.receive(j, contributions)
        engine.close_rounds(now=0.0)
    return engine.global_params


def test_regime_bounds_say_what_dga_can_gain_and_the_delay_that_hides_the_path() -> None:
    """FedAvg's round is T + R, DGA's at best T: at most 1 + R/T. Two messages in flight hide R with
    D ≥ ⌈R/T⌉ (R = 2.5 s behind 1 s rounds: 3); one in flight needs 2⌈R/T⌉ − 1 (5)."""
    assert regime_bounds(2.5, 1.0) == (3.5, 3)
    assert regime_bounds(2.5, 1.0, in_flight=1) == (3.5, 5)
    assert regime_bounds(0.5, 2.0) == (1.25, 1)  # a path shorter than a round: one round of delay hides it


def test_dga_with_zero_delay_is_exactly_fedavg() -> None:
    targets = [
        np.array([1, 2, 3], np.float32),
        np.array([-3, 0, 1], np.float32),
        np.array([0, 5, -2], np.float32),
    ]
    lr, rounds = 0.3, 6
    w = np.zeros(3, dtype=np.float32)
    for _ in range(rounds):  # textbook FedAvg, K = 1, equal weights
        updates = [(-lr * _quadratic_grad(w, t)).astype(np.float32) for t in targets]
        mean = (np.sum(np.array(updates, dtype=np.float64), axis=0) / len(targets)).astype(np.float32)
        w = (w + mean).astype(np.float32)
    np.testing.assert_array_equal(_run_engine(0, True, rounds, targets, lr), w)


def test_fl_form_matches_the_papers_per_step_pseudocode() -> None:
    """K = 1, plain SGD, constant lr, globals delivered exactly D rounds late: the FL form's model equals
    the per-step rule W ← W − lr·(g − G[i−D] + avg_g[i−D]) on every worker, at every step."""
    rng = np.random.default_rng(0)
    targets = [rng.normal(size=3).astype(np.float32) for _ in range(3)]
    delay, rounds, lr = 2, 9, 0.2
    workers = [np.zeros(3, np.float32) for _ in targets]
    own: list[list[np.ndarray]] = [[] for _ in targets]
    averages: list[np.ndarray] = []
    clients = [DelayedAveragingClient(delay) for _ in targets]
    history = {0: np.zeros(3, np.float32)}
    for client in clients:
        client.receive_global(0, history[0])
    for r in range(1, rounds + 1):
        i = r - 1
        grads = [_quadratic_grad(w, t) for w, t in zip(workers, targets, strict=True)]
        averages.append(np.mean(grads, axis=0))
        updates = []
        for j, client in enumerate(clients):
            if r - delay - 1 >= 0:
                client.receive_global(r - delay - 1, history[r - delay - 1])
            start = client.start_params()
            np.testing.assert_allclose(start, workers[j], atol=1e-5)
            update = (-lr * _quadratic_grad(start, targets[j])).astype(np.float32)
            client.record_sent(r, update)
            updates.append(update)
            own[j].append(grads[j])
            stale = i - delay
            workers[j] = dga_sgd_step(
                workers[j],
                grads[j],
                own[j][stale] if stale >= 0 else None,
                averages[stale] if stale >= 0 else None,
                lr,
            )
        history[r] = history[r - 1] + np.mean(updates, axis=0).astype(np.float32)
    for j, client in enumerate(clients):
        client.receive_global(rounds - delay, history[rounds - delay])
        np.testing.assert_allclose(client.start_params(), workers[j], atol=1e-5)


@pytest.mark.parametrize("correction", [True, False])
def test_dga_converges_near_the_consensus_optimum(correction: bool) -> None:
    targets = [np.array([4, 0, 0], np.float32), np.array([0, 4, 0], np.float32)]
    w = _run_engine(delay=3, correction=correction, rounds=60, targets=targets, lr=0.1)
    np.testing.assert_allclose(w, [2, 2, 0], atol=0.05)
