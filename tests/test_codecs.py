"""Tests of strategies.codecs: round trips, error feedback, unbiasedness, sizes, validation, fuzzing."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest

from strategies.codecs import (
    CodecError,
    CodecSpec,
    DGCOptions,
    Encoded,
    MalformedUpdate,
    make_client_codec,
    parse_codec,
    server_compressor,
)
from strategies.codecs.powersgd import PowerSGD, PowerSGDMemory
from strategies.spec import SpecError

SMALL = (
    ("conv.weight", (8, 1, 3, 3)),
    ("conv.bias", (8,)),
    ("fc.weight", (10, 32)),
    ("fc.bias", (10,)),
    ("thin.weight", (2, 40)),
)
# Same P as SMALL, other shapes: PowerSGD factors of SMALL do not fit it.
SMALL_RESHAPED = (
    ("conv.weight", (4, 18)),
    ("conv.bias", (8,)),
    ("fc.weight", (10, 32)),
    ("fc.bias", (10,)),
    ("thin.weight", (2, 40)),
)
OTHER = (("w", (7, 7)),)
# ~100k parameters with a few biases (a small CNN); P > 65536, so indices are uint32.
WIDE = (
    ("conv1.weight", (32, 1, 5, 5)),
    ("conv1.bias", (32,)),
    ("conv2.weight", (64, 32, 5, 5)),
    ("conv2.bias", (64,)),
    ("fc1.weight", (48, 1024)),
    ("fc1.bias", (48,)),
    ("fc2.weight", (10, 48)),
    ("fc2.bias", (10,)),
)
SPECS = [
    "none",
    "topk:0.05",
    "stc:0.05",
    "dgc:0.9",
    "powersgd:2",
    "onebit",
    "terngrad",
    "threshold:0.5",
    "int8",
    "qsgd:16",
]
SPARSE_SPECS = ["topk:0.001", "threshold:3.5", "dgc:0.999"]
SPARSE_HEADER = struct.Struct("<BIIf")


def size_of(layout) -> int:
    return sum(math.prod(shape) for _, shape in layout)


def tensors(layout, *vectors):
    """(shape, the tensor's piece of each vector...) per tensor."""
    start = 0
    for _, shape in layout:
        size = math.prod(shape)
        yield shape, *(vector[start : start + size] for vector in vectors)
        start += size


def matrix_mask(layout) -> np.ndarray:
    """True at the entries of tensors with dim > 1 (the ones DGC sparsifies)."""
    return np.concatenate([np.full(math.prod(shape), len(shape) > 1) for _, shape in layout])


def random_update(seed: int, layout=SMALL) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size_of(layout)).astype(np.float32)


def encode_once(spec: str, layout=SMALL, server_round: int = 10, seed: int = 0) -> tuple[str, bytes, np.ndarray]:
    """(stype, payload, u) of a fresh client's first encoding."""
    u = random_update(seed, layout)
    encoded = make_client_codec(parse_codec(spec), layout, seed).encode(u, server_round)
    stype, payload = encoded.stype, encoded.payload
    return stype, payload, u


def decode(stype: str, payload: bytes, layout=SMALL) -> np.ndarray:
    return server_compressor(stype).decode(payload, layout)


def decode_sent(encoded: Encoded, layout=SMALL) -> np.ndarray:
    """What the server decodes of a client's encoding; it must be what the client says it sent."""
    decoded = decode(encoded.stype, encoded.payload, layout)
    np.testing.assert_array_equal(decoded, encoded.decoded)
    return decoded


def fp16_bound(v: np.ndarray) -> np.ndarray:
    """Error bound of float16 storage of v/max|v|: half an ulp (2^-11 relative) or the subnormal step."""
    return 2.0**-11 * np.abs(v) + 2.0**-24 * np.abs(v).max()


# --- specs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", CodecSpec("none")),
        ("topk:0.01", CodecSpec("topk", 0.01)),
        ("dgc:0.999", CodecSpec("dgc", 0.999)),
        ("dgc:0.999:naive", CodecSpec("dgc", 0.999, "naive")),
        ("dgc:0.99:clip=0.5:momentum", CodecSpec("dgc", 0.99, "momentum", 0.5)),
        ("dgc:0.999:warmup=200", CodecSpec("dgc", 0.999, warmup_rounds=200)),
        ("powersgd:2", CodecSpec("powersgd", 2.0)),
        ("onebit", CodecSpec("onebit")),
        ("terngrad", CodecSpec("terngrad")),
        ("threshold:0.001", CodecSpec("threshold", 0.001)),
        ("int8", CodecSpec("int8")),
        ("qsgd:16", CodecSpec("qsgd", 16.0)),
        ("stc:0.01", CodecSpec("stc", 0.01)),
        ("topk:0.01:gm=0.9", CodecSpec("topk", 0.01, global_momentum=0.9)),
        ("dgc:0.999:gm=0.5:warmup=8", CodecSpec("dgc", 0.999, warmup_rounds=8, global_momentum=0.5)),
    ],
)
def test_parse_codec_accepts(spec: str, expected: CodecSpec) -> None:
    assert parse_codec(spec) == expected
    assert parse_codec(expected.label) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zip",
        "topk",
        "topk:0",
        "topk:1",
        "topk:abc",
        "topk:0.1:2",
        "dgc:1.5",
        "dgc:0.99:fast",
        "dgc:0.99:naive:full",
        "dgc:0.99:clip=-1",
        "dgc:0.99:clip=x",
        "dgc:0.99:warmup=0",
        "dgc:0.99:warmup=2.5",
        "dgc:0.99:warmup=4:warmup=8",
        "powersgd:1.5",
        "powersgd:0",
        "onebit:3",
        "int8:8",
        "threshold:0",
        "threshold:inf",
        "qsgd:0",
        "qsgd:40000",
        "qsgd:nan",
        "stc:1",
        "stc:0.01:3",
        "int8:gm=0.9",
        "topk:0.01:gm=1",
        "topk:0.01:gm=0.5:gm=0.6",
    ],
)
def test_parse_codec_rejects_with_one_line(spec: str) -> None:
    with pytest.raises(SpecError) as error:
        parse_codec(spec)
    assert isinstance(error.value, ValueError)
    assert str(error.value) and "\n" not in str(error.value)


def test_bad_updates_and_rounds_raise_codec_error() -> None:
    codec = make_client_codec(parse_codec("topk:0.1"), SMALL, 0)
    bad_calls = [
        lambda: codec.encode(np.zeros(size_of(SMALL) + 1, np.float32), 1),
        lambda: codec.encode(np.full(size_of(SMALL), np.nan, np.float32), 1),
        lambda: codec.encode(np.zeros(size_of(SMALL), np.float32), 0),
        lambda: make_client_codec(parse_codec("topk:0.1"), (("w", (0, 3)),), 0),
        lambda: make_client_codec(parse_codec("dgc:0.9"), SMALL, 0, num_clients=0),
    ]
    for call in bad_calls:
        with pytest.raises(CodecError, match=r"^[^\n]+$"):
            call()


# --- round trips ----------------------------------------------------------------------------------


def test_none_is_bitwise_lossless() -> None:
    u = random_update(0)
    u[:4] = [-0.0, 1e-45, 3.0e38, -1e-30]  # signed zero, subnormal, near float32 max
    encoded = make_client_codec(parse_codec("none"), SMALL, 0).encode(u, 1)
    stype, payload = encoded.stype, encoded.payload
    assert stype == "edgefl.none.v1"
    assert len(payload) == 5 + 4 * u.size
    assert np.array_equal(decode(stype, payload).view(np.uint32), u.view(np.uint32))


def test_topk_sends_the_largest_entries() -> None:
    stype, payload, u = encode_once("topk:0.05")
    sent = decode(stype, payload)
    k = round(0.05 * u.size)
    largest = np.argsort(-np.abs(u))[:k]
    assert set(np.flatnonzero(sent)) == set(largest)
    assert np.all(np.abs(sent - u)[largest] <= fp16_bound(u[largest]))


def test_threshold_sends_plus_minus_tau() -> None:
    stype, payload, u = encode_once("threshold:0.5")
    tau = np.float32(0.5)
    assert np.array_equal(decode(stype, payload), np.where(np.abs(u) >= tau, np.sign(u) * tau, 0))


def test_dgc_sends_top_entries_of_matrices_and_biases_dense() -> None:
    stype, payload, u = encode_once("dgc:0.9", server_round=10)  # after warm-up: density 0.1
    sent = decode(stype, payload)
    for shape, u_t, sent_t in tensors(SMALL, u, sent):
        if len(shape) <= 1:
            assert np.array_equal(sent_t, u_t)
            continue
        k = max(1, round(0.1 * u_t.size))
        chosen = sent_t != 0
        assert 0.8 * k <= chosen.sum() <= k
        assert np.abs(u_t[chosen]).min() >= np.abs(u_t[~chosen]).max()
        assert np.all(np.abs(sent_t - u_t)[chosen] <= fp16_bound(u_t[chosen]))


def test_dgc_warmup_schedule() -> None:
    layout = (("w", (100, 100)), ("b", (100,)))
    expected = [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    full, no_warmup = (
        make_client_codec(parse_codec("dgc:0.999"), layout, 0),
        make_client_codec(parse_codec("dgc:0.999:momentum"), layout, 0),
    )
    for server_round, density in enumerate(expected, start=1):
        u = random_update(server_round, layout)
        for codec, wanted in ((full, density), (no_warmup, 0.001)):
            sent = decode_sent(codec.encode(u, server_round), layout)
            k = round(wanted * 10_000)
            assert 0.8 * k <= np.count_nonzero(sent[:10_000]) <= k


def test_dgc_warmup_length_spreads_the_same_four_stages() -> None:
    options = DGCOptions.for_stage(0.999, warmup_rounds=10)
    densities = [options.density(r) for r in range(1, 12)]
    assert densities == [0.25] * 3 + [0.0625] * 2 + [0.015625] * 3 + [0.00390625] * 2 + [pytest.approx(0.001)]


def test_compress_bypasses_the_error_feedback() -> None:
    codec = make_client_codec(parse_codec("topk:0.1"), SMALL, 0)
    u = random_update(1)
    stype, payload = codec.compress(u, 1)
    np.testing.assert_array_equal(
        decode(stype, payload), decode_sent(make_client_codec(parse_codec("topk:0.1"), SMALL, 0).encode(u, 1))
    )
    assert not codec.memory.residual.any()  # encode would have kept the unsent entries


def test_powersgd_is_exact_for_low_rank_and_a_projection_otherwise() -> None:
    layout = (("w", (30, 20)), ("b", (30,)), ("small", (3, 2)))
    rng = np.random.default_rng(1)
    low_rank = (rng.standard_normal((30, 2)) @ rng.standard_normal((2, 20))).astype(np.float32)
    u = np.concatenate([low_rank.ravel(), rng.standard_normal(36).astype(np.float32)])
    encoded = make_client_codec(parse_codec("powersgd:2"), layout, 0).encode(u, 1)
    stype, payload = encoded.stype, encoded.payload
    sent = decode(stype, payload, layout)
    assert np.allclose(sent[:600], u[:600], atol=1e-4 * np.abs(u[:600]).max())
    assert np.array_equal(sent[600:], u[600:])  # bias and the (3, 2) matrix ((3+2)·2 ≥ 6) go dense

    matrix = rng.standard_normal((30, 20)).astype(np.float32)
    u[:600] = matrix.ravel()
    encoded = make_client_codec(parse_codec("powersgd:2"), layout, 0).encode(u, 1)
    stype, payload = encoded.stype, encoded.payload
    approx = decode(stype, payload, layout)[:600].reshape(30, 20)
    # P̂ Qᵀ = P̂ P̂ᵀ M is an orthogonal projection of M: the error is orthogonal to it and neither exceeds M.
    assert abs(np.sum((matrix - approx) * approx)) <= 1e-4 * np.sum(matrix**2)
    assert np.linalg.norm(approx) <= np.linalg.norm(matrix) * (1 + 1e-5)
    assert 0 < np.linalg.norm(matrix - approx) < np.linalg.norm(matrix)


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation() -> None:
    """Re-encoding one matrix with the warm-started Q is subspace iteration: P̂ Qᵀ → the truncated SVD."""
    layout = (("w", (40, 30)),)
    rng = np.random.default_rng(2)
    left, _ = np.linalg.qr(rng.standard_normal((40, 30)))
    right, _ = np.linalg.qr(rng.standard_normal((30, 30)))
    singular = np.concatenate([[3.0, 2.5], np.linspace(1.5, 0.1, 28)])
    matrix = ((left * singular) @ right.T).astype(np.float32)
    best = (left[:, :2] * singular[:2]) @ right[:, :2].T
    memory, compressor = PowerSGDMemory(layout, 2, seed=0), PowerSGD(2)
    errors = []
    for _ in range(30):
        payload = compressor.encode(matrix.ravel(), layout, memory.compressor_state(1, rng))
        approx = compressor.decode(payload, layout).reshape(40, 30)
        errors.append(np.linalg.norm(approx - best) / np.linalg.norm(best))
    assert errors[0] > 0.1
    assert errors[-1] < 1e-3


def test_onebit_keeps_signs_and_column_sums() -> None:
    stype, payload, u = encode_once("onebit")
    sent = decode(stype, payload)
    for shape, u_t, sent_t in tensors(SMALL, u, sent):
        rows = shape[0]
        if rows < 3:
            assert np.array_equal(sent_t, u_t)
            continue
        u_m, sent_m = u_t.reshape(rows, -1), sent_t.reshape(rows, -1)
        assert np.array_equal(sent_m < 0, u_m < 0)
        assert np.allclose(sent_m.sum(axis=0), u_m.sum(axis=0), atol=1e-5 * rows)
        assert len(np.unique(sent_m[:, 0])) <= 2


def per_tensor_scale(layout, u: np.ndarray, norm: str) -> np.ndarray:
    """s_t repeated over tensor t's entries: max|v_t| or ‖v_t‖₂."""
    return np.concatenate(
        [
            np.full(t.size, np.abs(t).max() if norm == "max" else np.linalg.norm(t.astype(np.float64)))
            for _, t in tensors(layout, u)
        ]
    )


def test_terngrad_sends_zero_or_the_signed_tensor_max() -> None:
    stype, payload, u = encode_once("terngrad")
    sent = decode(stype, payload)
    scale = per_tensor_scale(SMALL, u, "max")
    assert np.all((sent == 0) | (np.abs(sent) == scale.astype(np.float32)))
    assert np.all(sent * u >= 0)
    assert np.all(sent[np.abs(u) == scale] != 0)  # probability |v|/s = 1


@pytest.mark.parametrize(("spec", "levels", "norm"), [("int8", 127, "max"), ("qsgd:16", 16, "l2")])
def test_stochastic_rounding_is_within_one_level(spec: str, levels: int, norm: str) -> None:
    stype, payload, u = encode_once(spec)
    step = per_tensor_scale(SMALL, u, norm) / levels
    assert np.all(np.abs(decode(stype, payload) - u) <= step * (1 + 1e-5))


# --- error feedback and DGC's memory --------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "residual_name"),
    [
        ("topk:0.05", "residual"),
        ("stc:0.05", "residual"),
        ("threshold:0.5", "residual"),
        ("onebit", "residual"),
        ("powersgd:2", "residual"),
        ("dgc:0.9:accumulate", "velocity"),
    ],
)
def test_error_feedback_conserves_the_sum_of_updates(spec: str, residual_name: str) -> None:
    codec = make_client_codec(parse_codec(spec), SMALL, 3)
    sent_total = np.zeros(size_of(SMALL))
    update_total = np.zeros(size_of(SMALL))
    for server_round in range(1, 21):
        u = random_update(100 + server_round)
        sent_total += decode_sent(codec.encode(u, server_round))
        update_total += u
    residual = codec.state_dict()[residual_name]
    assert np.abs(residual).max() > 0.01  # the codec did leave something out
    assert np.allclose(sent_total + residual, update_total, atol=1e-4)


def test_dgc_momentum_correction_conserves_the_sum_of_velocities() -> None:
    """u_t = m·u_{t−1}(masked) + g_t is what enters the velocity each round: Σ sent + v_T = Σ u_t."""
    codec = make_client_codec(parse_codec("dgc:0.9"), SMALL, 4)
    sent_total = np.zeros(size_of(SMALL))
    velocity_total = np.zeros(size_of(SMALL))
    sparsified = matrix_mask(SMALL)
    for server_round in range(1, 21):
        g = random_update(200 + server_round)
        velocity_total += 0.9 * codec.state_dict()["momentum"] + g
        sent = decode_sent(codec.encode(g, server_round))
        sent_total += sent
        momentum = codec.state_dict()["momentum"]
        assert np.all(momentum[(sent != 0) & sparsified] == 0)  # momentum factor masking
        assert np.all(momentum[~sparsified] != 0)  # dense tensors keep plain momentum
    velocity = codec.state_dict()["velocity"]
    assert np.abs(velocity).max() > 0.01
    assert np.allclose(sent_total + velocity, velocity_total, atol=1e-4)


def test_dgc_ablation_stages() -> None:
    g = random_update(5)
    naive = make_client_codec(parse_codec("dgc:0.9:naive"), SMALL, 0)
    sent = decode_sent(naive.encode(g, 1))
    assert not np.any(naive.state_dict()["velocity"]) and not np.any(naive.state_dict()["momentum"])
    assert np.count_nonzero(sent[:72]) <= round(0.1 * 72)  # no warm-up: the target density from round 1

    unmasked = make_client_codec(parse_codec("dgc:0.9:warmup"), SMALL, 0)
    sent = decode_sent(unmasked.encode(g, 1))
    assert np.array_equal(unmasked.state_dict()["momentum"], g)  # momentum, but no masking at sent indices
    assert np.count_nonzero(sent[:72]) > round(0.1 * 72)  # warm-up: 25% in round 1


def test_dgc_local_clipping_uses_the_clients_share_of_the_norm() -> None:
    g = 100 * random_update(6)
    codec = make_client_codec(parse_codec("dgc:0.9:clip=2.0"), SMALL, 0, num_clients=4)
    sent = decode_sent(codec.encode(g, 1))
    entered = sent + codec.state_dict()["velocity"]
    assert np.allclose(entered, g * (2.0 / math.sqrt(4) / np.linalg.norm(g)), atol=1e-6)


# --- unbiasedness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["terngrad", "int8", "qsgd:4"])
def test_stochastic_codecs_are_unbiased(spec: str) -> None:
    """Mean of n encodings vs u: each entry's error must be within 5 standard deviations of the mean,
    σ_i² / n, with the per-entry variance of the method: TernGrad s·|v_i| − v_i²; stochastic rounding to a
    step δ = s/L: δ²·f(1 − f), f = frac(|v_i|/δ). Biased variants (e.g. round-to-nearest) fail by far."""
    u = random_update(7)
    n = 2000
    codec = make_client_codec(parse_codec(spec), SMALL, 11)
    total = np.zeros(u.size)
    for server_round in range(1, n + 1):
        total += decode_sent(codec.encode(u, server_round))
    mean = total / n
    v = np.abs(u.astype(np.float64))
    if spec == "terngrad":
        variance = per_tensor_scale(SMALL, u, "max") * v - v**2
    else:
        step = per_tensor_scale(SMALL, u, "max" if spec == "int8" else "l2") / (127 if spec == "int8" else 4)
        fraction = v / step - np.floor(v / step)
        variance = step**2 * fraction * (1 - fraction)
    assert np.count_nonzero(variance) > 0.9 * u.size
    assert np.all(np.abs(mean - u) <= 5 * np.sqrt(variance / n) + 1e-6 * (1 + v))


# --- payload sizes --------------------------------------------------------------------------------


def expected_size(spec: str, layout, u: np.ndarray, payload: bytes) -> int:
    """Each codec's documented size formula, computed from the layout (and u or the header's count)."""
    name, _, value = spec.partition(":")
    size, count = size_of(layout), len(layout)
    index_bytes = 2 if size <= 65536 else 4
    shapes = [shape for _, shape in layout]
    if name == "none":
        return 5 + 4 * size
    if name == "topk":
        return 13 + max(1, round(float(value) * size)) * (index_bytes + 2)
    if name == "stc":
        k, bits = max(1, round(float(value) * size)), struct.unpack_from("<B", payload, 13)[0]
        gaps = np.diff(np.sort(np.argsort(-np.abs(u))[:k]), prepend=-1) - 1
        return 14 + math.ceil(int(np.sum(gaps // 2**bits + 1 + bits)) / 8) + math.ceil(k / 8)
    if name == "threshold":
        sent = int(np.sum(np.abs(u) >= np.float32(value)))
        return 13 + sent * index_bytes + math.ceil(sent / 8)
    if name == "dgc":
        sent = SPARSE_HEADER.unpack_from(payload)[2]
        return 13 + sent * (index_bytes + 2) + 4 * sum(math.prod(s) for s in shapes if len(s) <= 1)
    if name == "powersgd":
        rank, floats = int(value), 0
        for shape in shapes:
            m, n = shape[0], math.prod(shape[1:])
            floats += (m + n) * rank if len(shape) >= 2 and (m + n) * rank < m * n else m * n
        return 7 + 4 * floats
    if name == "onebit":
        quantized = [(s[0], math.prod(s[1:])) for s in shapes if s[0] >= 3]
        dense = sum(math.prod(s) for s in shapes if s[0] < 3)
        bits = sum(m * n for m, n in quantized)
        return 5 + 4 * (sum(2 * n for _, n in quantized) + dense) + math.ceil(bits / 8)
    if name == "terngrad":
        return 5 + 4 * count + math.ceil(size / 4)
    levels = 127 if name == "int8" else int(value)
    return 9 + 4 * count + size * (1 if levels <= 127 else 2)


@pytest.mark.parametrize(
    ("spec", "layout"),
    [(spec, SMALL) for spec in SPECS]
    + [("qsgd:1000", SMALL), ("topk:0.001", WIDE), ("stc:0.0025", WIDE), ("dgc:0.999", WIDE)],
)
def test_payload_size_matches_formula(spec: str, layout) -> None:
    stype, payload, u = encode_once(spec, layout)
    assert stype.startswith(f"edgefl.{spec.partition(':')[0]}.")
    assert len(payload) == expected_size(spec, layout, u, payload)


def test_dgc_at_999_compresses_at_least_300x() -> None:
    codec = make_client_codec(parse_codec("dgc:0.999"), WIDE, 0)
    for server_round in range(1, 6):  # the warm-up takes rounds 1–4
        encoded = codec.encode(0.01 * random_update(server_round, WIDE), server_round)
        stype, payload = encoded.stype, encoded.payload
    assert stype == "edgefl.dgc.v1"
    assert 4 * size_of(WIDE) / len(payload) >= 300


def test_payload_larger_than_dense_falls_back_to_dense() -> None:
    layout = (("w", (2,)),)  # 13-byte sparse header + 1 entry > 5 + 8 dense bytes
    codec = make_client_codec(parse_codec("topk:0.5"), layout, 0)
    u = np.array([1.5, -2.0], dtype=np.float32)
    encoded = codec.encode(u, 1)
    stype, payload = encoded.stype, encoded.payload
    assert stype == "edgefl.none.v1"
    assert np.array_equal(decode(stype, payload, layout), u)
    assert not np.any(codec.state_dict()["residual"])


# --- server side: validation -------------------------------------------------------


def test_unknown_stype_is_malformed() -> None:
    with pytest.raises(MalformedUpdate, match=r"unknown update type 'edgefl\.zip\.v1'"):
        server_compressor("edgefl.zip.v1")


@pytest.mark.parametrize("spec", SPECS)
def test_every_decoder_rejects_bad_framing(spec: str) -> None:
    stype, payload, _ = encode_once(spec)
    compressor = server_compressor(stype)
    dense_size = 5 + 4 * size_of(SMALL)
    cases = [
        (payload[:-1], SMALL, r"truncated payload|take \d+ bytes"),
        (payload[:3], SMALL, "truncated payload of 3 bytes, its header needs"),
        (payload + b"\0", SMALL, r"oversized payload|take \d+ bytes|larger than dense"),
        (payload.ljust(dense_size + 1, b"\0"), SMALL, "larger than dense"),
        (payload, OTHER, "header says P=490 but the model layout has P=49"),
        (b"\x02" + payload[1:], SMALL, "unsupported format version 2"),
    ]
    for bad, layout, reason in cases:
        with pytest.raises(MalformedUpdate, match=reason):
            compressor.decode(bad, layout)


def sparse_payload(indices: list[int], values: list[float], scale: float = 1.0, tail: bytes = b"") -> bytes:
    """A hand-made top-k/DGC payload for SMALL (uint16 indices, float16 values)."""
    header = SPARSE_HEADER.pack(1, size_of(SMALL), len(indices), scale)
    return header + np.array(indices, "<u2").tobytes() + np.array(values, "<f2").tobytes() + tail


DGC_TAIL = bytes(4 * 18)  # the two biases of SMALL, dense


@pytest.mark.parametrize(
    ("stype", "payload", "reason"),
    [
        ("edgefl.topk.v1", sparse_payload([3, 490], [0.5, 0.5]), "index 490 out of range for P=490"),
        ("edgefl.topk.v1", sparse_payload([3, 3], [0.5, 0.5]), "index 3 is repeated"),
        ("edgefl.topk.v1", sparse_payload([9, 3], [0.5, 0.5]), "not in increasing order"),
        ("edgefl.topk.v1", sparse_payload([3], [np.inf]), "values contain NaN or Inf"),
        ("edgefl.topk.v1", sparse_payload([3], [0.5], scale=np.nan), "scale must be positive"),
        ("edgefl.topk.v1", sparse_payload([3], [60000.0], scale=1e36), "values contain NaN or Inf"),
        ("edgefl.dgc.v1", sparse_payload([490], [0.5], tail=DGC_TAIL), "out of range"),
        ("edgefl.dgc.v1", sparse_payload([75], [0.5], tail=DGC_TAIL), "dim ≤ 1 tensor"),
        (
            "edgefl.dgc.v1",
            sparse_payload([3], [0.5], tail=np.full(18, np.inf, "<f4").tobytes()),
            "dense values",
        ),
        (
            "edgefl.threshold.v1",
            SPARSE_HEADER.pack(1, 490, 2, 0.1) + np.array([7, 7], "<u2").tobytes() + b"\0",
            "repeated",
        ),
        (
            "edgefl.threshold.v1",
            SPARSE_HEADER.pack(1, 490, 1, np.inf) + np.array([7], "<u2").tobytes() + b"\0",
            "threshold τ must be positive",
        ),
    ],
)
def test_sparse_decoders_reject_bad_contents(stype: str, payload: bytes, reason: str) -> None:
    with pytest.raises(MalformedUpdate, match=reason):
        decode(stype, payload)


def with_bytes(payload: bytes, offset: int, data: bytes) -> bytes:
    return payload[:offset] + data + payload[offset + len(data) :]


@pytest.mark.parametrize(
    ("spec", "offset", "data", "reason"),
    [
        ("none", 5 + 4 * 7, np.float32(np.nan).tobytes(), "values contain NaN or Inf"),
        ("onebit", 5, np.float32(np.inf).tobytes(), "scales and dense entries contain NaN or Inf"),
        ("terngrad", 5, np.float32(np.nan).tobytes(), "scales contain NaN or Inf"),
        ("terngrad", 5, np.float32(-1).tobytes(), "negative scale"),
        ("terngrad", 5 + 4 * 5, b"\xff", "invalid ternary code 3 at index 0"),
        ("int8", 9, np.float32(np.inf).tobytes(), "scales contain NaN or Inf"),
        ("qsgd:16", 9 + 4 * 5, np.int8(17).tobytes(), "exceeds ±16 levels"),
        ("qsgd:16", 5, struct.pack("<I", 0), "0 levels is outside"),
        ("powersgd:2", 7, np.float32(np.nan).tobytes(), "factors contain NaN or Inf"),
        ("powersgd:2", 5, struct.pack("<H", 3), "rank-3 factors for this layout take"),
    ],
)
def test_dense_decoders_reject_bad_contents(spec: str, offset: int, data: bytes, reason: str) -> None:
    stype, payload, _ = encode_once(spec)
    with pytest.raises(MalformedUpdate, match=reason):
        decode(stype, with_bytes(payload, offset, data))


def test_powersgd_factors_that_overflow_or_do_not_fit_the_layout() -> None:
    stype, payload, _ = encode_once("powersgd:2")
    huge = np.full(2, 3e38, "<f4").tobytes()  # row 0 of P̂ (conv: 8×2, at 7) and of Q (9×2, after P̂)
    with pytest.raises(MalformedUpdate, match="decoded entries"):
        decode(stype, with_bytes(with_bytes(payload, 7, huge), 7 + 4 * 16, huge))
    with pytest.raises(MalformedUpdate, match="rank-2 factors for this layout take"):
        decode(stype, payload, SMALL_RESHAPED)


def mutations(payload: bytes, rng: np.random.Generator, count: int):
    """Random bytes, bit flips, truncations, extensions and overwritten header fields of a valid payload."""
    for trial in range(count):
        kind = trial % 5
        if kind == 0:
            yield rng.bytes(int(rng.integers(0, len(payload) + 16)))
        elif kind == 1:
            bits = np.unpackbits(np.frombuffer(payload, np.uint8))
            bits[rng.integers(0, bits.size, int(rng.integers(1, 9)))] ^= 1
            yield np.packbits(bits).tobytes()
        elif kind == 2:
            yield payload[: int(rng.integers(0, len(payload)))]
        elif kind == 3:
            yield payload + rng.bytes(int(rng.integers(1, 64)))
        else:
            yield with_bytes(payload, int(rng.integers(0, 13)), rng.bytes(int(rng.integers(1, 5))))


@pytest.mark.parametrize("spec", SPECS)
def test_fuzzed_payloads_decode_to_finite_vectors_or_raise_malformed(spec: str) -> None:
    """Every decoder checks the exact size its header implies, so no payload of another length gets through
    (truncated, extended, random bytes); a same-length one that does (a flipped value bit) decodes to a finite
    update of the model's size."""
    stype, payload, _ = encode_once(spec)
    compressor = server_compressor(stype)
    rng = np.random.default_rng(zlib.crc32(spec.encode()))
    resized = 0
    for bad in mutations(payload, rng, 400):
        resized += len(bad) != len(payload)
        try:
            decoded = compressor.decode(bad, SMALL)
        except MalformedUpdate:
            continue
        assert len(bad) == len(payload), f"a {len(bad)}-byte payload was accepted for a {len(payload)}-byte format"
        assert decoded.dtype == np.float32 and decoded.shape == (size_of(SMALL),)
        assert np.isfinite(decoded).all()
    assert resized >= 200  # the mutations really try other lengths: truncations, extensions, random bytes


# --- state ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["topk:0.05", "dgc:0.9", "powersgd:2", "onebit"])
def test_state_dict_restores_the_memory(spec: str) -> None:
    original = make_client_codec(parse_codec(spec), SMALL, 5)
    for server_round in range(1, 4):
        original.encode(random_update(server_round), server_round)
    state = original.state_dict()
    assert all(np.any(array) for array in state.values())
    restored = make_client_codec(parse_codec(spec), SMALL, 5)
    restored.load_state_dict(state)
    u = random_update(4)
    first, second = original.encode(u, 4), restored.encode(u, 4)
    assert (first.stype, first.payload) == (second.stype, second.payload)

    name = next(iter(state))
    with pytest.raises(CodecError, match=f"codec state '{name}' has shape"):
        restored.load_state_dict({**state, name: np.zeros(3)})
    with pytest.raises(CodecError, match="codec state has arrays"):
        restored.load_state_dict({})


@pytest.mark.parametrize("model", ["resnet8", "leaf-lstm"])
def test_every_codec_carries_the_papers_models(model: str) -> None:
    """ResNet-8's conv and GroupNorm tensors and LEAF's LSTM (embedding, 2 x (4·256) x 512 gate matrices, biases):
    what each codec sends is what the server decodes, and the dense codec is exact."""
    from ml.models import build_model, param_layout
    from tests.test_models import image_set, text_set

    layout = param_layout(build_model(image_set(28) if model == "resnet8" else text_set(), 0, model))
    for spec in SPECS:
        u = random_update(7, layout)
        encoded = make_client_codec(parse_codec(spec), layout, 0).encode(u, 10)
        decoded = decode_sent(encoded, layout)
        assert decoded.shape == u.shape and np.isfinite(decoded).all()
        if spec == "none":
            np.testing.assert_array_equal(decoded, u)
