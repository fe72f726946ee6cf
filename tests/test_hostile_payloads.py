"""Hostile payloads against every codec's decoder, the server's side of a device's update (issue #27): truncated,
oversized, a decoder bomb, counts beyond the layout, indices out of range or repeated, non-finite values and
wrong lengths are each refused with MalformedUpdate and its one reason (the round engine's refusal), before
anything sized by the payload is allocated; no decoder's memory exceeds 4x the dense model's, and an STC decoder
bomb, which cost the old decoder ~400x (160 MB for a 100k-entry model), costs almost nothing."""

from __future__ import annotations

import contextlib
import math
import struct
import tracemalloc
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest

from strategies.codecs import MalformedUpdate, make_client_codec, parse_codec, server_compressor
from strategies.codecs.base import dense_payload_size, layout_info
from strategies.codecs.registry import CODECS, CodecSpec
from strategies.codecs.sparse import SPARSE_HEADER
from strategies.codecs.stc import STC_HEADER
from tests.test_codecs import WIDE  # ~100k entries (uint32 indices), for the memory bounds

LAYOUT = (("conv.weight", (8, 1, 3, 3)), ("conv.bias", (8,)), ("fc.weight", (10, 32)), ("fc.bias", (10,)))
P = layout_info(LAYOUT).size  # 410: uint16 indices
DENSE = dense_payload_size(P)  # 1645 bytes
SPECS = ["none", "topk:0.05", "threshold:1.5", "stc:0.05", "dgc:0.9", "powersgd:2", "onebit", "terngrad", "int8",
         "qsgd:16"]  # fmt: skip


@cache
def valid(spec: str) -> tuple[str, bytes]:
    """The wire type and payload a client sends for a random update of LAYOUT (round 10: DGC's warm-up is over)."""
    u = np.random.default_rng(0).standard_normal(P).astype(np.float32)
    encoded = make_client_codec(parse_codec(spec), LAYOUT, 0).encode(u, 10)
    assert encoded.stype == f"edgefl.{spec.partition(':')[0]}.v1"  # not the dense fallback
    return encoded.stype, encoded.payload


def patched(payload: bytes, offset: int, fmt: str, value: float) -> bytes:
    """The payload with one little-endian field at ``offset`` overwritten."""
    changed = bytearray(payload)
    struct.pack_into(fmt, changed, offset, value)
    return bytes(changed)


def refused(stype: str, payload: bytes, layout=LAYOUT) -> str:
    """The one-line reason the server's decoder refuses ``payload`` with; fails if it decodes or raises another
    exception."""
    with pytest.raises(MalformedUpdate) as error:
        server_compressor(stype).decode(payload, layout)
    assert "\n" not in str(error.value)
    return str(error.value)


# --- what every codec refuses the same way -------------------------------------------------------------------


HEADER_BYTES = {"none": 5, "topk": 13, "threshold": 13, "stc": 14, "dgc": 13, "powersgd": 7, "onebit": 5,
                "terngrad": 5, "int8": 9, "qsgd": 9}  # fmt: skip


@pytest.mark.parametrize("spec", SPECS)
def test_framing_every_codec_refuses_with_its_reason(spec: str) -> None:
    stype, payload = valid(spec)
    size, header = len(payload), HEADER_BYTES[spec.partition(":")[0]]
    assert refused(stype, payload[:3]) == f"{stype}: truncated payload of 3 bytes, its header needs {header}"
    assert refused(stype, b"") == f"{stype}: truncated payload of 0 bytes, its header needs {header}"
    bomb = payload.ljust(DENSE + 1, b"\0")  # a count the header keeps small, and a dense model's bytes after it
    assert refused(stype, bomb) == f"{stype}: payload of {DENSE + 1} bytes is larger than dense float32 ({DENSE} bytes)"
    assert refused(stype, patched(payload, 1, "<I", P + 1)) == (
        f"{stype}: header says P={P + 1} but the model layout has P={P}"
    )
    assert refused(stype, patched(payload, 1, "<I", 2**32 - 1)) == (
        f"{stype}: header says P={2**32 - 1} but the model layout has P={P}"
    )
    assert refused(stype, patched(payload, 0, "<B", 2)) == f"{stype}: unsupported format version 2, expected 1"
    if spec == "none":
        return  # its exact size is the dense bound: one byte less or more is the two cases below
    for length, problem in ((size - 1, "truncated"), (size + 1, "oversized"), (DENSE, "oversized")):
        reason = refused(stype, payload[:length].ljust(length, b"\0"))
        if spec.startswith("powersgd"):
            assert reason == f"{stype}: rank-2 factors for this layout take {size} bytes, the payload has {length}"
        elif spec.startswith("stc"):  # its sizes come from its codes: the exact reasons are in the table below
            assert reason.startswith(f"{stype}: {problem} payload")
        else:
            assert reason == f"{stype}: {problem} payload of {length} bytes, its header implies {size}"


def test_the_dense_codec_refuses_a_byte_less_or_more() -> None:
    stype, payload = valid("none")
    assert (
        refused(stype, payload[:-1]) == f"{stype}: truncated payload of {DENSE - 1} bytes, its header implies {DENSE}"
    )
    assert refused(stype, payload + b"\0") == (
        f"{stype}: payload of {DENSE + 1} bytes is larger than dense float32 ({DENSE} bytes)"
    )


# --- each codec's counts, indices and values ---------------------------------------------------------------------


def changed(spec: str, offset: int, fmt: str, value: float) -> bytes:
    """The valid payload of codec ``spec`` with one header or body field overwritten."""
    return patched(valid(spec)[1], offset, fmt, value)


def sparse(count: int, indices: list[int], values: list[float], scale: float = 1.0, tail: bytes = b"") -> bytes:
    """A hand-made top-k/DGC payload for LAYOUT: header, uint16 indices, float16 values, then ``tail``."""
    header = SPARSE_HEADER.pack(1, P, count, scale)
    return header + np.array(indices, "<u2").tobytes() + np.array(values, "<f2").tobytes() + tail


def threshold(count: int, indices: list[int], tau: float = 0.5) -> bytes:
    header = SPARSE_HEADER.pack(1, P, count, tau)
    return header + np.array(indices, "<u2").tobytes() + bytes(math.ceil(len(indices) / 8))


def stc(count: int, mu: float, bits: int, stream: bytes) -> bytes:
    return STC_HEADER.pack(1, P, count, mu, bits) + stream + bytes(math.ceil(count / 8))


BIASES = bytes(4 * 18)  # DGC sends LAYOUT's two biases dense


def table() -> list[tuple[str, str, Callable[[], bytes], str]]:
    """(codec spec, case, the hostile payload, the reason after the wire type)."""
    return [
        ("topk", "count>P", lambda: sparse(P + 1, [], []), "411 entries, expected 1..410 for this layout"),
        (
            "topk",
            "count=2^32-1",
            lambda: sparse(2**32 - 1, [], []),
            "4294967295 entries, expected 1..410 for this layout",
        ),
        ("topk", "count=0", lambda: sparse(0, [], []), "0 entries, expected 1..410 for this layout"),
        ("topk", "index=P", lambda: sparse(2, [3, P], [0.5, 0.5]), "index 410 out of range for P=410"),
        ("topk", "index=65535", lambda: sparse(1, [65535], [0.5]), "index 65535 out of range for P=410"),
        ("topk", "repeated", lambda: sparse(2, [3, 3], [0.5, 0.5]), "index 3 is repeated"),
        ("topk", "unordered", lambda: sparse(2, [9, 3], [0.5, 0.5]), "indices are not in increasing order"),
        ("topk", "value-inf", lambda: sparse(1, [3], [np.inf]), "values contain NaN or Inf"),
        ("topk", "value-nan", lambda: sparse(1, [3], [np.nan]), "values contain NaN or Inf"),
        ("topk", "scale-inf", lambda: sparse(1, [3], [0.5], np.inf), "scale must be positive and finite, got inf"),
        ("topk", "scale-negative", lambda: sparse(1, [3], [0.5], -1), "scale must be positive and finite, got -1.0"),
        ("topk", "scaled-overflow", lambda: sparse(1, [3], [60000.0], 1e36), "values contain NaN or Inf"),
        (
            "topk",
            "odd-length",
            lambda: sparse(2, [3, 4], [0.5, 0.5])[:-1],
            "truncated payload of 20 bytes, its header implies 21",
        ),
        ("threshold", "count>P", lambda: threshold(P + 1, []), "411 entries, expected 0..410 for this layout"),
        ("threshold", "index=P", lambda: threshold(1, [P]), "index 410 out of range for P=410"),
        ("threshold", "repeated", lambda: threshold(2, [7, 7]), "index 7 is repeated"),
        ("threshold", "tau-nan", lambda: threshold(1, [7], np.nan), "threshold τ must be positive and finite, got nan"),
        (
            "dgc",
            "count>sparse",
            lambda: sparse(393, [], [], tail=BIASES),
            "393 entries of the dim > 1 tensors, expected 0..392 for this layout",
        ),
        (
            "dgc",
            "count=2^32-1",
            lambda: sparse(2**32 - 1, [], [], tail=BIASES),
            "4294967295 entries of the dim > 1 tensors, expected 0..392 for this layout",
        ),
        ("dgc", "index=P", lambda: sparse(1, [P], [0.5], tail=BIASES), "index 410 out of range for P=410"),
        (
            "dgc",
            "index-in-a-bias",
            lambda: sparse(1, [75], [0.5], tail=BIASES),
            "a sparse index lies in a dim ≤ 1 tensor, which is sent dense",
        ),
        ("dgc", "repeated", lambda: sparse(2, [5, 5], [0.5, 0.5], tail=BIASES), "index 5 is repeated"),
        (
            "dgc",
            "dense-inf",
            lambda: sparse(1, [3], [0.5], tail=np.full(18, np.inf, "<f4").tobytes()),
            "dense values contain NaN or Inf",
        ),
        ("dgc", "no-biases", lambda: sparse(1, [3], [0.5]), "truncated payload of 17 bytes, its header implies 89"),
        ("stc", "count>P", lambda: stc(P + 1, 0.5, 0, bytes(52)), "411 entries, expected 1..410 for this layout"),
        ("stc", "count=0", lambda: stc(0, 0.5, 0, b""), "0 entries, expected 1..410 for this layout"),
        ("stc", "mu-inf", lambda: stc(1, np.inf, 0, b"\0"), "magnitude μ must be finite and ≥ 0, got inf"),
        ("stc", "mu-nan", lambda: stc(1, np.nan, 0, b"\0"), "magnitude μ must be finite and ≥ 0, got nan"),
        (
            "stc",
            "b=255",
            lambda: stc(1, 0.5, 255, b"\0"),
            "Rice parameter b=255 is above 9, the most 1 positions among P=410 can use",
        ),
        ("stc", "position=511", lambda: stc(1, 0.5, 9, bytes([0x7F, 0xC0])), "position 511 out of range for P=410"),
        (
            "stc",
            "runs-past",
            lambda: stc(2, 0.5, 0, b"\xff"),
            "truncated payload: position code 0 of 2 runs past its end",
        ),
        (
            "stc",
            "bomb",
            lambda: stc(1, 0.5, 0, bytes(DENSE - 15)),
            "oversized payload of 1645 bytes, 1 positions among P=410 coded with b=0 take at most 67",
        ),
        (
            "stc",
            "short",
            lambda: stc(20, 0.5, 4, bytes(5)),
            "truncated payload of 22 bytes, 20 positions coded with b=4 need at least 30",
        ),
        ("powersgd", "rank=0", lambda: changed("powersgd:2", 5, "<H", 0), "rank must be ≥ 1, the header says 0"),
        (
            "powersgd",
            "rank=65535",
            lambda: changed("powersgd:2", 5, "<H", 65535),
            "rank-65535 factors for this layout take 1647 bytes, the payload has 551",
        ),
        ("powersgd", "factor-nan", lambda: changed("powersgd:2", 7, "<f", np.nan), "factors contain NaN or Inf"),
        (
            "powersgd",
            "product-overflow",
            lambda: overflowing_factors(),
            "decoded entries (factor products) contain NaN or Inf",
        ),
        (
            "onebit",
            "scale-inf",
            lambda: changed("onebit", 5, "<f", np.inf),
            "scales and dense entries contain NaN or Inf",
        ),
        ("terngrad", "scale-nan", lambda: changed("terngrad", 5, "<f", np.nan), "scales contain NaN or Inf"),
        ("terngrad", "scale-negative", lambda: changed("terngrad", 5, "<f", -1), "negative scale -1.0"),
        ("terngrad", "code-3", lambda: changed("terngrad", 5 + 4 * 4, "<B", 0xFF), "invalid ternary code 3 at index 0"),
        ("int8", "scale-inf", lambda: changed("int8", 9, "<f", np.inf), "scales contain NaN or Inf"),
        ("int8", "level-128", lambda: changed("int8", 9 + 4 * 4, "<b", -128), "a quantized value exceeds ±127 levels"),
        (
            "int8",
            "levels=128",
            lambda: changed("int8", 5, "<I", 128),
            "truncated payload of 435 bytes, its header implies 845",
        ),
        ("qsgd", "levels=0", lambda: changed("qsgd:16", 5, "<I", 0), "0 levels is outside [1, 32767]"),
        (
            "qsgd",
            "levels=2^32-1",
            lambda: changed("qsgd:16", 5, "<I", 2**32 - 1),
            "4294967295 levels is outside [1, 32767]",
        ),
        ("qsgd", "level-17", lambda: changed("qsgd:16", 9 + 4 * 4, "<b", 17), "a quantized value exceeds ±16 levels"),
        ("none", "value-nan", lambda: changed("none", 5 + 4 * 7, "<f", np.nan), "values contain NaN or Inf"),
        ("none", "value-inf", lambda: changed("none", 5, "<f", -np.inf), "values contain NaN or Inf"),
    ]


def overflowing_factors() -> bytes:
    """PowerSGD factors each finite whose product is not: row 0 of P̂ (conv: 8×2, at 7) and of Q (9×2)."""
    huge = np.full(2, 3e38, "<f4").tobytes()
    payload = valid("powersgd:2")[1]
    return payload[:7] + huge + payload[15 : 7 + 4 * 16] + huge + payload[7 + 4 * 16 + 8 :]


@pytest.mark.parametrize(("codec", "case", "payload", "reason"), [pytest.param(*row, id=f"{row[0]}-{row[1]}")
                                                                   for row in table()])  # fmt: skip
def test_each_hostile_payload_is_refused_with_its_reason(codec: str, case: str, payload, reason: str) -> None:
    stype = f"edgefl.{codec}.v1"
    assert refused(stype, payload()) == f"{stype}: {reason}"


def test_every_codec_has_hostile_cases_of_its_own() -> None:
    """The table tries each codec's counts and contents, not only the shared framing."""
    assert {codec for codec, _, _, _ in table()} == set(CODECS)


# --- memory: bounded by the model, whatever the payload says -----------------------------------------------------


def peak_bytes(stype: str, payload: bytes, layout) -> int:
    """The most memory decoding ``payload`` held at once beyond what was held before (tracemalloc)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(MalformedUpdate):
            server_compressor(stype).decode(payload, layout)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_an_stc_decoder_bomb_is_refused_in_a_fraction_of_the_models_memory() -> None:
    """One position and a dense model's worth of zero bits: the old decoder listed every zero bit as a Python int
    (~160 MB, ~400x the 0.4 MB model, and about a second) before it refused the payload."""
    size = layout_info(WIDE).size
    bomb = STC_HEADER.pack(1, size, 1, 0.5, 0) + bytes(dense_payload_size(size) - STC_HEADER.size)
    reason = refused("edgefl.stc.v1", bomb, WIDE)
    assert reason.startswith(f"edgefl.stc.v1: oversized payload of {len(bomb)} bytes, 1 positions among P={size}")
    assert peak_bytes("edgefl.stc.v1", bomb, WIDE) < 4 * 4 * size


def densest(spec: CodecSpec) -> bytes:
    """The largest payload a codec's encoder writes for WIDE (its most entries kept), whatever its size."""
    compressor, memory = CODECS[spec.name].make(spec, WIDE, 0, 1)
    u = np.random.default_rng(1).standard_normal(layout_info(WIDE).size).astype(np.float32)
    return compressor.encode(u, WIDE, memory.compressor_state(10, np.random.default_rng(0)))


def worst_stc(bits: int) -> bytes:
    """Every position of WIDE, coded with b = bits: the longest stream the decoder reads (gaps 0, quotients 0)."""
    size = layout_info(WIDE).size
    stream = np.packbits(np.zeros(size * (1 + bits), np.uint8)).tobytes()
    return STC_HEADER.pack(1, size, size, 0.5, bits) + stream + bytes(math.ceil(size / 8))


@pytest.mark.parametrize(
    ("spec", "payload"),
    [(s, lambda s=s: densest(parse_codec(s))) for s in
     ("none", "topk:0.66", "threshold:0.3", "stc:0.999", "dgc:0.34", "powersgd:16", "onebit", "terngrad", "int8",
      "qsgd:1000")]
    + [("stc-b0", lambda: worst_stc(0)), ("stc-b1", lambda: worst_stc(1))],
)  # fmt: skip
def test_no_decoder_holds_more_than_4x_the_dense_model(spec: str, payload) -> None:
    """Each codec's densest payload (and STC's two longest streams, every position with b = 0 and b = 1) decodes
    within 4x the dense float32 model's memory, the dense result included: the old STC decoder took ~37x."""
    data = payload()
    name = spec.partition(":")[0].partition("-")[0]
    stype = f"edgefl.{name}.v1"
    size = layout_info(WIDE).size
    assert np.isfinite(server_compressor(stype).decode(data, WIDE)).all()
    assert peak_bytes(stype, data, WIDE) < 4 * 4 * size
