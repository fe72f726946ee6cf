"""The device's channel (``fl_client.channel``): Flower's Runtime API calls between the agent and its SuperNode over a
Unix socket, answered by Flower's own handlers on a real SuperNode state (``NodeStateFactory``), as Flower's SuperNode
stores a pulled message (``start_client_internal._insert_message`` and its task); the agent's task server on top of it
(``fl_client.tasks``); the refusals (another user, a wrong token, a malformed frame); the fallback where Flower's
router differs. No Flower process: the SuperNode's loop is stood in for by what it does with a message."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.proto.runtime_pb2 import PullTaskInputRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.fab import Fab
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.nodestate import NodeStateFactory
from flwr.supernode.start_client_internal import _insert_message

from contract.flower import AcquireTaskRequest
from contract.transport import NodeSignals
from fl_client import channel as channel_module
from fl_client.channel import ChannelClient, ChannelServer, RuntimeRefused, channel_name, why_no_channel
from fl_client.runtime_owner import NotOurSuperNode
from fl_client.tasks import TaskServer
from tests.conftest import REPO, STRANGER_UID, stranger_listening

NODE, RUN = 9, 5
CLAIM = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])


class SuperNode:
    """A SuperNode's state as its loop keeps it, and the channel served on it; ``deliver`` stores a message as the
    loop stores one it pulled (its run, FAB and context the first time, its task, the message and its objects)."""

    def __init__(self) -> None:
        factory = NodeStateFactory(ObjectStoreFactory())
        self.state, self.store = factory.state(), factory.objectstore_factory.store()
        self.state.set_node_id(NODE)
        self.signals = NodeSignals()
        self.port = 40000 + secrets.randbelow(20000)  # names the abstract socket only: no port is bound
        self.server = ChannelServer(self.port, self.signals)
        self.fab = Fab(hashlib.sha256(b"app").hexdigest(), b"app", {})

    def start(self) -> SuperNode:
        assert self.server.start()
        self.signals.attach(self.state)
        return self

    def deliver(self, round_: int = 1) -> Message:
        if self.state.get_run(RUN) is None:
            run = Run.create_empty(RUN)
            run.fab_hash = self.fab.hash_str
            self.state.store_run(run)
            self.state.store_fab(self.fab)
            context = Context(RUN, NODE, {"partition-id": 0, "num-partitions": 1}, RecordDict(), {})
            self.state.set_run_series_context(run.series_id, context)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, RUN, 0
        message = Message(
            RecordDict({"train": ConfigRecord({"round": round_})}), dst_node_id=NODE, message_type="train"
        )
        assert self.state.create_task(task_type=TaskType.CLIENT_APP, run_id=RUN, fab_hash=self.fab.hash_str)
        _insert_message(message, self.state, self.store)
        self.signals.message_stored()
        return message

    def stop(self) -> None:
        if self.server._listener is not None:
            self.server._listener.close()


@pytest.fixture
def supernode() -> Iterator[SuperNode]:
    node = SuperNode().start()
    yield node
    node.stop()


def test_the_installed_flower_routes_runtime_calls_as_the_channel_does() -> None:
    """Fails after a Flower upgrade that changes how its Runtime API router dispatches a call (which handler, on
    which task, on which state): re-read the router, then update CHANNEL_SOURCE in contract.flower (the agent would
    otherwise claim its tasks over HTTP again, ~3x the messaging CPU)."""
    assert why_no_channel() is None


def test_a_claim_waits_for_the_message_the_supernode_stores_and_asks_it_once(supernode: SuperNode) -> None:
    """A claim over the channel is answered once the SuperNode's loop has stored a message, not by asking again and
    again: Flower's acquire handler is called once before the message and once after it."""
    calls: list[int] = []
    asked = threading.Event()
    request_type, acquire, needs_task = supernode.server._routes[channel_module.WAIT_FOR_TASK]

    def counted(request: object, state: object) -> object:
        calls.append(1)
        answer = acquire(request, state)
        asked.set()
        return answer

    supernode.server._routes[channel_module.WAIT_FOR_TASK] = (request_type, counted, needs_task)
    client = ChannelClient(supernode.port)
    claimed: list = []
    waiting = threading.Thread(target=lambda: claimed.append(client.WaitForTask(CLAIM, 30.0)))
    waiting.start()
    assert asked.wait(30)  # it asked once, found no task, and waits
    supernode.deliver()
    waiting.join(30)
    assert claimed and claimed[0].HasField("task") and claimed[0].token
    assert len(calls) == 2
    empty = ChannelClient(supernode.port).WaitForTask(CLAIM, 0.05)  # nothing more stored: empty after its wait
    assert not empty.HasField("task")


def test_a_task_whose_message_is_still_coming_is_not_claimed(supernode: SuperNode) -> None:
    """Flower's loop makes a message's task before it pulls the message's objects (over a slow link, seconds): a
    claim waiting over the channel is answered once the message is stored, not when its task appears."""
    supernode.deliver()  # an earlier message, claimed: the channel's connection has seen a claim
    client = ChannelClient(supernode.port)
    assert client.WaitForTask(CLAIM, 5.0).HasField("task")
    assert not client.WaitForTask(CLAIM, 0.05).HasField("task")  # nothing more: this connection saw the loop's count
    assert supernode.state.create_task(task_type=TaskType.CLIENT_APP, run_id=RUN, fab_hash=supernode.fab.hash_str)
    assert not client.WaitForTask(CLAIM, 0.05).HasField("task")  # its task exists, its message is not stored yet
    supernode.signals.message_stored()  # the loop stored it
    assert client.WaitForTask(CLAIM, 5.0).HasField("task")


def test_a_task_is_served_over_the_channel_by_flowers_own_handlers(supernode: SuperNode) -> None:
    """What the agent's task server does with a task: its message pulled and answered over the channel, the
    SuperNode's state then listing the reply for its loop to push; the agent's hint of how many messages it takes."""
    message = supernode.deliver()
    replied = threading.Event()

    def app(msg: Message, context: Context) -> Message:
        assert msg.metadata.message_id == message.metadata.message_id
        assert msg.content["train"]["round"] == 1 and context.node_config["partition-id"] == 0
        TaskIdentity.node_id = NODE
        return Message(RecordDict({"update": ConfigRecord({"round": 1})}), reply_to=msg)

    tasks = TaskServer(f"127.0.0.1:{supernode.port}", app)
    tasks.most_held = lambda: 2
    stop = threading.Event()
    serving = threading.Thread(target=tasks.serve, args=(stop,))
    serving.start()
    try:
        assert supernode.signals.wait_for(lambda: supernode.signals.replies >= 3, 30)  # message, objects, output
        replies = supernode.state.get_messages_legacy(is_reply=True)
        replied.set()
        assert [r.metadata.reply_to_message_id for r in replies] == [message.metadata.message_id]
        assert supernode.signals.wait_for(lambda: supernode.signals.wanted == 2, 30)  # answered: holds none of 2
    finally:
        stop.set()
        serving.join(30)
    assert not serving.is_alive()
    assert supernode.signals.wait_for(lambda: supernode.signals.wanted == 1, 30)  # the agent left: as if it wanted


def test_a_call_for_a_task_its_token_does_not_name_is_refused(supernode: SuperNode) -> None:
    supernode.deliver()
    with pytest.raises(RuntimeRefused, match="authentication failed"):
        ChannelClient(supernode.port, token="f" * 64).PullTaskInput(PullTaskInputRequest())
    claim = ChannelClient(supernode.port).AcquireTask(CLAIM)
    assert ChannelClient(supernode.port, token=claim.token).PullTaskInput(PullTaskInputRequest()).run.run_id == RUN


def test_a_malformed_frame_drops_its_connection_and_the_channel_goes_on(supernode: SuperNode) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(channel_name(supernode.port))
        raw.sendall(struct.pack(">I", 2) + b"\x00\x01")  # shorter than a call's head
        assert raw.recv(16) == b""  # closed, unanswered
        raw.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(channel_name(supernode.port))
        raw.sendall(struct.pack(">I", channel_module.MAX_FRAME + 1))  # a frame too long to read
        assert raw.recv(16) == b""
    assert not ChannelClient(supernode.port).AcquireTask(CLAIM).HasField("task")


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")
def test_another_users_process_is_not_served(supernode: SuperNode) -> None:
    supernode.deliver()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a stranger on the device tries to claim the task
        try:
            os.setuid(STRANGER_UID)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.connect(channel_name(supernode.port))
                head = channel_module.CALL.pack(0, 0, 0)
                raw.settimeout(30)
                try:  # the SuperNode may close before the call is even sent
                    raw.sendall(struct.pack(">I", len(head)) + head)
                    outcome = b"answered" if raw.recv(16) else b"closed"
                except (BrokenPipeError, ConnectionResetError):
                    outcome = b"closed"
                except TimeoutError:
                    outcome = b"silent"
                os.write(write, outcome)
        finally:
            os._exit(0)
    os.close(write)
    said = os.read(read, 16)
    os.waitpid(pid, 0)
    os.close(read)
    assert said == b"closed"
    assert ChannelClient(supernode.port).AcquireTask(CLAIM).HasField("task")  # still there for the agent


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")
def test_the_agent_sends_nothing_to_a_channel_another_user_holds() -> None:
    """An abstract socket's name is whoever's binds it first: a stranger holding the device's channel name is
    refused before the agent sends a byte (NotOurSuperNode, which the agent's task server waits out)."""
    port = 40000 + secrets.randbelow(20000)
    with stranger_listening(socket.AF_UNIX, channel_name(port)) as (_, received):
        try:
            ChannelClient(port)
        except NotOurSuperNode as refused:
            assert f"held by uid {STRANGER_UID}" in str(refused)
        else:
            pytest.fail("the agent took a stranger's socket for its SuperNode's channel")
        assert int.from_bytes(os.read(received, 8), "big") == 0


def test_a_router_that_differs_serves_no_channel_and_says_why_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import logging, sys
            logging.basicConfig(stream=sys.stderr, format="%(message)s")
            import contract.flower as flower
            flower.CHANNEL_SOURCE["flwr.supercore.routers.runtime.router.pull_object"] = "0000000000000000"
            from contract.transport import NodeSignals
            from fl_client.supernode import serve_channel
            serve_channel(1, NodeSignals())
        """)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pull_object is not the code edgefl serves" in lines[0], lines
    assert "claims tasks over the HTTP Runtime API" in lines[0]
