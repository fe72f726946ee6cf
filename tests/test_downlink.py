"""Compressed downlink: the broadcast format, the delta chain, the client's x̂ against the server's, error
feedback, the lossless case against plain FedAvg, and DGA's sums with both directions compressed."""

from __future__ import annotations

import numpy as np
import pytest

from contract.settings import parse_partition
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, param_layout, set_flat_params
from ml.partition import partition_indices
from ml.trainer import LocalTrainer
from strategies.codecs import make_client_codec, parse_codec, server_compressor
from strategies.codecs.base import dense_payload_size, layout_info
from strategies.dga import DelayedAveragingClient, DGAServer
from strategies.downlink import (
    DENSE_STYPE,
    NO_BASE,
    Broadcast,
    BroadcastDecoder,
    BroadcastEncoder,
    DownlinkError,
    Part,
    reference_delta,
)
from strategies.rounds import RoundEngine, Update

LAYOUT = (("conv", (16, 1, 3, 3)), ("fc", (64, 120)), ("bias", (64,)))
SIZE = layout_info(LAYOUT).size


def global_models(rounds: int, seed: int = 0) -> list[np.ndarray]:
    """A global model moving by a random update every round, the way training moves it."""
    rng = np.random.default_rng(seed)
    models = [rng.standard_normal(SIZE).astype(np.float32) * 0.1]
    for _ in range(rounds):
        models.append((models[-1] + 0.01 * rng.standard_normal(SIZE)).astype(np.float32))
    return models


# --- the message format ---------------------------------------------------------------------------------


def test_broadcast_round_trips_through_header_and_blob() -> None:
    broadcast = Broadcast(3, (Part(4, "edgefl.topk.v1", b"abc"), Part(6, "edgefl.int8.v1", b"defgh")))
    parsed = Broadcast.parse(broadcast.header(), broadcast.blob())
    assert parsed == broadcast and parsed.round == 6


@pytest.mark.parametrize(
    ("change", "blob", "reason"),
    [
        ({"sizes": [3, 4]}, b"abcdefgh", "do not add up"),
        ({"sizes": [-1, 9]}, b"abcdefgh", "do not add up"),
        ({"rounds": [4, 4]}, b"abcdefgh", "strictly increase"),
        ({"rounds": [2, 6]}, b"abcdefgh", "strictly increase"),  # not after the base round 3
        ({"stypes": ["a"]}, b"abcdefgh", "differ in length"),
        ({"base-round": NO_BASE}, b"abcdefgh", "without a base"),
        ({"base-round": "x"}, b"abcdefgh", "not numeric"),
    ],
)
def test_inconsistent_broadcasts_are_refused_with_one_line(change: dict, blob: bytes, reason: str) -> None:
    header = {**Broadcast(3, (Part(4, "s", b"abc"), Part(6, "s", b"defgh"))).header(), **change}
    with pytest.raises(DownlinkError, match=reason) as error:
        Broadcast.parse(header, blob)
    assert "\n" not in str(error.value)


# --- the reference and the chain --------------------------------------------------------------------------


def test_reference_delta_lands_exactly_on_any_target_the_server_can_reach() -> None:
    rng = np.random.default_rng(1)
    reference = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-6, 2, 200_000)).astype(np.float32)
    update = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-6, 2, 200_000)).astype(np.float32)
    # A weight crossing a power of two: plain float32 subtraction misses −8.0 by one unit in the last place.
    reference[0], update[0] = np.float32(0.59532785), np.float32(-8.595328)
    target = reference + update  # how the server's global model moves (apply_update, float32)
    assert reference[0] + (target[0] - reference[0]) != target[0]
    np.testing.assert_array_equal(reference + reference_delta(target, reference), target)


@pytest.mark.parametrize("codec", ["topk:0.01", "stc:0.01", "int8"])
def test_every_client_holds_the_servers_reference_bit_for_bit(codec: str) -> None:
    """Clients that hear every round, every third round, or join late all end with the server's x̂."""
    models = global_models(12)
    encoder = BroadcastEncoder(parse_codec(codec), models[0], LAYOUT)
    clients = {1: BroadcastDecoder(LAYOUT), 3: BroadcastDecoder(LAYOUT), 7: BroadcastDecoder(LAYOUT)}
    for round_, model in enumerate(models[1:], start=1):
        for period, client in clients.items():
            if round_ % period == 0:
                broadcast = encoder.broadcast(round_, model, client.round)
                wire = Broadcast.parse(broadcast.header(), broadcast.blob())
                assert (wire.base_round == NO_BASE) == (client.round == NO_BASE)
                np.testing.assert_array_equal(client.receive(wire), encoder.reference)
                assert client.round == round_
        assert not np.array_equal(encoder.reference, model)  # lossy: x̂ is not the global model


def test_a_chain_is_much_smaller_than_the_model_and_grows_with_the_rounds_missed() -> None:
    models = global_models(4)
    encoder = BroadcastEncoder(parse_codec("topk:0.01"), models[0], LAYOUT)
    first = encoder.broadcast(1, models[1], NO_BASE)
    assert first.base_round == NO_BASE and first.parts[0].stype == DENSE_STYPE
    for round_ in (2, 3, 4):
        encoder.broadcast(round_, models[round_], 1)
    one, three = encoder.broadcast(4, models[4], 3), encoder.broadcast(4, models[4], 1)
    assert [p.round for p in one.parts] == [4] and [p.round for p in three.parts] == [2, 3, 4]
    assert len(three.blob()) == 3 * len(one.blob()) < dense_payload_size(SIZE) / 10
    assert encoder.broadcast(4, models[4], 99).base_round == NO_BASE  # a round it never held: dense


def test_a_chain_larger_than_the_model_is_sent_dense() -> None:
    models = global_models(3)
    encoder = BroadcastEncoder(parse_codec("none"), models[0], LAYOUT)
    assert encoder.broadcast(1, models[1], 0).base_round == 0  # one lossless delta: as large as the model
    encoder.broadcast(3, models[3], 1)  # rounds 2 and 3 close together: one delta
    assert encoder.broadcast(3, models[3], 1).base_round == 1
    assert encoder.broadcast(3, models[3], 0).base_round == NO_BASE  # two deltas would exceed the model


def test_error_feedback_brings_the_reference_to_a_model_that_stops_moving() -> None:
    models = global_models(2)
    encoder = BroadcastEncoder(parse_codec("topk:0.01"), models[0], LAYOUT)
    encoder.broadcast(1, models[1])
    gap = np.linalg.norm(models[1] - encoder.reference)
    for round_ in range(2, 200):
        encoder.broadcast(round_, models[1])  # the global model no longer moves; x̂ still catches up
    assert np.linalg.norm(models[1] - encoder.reference) < 0.01 * gap


def test_a_chain_from_another_round_is_refused_and_one_older_than_the_model_held_ignored() -> None:
    models = global_models(2)
    encoder = BroadcastEncoder(parse_codec("int8"), models[0], LAYOUT)
    client = BroadcastDecoder(LAYOUT)
    stale = encoder.broadcast(1, models[1], 0)  # sent before the dense model of round 1 below reached the client
    client.receive(encoder.broadcast(1, models[1], NO_BASE))
    held = client.reference.copy()
    np.testing.assert_array_equal(client.receive(stale), held)  # it changes nothing, and is not an error
    with pytest.raises(DownlinkError, match="continues from round 0 but this client holds round 1"):
        client.receive(encoder.broadcast(2, models[2], 0))
    corrupt = Broadcast(1, (Part(2, "edgefl.int8.v1", b"\x01\x02"),))
    with pytest.raises(DownlinkError, match=r"broadcast of round 2: .*truncated"):
        client.receive(corrupt)


def test_a_client_that_builds_the_start_model_is_sent_no_model_bytes_and_a_different_one_is_caught() -> None:
    models = global_models(2)
    encoder = BroadcastEncoder(parse_codec("topk:0.01"), models[0], LAYOUT)
    same, other = BroadcastDecoder(LAYOUT), BroadcastDecoder(LAYOUT)
    same.hold(0, models[0])
    other.hold(0, models[0] + np.float32(1e-3))  # e.g. another torch build initialising differently
    first = encoder.broadcast(0, models[0], 0)
    assert first.parts == () and first.blob() == b"" and first.round == 0
    np.testing.assert_array_equal(same.receive(Broadcast.parse(first.header(), first.blob())), models[0])
    with pytest.raises(DownlinkError, match=r"round 0 here has sha256 .* sent whole next"):
        other.receive(first)
    delta = encoder.broadcast(1, models[1], 0)
    assert delta.base_round == 0 and len(delta.blob()) < dense_payload_size(SIZE) / 50
    np.testing.assert_array_equal(same.receive(delta), encoder.reference)
    whole = encoder.broadcast(1, models[1], NO_BASE)  # what the server sends after the refusal
    np.testing.assert_array_equal(other.receive(whole), encoder.reference)


def test_the_engine_assumes_new_clients_hold_the_start_model_only_when_they_can_build_it() -> None:
    w0 = np.zeros(SIZE, dtype=np.float32)
    built = RoundEngine(w0, LAYOUT, rounds=3, num_clients=1, clients_build_start=True).next_request(0)
    sent = RoundEngine(w0, LAYOUT, rounds=3, num_clients=1).next_request(0)
    assert (built.global_round, built.held_round) == (0, 0)
    assert (sent.global_round, sent.held_round) == (0, NO_BASE)
    engine = RoundEngine(w0, LAYOUT, rounds=3, num_clients=1, clients_build_start=True)
    engine.next_request(0)
    engine.fail(0)  # it refused the broadcast (another start model): the model is sent whole
    assert engine.next_request(0).held_round == NO_BASE


# --- through the round engine -----------------------------------------------------------------------------


def federate(down: str | None, rounds: int = 4) -> list[np.ndarray]:
    """FedAvg (D = 0) of 2 clients training a real model on digits; the global model after every round.
    down=None: clients are handed the server's global model itself (plain FedAvg), else the broadcast."""
    dataset = load_dataset("digits")
    parts = partition_indices(dataset, parse_partition("iid"), 2, 0)
    model = build_model(dataset, 0)
    layout = param_layout(model)
    engine = RoundEngine(get_flat_params(model), layout, rounds=rounds, num_clients=2)
    encoder = BroadcastEncoder(parse_codec(down or "none"), engine.global_params, layout)
    decoders = [BroadcastDecoder(layout) for _ in parts]
    codecs = [make_client_codec(parse_codec("none"), layout, seed=j) for j in range(2)]
    trainers = [
        LocalTrainer(build_model(dataset, 0), dataset.x_train[idx], dataset.y_train[idx], 16, 0.05, 0.9, j)
        for j, idx in enumerate(parts)
    ]
    models = []
    while not engine.done:
        for j, trainer in enumerate(trainers):
            request = engine.next_request(j)
            start = request.global_params
            if down is not None:
                broadcast = encoder.broadcast(request.global_round, request.global_params, request.held_round)
                start = decoders[j].receive(Broadcast.parse(broadcast.header(), broadcast.blob()))
            set_flat_params(trainer.model, start)
            trainer.train_steps(5)
            encoded = codecs[j].encode(get_flat_params(trainer.model) - start, request.next_round)
            stype, payload = encoded.stype, encoded.payload
            assert not engine.receive(j, [Update(request.next_round, stype, payload, len(parts[j]))])
        models += [closed.global_params for closed in engine.close_rounds(now=0.0)]
    return models


def test_lossless_codec_both_ways_is_bit_for_bit_plain_fedavg() -> None:
    plain, broadcast = federate(None), federate("none")
    assert len(plain) == len(broadcast) == 4
    for a, b in zip(plain, broadcast, strict=True):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(federate("int8")[-1], plain[-1])  # a lossy downlink does change training


def test_dga_sums_check_out_with_both_directions_compressed() -> None:
    """D = 2, top-k up and int8 down, updates drawn at random: every client starts each round from
    x̂_a + Σ_{t > a} (its own updates as the server decoded them), and the server's model is w_0 plus the
    weighted means of exactly those decoded updates."""
    delay, rounds, weights = 2, 8, [3, 1]
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(SIZE).astype(np.float32)
    engine = RoundEngine(w0, LAYOUT, rounds=rounds, num_clients=2, strategy=DGAServer(delay))
    encoder = BroadcastEncoder(parse_codec("int8"), w0, LAYOUT, seed=7)
    decoders = [BroadcastDecoder(LAYOUT) for _ in weights]
    dga = [DelayedAveragingClient(delay) for _ in weights]
    codecs = [make_client_codec(parse_codec("topk:0.05"), LAYOUT, seed=j) for j in range(2)]
    decoded: dict[tuple[int, int], np.ndarray] = {}  # (client, round) → the update as the server decodes it
    next_round = [1, 1]
    while not engine.done:
        for j in range(2):
            request = engine.next_request(j)
            if request is None:
                continue
            if request.global_round is not None:
                broadcast = encoder.broadcast(request.global_round, request.global_params, request.held_round)
                dga[j].receive_global(broadcast.round, decoders[j].receive(broadcast))
            contributions = []
            while next_round[j] <= rounds and dga[j].can_start(next_round[j]):
                t, start = next_round[j], dga[j].start_params()
                own = sum((decoded[j, s] for s in range(dga[j].global_round + 1, t)), np.zeros(SIZE, np.float32))
                np.testing.assert_allclose(start, decoders[j].reference + own, rtol=0, atol=1e-5)
                encoded = codecs[j].encode(rng.standard_normal(SIZE).astype(np.float32) * 0.01, t)
                stype, payload = encoded.stype, encoded.payload
                decoded[j, t] = server_compressor(stype).decode(payload, LAYOUT)
                dga[j].record_sent(t, decoded[j, t])
                contributions.append(Update(t, stype, payload, weights[j]))
                next_round[j] += 1
            assert not engine.receive(j, contributions)
        engine.close_rounds(now=0.0)
    means = [(weights[0] * decoded[0, t] + weights[1] * decoded[1, t]) / sum(weights) for t in range(1, rounds + 1)]
    np.testing.assert_allclose(engine.global_params, w0 + np.sum(means, axis=0), rtol=0, atol=1e-5)
    assert max(dga[0].global_round, dga[1].global_round) >= rounds - delay - 1
