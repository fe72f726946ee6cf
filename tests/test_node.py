"""A device's SuperNode serves its tasks to its own edge agent only: the Runtime API listens on the device's
loopback, a claim must be signed with the node's SuperExec secret, and a reply needs the token of a claimed
task. Against a real tuned SuperNode (``python -m fl_client.supernode``); no SuperLink is needed for this."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from flwr.app import Message, RecordDict
from flwr.app.metadata import Metadata
from flwr.proto.runtime_pb2 import AcquireTaskRequest, PushAppMessagesRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, SuperExecAuthHttpInterceptor
from flwr.supercore.runtime import RuntimeHttpClient

from edgefl.launcher import NodeRuntime, flower_env, supernode_argv
from edgefl.processes import ProcessGroup, free_port
from fl_client.app import app
from fl_client.tasks import ACQUIRE, HeldTask, TaskServer

pytestmark = pytest.mark.federation

CLAIM = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
ONE_NODE = pytest.mark.xdist_group("node")  # the tests of the module's SuperNode: on one pytest-xdist worker


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeRuntime]:
    """One SuperNode that the tests below only ask (none changes what it holds): started once for the module."""
    tmp_path = tmp_path_factory.mktemp("node")
    runtime = NodeRuntime.create(tmp_path, "node")
    nowhere = f"127.0.0.1:{free_port()}"  # the SuperNode retries it; its Runtime API is up meanwhile
    argv = supernode_argv(nowhere, None, "partition-id=0 num-partitions=1", serve=runtime)
    with ProcessGroup(tmp_path / "logs", flower_env(tmp_path)) as procs:
        procs.start("supernode", argv)
        procs.wait_until("the Runtime API", lambda: _accepts(runtime.port), 60)
        yield runtime


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _client(port: int, *interceptors) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(f"127.0.0.1:{port}", True, None, list(interceptors))


@ONE_NODE
def test_only_a_claim_signed_with_the_nodes_secret_is_served(node: NodeRuntime) -> None:
    signed = SuperExecAuthHttpInterceptor(master_secret=node.secret_file.read_bytes(), protected_methods={ACQUIRE})
    assert not _client(node.port, signed).AcquireTask(CLAIM).HasField("task")  # accepted: no task pending
    forged = SuperExecAuthHttpInterceptor(master_secret=b"not the secret", protected_methods={ACQUIRE})
    for client in (_client(node.port), _client(node.port, forged)):
        with pytest.raises(httpx.HTTPStatusError) as refused:
            client.AcquireTask(CLAIM)
        assert refused.value.response.status_code in (401, 403)


@ONE_NODE
def test_a_reply_under_a_task_token_nobody_claimed_is_refused(node: NodeRuntime, caplog) -> None:
    """Also what a restarted agent does with the task its predecessor held (fl_client.tasks.HeldTask) when the
    SuperNode already failed it (60 s without heartbeats) or restarted: its token is refused, the record dropped."""
    client = _client(node.port, RuntimeTokenHttpInterceptor("f" * 64))
    with pytest.raises(httpx.HTTPStatusError) as refused:
        client.PushMessages(PushAppMessagesRequest())
    assert refused.value.response.status_code in (401, 403)
    metadata = Metadata(
        run_id=1, message_id="a" * 64, src_node_id=1, dst_node_id=2, reply_to_message_id="", group_id="1",
        created_at=time.time(), ttl=3600, message_type="train",
    )  # fmt: skip
    HeldTask(7, "f" * 64, Message(RecordDict(), metadata=metadata)).save(node.held_dir)
    record = HeldTask.path(node.held_dir, 7)
    assert HeldTask.load(record).message.metadata.message_id == "a" * 64
    assert record.stat().st_mode & 0o077 == 0  # the token answers the task: this user's only
    server = TaskServer(f"127.0.0.1:{node.port}", app, node.secret_file.read_bytes(), node.held_dir)
    server.answer_abandoned()
    assert not record.exists()
    assert "the SuperNode no longer holds task 7" in caplog.text
    record.write_text('{"task_id": 7, "token": "f')  # not ours: the agent starts all the same
    server.answer_abandoned()
    assert not record.exists()
    assert "does not hold a task (JSONDecodeError" in caplog.text


@ONE_NODE
def test_the_runtime_api_listens_on_the_devices_loopback_only(node: NodeRuntime) -> None:
    listening = [
        line.split()[1]
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == node.port
    ]
    assert listening == [f"0100007F:{node.port:04X}"]  # 127.0.0.1 only, no wildcard
    assert not any(
        line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == node.port
        for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]
    )


def test_an_agent_started_before_its_supernode_waits_for_it_and_stops_on_sigterm(tmp_path: Path) -> None:
    runtime = NodeRuntime.create(tmp_path, "node")
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        agent = subprocess.Popen(runtime.agent_argv(), stderr=out)
    try:
        deadline = time.monotonic() + 60
        while f"no SuperNode at 127.0.0.1:{runtime.port}" not in log.read_text():
            assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert runtime.ready_file.exists()
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    assert agent.returncode == 0, log.read_text()
