"""The Flower message layout: one Array each way, round trips, and replies the server must refuse."""

from __future__ import annotations

import numpy as np
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


def test_instruction_round_trip_carries_the_model_as_one_array() -> None:
    params = np.arange(10, dtype=np.float32)
    content = instruction_content(TrainInstruction({"dataset": "digits"}, 3, 7, 2, params))
    assert len(content.array_records[ARRAYS]) == 1
    instr = parse_instruction(content)
    assert (instr.job, instr.next_round, instr.last_round, instr.global_round) == ({"dataset": "digits"}, 3, 7, 2)
    np.testing.assert_array_equal(instr.global_params, params)
    assert parse_instruction(instruction_content(TrainInstruction({}, 1, 1, -1, None))).global_params is None


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
