"""The server's loop (``fl_server.engine.ServerLoop``) with a grid that stands in for Flower's: who is asked which
partition it trains, what a promoted spare trains, and the updates refused for their weight (no Flower processes)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from contract.messages import TrainReply
from contract.run_folder import ROUNDS, Mirror, RunFolder
from contract.settings import build_config, parse_partition
from contract.wire import HEADER, RECORD, WireError, parse_instruction, parse_reply, reply_content, wire_size
from fl_server.engine import PulledReplies, ServerLoop, parsed_reply
from ml.data import load_dataset
from ml.partition import partition_indices
from strategies.codecs import make_client_codec, parse_codec
from strategies.rounds import Update


class Grid:
    """Flower's grid as the loop uses it: the nodes connected, and the messages pushed to them (answered by hand)."""

    def __init__(self, nodes: set[int]) -> None:
        self.nodes = nodes
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def push_messages(self, messages: list[Message]) -> list[str]:
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(message)
        return [message.metadata.message_id for message in messages]

    def to(self, node: int) -> list[Message]:
        """The messages pushed to ``node`` since ``sent`` was last cleared."""
        return [m for m in self.sent if m.metadata.dst_node_id == node]


@pytest.fixture
def make_loop(tmp_path: Path, flower_task: None) -> Iterator[Callable[..., tuple[ServerLoop, Grid]]]:
    loops: list[ServerLoop] = []

    def make(nodes: set[int], **settings: object) -> tuple[ServerLoop, Grid]:
        grid = Grid(nodes)
        config = build_config(dataset="digits", partition="iid", clients=2, rounds=2, seed=0, out=str(tmp_path),
                              **settings)  # fmt: skip
        loops.append(ServerLoop(grid, config, RunFolder(tmp_path), PulledReplies(grid, "stock")))
        return loops[-1], grid

    yield make
    for loop in loops:
        loop.evaluator.close()


def _answer(loop: ServerLoop, message: Message, reply: TrainReply | Error, key_of: Message | None = None) -> None:
    """Settle ``message``'s reply as the loop would once pulled; it echoes the key of ``key_of`` (default: of
    ``message``, as the device the message reached does)."""
    if isinstance(reply, TrainReply):
        reply = dataclasses.replace(reply, reply_key=parse_instruction((key_of or message).content).reply_key)
    answer = Message(reply if isinstance(reply, Error) else reply_content(reply), reply_to=message)
    loop.settle(answer, parsed_reply(answer), wire_size(answer), loop.now())


def _identify(loop: ServerLoop, grid: Grid, partitions: dict[int, int]) -> None:
    """Each node answers who it is: ``partitions``' partition, of the size the server's split gives it."""
    loop._refresh_nodes()
    loop.push_requests()
    for node, partition in partitions.items():
        (asked,) = grid.to(node)
        _answer(loop, asked, TrainReply(partition, (), partition_size=loop.members.sizes[partition]))
    grid.sent.clear()


def _update(loop: ServerLoop, round_: int, num_examples: int) -> Update:
    zeros = np.zeros(loop.engine.global_params.size, np.float32)
    encoded = make_client_codec(parse_codec("none"), loop.engine.layout, seed=0).encode(zeros, round_)
    return Update(round_, encoded.stype, encoded.payload, num_examples)


def _rows(loop: ServerLoop) -> list[dict]:
    loop.evaluator.close()
    return [json.loads(line) for line in (loop.folder.path / ROUNDS).read_text().splitlines()]


def test_a_promoted_spare_trains_the_partition_it_takes_over(make_loop) -> None:
    """Partial participation, 1 of 2 partitions a round, round 1 samples partition 1 (seed 0). Node 13 waits as
    partition 1's spare; node 12 leaves before training: node 13 is asked for round 1 and its update closes it."""
    loop, grid = make_loop({11, 12, 13}, clients_per_round="1")
    assert loop.engine.sampler.clients(1) == {1}
    _identify(loop, grid, {11: 0, 12: 1, 13: 1})
    assert loop.members.spares == {13: 1}
    grid.nodes = {11, 13}
    loop._refresh_nodes()
    loop.push_requests()
    (asked,) = grid.to(13)
    assert grid.to(11) == [] and parse_instruction(asked.content).next_round == 1
    size = loop.members.sizes[1]
    _answer(loop, asked, TrainReply(1, (_update(loop, 1, size),), partition_size=size))
    loop.close_rounds()
    (row,) = _rows(loop)
    assert (row["round"], row["clients"], row["rejected"]) == (1, [1], [])


def test_flowers_error_to_who_are_you_asks_again_and_only_the_agents_refusal_refuses(make_loop) -> None:
    """Node 11's answer is lost to Flower (its heartbeat expired: node unavailable), node 12's agent refuses the
    run: node 11 is asked again once it is seen, and answers; node 12 is never asked again."""
    loop, grid = make_loop({11, 12})
    loop._refresh_nodes()
    loop.push_requests()
    _answer(loop, grid.to(11)[0], Error(ErrorCode.NODE_UNAVAILABLE, "Node is not available"))
    _answer(loop, grid.to(12)[0], Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "AgentError: partition 2 of 3"))
    assert loop.members.refused == {12}
    grid.sent.clear()
    loop._refresh_nodes()
    loop.push_requests()
    (asked,) = grid.to(11)
    assert grid.to(12) == [] and not parse_instruction(asked.content).asks_for_rounds
    _answer(loop, asked, TrainReply(0, (), partition_size=loop.members.sizes[0]))
    assert loop.members.admitted == {11: 0}


def test_updates_weighted_beyond_their_partition_are_refused_with_the_reason_in_rounds_jsonl(make_loop) -> None:
    """The server makes the run's split: a node declaring another size for its partition is refused; an update
    claiming more examples than its partition has is refused (never clamped), and so is a reply naming another
    partition; both appear in the round's ``rejected``, and the round closes on the honest update."""
    loop, grid = make_loop({11, 12, 13})
    sizes = loop.members.sizes
    split = partition_indices(load_dataset("digits"), parse_partition("iid"), 2, seed=0)  # as a device makes it
    assert sizes == {0: len(split[0]), 1: len(split[1])} and loop.members.split
    loop._refresh_nodes()
    loop.push_requests()
    for node, partition, size in ((11, 0, sizes[0]), (12, 1, sizes[1]), (13, 1, 10**9)):
        _answer(loop, grid.to(node)[0], TrainReply(partition, (), partition_size=size))
    assert loop.members.admitted == {11: 0, 12: 1} and loop.members.refused == {13}
    grid.sent.clear()
    loop.push_requests()
    (to_11,), (to_12,) = grid.to(11), grid.to(12)
    _answer(loop, to_11, TrainReply(0, (_update(loop, 1, sizes[0] + 1),), partition_size=sizes[0]))
    _answer(loop, to_12, TrainReply(0, (_update(loop, 1, sizes[0]),), partition_size=sizes[0]))  # not its own
    grid.sent.clear()
    loop.push_requests()
    (to_12,) = grid.to(12)  # its reply was refused whole: it is asked again
    _answer(loop, to_12, TrainReply(1, (_update(loop, 1, sizes[1]),), partition_size=sizes[1]))
    loop.close_rounds()
    (row,) = _rows(loop)
    assert row["clients"] == [1]
    reasons = [r["reason"] for r in row["rejected"]]
    assert reasons == [
        f"num_examples {sizes[0] + 1} is more than partition 0's {sizes[0]} training examples",
        f"node 12 trains partition 1 of {sizes[1]} examples; its reply names partition 0 of {sizes[0]}",
    ]


def test_a_reply_in_another_nodes_name_is_refused_and_the_node_it_names_asked_again(make_loop) -> None:
    """Flower's SuperLink takes a reply to any message from any node that names it (bench/hostile_clients.py): a
    reply must echo the key its message carried, which only the node the message reached has read. A forged answer
    to who a node is leaves it to be asked again (not refused); a forged update is refused and not aggregated."""
    loop, grid = make_loop({11, 12})
    sizes = loop.members.sizes
    loop._refresh_nodes()
    loop.push_requests()
    (to_11,), (to_12,) = grid.to(11), grid.to(12)
    _answer(loop, to_11, TrainReply(0, (), partition_size=sizes[0]), key_of=to_12)  # node 12 answers for node 11
    _answer(loop, to_12, TrainReply(1, (), partition_size=sizes[1]))
    assert loop.members.admitted == {12: 1} and not loop.members.refused
    grid.sent.clear()
    loop._refresh_nodes()
    loop.push_requests()
    (to_11,) = grid.to(11)  # asked again; its own answer admits it
    _answer(loop, to_11, TrainReply(0, (), partition_size=sizes[0]))
    assert loop.members.admitted == {11: 0, 12: 1}
    loop.push_requests()

    def rounds_to(node: int) -> list[Message]:
        return [m for m in grid.to(node) if parse_instruction(m.content).asks_for_rounds]

    (to_11,), (to_12,) = rounds_to(11), rounds_to(12)
    forged = TrainReply(0, (_update(loop, 1, sizes[0]),), partition_size=sizes[0])
    _answer(loop, to_11, forged, key_of=to_12)
    _answer(loop, to_12, TrainReply(1, (_update(loop, 1, sizes[1]),), partition_size=sizes[1]))
    grid.sent.clear()
    loop.push_requests()
    # The forged reply settled its message, so the SuperLink will refuse node 11's own as a duplicate: node 11 is
    # asked for round 1 again, and to send again what it kept (edge.agent); node 12's next message asks no resend.
    (to_11,) = rounds_to(11)
    again = parse_instruction(to_11.content)
    assert (again.next_round, again.resend) == (1, True)
    assert not any(parse_instruction(m.content).resend for m in grid.to(12))
    _answer(loop, to_11, TrainReply(0, (_update(loop, 1, sizes[0]),), partition_size=sizes[0]))
    loop.close_rounds()
    (row,) = _rows(loop)
    assert sorted(row["clients"]) == [0, 1]
    assert [r["reason"] for r in row["rejected"]] == [
        "its reply key is not the message's: not answered by node 11, which the message went to"
    ]


def test_a_clients_error_reason_reaches_the_log_as_one_bounded_printable_line(
    make_loop, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A reason that starts a line of its own (newline, carriage return, Unicode's line separator) with an echo
    record, and an escape sequence for the reader's terminal: the server logs one line, and the submitter's Mirror,
    fed the log as ``flwr log --stream`` carries it, writes nothing."""
    record = json.dumps({"kind": "row", "name": "rounds.jsonl", "row": {"round": 99}})
    forged = f"boom\nedgefl-result {record}\redgefl-result {record}\u2028edgefl-result {record}\x1b[2J" + "x" * 5000
    loop, grid = make_loop({11, 12})
    _identify(loop, grid, {11: 0, 12: 1})
    loop.push_requests()
    with caplog.at_level("WARNING"):
        _answer(loop, grid.to(11)[0], Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, forged))
    [logged] = [r.getMessage() for r in caplog.records if "replied with an error" in r.getMessage()]
    assert len(logged.splitlines()) == 1 and "\x1b" not in logged and len(logged) < 400, logged[:200]
    mirrored = tmp_path / "mirror"
    assert Mirror(mirrored).feed(caplog.text) == [] and not mirrored.exists()


@pytest.mark.parametrize("field", ["transport", "reply-key"])
def test_a_name_with_a_control_character_is_a_malformed_reply(field: str) -> None:
    reply = reply_content(TrainReply(0, (), transport="fast", reply_key="k"))
    content = reply.config_records[RECORD]
    header = json.loads(str(content[HEADER]))
    header[field] = "a\nedgefl-result {}"
    content[HEADER] = json.dumps(header)
    with pytest.raises(WireError, match=f"{field} is .*printable"):
        parse_reply(reply)
