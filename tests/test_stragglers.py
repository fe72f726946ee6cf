"""A client that stops answering mid-run (its edge agent frozen with SIGSTOP, not while sending) holds each round only
until the round's deadline: the run finishes with the others, and the rounds say so. Frozen mid-upload, its reply
is listed and the pull that took it waits up to 60 s for the rest: beside the server's loop
(``fl_server.engine.ReplyPuller``, tested here with a grid that stalls as the SuperLink would)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Error, Message, RecordDict
from flwr.app.metadata import Metadata
from flwr.common.constant import ErrorCode

from edge.devices import AgentThreads
from fl_server import engine
from fl_server.engine import ReplyPuller
from tests.conftest import start_edgefl, wait_for_rows


def _reply_to(message_id: str, error: Error | None = None) -> Message:
    """A reply to message ``message_id``: empty content, or ``error``."""
    sent = Metadata(
        run_id=1, message_id=message_id, src_node_id=1, dst_node_id=2, reply_to_message_id="", group_id="1",
        created_at=time.time(), ttl=3600, message_type="train",
    )  # fmt: skip
    return Message(error or RecordDict(), reply_to=Message(RecordDict(), metadata=sent))


UNAVAILABLE = Error(ErrorCode.MESSAGE_UNAVAILABLE, "Message Unavailable")


def _sending(agent_log: Path) -> bool:
    """Whether the agent is between answering a message (its ``reply:`` line) and having pushed the reply to its
    SuperNode (its ``served task`` line): the SuperNode lists a reply before its objects are all there."""
    text = agent_log.read_text()
    return text.count("edgefl.agent INFO reply:") > text.count("served task ")


class StalledUploadGrid:
    """Stands in for Flower's grid (unit test), as the SuperLink answers: a reply is listed to one pull call, and
    the message it answers is then forgotten ("message unavailable" to a later call that asks for it). The
    first call takes the reply to "a", whose upload never completes until ``release`` is set; the reply to "b"
    is there for the next."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.listed: set[str] = set()
        self.calls = 0

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        self.calls += 1
        ready = {"a"} if self.calls == 1 else {"b"}
        gone = [_reply_to(i, UNAVAILABLE) for i in sorted(self.listed.intersection(message_ids))]
        taken = sorted(ready.intersection(message_ids) - self.listed)
        self.listed.update(taken)
        if "a" in taken:
            self.release.wait()
        return gone + [_reply_to(message_id) for message_id in taken]


def _take(puller: ReplyPuller, count: int) -> list[Message]:
    taken, deadline = [], time.monotonic() + 10
    while len(taken) < count:
        assert time.monotonic() < deadline, f"only {taken} pulled"
        taken += [p.reply for p in puller.take()]
    return taken


def test_a_stalled_upload_holds_one_pull_call_not_the_others(monkeypatch) -> None:
    monkeypatch.setattr(engine, "PULL_STALLED_S", 0.0)
    monkeypatch.setattr(engine, "PULL_INTERVAL_S", (0.0, 0.0))  # the second poll starts its call at once
    grid = StalledUploadGrid()
    puller = ReplyPuller(grid)
    puller.poll(["a", "b"])  # lists "a" and waits on its upload
    while grid.calls < 1:
        time.sleep(0.001)
    puller.poll(["a", "b"])  # beside it: takes "b"; "a" is the older call's, not unavailable
    [b] = _take(puller, 1)
    assert b.metadata.reply_to_message_id == "b" and not b.has_error()
    grid.release.set()
    [a] = _take(puller, 1)
    assert a.metadata.reply_to_message_id == "a" and not a.has_error()
    assert puller.take() == []


def test_a_failed_pull_is_raised_in_the_loops_thread() -> None:
    class Gone:
        def pull_messages(self, message_ids: list[str]) -> list[Message]:
            raise ConnectionError("the SuperLink is gone")

    puller = ReplyPuller(Gone())
    puller.poll(["a"])
    with pytest.raises(ConnectionError, match="SuperLink is gone"):
        _take(puller, 1)


@pytest.mark.federation
def test_a_silent_client_does_not_stall_the_run(run_dir: Path) -> None:
    proc = start_edgefl(
        "run", "--strategy", "dga:1", "--dataset", "digits", "--partition", "iid", "--clients", "3",
        "--rounds", "6", "--local-steps", "5", "--quorum", "0.6", "--round-deadline-s", "4", "--out", str(run_dir),
    )  # fmt: skip
    wait_for_rows(run_dir, 1, "round 1", proc=proc)
    pid = AgentThreads.load(run_dir / ".node-2.ready").pid  # the agent's own word (it is forked: no command line)
    log, deadline = run_dir / "logs" / "agent-2.log", time.monotonic() + 60
    os.kill(pid, signal.SIGSTOP)
    while _sending(log):  # frozen while it hands a reply to its SuperNode: let it finish, so that no upload stalls
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "agent 2 was always sending a reply"
        time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(len(r["clients"]) >= 2 for r in rows)  # quorum: ceil(0.6 · 3)
    # Frozen after round 1, client 2 can have trained at most D + 1 = 2 rounds ahead of the model it held:
    # the last rounds close at their deadline without it.
    assert all(r["closed_by"] == "deadline" and 2 not in r["clients"] for r in rows[-2:])
    walls = [0.0] + [r["wall_s"] for r in rows]
    assert max(np.diff(walls)) < 20, walls  # no round waits on it past its deadline
