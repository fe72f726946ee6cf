"""``edgefl client`` keeps its device in the federation when its edge agent dies: the agent is started again
beside the running SuperNode (same node, same Runtime API and secret) and answers the tasks the dead one held.
No SuperLink is needed: a socket that accepts connections stands in for the server, and the SuperNode keeps
retrying it meanwhile (its Runtime API is up all the same)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from flwr.app import Message, RecordDict
from flwr.app.metadata import Metadata

from edgefl.processes import process_tree
from fl_client.tasks import HeldTask
from tests.conftest import processes_of
from tests.test_remote import Command

pytestmark = pytest.mark.federation


def _running(root: int, module: str) -> list[int]:
    """The PIDs of the processes under ``root`` running ``python -m MODULE``."""
    found = []
    for pid in process_tree([root]):
        try:
            if f"-m\0{module}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_killed_agent_is_started_again_beside_its_supernode_and_answers_what_it_held(tmp_path: Path) -> None:
    out = tmp_path / "client-0"
    with socket.socket() as server:  # accepts connections (the client's first check), answers nothing
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = Command("client", "--server", f"127.0.0.1:{server.getsockname()[1]}", "--insecure",
                         "--partition-id", "0", "--num-partitions", "1", "--dataset", "digits",
                         "--connect-timeout", "600", "--out", str(out))  # fmt: skip
        try:
            client.wait_for("edge agent ready; logs")
            deadline = time.monotonic() + 60
            while not _running(client.proc.pid, "fl_client.supernode"):
                assert time.monotonic() < deadline, "no SuperNode started"
                time.sleep(0.1)
            (agent,), (supernode,) = (
                _running(client.proc.pid, "fl_client.node"),
                _running(client.proc.pid, "fl_client.supernode"),
            )
            # A task the agent held when it died: its record stays for the agent that comes back.
            metadata = Metadata(
                run_id=1, message_id="a" * 64, src_node_id=1, dst_node_id=2, reply_to_message_id="", group_id="1",
                created_at=time.time(), ttl=3600, message_type="train",
            )  # fmt: skip
            HeldTask(7, "f" * 64, Message(RecordDict(), metadata=metadata)).save(out / ".node.tasks")
            os.kill(agent, signal.SIGKILL)
            client.wait_for(r"the edge agent exited with code -9; starting it again")
            client.wait_for("edge agent ready again")
            (restarted,) = _running(client.proc.pid, "fl_client.node")
            assert restarted != agent
            assert _running(client.proc.pid, "fl_client.supernode") == [supernode]  # the same node: not restarted
            log = out / "logs" / "agent.log"
            deadline = time.monotonic() + 60
            while "task 7" not in log.read_text():  # this SuperNode never gave it: the token is refused
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
            assert "the SuperNode no longer holds task 7 of the previous agent" in log.read_text()
            assert not HeldTask.path(out / ".node.tasks", 7).exists()
        finally:
            if client.proc.poll() is None:
                assert client.interrupt() == 130
    assert not processes_of(out)
