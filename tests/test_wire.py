"""The Flower message layout: three Flower objects each way whatever they carry, round trips, and messages the
receiver must refuse."""

from __future__ import annotations

import json
import math

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from contract.messages import TrainInstruction, TrainReply
from contract.wire import (
    HEADER,
    PAYLOAD,
    RECORD,
    WireError,
    instruction_content,
    parse_instruction,
    parse_reply,
    reply_content,
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
    return TrainReply(0, updates, {"peak_rss_mb": 100.0}, "fast", held_s=1.25)


def test_reply_round_trip_gives_back_the_same_update_records() -> None:
    parsed = parse_reply(reply_content(_reply()))
    assert parsed.updates[0] == _reply().updates[0]  # one record, agent to server
    assert parsed.updates[1].payload == b"de" and math.isnan(parsed.updates[1].loss)
    assert (parsed.health, parsed.transport, parsed.held_s) == ({"peak_rss_mb": 100.0}, "fast", 1.25)


def test_a_message_is_three_flower_objects_however_large(flower_task: None) -> None:
    """Message, RecordDict, ConfigRecord: one round of parallel object requests over the link each way."""
    big = TrainReply(0, tuple(Update(r, "edgefl.none.v1", bytes(400_000), 1) for r in (1, 2, 3)))
    for content in (
        reply_content(_reply()),
        reply_content(big),
        instruction_content(TrainInstruction("{}", 1, 1, None)),
    ):
        assert wire_size(Message(content, dst_node_id=1, message_type="train")).objects == 3
    assert wire_size(Message(reply_content(big), dst_node_id=1, message_type="train")).bytes > 1_200_000


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
