"""The Flower message layout: three Flower objects each way whatever they carry, round trips, and messages the
receiver must refuse."""

from __future__ import annotations

import itertools
import json
import math
import re
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_body, no_object_id_recompute

from contract.messages import TrainInstruction, TrainReply
from contract.wire import (
    HEADER,
    PAYLOAD,
    RECORD,
    WireError,
    WireSize,
    instruction_content,
    parse_instruction,
    parse_reply,
    reply_content,
    train_message,
    wire_size,
)
from strategies.downlink import Broadcast, Part
from strategies.rounds import Update


def test_instruction_round_trip_carries_the_broadcast() -> None:
    broadcast = Broadcast(2, (Part(3, "edgefl.topk.v1", b"abc"), Part(5, "edgefl.int8.v1", b"defg")))
    instr = TrainInstruction('{"dataset": "digits"}', 3, 7, broadcast)
    assert parse_instruction(instruction_content(instr)) == instr
    assert parse_instruction(instruction_content(TrainInstruction("{}", 1, 1, None))).broadcast is None


def _reply() -> TrainReply:
    updates = (Update(1, "edgefl.none.v1", b"abc", 10, 0.5, 1.0), Update(2, "edgefl.topk.v1", b"de", 10, 0.4, math.nan))
    return TrainReply(0, updates, {"peak_rss_mb": 100.0}, "fast", held_s=1.25, reply_key="k" * 32)


def test_reply_round_trip_gives_back_the_same_update_records() -> None:
    parsed = parse_reply(reply_content(_reply()))
    assert parsed.updates[0] == _reply().updates[0]  # one record, agent to server
    assert parsed.updates[1].payload == b"de" and math.isnan(parsed.updates[1].loss)
    assert (parsed.health, parsed.transport, parsed.held_s) == ({"peak_rss_mb": 100.0}, "fast", 1.25)


def test_a_message_is_three_flower_objects_however_large(flower_task: None) -> None:
    """Message, RecordDict, ConfigRecord: one round of parallel object requests over the link each way."""
    big = TrainReply(0, tuple(Update(r, "edgefl.none.v1", bytes(400_000), 1) for r in (1, 2, 3)), reply_key="k")
    for content in (
        reply_content(_reply()),
        reply_content(big),
        instruction_content(TrainInstruction("{}", 1, 1, None)),
    ):
        assert wire_size(Message(content, dst_node_id=1, message_type="train")).objects == 3
    assert wire_size(Message(reply_content(big), dst_node_id=1, message_type="train")).bytes > 1_200_000


def _deflated_size(message: Message) -> WireSize:
    """What ``wire_size`` counts, the way Flower sends it: every object of the message serialized."""
    with no_object_id_recompute():
        objects = get_all_nested_objects(message).values()
        return WireSize(sum(len(obj.deflate()) for obj in objects), len(objects))


def _reply_of(size: int, instruction: Message, updates: int = 1) -> Message:
    """A reply to ``instruction`` whose payload is ``size`` bytes in ``updates`` updates."""
    data = (bytes(range(256)) * (size // 256 + 1))[:size]
    cuts = [size * i // updates for i in range(updates + 1)]
    parts = tuple(Update(i + 1, "edgefl.none.v1", data[a:b], 1) for i, (a, b) in enumerate(itertools.pairwise(cuts)))
    return Message(reply_content(TrainReply(0, parts, reply_key="k")), reply_to=instruction)


@pytest.fixture
def instruction(flower_task: None) -> Message:
    """An instruction as the server pushed it (the SuperLink gave it its id), for replies to answer."""
    message = train_message(TrainInstruction("{}", 1, 1, None, reply_key="k" * 32), 7)
    message.metadata.__dict__["_message_id"] = "a" * 64
    return message


def _body_length(message: Message) -> int:
    """Bytes of the body of the message's ConfigRecord, deflated."""
    return len(get_object_body(message.content.config_records[RECORD].deflate(), ConfigRecord))


def test_wire_size_is_byte_exact_across_every_length_boundary(instruction: Message) -> None:
    """Counted without serializing the payload, and equal to the bytes Flower sends to the byte: payloads of
    every small size, across each length prefix's 7-bit boundaries (the bytes value, its entry, the record's
    item) and across the decimal digits of the body's length in the object's head; in one update or three."""
    overhead = _body_length(_reply_of(0, instruction))
    sizes = [*range(300), *(edge + d for edge in (2**14, 2**21) for d in range(-12, 3))]
    sizes += [10**digits - overhead + d for digits in range(3, 7) for d in range(-24, 4)]  # "size": n grows too
    for size in sizes:
        for updates in (1, 3):
            reply = _reply_of(size, instruction, updates)
            assert wire_size(reply) == _deflated_size(reply), (size, updates)
    crossed = {len(str(_body_length(_reply_of(10**6 - overhead + d, instruction)))) for d in (-24, 3)}
    assert crossed == {6, 7}  # the sizes above do cross a digit of the body's length


def test_wire_size_is_byte_exact_for_every_kind_of_message(instruction: Message) -> None:
    """Instructions with and without a broadcast, an error reply, and a message of other records and values
    (several bytes values in one record, empty ones, lists, arrays, metrics): each as Flower sends it."""
    broadcast = Broadcast(2, (Part(3, "edgefl.topk.v1", bytes(5000)), Part(5, "edgefl.int8.v1", b"defg")))
    records = RecordDict({
        "config": ConfigRecord({"a": b"x" * 200, "s": "text", "n": 3, "e": b"", "c": bytes(20_000),
                                "l": [b"ab", b"cd"], "f": 0.5}),
        "more": ConfigRecord({"only": bytes(130)}),
        "metrics": MetricRecord({"loss": 0.25}),
        "arrays": ArrayRecord({"w": Array(np.arange(1000, dtype=np.float32))}),
    })  # fmt: skip
    for message in (
        train_message(TrainInstruction("{}", 1, 1, None), 3),
        train_message(TrainInstruction('{"job": 1}', 2, 4, broadcast), 3),
        Message(Error(code=0, reason="the ClientApp raised"), reply_to=instruction),
        Message(records, dst_node_id=1, message_type="train"),
        _reply_of(15 << 20, instruction),
    ):
        assert wire_size(message) == _deflated_size(message)


def _peak_bytes(call: Callable[[], object]) -> int:
    """The most Python memory ``call`` held at once on top of what was there before (``tracemalloc``)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_wire_size_does_not_serialize_the_payload_again(instruction: Message) -> None:
    """A 15 MB reply is counted in well under a megabyte: serializing it cost four copies at once, twice."""
    reply = _reply_of(15 << 20, instruction)
    assert _peak_bytes(lambda: wire_size(reply)) < 1 << 20


def test_a_refused_reply_copies_none_of_its_payload(instruction: Message) -> None:
    """Every field is checked before an update's payload is cut out of the reply's: a refused reply of several
    updates copies none of it. One update is the reply's payload itself; several are cut out of it."""
    one = _reply_of(15 << 20, instruction).content
    assert parse_reply(one).updates[0].payload is one.config_records[RECORD][PAYLOAD]
    three = _reply_of(15 << 20, instruction, updates=3).content
    parsed = parse_reply(three)
    assert [len(u.payload) for u in parsed.updates] == [5 << 20] * 3
    assert b"".join(u.payload for u in parsed.updates) == three.config_records[RECORD][PAYLOAD]
    for change in ({"held-s": -1.0}, {"reply-key": ""}, {"partition-id": None}, {"health": []}):
        tampered = _tampered(three, **change)

        def refused(content: RecordDict = tampered) -> None:
            with pytest.raises(WireError):
                parse_reply(content)

        assert _peak_bytes(refused) < 1 << 20, change


def _tampered(content: RecordDict, **header: object) -> RecordDict:
    record = content.config_records[RECORD]
    return RecordDict({RECORD: ConfigRecord({HEADER: json.dumps({**json.loads(record[HEADER]), **header}),
                                             PAYLOAD: record[PAYLOAD]})})  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"updates": [{"round": 1, "stype": "x", "size": 4, "num-examples": 1, "train-s": 0, "loss": 0}]},  # 4 ≠ 5
        {"updates": [{"round": 1, "stype": "x", "size": -1, "num-examples": 1, "train-s": 0, "loss": 0}]},
        {"updates": [{"round": 1}]},
        {"health": []},
        {"partition-id": "zero"},
        {"held-s": -1.0},  # how long the agent held the message: a duration
        {"held-s": None},
    ],
)
def test_inconsistent_replies_are_refused(change: dict) -> None:
    with pytest.raises(WireError):
        parse_reply(_tampered(reply_content(_reply()), **change))


def test_instructions_that_do_not_add_up_are_refused() -> None:
    content = instruction_content(TrainInstruction("{}", 1, 1, Broadcast(0, (Part(1, "edgefl.topk.v1", b"abc"),))))
    with pytest.raises(WireError, match="do not add up"):
        parse_instruction(_tampered(content, broadcast={"base-round": 0, "rounds": [1], "stypes": ["s"], "sizes": [4],
                                                          "sha256": ""}))  # fmt: skip
    header = json.dumps({"job": "{}", "next-round": 1, "last-round": 1})
    with pytest.raises(WireError, match="without a broadcast"):
        parse_instruction(RecordDict({RECORD: ConfigRecord({HEADER: header, PAYLOAD: b"abc"})}))
    with pytest.raises(WireError, match="not an edgefl message"):
        parse_instruction(RecordDict({"other": ConfigRecord({"x": 1})}))


def _reply_header_text(**raw: str) -> str:
    """The JSON header of ``_reply()`` with the named fields' values replaced by raw JSON text (``1e400``,
    ``Infinity``, a 400-digit integer: what ``json.dumps`` never writes but a stranger may). A name ``u.FIELD``
    is a field of the first update."""
    header = json.loads(reply_content(_reply()).config_records[RECORD][HEADER])
    for name in raw:
        where, key = (header["updates"][0], name[2:]) if name.startswith("u.") else (header, name)
        where[key] = f"@{name}@"
    text = json.dumps(header)
    for name, value in raw.items():
        text = text.replace(f'"@{name}@"', value)
    return text


def _raw_reply(header: str) -> RecordDict:
    payload = reply_content(_reply()).config_records[RECORD][PAYLOAD]
    return RecordDict({RECORD: ConfigRecord({HEADER: header, PAYLOAD: payload})})


INTEGER_FIELDS = ["partition-id", "partition-size", "u.round", "u.size", "u.num-examples"]
NUMBER_FIELDS = ["held-s", "u.train-s", "u.loss"]
HUGE = "1" + "0" * 400  # 10**400 as a JSON integer
HOSTILE_NUMBERS = ["1e400", "-1e400", "Infinity", "-Infinity", "NaN", HUGE, '"7"', "[1]", "{}"]
HOSTILE_INTEGERS = [*HOSTILE_NUMBERS, "true", "false", "null", "1.5", "2.0", "-1", str(2**31)]


@pytest.mark.parametrize(
    ("field", "value"),
    [(f, v) for f in INTEGER_FIELDS for v in HOSTILE_INTEGERS]
    + [(f, v) for f in NUMBER_FIELDS for v in HOSTILE_NUMBERS]
    + [("held-s", "-0.5"), ("u.train-s", "-1"), ("held-s", "true"), ("u.train-s", "null"), ("held-s", "1e9")],
    ids=lambda value: "10**400" if value == HUGE else None,
)
def test_a_hostile_number_in_any_reply_field_is_refused_with_its_reason(field: str, value: str) -> None:
    """Overflowing (1e400, a 400-digit integer), non-finite, negative, out-of-range, bool-as-int and mistyped
    values: each is a WireError (what the server turns into a refusal) naming the field, never OverflowError or
    another exception that would end the run."""
    with pytest.raises(WireError) as refused:
        parse_reply(_raw_reply(_reply_header_text(**{field: value})))
    reason = str(refused.value)
    name = field.removeprefix("u.")
    assert reason.startswith("malformed reply: ") and name in reason and "\n" not in reason and len(reason) < 200
    if field.startswith("u."):
        assert "update 0: " in reason


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("u.num-examples", "0", "update 0: num-examples is 0, not an integer in [1, 2147483647]"),
        ("u.num-examples", str(2**31), "update 0: num-examples is 2147483648, not an integer in [1, 2147483647]"),
        ("u.num-examples", "true", "update 0: num-examples is True, not an integer in [1, 2147483647]"),
        ("u.round", "0", "update 0: round is 0, not an integer in [1, 2147483647]"),
        ("u.size", "6", "update 0: size is 6, not an integer in [0, 5]"),  # the payload has 3 + 2 bytes
        ("u.loss", "1e400", "update 0: loss is inf, not a number in [-1e+30, 1e+30]"),
        ("u.train-s", "NaN", "update 0: train-s is nan, not a number in [0, 2.592e+06]"),
        ("partition-id", HUGE, "partition-id is 10000000000000000000...(401 characters), not an integer"),
        ("held-s", "Infinity", "held-s is inf, not a number in [0, 2.592e+06]"),
        ("u.stype", "7", "update 0: stype is 7, not a name of 1 to 64 printable characters"),
        ("transport", '"' + "x" * 65 + '"', "transport is 'xxxxxxxxxxxxxxxxxxx...(67 characters), not a name"),
        ("health", '{"t": NaN}', "health reading 't' is nan, not a number"),
        ("health", '{"t": [1]}', "health reading 't' is [1], not a name"),
        ("updates", "{}", "updates is {}, not a list of at most 1024 updates"),
    ],
)
def test_the_reason_names_the_field_its_value_and_its_range(field: str, value: str, expected: str) -> None:
    with pytest.raises(WireError, match=re.escape(f"malformed reply: {expected}")):
        parse_reply(_raw_reply(_reply_header_text(**{field: value})))


def test_replies_too_deep_too_long_or_missing_a_field_are_refused() -> None:
    with pytest.raises(WireError, match="not an edgefl message \\(RecursionError"):
        parse_reply(_raw_reply("[" * 100_000 + "]" * 100_000))
    with pytest.raises(WireError, match="not an edgefl message \\(ValueError: Exceeds the limit"):
        parse_reply(_raw_reply(_reply_header_text(**{"partition-id": "9" * 5000})))
    entries = json.dumps([{"round": 1, "stype": "x", "size": 0, "num-examples": 1, "train-s": 0, "loss": None}] * 1025)
    with pytest.raises(WireError, match="not a list of at most 1024 updates"):
        parse_reply(_raw_reply(_reply_header_text(updates=entries)))
    header = json.loads(_reply_header_text())
    del header["updates"][0]["num-examples"]
    with pytest.raises(WireError, match="malformed reply: no field 'num-examples'"):
        parse_reply(_raw_reply(json.dumps(header)))


def test_the_limits_let_every_honest_reply_through() -> None:
    """The largest values an agent can report pass: a 2^31 − 1 example partition, a loss of 1e30, 30 days."""
    update = Update(2**31 - 1, "edgefl.none.v1", b"abc", 2**31 - 1, 30 * 24 * 3600.0, -1e30)
    reply = TrainReply(2**31 - 1, (update,), {"peak_rss_mb": 1e4, "cpu_temp_c": None, "throttled": 0}, "fast",
                       held_s=0.0, partition_size=2**31 - 1, reply_key="k" * 64)  # fmt: skip
    assert parse_reply(reply_content(reply)) == reply


@pytest.mark.parametrize("value", ["1e400", "Infinity", "NaN", "true", "2.5", '"1"'])
def test_a_hostile_number_in_an_instruction_is_a_wire_error(value: str) -> None:
    """The device's side: the rounds and a broadcast's metadata are integers, or the instruction is refused."""
    header = json.dumps({"job": "{}", "next-round": "@", "last-round": 1})
    with pytest.raises(WireError, match="malformed instruction: next-round is"):
        parse_instruction(RecordDict({RECORD: ConfigRecord({HEADER: header.replace('"@"', value), PAYLOAD: b""})}))
    broadcast = '{"base-round": @, "rounds": [1], "stypes": ["s"], "sizes": [3], "sha256": ""}'.replace("@", value)
    header = '{"job": "{}", "next-round": 1, "last-round": 1, "broadcast": ' + broadcast + "}"
    with pytest.raises(WireError, match="malformed instruction: broadcast metadata is incomplete or not numeric"):
        parse_instruction(RecordDict({RECORD: ConfigRecord({HEADER: header, PAYLOAD: b"abc"})}))


def test_fuzzed_reply_headers_parse_or_are_wire_errors() -> None:
    """Any JSON value in any field of a reply's header, and fields dropped: a TrainReply whose numbers are finite
    and in range, or a WireError, never another exception (which would end the server's run)."""
    rng = np.random.default_rng(27)
    values = [None, True, False, 0, -1, 1, 2**31, 2**63, 10**400, 0.5, -0.0, 1e308, math.inf, -math.inf, math.nan,
              "", "x", "7", [], [1], {}, {"a": 1}, [{"round": 1}]]  # fmt: skip
    header = json.loads(reply_content(_reply()).config_records[RECORD][HEADER])
    for _ in range(2000):
        fuzzed = json.loads(json.dumps(header))
        for _ in range(int(rng.integers(1, 4))):
            entries = fuzzed.get("updates")
            in_update = rng.random() < 0.6 and isinstance(entries, list) and len(entries) == 2
            where = entries[int(rng.integers(0, 2))] if in_update else fuzzed
            if not isinstance(where, dict) or not where:
                continue
            key = list(where)[int(rng.integers(0, len(where)))]
            if rng.random() < 0.1:
                del where[key]
            else:
                where[key] = values[int(rng.integers(0, len(values)))]
        try:
            reply = parse_reply(_raw_reply(json.dumps(fuzzed)))
        except WireError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 200
            continue
        numbers = [reply.partition_id, reply.held_s, reply.partition_size]
        numbers += [x for u in reply.updates for x in (u.round, u.num_examples, u.train_s)]
        assert all(type(x) in (int, float) and math.isfinite(x) and 0 <= x < 2**31 for x in numbers)
