"""The strategy table and what carries a strategy's vector: every edgefl row makes both halves from its parsed
setting and they are the protocol's, the wire carries ``TrainInstruction.state`` exactly and refuses one that does
not add up, and a device refuses a vector that does not fit its model."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from contract.messages import TrainInstruction
from contract.settings import RunConfig
from contract.wire import HEADER, PAYLOAD, RECORD, WireError, instruction_content, parse_instruction
from edge.agent import AgentError, Session
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, param_layout
from strategies.codecs import parse_codec
from strategies.downlink import Broadcast, BroadcastEncoder, Part
from strategies.registry import STRATEGIES, app_of, client_half, parse_strategy, server_half
from strategies.rounds import RoundEngine
from strategies.strategy import ClientHalf, ServerHalf, ServerSetup

# One representative setting per edgefl row: a new row without one here fails the first test.
TEXTS = {"fedavg": "fedavg", "dga": "dga:2", "fedbuff": "fedbuff:2", "fedprox": "fedprox:0.1", "scaffold": "scaffold"}


def _members(protocol: type) -> dict[str, object]:
    """The protocol's own members (methods and properties), as declared in ``strategies.strategy``."""
    return {name: value for name, value in vars(protocol).items() if not name.startswith("_")}


def _parameters(function: object) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def _satisfies(half: object, protocol: type) -> None:
    """``half`` has every member of ``protocol``; each method takes the protocol's parameters, by name."""
    for name, member in _members(protocol).items():
        assert hasattr(half, name), f"{type(half).__name__} has no {name}"
        if callable(member):
            assert callable(getattr(half, name)), f"{type(half).__name__}.{name} is not a method"
            assert _parameters(getattr(type(half), name)) == _parameters(member), f"{type(half).__name__}.{name}"


def test_the_protocols_are_what_the_halves_are_checked_against() -> None:
    """A guard on the check below: it compares the members the protocols really declare."""
    assert {"receive_global", "record_sent", "can_start", "start_params", "objective", "global_round"} <= set(
        _members(ClientHalf)
    )
    assert {"open", "add", "close", "message_state", "state", "restore", "delay", "buffer"} <= set(_members(ServerHalf))


def test_every_edgefl_row_has_a_representative_setting() -> None:
    assert {name for name, row in STRATEGIES.items() if row.app == "edgefl"} == set(TEXTS)
    assert all(row.name == name for name, row in STRATEGIES.items())


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_row_makes_both_halves_from_its_setting(name: str) -> None:
    """The parsed setting names its row and its label parses back to it; the row's halves are the protocol's and
    the server half's D and K are the setting's (they set the engine's schedule)."""
    settings = parse_strategy(TEXTS[name])
    assert settings.name == name and settings.label == TEXTS[name]
    assert parse_strategy(settings.label) == settings and app_of(settings) == "edgefl"
    client = client_half(settings)
    server = server_half(settings, ServerSetup(size=4, clients=2, local_steps=3, momentum=0.0))
    _satisfies(client, ClientHalf)
    _satisfies(server, ServerHalf)
    assert (server.delay, server.buffer) == (settings.delay, settings.buffer)
    assert client.global_round == -1 and not client.can_start(1)  # nothing received: no round may start
    client.receive_global(0, np.zeros(4, np.float32))
    assert client.can_start(1) and client.objective(client.start_params()) is not None
    assert server.message_state(0) is None  # nothing learnt yet: nothing sent beside the model


def test_flowers_own_fedavg_has_no_edgefl_halves() -> None:
    settings = parse_strategy("flower-fedavg")
    assert app_of(settings) == "flower" and settings.label == "flower-fedavg"
    with pytest.raises(ValueError, match="Flower's own"):
        client_half(settings)


# ----- the wire --------------------------------------------------------------------------------------------------
BROADCAST = Broadcast(2, (Part(3, "edgefl.topk.v1", b"abc"), Part(5, "edgefl.int8.v1", b"defg")))
STATE = np.array([0.5, -0.0, 1e-38, -3.25e7, np.float32(np.pi), 0.0], np.float32)


def test_the_wire_carries_the_strategys_vector_exactly() -> None:
    """A float32 vector sent with a broadcast comes back bit for bit (−0.0 and a subnormal too), as float32, and
    the broadcast with it; an instruction without one comes back with none."""
    instr = TrainInstruction('{"dataset": "digits"}', 3, 7, BROADCAST, state=STATE)
    parsed = parse_instruction(instruction_content(instr))
    assert parsed.state is not None and parsed.state.dtype == np.float32
    assert parsed.state.tobytes() == STATE.tobytes()
    assert parsed.broadcast == BROADCAST
    assert (parsed.job, parsed.next_round, parsed.last_round, parsed.reply_key) == (
        instr.job, 3, 7, instr.reply_key
    )  # fmt: skip
    assert parse_instruction(instruction_content(TrainInstruction("{}", 1, 1, BROADCAST))).state is None
    float64 = TrainInstruction("{}", 1, 1, BROADCAST, state=STATE.astype(np.float64))
    assert parse_instruction(instruction_content(float64)).state.tobytes() == STATE.tobytes()


def _with_header(content: RecordDict, **header: object) -> RecordDict:
    record = content.config_records[RECORD]
    changed = {**json.loads(record[HEADER]), **header}
    return RecordDict({RECORD: ConfigRecord({HEADER: json.dumps(changed), PAYLOAD: record[PAYLOAD]})})


@pytest.mark.parametrize("values", [len(STATE) + 3, 10_000, len(STATE) + 1, -1, "6", True, 6.0])
def test_a_state_size_that_does_not_fit_the_payload_is_a_wire_error(values: object) -> None:
    """More values than the payload holds, more than leaves the broadcast its bytes, or not a count at all."""
    content = instruction_content(TrainInstruction("{}", 1, 1, BROADCAST, state=STATE))
    with pytest.raises(WireError):
        parse_instruction(_with_header(content, state=values))


def test_a_state_without_a_broadcast_is_a_wire_error() -> None:
    content = instruction_content(TrainInstruction("{}", 1, 1, None, state=STATE))
    with pytest.raises(WireError, match="without a broadcast"):
        parse_instruction(content)


def test_a_state_size_that_hides_payload_bytes_is_a_wire_error() -> None:
    """Fewer values than sent: the rest of the vector is taken for the broadcast's bytes, which do not add up."""
    content = instruction_content(TrainInstruction("{}", 1, 1, BROADCAST, state=STATE))
    with pytest.raises(WireError):
        parse_instruction(_with_header(content, state=len(STATE) - 1))


# ----- the device ------------------------------------------------------------------------------------------------
def test_a_device_refuses_a_vector_that_does_not_fit_its_model() -> None:
    """SCAFFOLD's correction must have one value per parameter: one too many or too few is an AgentError and
    the client half is not told; one of the right length becomes its local steps' drift."""
    job = RunConfig(strategy="scaffold", dataset="digits", partition="iid", clients=2, rounds=3).client_job()
    dataset = load_dataset("digits")
    model = build_model(dataset, job.seed)
    params = get_flat_params(model)
    broadcast = BroadcastEncoder(parse_codec("none"), params, param_layout(model)).broadcast(0, params)
    session = Session(job, 0, 2, data=dataset)  # the whole set stands for the partition: only its shape matters
    for size in (params.size + 1, params.size - 1, 1):
        with pytest.raises(AgentError, match=f"has {size} values, the model {params.size}"):
            session.take_instruction(TrainInstruction(job.to_json(), 1, 3, broadcast, state=np.zeros(size, np.float32)))
        assert session.strategy.global_round == -1
    drift = np.linspace(-1, 1, params.size, dtype=np.float32)
    session.take_instruction(TrainInstruction(job.to_json(), 1, 3, broadcast, state=drift))
    assert session.strategy.global_round == 0
    np.testing.assert_array_equal(session.strategy.objective(session.strategy.start_params()).drift, drift)


@pytest.mark.parametrize(
    ("strategy", "codec"), [("fedprox:0.1", "topk:0.1"), ("scaffold", "topk:0.1"), ("scaffold", "int8")]
)
def test_fedprox_and_scaffold_compose_with_partial_participation_and_the_codecs(strategy: str, codec: str) -> None:
    """Three rounds, 2 of 3 partitions a round, an uplink codec: the devices' sessions and the server's round engine
    (decode, validation, the strategy's sum and step) without Flower. Every round closes with its sampled clients'
    updates and moves the global model; SCAFFOLD's server then holds a variate for each client that trained, and a
    client's next message carries its correction c − c_i."""
    config = RunConfig(strategy=strategy, compress=codec, dataset="digits", partition="iid", clients=3,
                       clients_per_round="2", rounds=3, local_steps=3)  # fmt: skip
    job = config.client_job()
    dataset = load_dataset("digits")
    sessions = [Session(job, j, 3, data=dataset) for j in range(3)]
    start = get_flat_params(sessions[0].model)
    setup = ServerSetup(start.size, 3, job.local_steps, job.local_momentum, lambda _round: job.lr)
    half = server_half(config.strategy_spec, setup)
    engine = RoundEngine(start, sessions[0].layout, rounds=3, num_clients=3, sampler=job.sampler(), strategy=half)
    trained: set[int] = set()
    for round_ in (1, 2, 3):
        before = engine.global_params.copy()
        for j, session in enumerate(sessions):
            request = engine.next_request(j, j)
            if request is None:
                continue
            assert request.next_round == round_
            if strategy == "scaffold" and j in trained:
                np.testing.assert_array_equal(request.state, half.message_state(j))
            session.strategy.receive_global(request.global_round, request.global_params, request.state)
            update, sent = session.train_one_round(round_, session.strategy.start_params())
            session.strategy.record_sent(round_, sent)
            assert engine.receive(j, [update], j) == []
            trained.add(j)
        (closed,) = engine.close_rounds(now=0.0)
        assert closed.round == round_ and sorted(closed.clients) == sorted(job.sampler().clients(round_))
        assert np.isfinite(engine.global_params).all() and not np.array_equal(engine.global_params, before)
    expected = {"c", *(f"c/{j}" for j in sorted(trained))} if strategy == "scaffold" else set()
    assert set(half.state()) == expected
