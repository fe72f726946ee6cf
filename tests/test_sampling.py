"""Partial participation: the seeded per-round sample, and how the round engine and the agent follow it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from contract.messages import TrainInstruction
from contract.settings import RunConfig, build_config
from edge.agent import EdgeAgent
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, param_layout
from strategies.codecs import parse_codec
from strategies.dga import DGAServer
from strategies.downlink import BroadcastEncoder
from strategies.rounds import RoundEngine
from strategies.sampling import Sampler, parse_clients_per_round
from strategies.spec import SpecError
from tests.test_rounds import LAYOUT, _update


def test_a_round_samples_m_distinct_clients_from_the_seed_and_the_round_alone() -> None:
    sampler = Sampler(seed=7, population=100, per_round=10)
    rounds = [sampler.clients(t) for t in range(1, 401)]
    assert all(len(s) == 10 and s <= set(range(100)) for s in rounds)  # without replacement, within N
    assert Sampler(7, 100, 10).clients(3) == rounds[2]  # the same seed and round: the same sample, on any end
    assert Sampler(8, 100, 10).clients(3) != rounds[2]
    assert len(set(rounds)) == len(rounds)  # rounds are not all alike
    # Uniform: every client is sampled about M/N = 10 % of 400 rounds (binomial sd 6: a 5-sd band).
    counts = np.bincount([p for s in rounds for p in s], minlength=100)
    assert counts.min() >= 10 and counts.max() <= 70


def test_the_sample_is_the_first_m_clients_by_the_hash_of_seed_round_and_client() -> None:
    """Hand-worked: the order the module's docstring defines, computed here with hashlib directly."""
    keys = {p: hashlib.sha256(f"3/5/{p}".encode()).digest() for p in range(6)}
    assert Sampler(3, 6, 2).clients(5) == frozenset(sorted(keys, key=keys.__getitem__)[:2])


def test_everyone_trains_every_round_without_partial_participation() -> None:
    sampler = Sampler(0, 4, 4)
    assert sampler.everyone and sampler.clients(9) == {0, 1, 2, 3}
    assert sampler.next_round(2, 5, 9) == 5 and sampler.count(2, 5, 9) == 5


def test_next_round_and_count_follow_the_sample() -> None:
    sampler = Sampler(1, 10, 3)
    mine = [t for t in range(1, 31) if 4 in sampler.clients(t)]
    assert sampler.next_round(4, 1, 30) == mine[0]
    assert sampler.next_round(4, mine[0] + 1, 30) == mine[1]
    assert sampler.count(4, 1, 30) == len(mine)
    assert sampler.next_round(4, mine[-1] + 1, 30) is None


@pytest.mark.parametrize(
    ("text", "expected"), [("all", 10), ("3", 3), ("10", 10), ("0.5", 5), ("0.25", 3), ("0.01", 1), ("1.0", 10)]
)
def test_clients_per_round_is_a_count_or_a_fraction(text: str, expected: int) -> None:
    assert parse_clients_per_round(text, 10) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("11", "more than the run's 10"), ("0", "positive count"), ("0.0", r"\(0, 1\]"), ("1.5", r"\(0, 1\]"),
     ("-2", "positive count"), ("half", "'all', a count or a fraction")],
)  # fmt: skip
def test_bad_clients_per_round_is_one_line(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):  # an EdgeflError: the command prints it in one line, exit 2
        build_config(clients=10, clients_per_round=text)


def test_the_run_config_carries_the_count_to_every_device() -> None:
    config = build_config(clients=8, clients_per_round="0.5", seed=4)
    assert config.per_round == 4 and config.client_job().clients_per_round == 4
    assert config.client_job().sampler().clients(2) == Sampler(4, 8, 4).clients(2)
    assert RunConfig().per_round == RunConfig().clients  # "all" by default


def test_the_engine_asks_only_the_sampled_clients_and_closes_on_their_answers() -> None:
    """FedAvg, 4 clients, 2 per round: a client is sent a message only for a round it is sampled in, and a round
    closes once its two have answered; an update for a round the client sits out is refused."""
    sampler = Sampler(seed=2, population=4, per_round=2)
    engine = RoundEngine(np.zeros(4, np.float32), LAYOUT, rounds=6, num_clients=4, sampler=sampler)
    for round_ in range(1, 7):
        sampled = sampler.clients(round_)
        asked = {p for p in range(4) if engine.next_request(100 + p, p) is not None}
        assert asked == sampled
        outsider = min(set(range(4)) - sampled)
        rejection = engine.receive(100 + outsider, [_update([9, 9, 9, 9], round_)], outsider)
        assert [r.reason.split(":")[0] for r in rejection] == ["unrequested"]
        first, second = sorted(sampled)
        engine.receive(100 + first, [_update([1, 1, 1, 1], round_)], first)
        assert engine.close_rounds(now=0) == []
        engine.receive(100 + second, [_update([3, 3, 3, 3], round_)], second)
        closed = engine.close_rounds(now=0)
        assert [(c.round, sorted(c.clients), c.closed_by) for c in closed] == [(round_, [first, second], "all")]
    np.testing.assert_allclose(engine.global_params, [12, 12, 12, 12])  # six rounds of mean(1, 3)


def test_dga_with_gaps_a_client_back_after_sitting_out_is_sent_the_newest_global_model() -> None:
    """D = 1, 3 clients, 1 per round: whoever is sampled for round t is sent the global model of round t − 1 or
    newer with its request, however long it sat out (the staleness bound holds per round); an update for the next
    round, which D = 1 would allow, is refused when the client is not sampled for it."""
    sampler = Sampler(seed=5, population=3, per_round=1)
    engine = RoundEngine(
        np.zeros(4, np.float32), LAYOUT, rounds=8, num_clients=3, strategy=DGAServer(1), sampler=sampler
    )
    last_trained = {}
    for round_ in range(1, 9):
        (client,) = sampler.clients(round_)
        request = engine.next_request(client, client)
        assert request is not None and request.next_round == round_
        assert request.global_round is not None and request.global_round >= round_ - 2
        ahead = [] if client in sampler.clients(round_ + 1) else [_update([9, 9, 9, 9], round_ + 1)]
        rejections = engine.receive(client, [_update([1, 1, 1, 1], round_), *ahead], client)
        assert [r.reason for r in rejections] == ["unrequested: the client is not sampled for that round"] * len(ahead)
        assert [c.round for c in engine.close_rounds(now=0)] == [round_]
        last_trained[round_] = round_ - max((t for t in last_trained if client in sampler.clients(t)), default=0)
    assert max(last_trained.values()) > 2  # some client did sit out rounds


def test_dga_with_gaps_a_client_with_nothing_in_flight_starts_from_the_newest_model() -> None:
    """D = 2, 3 clients, 1 per round: a client whose every update is aggregated is asked for round t only once
    round t − 1 has closed, and sent that model — not two rounds early with an older one it cannot correct."""
    sampler = Sampler(seed=5, population=3, per_round=1)
    engine = RoundEngine(
        np.zeros(4, np.float32), LAYOUT, rounds=8, num_clients=3, strategy=DGAServer(2), sampler=sampler
    )
    for round_ in range(1, 9):
        requests = {c: engine.next_request(c, c) for c in range(3)}
        (client,) = sampler.clients(round_)
        assert (requests[client].next_round, requests[client].global_round) == (round_, round_ - 1)
        assert all(request is None for other, request in requests.items() if other != client)
        engine.receive(client, [_update([1, 1, 1, 1], round_)], client)
        assert [c.round for c in engine.close_rounds(now=0)] == [round_]


def test_the_agent_trains_only_the_rounds_its_partition_is_sampled_in() -> None:
    """DGA with D = 3, 2 of 4 clients per round: of the rounds 1..4 the global model of round 0 unlocks, the agent
    trains and sends the ones this partition is sampled for, and only those (each as soon as it is ready)."""
    config = RunConfig(strategy="dga:3", dataset="digits", partition="iid", clients=4, clients_per_round="2",
                       rounds=4, local_steps=2)  # fmt: skip
    job = config.client_job()
    model = build_model(load_dataset("digits"), job.seed)
    params, layout = get_flat_params(model), param_layout(model)
    broadcast = BroadcastEncoder(parse_codec("none"), params, layout).broadcast(0, params)
    partition = next(p for p in range(4) if 0 < job.sampler().count(p, 1, 4) < 4)
    sampled = [t for t in range(1, 5) if partition in job.sampler().clients(t)]
    agent = EdgeAgent()
    try:
        rounds = [
            u.round for u in agent.train(TrainInstruction(job.to_json(), 1, 4, broadcast), partition, 4, 1).updates
        ]
        while rounds[-1] < sampled[-1]:
            rounds += [
                u.round for u in agent.train(TrainInstruction(job.to_json(), 1, 4, None), partition, 4, 1).updates
            ]
    finally:
        agent.stop()
    assert rounds == sampled
