"""Flower's waits as edgefl tunes them (``contract.transport``): the check that guards the change, the fallback to
stock Flower, and what the tuned SuperNode does with its idle polls. Each case runs in a fresh interpreter, as
the SuperNode and the ServerApp do, so this process's Flower stays stock."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.app.metadata import Metadata
from flwr.common.constant import ErrorCode
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import (  # pylint: disable=E0611
    ConfirmMessageReceivedRequest,
    ConfirmMessageReceivedResponse,
    ObjectTree,
    PullObjectRequest,
    PullObjectResponse,
)
from flwr.proto.message_pb2 import Message as MessageProto  # pylint: disable=E0611
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullAppMessagesResponse  # pylint: disable=E0611
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

from contract import transport
from contract.flower import set_message_id
from contract.transport import (
    IDLE_POLL_S,
    KEEPALIVE_S,
    BulkApart,
    UploadPace,
    WarmLanes,
    pull_listed,
    pull_replies,
    why_pulled_whole,
)
from tests.conftest import REPO


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **env},
    )  # fmt: skip


def test_the_installed_flower_is_the_code_edgefl_tunes() -> None:
    """Fails after a Flower upgrade that moves any of the waits edgefl changes: re-read them, then update the
    digests in contract.flower (TUNED_SOURCE; the run would otherwise go on with stock Flower, slower)."""
    done = _python("from contract.transport import why_stock; print(why_stock())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_tune_changes_flowers_waits() -> None:
    done = _python("""
        import time
        from contract.transport import tune
        from flwr.supernode import start_client_internal as loop
        from flwr.supercore.inflatable import inflatable_utils as objects
        from flwr.supercore.protobuf.client import ProtobufClient
        print(tune())
        pull = objects.pull_objects.__kwdefaults__
        print(loop.time is time, pull["initial_backoff"], pull["max_time"], objects.get_num_workers(8))
        client = ProtobufClient("http://127.0.0.1:9", interceptors=("x",), timeout=7.0)  # httpx's own pools below
        pools = client._client._transport.pools
        connections = [pools[""], *(pools[kind]._make_lane() for kind in ("/push-object", "/pull-object"))]
        print(*{pool._pool._keepalive_expiry for pool in connections}, len(pools), client._client.timeout.read)
        print(*(pool._pool._max_connections for pool in connections))
        print(client._interceptors)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fast", "False", "0.01", "60.0", "8", "60.0", "3", "7.0", "100", "1", "1", "('x',)"]


def test_objects_up_objects_down_and_the_rest_each_go_on_a_pool_of_their_own() -> None:
    """A model down and an update up never share a connection, nor meet one that only carried small requests."""
    made: list[list[str]] = []

    def pool() -> httpx.MockTransport:
        seen: list[str] = []
        made.append(seen)
        return httpx.MockTransport(lambda request: seen.append(request.url.path) or httpx.Response(200))

    with httpx.Client(transport=BulkApart(pool, pool)) as client:
        for path in ("push-object", "pull-object", "pull-messages", "push-object", "push-messages", "pull-object"):
            client.post(f"https://server:9092/api/v0/fleet/{path}")
    assert sorted(made) == [
        ["/api/v0/fleet/pull-messages", "/api/v0/fleet/push-messages"],
        ["/api/v0/fleet/pull-object"] * 2,
        ["/api/v0/fleet/push-object"] * 2,
    ]


class _Body(httpx.SyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.body = body

    def __iter__(self) -> Iterator[bytes]:
        yield self.body


def _lanes(
    size: Callable[[httpx.Request], int], clock: Callable[[], float] = time.monotonic
) -> tuple[httpx.Client, list[list[int]]]:
    """A client on a ``WarmLanes`` of mock connections that answer each request with ``size(request)`` bytes, and
    per connection (in the order they were opened) the sizes it carried."""
    carried: list[list[int]] = []

    def lane() -> httpx.MockTransport:
        mine: list[int] = []
        carried.append(mine)

        def answer(request: httpx.Request) -> httpx.Response:
            mine.append(size(request))
            return httpx.Response(200, stream=_Body(b"x" * size(request)))  # read as it is used, as a socket's

        return httpx.MockTransport(answer)

    return httpx.Client(transport=WarmLanes(lane, down=True, clock=clock)), carried


def test_an_object_down_goes_on_the_idle_connection_that_carried_the_most_down() -> None:
    """A message's three objects pulled at once take three connections, its model (1 MB) the second. The next
    message's objects one at a time (as a pull retried after the SuperLink had not got the object yet) go where the
    model went, not on the oldest idle connection."""
    client, carried = _lanes(lambda request: int(request.url.path.rsplit("/", 1)[1]))
    with contextlib.ExitStack() as held:  # the three in flight at once, as parallel pulls are
        streams = [held.enter_context(client.stream("POST", f"https://s/pull-object/{n}")) for n in (300, 10**6, 500)]
        for stream in streams:
            stream.read()
    for size in (500, 10**6, 300):
        client.post(f"https://s/pull-object/{size}")
    assert carried == [[300], [10**6, 500, 10**6, 300], [500]]


def test_a_connection_carries_one_request_at_a_time_and_is_new_again_past_the_keep_alive() -> None:
    """Two requests in flight at once never share a connection (a pool of one would make the second wait); once
    the first's body is read its connection is idle again, and one idle past ``KEEPALIVE_S`` counts as new."""
    now = [0.0]
    client, carried = _lanes(lambda request: int(request.url.path.rsplit("/", 1)[1]), clock=lambda: now[0])
    with client.stream("POST", "https://s/pull-object/10") as first:
        client.post("https://s/pull-object/20")  # while the first's body is unread
        first.read()
    client.post("https://s/pull-object/30")
    assert carried == [[10], [20, 30]]  # the one that carried more
    now[0] += KEEPALIVE_S + 1  # both closed by their pools meanwhile: the oldest idle one, as httpx would
    client.post("https://s/pull-object/5")
    assert carried == [[10, 5], [20, 30]]


def test_code_that_differs_falls_back_to_stock_flower_with_one_line() -> None:
    done = _python("""
        import time
        import contract.transport as transport
        from flwr.supernode import start_client_internal as loop
        from flwr.supercore.inflatable import inflatable_utils as objects
        name = "flwr.supernode.start_client_internal._push_messages"
        transport.TUNED_SOURCE[name] = "0000000000000000"  # as after an upgrade
        print(transport.tune())
        print(loop.time is time, objects.pull_objects.__kwdefaults__["initial_backoff"])
        from flwr.supercore.protobuf.client import ProtobufClient
        print(ProtobufClient("http://127.0.0.1:9")._client._transport._pool._keepalive_expiry)  # httpx's one, 5 s
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stock", "True", "1", "5.0"]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "_push_messages is not the code edgefl tunes" in lines[0], lines


def test_the_installed_flower_serializes_as_edgefl_counts() -> None:
    """Fails after a Flower upgrade that changes the serialization ``message_bytes`` mirrors: re-read it, then
    update contract.flower.COUNT_SOURCE (wire sizes would otherwise be counted by serializing whole messages
    again)."""
    done = _python("from contract.transport import why_counted_whole; print(why_counted_whole())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_a_serialization_that_differs_is_counted_whole_to_the_same_bytes() -> None:
    """A 2 MB reply counted by arithmetic, and again, as after an upgrade, by serializing it: the same bytes, and
    only the arithmetic holds under a megabyte on top of the reply."""
    done = _python("""
        import tracemalloc
        import contract.transport as transport
        from contract.messages import TrainReply
        from contract.wire import reply_content
        from flwr.app import Message
        from flwr.supercore.task_identity import TaskIdentity
        from strategies.rounds import Update
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1  # Flower builds messages in tasks
        reply = Message(reply_content(TrainReply(0, (Update(1, "edgefl.none.v1", bytes(2 << 20), 1),))),
                        dst_node_id=1, message_type="train")
        for digest in (None, "0000000000000000"):
            if digest:
                transport.COUNT_SOURCE["flwr.app.message.configrecord.ConfigRecord.deflate"] = digest
                transport.why_counted_whole.cache_clear()
            tracemalloc.start()
            counted = transport.message_bytes(reply)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(counted[0], counted[1], peak < 1 << 20)
        print(transport.why_counted_whole())
    """)
    assert done.returncode == 0, done.stderr
    arithmetic, whole, why = done.stdout.strip().splitlines()
    assert arithmetic.split()[:2] == whole.split()[:2]
    assert (arithmetic.split()[2], whole.split()[2]) == ("True", "False")
    assert "ConfigRecord.deflate is not the code edgefl counts by" in why


def test_edgefl_transport_stock_leaves_flower_as_it_is() -> None:
    done = _python("from contract.transport import tune; print(tune())", EDGEFL_TRANSPORT="stock")
    assert done.returncode == 0 and done.stdout.strip() == "stock"
    assert "EDGEFL_TRANSPORT=stock" in done.stderr


def test_an_idle_supernode_backs_off_and_a_message_resets_its_poll(monkeypatch) -> None:
    import contract.transport as transport

    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    idle = transport._IdleBackoff()
    for _ in range(12):
        idle.wait()
    idle.received()
    idle.wait()
    assert slept[0] == IDLE_POLL_S[0] and slept[-1] == IDLE_POLL_S[0]
    assert slept[:12] == sorted(slept[:12])
    assert max(slept) == IDLE_POLL_S[1]
    clock = transport._TunedClock(idle)
    clock.sleep(transport.STOCK_REPLY_S)
    clock.sleep(0.2)  # any other sleep of Flower's is left as it is
    assert slept[-2:] == [transport.REPLY_POLL_S, 0.2]


class _State:
    """Flower's NodeState as the pipeline uses it: replies, each listed once; counts how often it was looked at."""

    def __init__(self) -> None:
        self.replies: list[str] = []
        self.looked = 0
        self.looked_at = threading.Event()

    def get_messages_legacy(self, *, is_reply: bool) -> list[str]:
        assert is_reply
        self.looked += 1
        self.looked_at.set()
        taken, self.replies = self.replies, []
        return taken


class _Pushed(list):
    """The replies handed to Flower's ``_push_messages``, each call's list; ``done`` is set at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()


def _pipeline(pulled: list[int | None], signals=None):
    """A pipeline over a scripted pull (``pulled``, in order) and Flower's ``_push_messages`` (what it was handed is
    kept in the returned list), with its state's keyword arguments."""
    import contract.transport as transport

    pushed = _Pushed()

    def push(*, state, object_store, send, push_object) -> None:  # Flower's _push_messages, which waits for one
        pushed.append(list(state.get_messages_legacy(is_reply=True)))
        pushed.done.set()

    def pull(*, state, confirm_message_received) -> int | None:  # Flower's: stores a message, then confirms it
        run_id = pulled.pop(0)
        if run_id is not None:
            confirm_message_received(run_id, "message")
        return run_id

    state = _State()
    idle = transport._IdleBackoff()
    pipeline = transport._Pipeline(pull, push, idle, signals or transport.NodeSignals())
    kwargs = {"state": state, "object_store": None, "send": None, "push_object": None}
    return pipeline, idle, state, pushed, kwargs


def test_the_pipelined_supernode_pulls_and_pushes_independently() -> None:
    """Flower's loop pulls one message, then waits for its reply. Tuned, a pull that finds nothing still lets the
    loop go on to the push; the push sends the replies there are (handing Flower's ``_push_messages`` the list it
    took, so it never waits) and otherwise waits at most the idle poll — none right after a message came. With no
    agent on the channel to tell it of a reply, it looks at its state every REPLY_POLL_S meanwhile."""
    import contract.transport as transport

    pipeline, idle, state, pushed, kwargs = _pipeline([None, 5])
    pulled_none = pipeline.pull(state=state, confirm_message_received=_confirm)
    assert pulled_none == transport.NO_RUN  # nothing pulled: the loop goes on to push
    started = time.monotonic()
    pipeline.push(**kwargs)  # no reply: it looked for one up to the idle poll, then backs off
    assert pushed == [] and state.looked >= 2 and time.monotonic() - started >= IDLE_POLL_S[0]
    assert idle.delay > IDLE_POLL_S[0]
    # a message: no idle wait before pushing what there is
    assert pipeline.pull(state=state, confirm_message_received=_confirm) == 5
    looked = state.looked
    pipeline.push(**kwargs)
    assert pushed == [] and state.looked == looked + 1
    state.replies = ["reply-1", "reply-2"]
    pipeline.push(**kwargs)
    assert pushed == [["reply-1", "reply-2"]] and idle.delay == IDLE_POLL_S[0]


def _confirm(run_id: int, message_id: str) -> None:
    """Flower's ConfirmMessageReceived, stood in for."""


def test_over_the_channel_a_message_is_the_agents_before_the_superlink_is_told_of_it() -> None:
    """Flower's loop tells the SuperLink it received a message (a link round trip) before it pulls the next one or
    lets anyone know. Over the channel the agent is told as soon as the message's objects are stored, and the
    confirmation goes out on a thread of its own while the loop goes on."""
    import contract.transport as transport

    signals = transport.NodeSignals()
    signals.want(1)
    pipeline, _, state, _, _ = _pipeline([7], signals)
    confirming, release = threading.Event(), threading.Event()
    confirmed: list[tuple[int, str]] = []

    def slow_confirm(run_id: int, message_id: str) -> None:  # the round trip, held until released
        confirming.set()
        release.wait(30)
        confirmed.append((run_id, message_id))

    assert pipeline.pull(state=state, confirm_message_received=slow_confirm) == 7  # the loop did not wait for it
    assert signals.stored == 1 and not confirmed
    assert confirming.wait(30)
    release.set()
    pipeline._confirmer.shutdown(wait=True)
    assert confirmed == [(7, "message")]


def test_over_the_channel_replies_go_out_at_once_and_a_full_agent_is_polled_for_slowly() -> None:
    """Over the channel the agent tells the SuperNode what happened: a reply it hands over goes out at once on the
    pusher's thread, whatever the loop is doing (here: waiting to poll); while the agent wants no message (it holds
    all the server keeps at it) the loop waits up to SLOW_POLL_S before it polls the SuperLink, and goes on at once
    when the agent comes to want one."""
    import contract.transport as transport

    signals = transport.NodeSignals()
    pipeline, _, state, pushed, kwargs = _pipeline([None, None], signals)
    signals.want(0)
    assert pipeline.pull(state=state, confirm_message_received=_confirm) == transport.NO_RUN
    assert signals.state is state
    came = threading.Event()

    def hand_over_then_want() -> None:
        state.looked_at.wait(10)  # the pusher looked, found nothing, and waits
        state.replies = ["reply"]
        signals.reply_stored()
        if pushed.done.wait(10):
            came.set()
        signals.want(1)

    helper = threading.Thread(target=hand_over_then_want)
    helper.start()
    started = time.monotonic()
    pipeline.push(**kwargs)  # the loop's wait before its next pull
    waited = time.monotonic() - started
    helper.join()
    assert came.is_set() and pushed == [["reply"]]  # pushed while the loop was waiting
    assert waited < transport.SLOW_POLL_S  # the loop went on as soon as the agent wanted a message


def _reply(
    node_id: int, value: float, extra_records: int = 0
) -> tuple[Message, dict[str, bytes], MessageProto, ObjectTree]:
    """A reply of node ``node_id`` as the SuperLink holds it once pushed: the message, its objects by id, and its
    proto and object tree as PullMessages lists it. Its shape is an edgefl reply's (one ConfigRecord: 3 objects),
    with ``extra_records`` more records."""
    metadata = Metadata(
        run_id=1, message_id="", src_node_id=node_id, dst_node_id=0, reply_to_message_id=f"{value:064.0f}",
        group_id="1", created_at=time.time(), ttl=3600, message_type="train",
    )  # fmt: skip
    records = {"update": ConfigRecord({"w": np.full(1000, value, np.float32).tobytes()})}
    records.update({f"extra-{i}": ConfigRecord({"x": f"y{i}".encode()}) for i in range(extra_records)})
    content = RecordDict(records)
    message = Message(content, metadata=metadata)
    objects = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(message).items()}
    set_message_id(message, message.object_id)
    return message, objects, message_to_proto(remove_content_from_message(message)), get_object_tree(message)


class _StalledUpload:
    """The SuperLink's Runtime API, scripted where a real one cannot be made to stall on cue: ``replies`` are
    listed, in their order, and the objects of ``stalled`` are still on their way (PullObject: found, not
    available) until ``arrived`` is set; what was asked for before is in ``asked_before``."""

    def __init__(self, replies: list[tuple], stalled: tuple) -> None:
        self.replies = replies
        self.stalled = set(stalled[1])
        self.arrived = threading.Event()
        self.asked_before: set[str] = set()
        self.confirmed: list[str] = []

    def PullMessages(self, request: PullAppMessagesRequest) -> PullAppMessagesResponse:
        return PullAppMessagesResponse(
            messages_list=[proto for _, _, proto, _ in self.replies],
            message_object_trees=[tree for _, _, _, tree in self.replies],
        )

    def PullObject(self, request: PullObjectRequest) -> PullObjectResponse:
        if not self.arrived.is_set():
            self.asked_before.add(request.object_id)
            if request.object_id in self.stalled:
                return PullObjectResponse(object_found=True, object_available=False)
        content = next(objects[request.object_id] for _, objects, _, _ in self.replies if request.object_id in objects)
        return PullObjectResponse(object_found=True, object_available=True, object_content=content)

    def ConfirmMessageReceived(self, request: ConfirmMessageReceivedRequest) -> ConfirmMessageReceivedResponse:
        self.confirmed.append(request.message_object_id)
        return ConfirmMessageReceivedResponse()


def test_a_reply_listed_with_a_stalled_upload_comes_as_soon_as_its_own_objects_are_in() -> None:
    """Flower's grid pulls the listed replies' objects one reply after another and returns them together: a reply
    listed behind one whose upload stalled waited for it (up to 60 s, a round past its deadline). ``pull_listed``
    gives another node's at once; the stalled node's replies come once its objects are in, in their order (the
    server follows what a node holds by its replies), each whole and its receipt confirmed."""
    stalled, later, other = _reply(1, 1.0), _reply(1, 3.0), _reply(2, 2.0)
    runtime = _StalledUpload([stalled, later, other], stalled)
    replies = pull_listed(runtime, Node(node_id=0), 1, ["a", "b", "c"])
    with ThreadPoolExecutor(1) as waiter:  # a pull that waits for the stalled upload fails here, it does not hang
        try:
            first = waiter.submit(next, replies).result(timeout=20)
            assert first.metadata.message_id == other[0].metadata.message_id
            assert runtime.confirmed == [other[0].metadata.message_id]
        finally:
            runtime.arrived.set()  # its objects arrive (and end a pull that waited for them)
        rest = [waiter.submit(next, replies).result(timeout=20) for _ in range(2)]
    assert not runtime.asked_before & set(later[1]), "node 1's second reply was pulled before its first"
    pulled = [first, *rest]
    assert [p.metadata.message_id for p in pulled] == [r[0].metadata.message_id for r in (other, stalled, later)]
    assert runtime.confirmed == [p.metadata.message_id for p in pulled]
    for reply, (sent, *_) in zip(pulled, (other, stalled, later), strict=True):
        assert reply.content["update"]["w"] == sent.content["update"]["w"]
        assert reply.metadata.reply_to_message_id == sent.metadata.reply_to_message_id
    assert next(replies, None) is None
    runtime.replies = []  # most polls: nothing listed
    assert list(pull_listed(runtime, Node(node_id=0), 1, ["a"])) == []


def test_a_node_with_uploads_behind_it_is_waited_for_by_its_own_pace() -> None:
    """First replies: PULL_MAX_S. Then PACE_FACTOR × its slowest recent upload, at least PULL_MIN_S; doubled for each
    reply given up on since the last that came (a resend larger than usual is given longer each time), at most
    PULL_MAX_S; a reply that comes starts the doubling again. Nodes apart."""
    pace = UploadPace()
    assert pace.allowed_s(1) == transport.PULL_MAX_S
    pace.came(1, 0.5)
    assert pace.allowed_s(1) == transport.PULL_MIN_S and pace.allowed_s(2) == transport.PULL_MAX_S
    pace.came(1, 4.0)
    assert pace.allowed_s(1) == transport.PACE_FACTOR * 4.0
    pace.gave_up(1)
    assert pace.allowed_s(1) == 2 * transport.PACE_FACTOR * 4.0
    pace.gave_up(1)
    assert pace.allowed_s(1) == transport.PULL_MAX_S
    pace.came(1, 1.0)
    assert pace.allowed_s(1) == transport.PACE_FACTOR * 4.0  # the slowest of the last PACE_WINDOW still counts
    for _ in range(transport.PACE_WINDOW):
        pace.came(1, 1.0)
    assert pace.allowed_s(1) == transport.PULL_MIN_S


def test_a_stalled_upload_of_a_paced_node_is_given_up_on_at_its_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose uploads came within a fraction of a second, then a reply whose objects never come (the gateway
    refused them: 413): it comes as Flower's "message unavailable" error after the node's pace, not PULL_MAX_S, and
    the other node's reply as soon as its objects are in."""
    monkeypatch.setattr(transport, "PULL_MIN_S", 0.3)
    stalled, other = _reply(1, 1.0), _reply(2, 2.0)
    runtime = _StalledUpload([stalled, other], stalled)
    pace = UploadPace()
    pace.came(1, 0.01)
    started = time.monotonic()
    pulled = {r.metadata.reply_to_message_id: r for r in pull_listed(runtime, Node(node_id=0), 1, ["a"], pace)}
    waited = time.monotonic() - started
    assert 0.3 <= waited < transport.PULL_MAX_S / 4, waited
    given_up, came = pulled[stalled[0].metadata.reply_to_message_id], pulled[other[0].metadata.reply_to_message_id]
    assert given_up.has_error() and given_up.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert "(waited 0 s)" in given_up.error.reason, given_up.error.reason
    assert not came.has_error()
    assert pace.allowed_s(1) == 2 * 0.3 and pace.allowed_s(2) == transport.PULL_MIN_S  # node 2's reply came


def test_a_reply_of_more_objects_than_edgefls_is_refused_before_any_is_pulled() -> None:
    """A reply with 40 extra records (43 objects; edgefl's have 3) was pulled whole and parsed as a TrainReply: now
    none of its objects is asked for, it comes as the node's error, and its receipt is confirmed."""
    runtime = _StalledUpload([_reply(1, 1.0, extra_records=40)], (None, ()))  # PullObject would note each ask
    proto = runtime.replies[0][2]
    [refused] = pull_listed(runtime, Node(node_id=0), 1, ["a"])
    assert refused.has_error() and "lists 43 objects, an edgefl reply 3: not pulled" in refused.error.reason
    assert refused.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert runtime.asked_before == set() and runtime.confirmed == [proto.metadata.message_id]


def test_a_grid_pull_that_differs_is_flowers_own() -> None:
    """After an upgrade that changes ``HttpGrid.pull_messages``, the ServerApp (tuned) pulls replies by the grid's
    own call."""
    done = _python("""
        import contract.transport as transport
        transport.PULL_SOURCE["flwr.superlink.grid.http_grid.HttpGrid.pull_messages"] = "0000000000000000"
        print(transport.tune())
        print(transport.why_pulled_whole())
    """)
    assert done.returncode == 0, done.stderr
    tuned, reason = done.stdout.strip().splitlines()
    assert tuned == "fast" and "pull_messages is not the code edgefl pulls replies by" in reason, done.stdout


def test_an_untuned_process_pulls_replies_through_the_grids_own_call() -> None:
    """Where Flower runs stock (this test process never tunes it), the grid's own ``pull_messages``."""

    class Grid:
        def pull_messages(self, message_ids: list[str]) -> list[str]:
            return [f"reply to {message_id}" for message_id in message_ids]

    assert why_pulled_whole() == "Flower's message path is stock here"
    assert list(pull_replies(Grid(), ["a", "b"])) == ["reply to a", "reply to b"]
