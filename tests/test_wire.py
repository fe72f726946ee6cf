"""The Flower message layout: one Array each way, round trips, and replies the server must refuse."""

from __future__ import annotations

import pytest

from fl_client.wire import (
    ARRAYS,
    CONFIG,
    TrainInstruction,
    TrainReply,
    UpdateMeta,
    instruction_content,
    parse_instruction,
    parse_reply,
    reply_content,
)
from strategies.downlink import Broadcast, Part


def test_instruction_round_trip_carries_the_broadcast_as_one_array() -> None:
    broadcast = Broadcast(2, (Part(3, "edgefl.topk.v1", b"abc"), Part(5, "edgefl.int8.v1", b"defg")))
    content = instruction_content(TrainInstruction({"dataset": "digits"}, 3, 7, broadcast))
    assert len(content.array_records[ARRAYS]) == 1
    instr = parse_instruction(content)
    assert (instr.job, instr.next_round, instr.last_round, instr.broadcast) == ({"dataset": "digits"}, 3, 7, broadcast)
    assert parse_instruction(instruction_content(TrainInstruction({}, 1, 1, None))).broadcast is None


def test_instruction_with_a_broadcast_that_does_not_add_up_is_refused() -> None:
    content = instruction_content(TrainInstruction({}, 1, 1, Broadcast(0, (Part(1, "edgefl.topk.v1", b"abc"),))))
    content[CONFIG]["sizes"] = [4]
    with pytest.raises(ValueError, match="do not add up"):
        parse_instruction(content)
    del content.array_records[ARRAYS]
    with pytest.raises(KeyError):  # metadata without the bundle
        parse_instruction(content)


def _reply() -> TrainReply:
    updates = [UpdateMeta(1, "edgefl.none.v1", 3, 10, 0.5, 1.0), UpdateMeta(2, "edgefl.topk.v1", 2, 10, 0.4, 0.9)]
    return TrainReply(0, updates, b"abcde", {"peak_rss_mb": 100.0})


def test_reply_round_trip_splits_the_bundle() -> None:
    content = reply_content(_reply())
    assert len(content.array_records[ARRAYS]) == 1
    parsed = parse_reply(content)
    assert [m.round for m in parsed.updates] == [1, 2] and parsed.payloads() == [b"abc", b"de"]
    assert parsed.health == {"peak_rss_mb": 100.0}


@pytest.mark.parametrize("field", ["sizes", "rounds"])
def test_inconsistent_replies_are_refused(field: str) -> None:
    content = reply_content(_reply())
    config = content[CONFIG]
    config[field] = [*list(config[field]), 9] if field == "rounds" else [3, 3]
    with pytest.raises(ValueError):
        parse_reply(content)
