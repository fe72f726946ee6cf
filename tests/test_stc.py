"""Sparse Ternary Compression: the Rice coder against a hand-worked example, b*, round trips, the size formula,
error feedback on both sides, the missed-rounds rule, and malformed payloads (the fuzz test is in
test_codecs.py with every other codec)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies.codecs import MalformedUpdate, make_client_codec, parse_codec, server_compressor
from strategies.codecs.base import dense_payload_size, layout_info
from strategies.codecs.stc import (
    STC_HEADER,
    max_rice_bits,
    max_stream_bits,
    rice_decode,
    rice_encode,
    rice_parameter,
    stc_payload_size,
)
from strategies.downlink import NO_BASE, BroadcastDecoder, BroadcastEncoder

LAYOUT = (("conv", (16, 1, 3, 3)), ("fc", (64, 120)), ("bias", (64,)))
SIZE = layout_info(LAYOUT).size
WIDE = (("conv", (64, 32, 5, 5)), ("fc", (48, 1024)))  # P > 65536
STYPE = "edgefl.stc.v1"


def test_rice_coder_matches_a_hand_worked_example() -> None:
    """Positions 2, 3, 9 → gaps 2, 0, 5; with b = 2: 2 = 0·4 + 2 → '0' '10'; 0 → '0' '00'; 5 = 1·4 + 1 →
    '10' '01'. Stream 0100001001, padded: 01000010 01000000 = 0x42 0x40."""
    assert rice_encode(np.array([2, 3, 9]), 2) == bytes([0x42, 0x40])
    assert rice_decode(bytes([0x42, 0x40]), 3, 2, 20, STYPE).tolist() == [2, 3, 9]
    assert rice_encode(np.array([0, 1, 5]), 0) == bytes([0b00111000])  # b = 0: gaps 0, 0, 3 → 0 0 1110


@pytest.mark.parametrize(("density", "bits"), [(0.5, 0), (0.1, 3), (0.01, 6), (0.0025, 8), (1e-6, 19)])
def test_rice_parameter_is_the_papers_optimum(density: float, bits: int) -> None:
    assert rice_parameter(density) == bits


def test_rice_parameter_minimises_the_expected_bits_of_geometric_gaps() -> None:
    """For gaps ~ Geometric(p), E[bits] = b + 1 + E[⌊d/2^b⌋] = b + 1 + (1−p)^(2^b) / (1 − (1−p)^(2^b))."""
    for density in (0.3, 0.05, 0.01, 0.001):
        expected = [b + 1 + (1 - density) ** 2**b / (1 - (1 - density) ** 2**b) for b in range(25)]
        assert expected[rice_parameter(density)] <= min(expected) + 1e-9


@pytest.mark.parametrize("layout", [LAYOUT, WIDE])
def test_round_trip_sends_plus_minus_the_mean_magnitude_of_the_top_k(layout) -> None:
    size = layout_info(layout).size
    u = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    encoded = make_client_codec(parse_codec("stc:0.01"), layout, 0).encode(u, 1)
    k = round(0.01 * size)
    top = np.sort(np.argsort(-np.abs(u))[:k])
    expected = np.zeros(size, np.float32)
    expected[top] = np.float32(np.abs(u[top]).mean()) * np.sign(u[top])
    decoded = server_compressor(encoded.stype).decode(encoded.payload, layout)
    np.testing.assert_allclose(decoded, expected, rtol=1e-6)
    np.testing.assert_array_equal(decoded, encoded.decoded)
    assert len(encoded.payload) == stc_payload_size(top, rice_parameter(0.01))
    b, q = rice_parameter(0.01), 0.99**64 / (1 - 0.99**64)  # E[⌊d/2^b⌋] of geometric gaps, b = 6
    assert 8 * (len(encoded.payload) - STC_HEADER.size) < 1.1 * k * (b + 1 + q + 1)  # + 1 sign bit


def test_size_formula_counts_every_code() -> None:
    indices = np.array([0, 7, 8, 100, 489])
    gaps = [0, 6, 0, 91, 388]
    for bits in (0, 3, 6):
        codes = sum(g // 2**bits + 1 + bits for g in gaps)
        assert stc_payload_size(indices, bits) == 14 + math.ceil(codes / 8) + 1
        assert len(rice_encode(indices, bits)) == math.ceil(codes / 8)


def test_client_error_feedback_conserves_the_sum_of_updates() -> None:
    codec = make_client_codec(parse_codec("stc:0.02"), LAYOUT, 3)
    sent, total = np.zeros(SIZE), np.zeros(SIZE)
    for server_round in range(1, 31):
        u = np.random.default_rng(server_round).standard_normal(SIZE).astype(np.float32)
        sent += codec.encode(u, server_round).decoded
        total += u
    residual = codec.state_dict()["residual"]
    assert np.abs(residual).max() > 0.1
    np.testing.assert_allclose(sent + residual, total, atol=1e-3)


def global_models(rounds: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    models = [rng.standard_normal(SIZE).astype(np.float32) * 0.1]
    for _ in range(rounds):
        models.append((models[-1] + 0.01 * rng.standard_normal(SIZE)).astype(np.float32))
    return models


def test_server_error_feedback_conserves_the_sum_of_global_updates() -> None:
    """x̂_T = x̂_0 + Σ decode(δ_a), and what is left, w_T − x̂_T, is exactly what the last δ left out of
    v_T = w_T − x̂_{T−1}: the broadcast never loses an aggregated update, it only delays part of it."""
    models = global_models(20)
    encoder = BroadcastEncoder(parse_codec("stc:0.01"), models[0], LAYOUT)
    decoder = server_compressor(STYPE)
    applied = models[0].astype(np.float64)
    for round_, model in enumerate(models[1:], start=1):
        before = encoder.reference.copy()
        (part,) = encoder.broadcast(round_, model, round_ - 1).parts
        delta = decoder.decode(part.payload, LAYOUT)
        applied += delta
    np.testing.assert_allclose(encoder.reference, applied, atol=1e-5)
    np.testing.assert_allclose(models[-1] - encoder.reference, (models[-1] - before) - delta, atol=1e-6)


def test_a_client_that_missed_rounds_gets_the_deltas_since_its_round_or_the_model() -> None:
    """The paper's caching rule: the updates since the client's last round, or the whole model if smaller."""
    models = global_models(60)
    encoder = BroadcastEncoder(parse_codec("stc:0.3"), models[0], LAYOUT)
    steady, absent = BroadcastDecoder(LAYOUT), BroadcastDecoder(LAYOUT)
    steady.receive(encoder.broadcast(1, models[1]))
    absent.receive(encoder.broadcast(1, models[1]))
    for round_ in range(2, 6):
        steady.receive(encoder.broadcast(round_, models[round_], steady.round))
    missed = encoder.broadcast(5, models[5], absent.round)
    assert [p.round for p in missed.parts] == [2, 3, 4, 5]
    assert {p.stype for p in missed.parts} == {STYPE}
    assert len(missed.blob()) < dense_payload_size(SIZE)
    np.testing.assert_array_equal(absent.receive(missed), steady.reference)
    for round_ in range(6, 61):
        steady.receive(encoder.broadcast(round_, models[round_], steady.round))
    late = encoder.broadcast(60, models[60], absent.round)  # 55 deltas would outweigh the model
    assert late.base_round == NO_BASE
    np.testing.assert_array_equal(absent.receive(late), steady.reference)


def stc_payload(count: int, mu: float, bits: int, stream: bytes, signs: bytes) -> bytes:
    """A hand-made payload for TINY."""
    return STC_HEADER.pack(1, 20, count, mu, bits) + stream + signs


TINY = (("w", (4, 5)),)  # P = 20
GOOD_STREAM = bytes([0x42, 0x40])  # positions 2, 3, 9 with b = 2


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        pytest.param(stc_payload(3, 0.5, 2, GOOD_STREAM, b"\x00"), None, id="valid"),
        pytest.param(stc_payload(0, 0.5, 2, b"", b""), r"0 entries, expected 1\.\.20", id="k=0"),
        pytest.param(stc_payload(21, 0.5, 2, GOOD_STREAM, b"\x00"), r"21 entries, expected 1\.\.20", id="k>P"),
        pytest.param(stc_payload(3, float("nan"), 2, GOOD_STREAM, b"\x00"), "μ must be finite", id="mu-nan"),
        pytest.param(stc_payload(3, float("inf"), 2, GOOD_STREAM, b"\x00"), "μ must be finite", id="mu-inf"),
        pytest.param(stc_payload(3, -1.0, 2, GOOD_STREAM, b"\x00"), "μ must be finite", id="mu-negative"),
        pytest.param(stc_payload(3, 0.5, 32, GOOD_STREAM, b"\x00"), "b=32 is above 3, the most 3 positions", id="b=32"),
        pytest.param(stc_payload(3, 0.5, 4, GOOD_STREAM, b"\x00"), "b=4 is above 3", id="b>useful"),
        pytest.param(
            stc_payload(3, 0.5, 2, bytes([0x42, 0x41]), b"\x00"),
            "non-zero padding after the position codes",
            id="code-padding",
        ),
        pytest.param(
            stc_payload(3, 0.5, 2, GOOD_STREAM, b"\x01"), "non-zero padding after the sign bits", id="sign-padding"
        ),
        pytest.param(
            stc_payload(3, 0.5, 2, GOOD_STREAM, b"\x00\x00"),
            "oversized payload of 18 bytes, 3 positions among P=20 coded with b=2 take at most 17",
            id="oversized",
        ),
        pytest.param(
            stc_payload(3, 0.5, 2, GOOD_STREAM, b""),
            "truncated payload of 16 bytes, 3 positions coded with b=2 need at least 17",
            id="truncated",
        ),
        pytest.param(
            stc_payload(3, 0.5, 2, b"\xff\xff", b"\x00"), "position code 0 of 3 runs past its end", id="runs-past"
        ),
        pytest.param(stc_payload(1, 0.5, 2, b"\xf8", b"\x00"), "position 20 out of range for P=20", id="out-of-range"),
        pytest.param(
            stc_payload(1, 0.5, 0, bytes(3), b"\x00"),
            "oversized payload: a byte or more after the 1 position codes",
            id="bytes-after-codes",
        ),
        pytest.param(
            stc_payload(1, 0.5, 0, bytes(70), b"\x00"), "oversized payload of 85 bytes, 1 positions", id="bomb"
        ),
    ],
)
def test_decoder_refuses_malformed_payloads(payload: bytes, reason: str | None) -> None:
    decoder = server_compressor(STYPE)
    if reason is None:
        decoded = decoder.decode(payload, TINY)
        assert np.flatnonzero(decoded).tolist() == [2, 3, 9] and set(decoded[[2, 3, 9]]) == {0.5}
        return
    with pytest.raises(MalformedUpdate, match=reason):
        decoder.decode(payload, TINY)


@pytest.mark.parametrize("density", [1e-9, 1e-6, 0.001, 0.01, 0.1, 0.3, 0.5, 0.9])
def test_the_encoder_never_uses_a_rice_parameter_the_decoder_refuses(density: float) -> None:
    """A density below 1/P asks for b* above what one position among P can use: the encoder caps it (b=19 at
    density 1e-6 would be refused on a 7,888-entry model, whose one position needs at most 13 bits)."""
    u = np.random.default_rng(2).standard_normal(SIZE).astype(np.float32)
    encoded = make_client_codec(parse_codec(f"stc:{density}"), LAYOUT, 0).encode(u, 1)
    _, _, count, _, bits = STC_HEADER.unpack_from(encoded.payload)
    assert bits <= max_rice_bits(count, SIZE) and bits == min(rice_parameter(density), max_rice_bits(count, SIZE))
    np.testing.assert_array_equal(server_compressor(STYPE).decode(encoded.payload, LAYOUT), encoded.decoded)


def test_stream_bound_is_what_the_worst_positions_take() -> None:
    """``max_stream_bits`` is reached: the largest gaps (all of P − k in one) at every b the decoder accepts."""
    for count in (1, 2, 7, 79, SIZE):
        for bits in range(max_rice_bits(count, SIZE) + 1):
            worst = np.concatenate((np.arange(count - 1), [SIZE - 1]))  # gaps 0, …, 0, P − k
            assert len(rice_encode(worst, bits)) == math.ceil(max_stream_bits(count, bits, SIZE) / 8)
