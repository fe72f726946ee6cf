"""The edge agent on a device (no Flower): where it finds its data, what a reply carries."""

from __future__ import annotations

import numpy as np
import pytest

from contract.messages import TrainInstruction
from contract.settings import ClientJob, RunConfig
from edge.agent import EdgeAgent, Session
from ml.data import FASHION_MNIST_DIR, DataError, load_dataset
from ml.models import build_model, get_flat_params, param_layout
from strategies.codecs import parse_codec
from strategies.downlink import BroadcastEncoder
from strategies.rounds import Update


def test_the_devices_data_dir_wins_over_the_runs() -> None:
    """The run was submitted on a machine whose data lives elsewhere: the agent's ``--data-dir`` points at
    this device's copy."""
    if not FASHION_MNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist is not installed")
    job = RunConfig(
        dataset="fashion-mnist", partition="iid", data_dir="/nonexistent/fashion-mnist", clients=2
    ).client_job()
    with pytest.raises(DataError, match="/nonexistent/fashion-mnist"):
        Session(job, 0, 2)
    session = Session(job, 0, 2, data_dir=str(FASHION_MNIST_DIR))
    assert session.num_examples > 0


def test_the_job_is_parsed_once_per_run_and_refused_when_malformed() -> None:
    job = RunConfig(dataset="digits", partition="iid", clients=2).client_job()
    assert ClientJob.from_json(job.to_json()) == job
    agent = EdgeAgent()
    try:
        session = agent.session_for(job.to_json(), 0, 2)
        assert agent.session_for(job.to_json(), 0, 2) is session  # same run: the same session, not re-parsed
    finally:
        agent.stop()
    for bad in ('{"dataset": "digits"}', "[]", job.to_json().replace('"local-steps": 20', '"local-steps": "20"')):
        with pytest.raises(ValueError):
            ClientJob.from_json(bad)


def test_a_reply_carries_every_round_the_global_model_unlocks() -> None:
    """DGA with D = 2: the message that brings the global model of round 0 is answered with rounds 1..3, all
    of them (the staleness bound), not just the first one ready; a message that brings nothing new is
    answered at once with nothing."""
    job = RunConfig(
        strategy="dga:2", dataset="digits", partition="iid", clients=2, rounds=10, local_steps=2
    ).client_job()
    model = build_model(load_dataset("digits"), job.seed)
    params, layout = get_flat_params(model), param_layout(model)
    broadcast = BroadcastEncoder(parse_codec("none"), params, layout).broadcast(0, params)
    agent = EdgeAgent(transport="fast")
    try:
        reply = agent.train(TrainInstruction(job.to_json(), 1, 3, broadcast), 0, 2)
        assert [u.round for u in reply.updates] == [1, 2, 3]
        assert all(u.num_examples > 0 and u.payload for u in reply.updates)
        assert reply.transport == "fast" and reply.partition_id == 0
        reply = agent.train(TrainInstruction(job.to_json(), 4, 3, None), 0, 2)
        assert reply.updates == ()
    finally:
        agent.stop()


def test_the_agent_replies_early_when_the_rounds_left_fill_the_round_trip() -> None:
    """D = 2 with 1 s rounds and a 1.5 s round trip measured: the agent answers with rounds 1 and 2 and trains
    round 3 while the reply travels (then it is at the bound); with the trip longer than three rounds, or not
    yet measured, it answers only at the bound."""
    job = RunConfig(strategy="dga:2", dataset="digits", partition="iid", clients=2, rounds=10).client_job()
    session = Session(job, 0, 2)
    session.take_global(0, get_flat_params(session.model), now=0.0)

    def finish(round_: int) -> None:
        session.training = True
        session.next_round = round_
        session.finish_round(Update(round_, "none", b"", 1, train_s=1.0, loss=0.0), np.zeros(0, np.float32))

    finish(1)
    session.round_trip_s = 1.5
    assert not session.reply_due()  # 1 ready, 2 left
    finish(2)
    assert session.reply_due()  # 2 ready, 1 left (⌈1.5 s / 1 s⌉ = 2 would do)
    assert [u.round for u in session.take_outbox(now=5.0)] == [1, 2]
    assert not session.reply_due()  # round 3 is left to train
    finish(3)
    assert session.reply_due()  # at the bound: round 4 needs the global model of round 1
    session.take_outbox(now=6.0)
    session.take_global(3, get_flat_params(session.model), now=16.0)
    assert session.round_trip_s == pytest.approx(0.5 * 1.5 + 0.5 * 10.0)  # measured: reply at 6 s, model at 16 s
    finish(4)
    finish(5)
    assert not session.reply_due()  # 5.75 s ≥ 3 rounds: the trip cannot be hidden, so at the bound
    session.round_trip_s = None
    assert not session.reply_due()
