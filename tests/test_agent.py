"""The edge agent on a device (no Flower): where it finds its data, what a reply carries."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from contract.messages import TrainInstruction, TrainReply
from contract.settings import ClientJob, RunConfig
from edge.agent import AgentError, EdgeAgent, Session
from ml.data import FASHION_MNIST_DIR, DataError, load_dataset
from ml.models import build_model, get_flat_params, param_layout
from strategies.codecs import parse_codec
from strategies.downlink import Broadcast, BroadcastEncoder
from strategies.rounds import Update

RUN = 1  # Flower's run id of the messages


def test_the_devices_data_dir_wins_over_the_runs() -> None:
    """The run was submitted on a machine whose data lives elsewhere: the agent's ``--data-dir`` points at
    this device's copy; without one, a device of the same operator (the local launcher) reads the run's folder."""
    if not FASHION_MNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist is not installed")
    job = RunConfig(
        dataset="fashion-mnist", partition="iid", data_dir="/nonexistent/fashion-mnist", clients=2
    ).client_job()
    for agent, fails in ((EdgeAgent(), True), (EdgeAgent(data_dir=str(FASHION_MNIST_DIR)), False)):
        try:
            if fails:
                with pytest.raises(DataError, match="/nonexistent/fashion-mnist"):
                    agent.session_for(job.to_json(), 0, 2, run_id=RUN)
            else:
                assert agent.session_for(job.to_json(), 0, 2, run_id=RUN).num_examples > 0
        finally:
            agent.stop()


def test_a_device_of_its_own_takes_neither_the_runs_folder_nor_a_hub_data_set_it_did_not_name() -> None:
    """``edgefl client`` names its data set (``own_dataset``): the server's data folder, a path on the device the
    server chose, is never read (the device's own data is), and a hub data set the server asks for is refused in one
    line before anything is fetched, unless it is the one the device's owner named."""
    if not FASHION_MNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist is not installed")
    job = RunConfig(dataset="fashion-mnist", partition="iid", data_dir="/nonexistent/fashion-mnist", clients=2)
    agent = EdgeAgent(own_dataset="fashion-mnist")
    try:
        session = agent.session_for(job.client_job().to_json(), 0, 2, run_id=RUN)
        assert session.num_examples > 0  # the run's folder was not read: the package's copy was
        hub = RunConfig(dataset="hf:someone/else\x1b[2J", partition="iid", clients=2).client_job()
        with pytest.raises(AgentError, match=r"hub data set 'hf:someone/else.*only when its owner names it") as refused:
            agent.session_for(hub.to_json(), 0, 2, run_id=RUN + 1)
        assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)
    finally:
        agent.stop()


def test_the_job_is_parsed_once_per_run_and_refused_when_malformed() -> None:
    job = RunConfig(dataset="digits", partition="iid", clients=2).client_job()
    assert ClientJob.from_json(job.to_json()) == job
    agent = EdgeAgent()
    try:
        session = agent.session_for(job.to_json(), 0, 2, run_id=7)
        assert agent.session_for(job.to_json(), 0, 2, run_id=7) is session  # same run: the same session, not re-parsed
    finally:
        agent.stop()
    for bad in ('{"dataset": "digits"}', "[]", job.to_json().replace('"local-steps": 20', '"local-steps": "20"')):
        with pytest.raises(ValueError):
            ClientJob.from_json(bad)


def test_each_held_message_is_answered_with_the_next_round_ready() -> None:
    """DGA with D = 2 and two messages in flight: the message that brings the global model of round 0 and the
    one beside it are each answered as soon as a round is ready (rounds trained meanwhile go together); a held
    message waits while the session sits at the staleness bound, and once the run will train nothing more here
    a message is answered at once with nothing."""
    job = RunConfig(
        strategy="dga:2", dataset="digits", partition="iid", clients=2, rounds=3, local_steps=2
    ).client_job()
    model = build_model(load_dataset("digits"), job.seed)
    params, layout = get_flat_params(model), param_layout(model)
    broadcast = BroadcastEncoder(parse_codec("none"), params, layout).broadcast(0, params)
    agent = EdgeAgent(transport="fast")
    try:
        first = agent.train(TrainInstruction(job.to_json(), 1, 3, broadcast), 0, 2, RUN)
        assert first.updates and first.updates[0].round == 1
        assert all(u.num_examples > 0 and u.payload for u in first.updates)
        assert first.transport == "fast" and first.partition_id == 0 and first.held_s > 0
        rounds = [u.round for u in first.updates]
        while rounds[-1] < 3:
            rounds += [u.round for u in agent.train(TrainInstruction(job.to_json(), 2, 3, None), 0, 2, RUN).updates]
        assert rounds == [1, 2, 3]  # every round once, in order
        assert agent.train(TrainInstruction(job.to_json(), 4, 3, None), 0, 2, RUN).updates == ()  # the run is over here
    finally:
        agent.stop()


def test_a_session_at_the_staleness_bound_holds_its_message() -> None:
    """D = 1: rounds 1 and 2 need only the start model; round 3 needs the global model of round 1. Until it
    comes, a message with nothing ready is held, not answered empty (which would cost a message cycle for
    nothing); a ready round is due at once, and so is an empty answer once the run will train nothing more."""
    job = RunConfig(strategy="dga:1", dataset="digits", partition="iid", clients=2, rounds=3).client_job()
    session = Session(job, 0, 2)
    session.strategy.receive_global(0, get_flat_params(session.model))

    def finish(round_: int) -> None:
        session.training = True
        session.next_round = round_
        session.finish_round(Update(round_, "none", b"", 1, train_s=1.0, loss=0.0), np.zeros(0, np.float32))

    assert not session.reply_due() and session.can_train()
    finish(1)
    assert session.reply_due()
    assert [u.round for u in session.take_outbox()] == [1]
    finish(2)
    session.take_outbox()
    assert not session.can_train() and not session.reply_due()  # at the bound: held
    session.strategy.receive_global(1, get_flat_params(session.model))
    assert session.can_train()
    finish(3)
    session.take_outbox()
    assert session.reply_due()  # round 3 was the last: nothing more will come


def _start(job: ClientJob) -> Broadcast:
    """The dense broadcast of the seeded start model, as a run's first message to a client carries it."""
    model = build_model(load_dataset("digits"), job.seed)
    params = get_flat_params(model)
    return BroadcastEncoder(parse_codec("none"), params, param_layout(model)).broadcast(0, params)


def _run(agent: EdgeAgent, job: ClientJob, run_id: int) -> list[Update]:
    """One run's messages to partition 0 until it has trained every round: the first brings the start model."""
    updates = list(agent.train(TrainInstruction(job.to_json(), 1, job.rounds, _start(job)), 0, 2, run_id).updates)
    while updates[-1].round < job.rounds:
        updates += agent.train(TrainInstruction(job.to_json(), 2, job.rounds, None), 0, 2, run_id).updates
    return updates


def test_a_second_run_with_the_same_job_trains_from_round_1_in_a_fresh_session() -> None:
    """Runs are told apart by Flower's run id, not by their job: ``compare`` run twice, or a resumed run, sends
    the same job under a new run id and gets a fresh session (no DownlinkError, no update dropped as older); the
    device keeps one session, and a late message of the ended run is refused, not trained again."""
    job = RunConfig(
        strategy="dga:1", dataset="digits", partition="iid", clients=2, rounds=2, local_steps=2
    ).client_job()
    agent = EdgeAgent()
    try:
        first = _run(agent, job, run_id=11)
        second = _run(agent, job, run_id=12)
        with pytest.raises(AgentError, match="run 11 has ended on this device, which trains run 12 now"):
            agent.train(TrainInstruction(job.to_json(), 2, job.rounds, None), 0, 2, 11)
    finally:
        agent.stop()
    assert [u.round for u in first] == [u.round for u in second] == [1, 2]
    # A fresh session: the same seed, start model, data order, codec and DGA state give the same updates.
    assert [u.payload for u in second] == [u.payload for u in first]


def test_the_session_loaded_before_a_run_is_taken_by_its_first_run_only() -> None:
    """``--job`` builds the coming run's session before its run id is known: the first run of that job takes it;
    the next run with the same job gets a new one."""
    job = RunConfig(dataset="digits", partition="iid", clients=2).client_job()
    agent = EdgeAgent()
    try:
        loaded = agent.session_for(job.to_json(), 0, 2, run_id=None)
        assert agent.session_for(job.to_json(), 0, 2, run_id=21) is loaded
        assert agent.session_for(job.to_json(), 0, 2, run_id=22) is not loaded
    finally:
        agent.stop()


def test_a_message_held_by_a_run_that_another_run_replaced_is_answered_at_once() -> None:
    """D = 1 and no new global model: run 31's message for round 3 waits at the staleness bound. Run 32's first
    message replaces the session (a device holds one run's data and model), and the held message is answered
    with the reason instead of waiting forever."""
    job = RunConfig(
        strategy="dga:1", dataset="digits", partition="iid", clients=2, rounds=3, local_steps=2
    ).client_job()
    agent = EdgeAgent()
    held: queue.Queue[BaseException | TrainReply] = queue.Queue()

    def hold() -> None:
        try:
            held.put(agent.train(TrainInstruction(job.to_json(), 3, 3, None), 0, 2, 31))
        except AgentError as exc:
            held.put(exc)

    try:
        rounds = [u.round for u in agent.train(TrainInstruction(job.to_json(), 1, 3, _start(job)), 0, 2, 31).updates]
        while rounds[-1] < 2:
            rounds += [u.round for u in agent.train(TrainInstruction(job.to_json(), 2, 3, None), 0, 2, 31).updates]
        waiting = threading.Thread(target=hold)
        waiting.start()
        assert agent.train(TrainInstruction(job.to_json(), 1, 3, _start(job)), 0, 2, 32).updates[0].round == 1
        answer = held.get(timeout=60)
        waiting.join()
    finally:
        agent.stop()
    assert isinstance(answer, AgentError) and "run 32" in str(answer), answer


def test_a_reply_the_server_lost_is_sent_again_and_the_messages_held_before_are_answered_empty() -> None:
    """FedAvg (D = 0): round 1's reply is lost (another node's forged reply took its message; the SuperLink refuses
    this one as a duplicate), so the server never closes round 1. A message that asks for round 2 is held: round 2
    needs round 1's global model. The server's next message says the reply was lost (``resend``): it is answered
    at once with round 1's update as first sent, and the held message, whose reply the SuperLink would refuse
    too, with nothing — instead of both waiting for a model that cannot come."""
    job = RunConfig(dataset="digits", partition="iid", clients=2, rounds=3, local_steps=2).client_job()
    agent = EdgeAgent()
    held: queue.Queue[BaseException | TrainReply] = queue.Queue()

    def hold() -> None:
        try:
            held.put(agent.train(TrainInstruction(job.to_json(), 2, 3, None), 0, 2, RUN))
        except AgentError as exc:
            held.put(exc)

    try:
        (lost,) = agent.train(TrainInstruction(job.to_json(), 1, 3, _start(job)), 0, 2, RUN).updates
        waiting = threading.Thread(target=hold)
        waiting.start()
        deadline = time.monotonic() + 60
        while agent._arrivals < 2:  # the held message has been taken
            assert time.monotonic() < deadline and held.empty(), "the second message was not held"
            time.sleep(0.01)
        again = agent.train(TrainInstruction(job.to_json(), 1, 3, None, resend=True), 0, 2, RUN)
        answer = held.get(timeout=60)
        waiting.join()
    finally:
        agent.stop()
    assert [(u.round, u.payload) for u in again.updates] == [(1, lost.payload)]
    assert isinstance(answer, TrainReply) and answer.updates == ()


def test_kept_updates_last_until_the_global_model_of_their_round() -> None:
    """What a resend may carry: updates answered, until a global model that closes their round arrives."""
    job = RunConfig(strategy="dga:1", dataset="digits", partition="iid", clients=2, rounds=3).client_job()
    session = Session(job, 0, 2)
    start = _start(job)
    session.take_instruction(TrainInstruction(job.to_json(), 1, 3, start))
    for round_ in (1, 2):
        session.finish_round(Update(round_, "none", b"x", 1), np.zeros(0, np.float32))
    answered = session.take_outbox()
    assert [u.round for u in answered] == [1, 2] and session.kept_from(1) == []  # kept only once answered
    session.keep(answered)
    assert [u.round for u in session.kept_from(1)] == [1, 2] and [u.round for u in session.kept_from(2)] == [2]
    model = get_flat_params(session.model)
    round_1 = BroadcastEncoder(parse_codec("none"), model, session.layout).broadcast(1, model)
    session.take_instruction(TrainInstruction(job.to_json(), 3, 3, round_1))
    assert [u.round for u in session.kept_from(1)] == [2]
