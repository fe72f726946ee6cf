"""The agent's task server (``fl_client.tasks``) without Flower processes: it talks to its own SuperNode only
(the Runtime API port is picked free before the SuperNode binds it, so another local user may bind it first), and
a task it held when it died is answered once, never twice. A stand-in Runtime API of this user records what the
agent sends; Flower's SuperLink state is used as the SuperLink uses it."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, SubStatus
from flwr.proto.runtime_pb2 import PushAppMessagesRequest, PushTaskOutputRequest  # pylint: disable=E0611
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.supercore.constant import TaskType
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation.noop_federation_manager import NOOP_FEDERATION_ID, NoOpFederationManager

from fl_client import tasks
from fl_client.app import app
from fl_client.runtime_owner import check_own_server
from fl_client.tasks import ABANDONED, HeldTask, TaskServer
from tests.conftest import STRANGER_UID, stranger_listening

PUSH_REPLY, PUSH_OUTPUT = "/v1/runtime/push-messages", "/v1/runtime/push-task-output"


# ----- the agent's own SuperNode only ------------------------------------------------------------------------
@contextmanager
def _runtime_api() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    """A stand-in Runtime API of this user on 127.0.0.1: every request is answered with an empty protobuf
    message (no task pending, nothing more to push); yields its address and the (path, body) of each request."""
    requests: list[tuple[str, bytes]] = []

    class Empty(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            requests.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "application/protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Empty) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"127.0.0.1:{server.server_port}", requests
        finally:
            server.shutdown()


class _StopOn(logging.Handler):
    """Sets ``stop`` when a record containing ``text`` is logged: the agent reached that point."""

    def __init__(self, text: str, stop: threading.Event) -> None:
        super().__init__()
        self.text, self.stop, self.lines = text, stop, []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if self.text in record.getMessage():
            self.stop.set()


@pytest.mark.skipif(os.geteuid() != 0, reason="binds a port as another user: needs root to switch")
def test_the_agent_sends_nothing_to_a_runtime_api_port_another_user_holds() -> None:
    stop = threading.Event()
    refusal = _StopOn("waiting for this device's SuperNode", stop)
    logger = logging.getLogger("edgefl.tasks")
    logger.addHandler(refusal)
    try:
        with stranger_listening(socket.AF_INET, ("127.0.0.1", 0)) as (port, received):
            serving = threading.Thread(target=TaskServer(f"127.0.0.1:{port}", app, b"secret").serve, args=(stop,))
            serving.start()
            serving.join(timeout=60)
            assert not serving.is_alive(), "the agent never refused the stranger's port"
            assert int.from_bytes(os.read(received, 8), "big") == 0  # not even the claim's headers
    finally:
        stop.set()
        logger.removeHandler(refusal)
    (line,) = [line for line in refusal.lines if "refused" in line]
    assert f"refused the Runtime API at 127.0.0.1:{port}: the port is held by uid {STRANGER_UID}" in line
    assert f"not by this agent's user (uid {os.geteuid()})" in line


def test_the_agent_serves_a_runtime_api_of_its_own_user() -> None:
    with _runtime_api() as (address, requests):
        assert TaskServer(address, app, b"secret").claim_one() is False  # served, and no task was pending
    assert [path for path, _ in requests] == ["/v1/runtime/acquire-task"]


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_listener_of_this_user_is_recognised_on_ipv4_and_dual_stack_ipv6(family: socket.AddressFamily) -> None:
    """A listener on [::] (not IPv6-only) also takes connections to 127.0.0.1: /proc/net/tcp6 lists its end."""
    with socket.socket(family) as listener:
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(("127.0.0.1" if family == socket.AF_INET else "::", 0))
        listener.listen()
        with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as conn:
            check_own_server(conn)  # raises NotOurSuperNode otherwise


# ----- a held task is answered once ---------------------------------------------------------------------------
class _Killed(BaseException):
    """The agent is killed here: nothing after it runs (no ``except Exception``, no cleanup that matters)."""


def _instruction(run_id: int, dst_node_id: int) -> Message:
    """A message from the server to node ``dst_node_id``, with its id, as the SuperLink stores it."""
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    message = Message(RecordDict({"train": ConfigRecord({"round": 1})}), dst_node_id=dst_node_id, message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id
    return message


def _reply(content: RecordDict | Error, to: Message) -> Message:
    TaskIdentity.node_id = to.metadata.dst_node_id
    reply = Message(content, reply_to=to)
    reply.metadata.__dict__["_message_id"] = reply.object_id
    return reply


def test_the_superlink_refuses_a_second_reply_to_the_same_message(flower_task: None) -> None:
    """What the held-task record relies on if the agent is killed between pushing its reply and marking it
    pushed: Flower 1.41's SuperLink (its in-memory state, edgefl's) keeps the first reply to a message and
    refuses another, before and after the ServerApp pulled the first."""
    state = InMemoryLinkState(NoOpFederationManager(), InMemoryObjectStore())
    node = state.create_node("owner", "device", b"public key", 30.0)
    assert state.activate_node(node, 30.0)
    run_id = state.create_run(None, None, None, {}, NOOP_FEDERATION_ID, None, None, TaskType.SERVER_APP)
    message = _instruction(run_id, node)
    assert state.store_message_ins(message) == message.metadata.message_id
    update = _reply(RecordDict({"update": ConfigRecord({"round": 1})}), message)
    assert state.store_message_res(update) == update.metadata.message_id
    assert state.store_message_res(_reply(Error(1, ABANDONED), message)) is None
    assert [reply.metadata.message_id for reply in state.get_message_res({message.metadata.message_id}, run_id)] == [
        update.metadata.message_id
    ]
    state.delete_messages({message.metadata.message_id})  # the ServerApp took the reply
    assert state.store_message_res(_reply(Error(1, ABANDONED), message)) is None


def test_an_agent_killed_after_pushing_its_reply_only_finishes_the_task_when_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flower_task: None
) -> None:
    message = _instruction(run_id=5, dst_node_id=9)
    pushed: list[Message] = []

    def killed(*_: object) -> None:
        raise _Killed

    monkeypatch.setattr(tasks, "_pull_input", lambda _client: (message, Context(5, 9, {}, RecordDict(), {})))
    monkeypatch.setattr(tasks, "_push_reply", lambda _client, reply: pushed.append(reply))
    monkeypatch.setattr(tasks, "_push_output", killed)  # killed after the reply went out, before the task's end
    held = tmp_path / "tasks"
    dying = TaskServer("127.0.0.1:1", lambda msg, _context: _reply(RecordDict(), msg), b"secret", held)
    with pytest.raises(_Killed):
        dying._serve(None, 7, "f" * 64, 0.0)
    assert len(pushed) == 1 and HeldTask.load(HeldTask.path(held, 7)).answered
    monkeypatch.undo()

    with _runtime_api() as (address, requests):
        TaskServer(address, app, b"secret", held).answer_abandoned()
    assert [path for path, _ in requests] == [PUSH_OUTPUT]  # no second reply
    assert PushTaskOutputRequest.FromString(requests[0][1]).sub_status == SubStatus.COMPLETED
    assert not HeldTask.path(held, 7).exists()


def test_a_task_held_unanswered_is_answered_with_an_error_when_the_agent_restarts(
    tmp_path: Path, flower_task: None
) -> None:
    message = _instruction(run_id=5, dst_node_id=9)
    HeldTask(7, "f" * 64, message).save(tmp_path)
    with _runtime_api() as (address, requests):
        TaskServer(address, app, b"secret", tmp_path).answer_abandoned()
    assert [path for path, _ in requests] == [PUSH_REPLY, PUSH_OUTPUT]
    (reply,) = PushAppMessagesRequest.FromString(requests[0][1]).messages_list
    assert reply.metadata.reply_to_message_id == message.metadata.message_id
    assert PushTaskOutputRequest.FromString(requests[1][1]).sub_status == SubStatus.FAILED
    assert not HeldTask.path(tmp_path, 7).exists()
