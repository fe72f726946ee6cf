"""Flower's fixed waits on the message path, shortened: the one place edgefl changes Flower's private
behaviour. Each row is a wait in Flower's own code that a message round trip pays:

| where (flwr 1.41.0, 1.42.0)                          | stock                    | tuned                          |
|------------------------------------------------------|--------------------------|--------------------------------|
| SuperNode, after a pull for messages found none      | 3 s                      | 10 ms, ×1.5 per empty pull,    |
| (``start_client_internal``; one Fleet request each)  |                          | 250 ms at most (IDLE_POLL_S)   |
| SuperNode, waiting for the reply and its objects     | 0.5 s                    | 5 ms (REPLY_POLL_S)            |
| (``_push_messages``; its own memory, no request)     |                          |                                |
| ``pull_objects``, an object still uploading (a reply | 1 s, doubling to 10 s,   | 10 ms, doubling to 50 ms, for  |
| is listed before its upload completes)               | 500 tries or 2 h         | 60 s at most (PULL_MAX_S), ~10 |
|                                                      |                          | s for a node paced (UploadPace)|
| objects pulled or pushed in parallel                 | min(2, cores)            | 8 (CONCURRENCY)                |
| a pooled connection kept while idle (httpx, in       | 5 s                      | 60 s (KEEPALIVE_S)             |
| ``ProtobufClient``: SuperNode and ServerApp)         |                          |                                |

And one change of order: Flower's SuperNode pulls one message, then waits until its reply exists and pushes it
before it pulls the next — one message in flight per node. edgefl's SuperNode pulls every message queued for it
and pushes each reply as soon as it exists (``_Pipeline``), so the agent holds several messages at once and
answers each when it has an update ready (``edge.agent``): DGA's updates leave as they are trained, not in
bundles behind one message. Where its agent talks to it over the device's channel (``fl_client.channel``), the
loop and the agent tell each other what happened instead of looking (``NodeSignals``): a stored message wakes the
agent's claim, a reply the agent hands over wakes the push, and while the agent holds every message the server
keeps at it (``contract.settings.ClientJob.most_held``) the loop asks the SuperLink for another only every
``SLOW_POLL_S``.

The SuperNode (``python -m fl_client.supernode``) and edgefl's ServerApp call ``tune()`` before Flower moves a
message. It changes nothing unless the installed flwr is one of ``contract.flower.FLWR_CHECKED`` and the source of
every function it changes hashes to what was read when these values were chosen (``TUNED_SOURCE``, checked by
Flower's door, ``contract.flower``, which also hands this module every Flower internal it uses); otherwise — or
with ``EDGEFL_TRANSPORT=stock`` — Flower runs stock and ``tune()`` says why in one log line. Either way the run
records which (``fast`` or ``stock``). Flower's own FedAvg baseline never calls it.

This module also reads Flower's serialization, changing nothing: ``message_bytes`` counts the bytes a message
takes on the wire (every object of its tree, deflated) without serializing its bytes values — a 15 MB reply
serialized is four copies of it at once — by arithmetic that mirrors the functions in ``COUNT_SOURCE``; where
their code differs it serializes the whole message, as Flower does.

The ServerApp pulls its replies through ``pull_replies``: Flower's ``HttpGrid.pull_messages`` takes every reply
the SuperLink lists, pulls their objects one reply after another and returns them all at once, so a reply whose
upload has stalled (a device that lost its link mid-upload) holds every reply listed with it for as long as its
own objects are waited for (``PULL_MAX_S``). ``pull_replies`` makes the same calls with the replies of different
nodes pulled side by side, gives each reply as soon as its own objects are in (one node's in their order), and waits
for a node's objects only as long as its own uploads have taken (``UploadPace``); where ``PULL_SOURCE`` differs, or
the grid is not Flower's ``HttpGrid``, or Flower runs stock, it is the grid's own ``pull_messages``. A reply whose
object tree is not an edgefl reply's shape (more than ``REPLY_OBJECTS``) is not pulled at all: it comes as the
client's error, and its receipt is confirmed so that the SuperLink lets it go.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from contract.flower import COUNT_SOURCE, PULL_SOURCE, TUNED_SOURCE, code_key, set_message_id, why_differs

if TYPE_CHECKING:
    from flwr.app import ConfigRecord, Message
    from flwr.serverapp import Grid

log = logging.getLogger("edgefl.transport")

STOCK_ENV = "EDGEFL_TRANSPORT"  # "stock": leave Flower as it is
FAST, STOCK = "fast", "stock"
SIMULATION = "simulation"  # Flower's Simulation Engine carries messages in memory: nothing here applies

IDLE_POLL_S = (0.01, 0.25)  # a SuperNode's next pull after an empty one: 10 ms after a message, backing off to
# 250 ms. An empty pull costs the SuperLink ~5 ms of CPU: a fixed short poll would cost a core on a small host.
REPLY_POLL_S = 0.005  # the SuperNode checks its own in-memory state for the reply (an agent over HTTP tells it nothing)
SLOW_POLL_S = 1.0  # the SuperNode's poll while its agent holds every message the server keeps at it: only a message
# the agent does not wait for (a new run, a round closed at its deadline without it) comes then
RETRY_BACKOFF_S = (0.01, 0.05)  # first retry, then doubling up to the cap: a doubling up to 10 s overshoots an
# upload that takes seconds over a slow link by up to as long again
PULL_MAX_S = 60.0  # a reply whose upload has not completed 60 s after it was listed is given up as lost (stock: the
# SuperLink's 180 s upload session); our largest message over the slowest profile (iot-uplink, 0.25 Mbit/s up)
# uploads in well under that. The pull waiting on it runs beside the server's loop (fl_server.engine.ReplyPuller).
PULL_MIN_S, PACE_FACTOR, PACE_WINDOW = 10.0, 4.0, 8  # a node with uploads behind it: its next reply is given
# PACE_FACTOR × the slowest of its last PACE_WINDOW to come whole, at least PULL_MIN_S (UploadPace)
CONCURRENCY = 8  # requests waiting on the network, not CPU work: a message has 3 objects each way
BULK_PATHS = ("/push-object", "/pull-object")  # the Fleet API requests that carry objects: own pools (BulkApart)
REPLY_OBJECTS = 3  # Flower objects of an edgefl reply whatever it carries (the message, its RecordDict, one
# ConfigRecord holding the header and the payload: contract.wire); a reply listing more is not pulled
UNDELIVERED = "Reply message objects are unavailable."  # Flower's words (HttpGrid) for a reply listed, never uploaded
KEEPALIVE_S = 60.0  # a pooled connection idle this long is closed. httpx's 5 s closed those a reply's parallel
# uploads opened before the next reply (LEAF's LSTM over long-distance: 12-15 connections a client in 12 rounds of
# 7 s), and each new one starts from TCP's initial window: ~4 round trips. Below the gateway's keepalive_timeout.
STOCK_IDLE_S, STOCK_REPLY_S = 3, 0.5  # the literal sleeps in Flower's SuperNode loop
NO_RUN = 0  # what the pipelined pull reports when there was no message: not None, so the loop goes on to push

_applied: str | None = None


def _why_differs(expected: Mapping[str, str], what: str) -> str | None:
    """None when Flower's code may be used as edgefl does (``contract.flower.why_differs``) and
    ``EDGEFL_TRANSPORT`` is not ``stock``; otherwise why not (one line)."""
    if os.environ.get(STOCK_ENV, FAST) == STOCK:
        return f"{STOCK_ENV}=stock"
    return why_differs(expected, what)


def why_stock() -> str | None:
    """None when Flower can be tuned here; otherwise the reason it runs stock (one line)."""
    return _why_differs(TUNED_SOURCE, "tunes")


def remembered_transport() -> str | None:
    """FAST or STOCK for a SuperNode here (``why_stock``) as ``remember_transport`` last found it for the installed
    flwr code (``contract.flower.code_key``), without importing that code; None when it has not been found yet."""
    if os.environ.get(STOCK_ENV, FAST) == STOCK:
        return STOCK
    with contextlib.suppress(OSError):
        answer = _remembered().read_text().strip()
        return answer if answer in (FAST, STOCK) else None
    return None


def remember_transport() -> str:
    """FAST or STOCK for a SuperNode here (``why_stock``, which imports the SuperNode's loop), remembered on disk for
    ``remembered_transport``."""
    answer = STOCK if why_stock() else FAST
    path = _remembered()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(answer + "\n")
        os.replace(partial, path)
    return answer


def _remembered() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgefl"
    return cache / f"transport-{code_key(TUNED_SOURCE)}.txt"


@functools.cache
def why_counted_whole() -> str | None:
    """None when ``message_bytes`` may count a message without serializing its bytes values; otherwise why it
    serializes the whole message (one line)."""
    return _why_differs(COUNT_SOURCE, "counts by")


def message_bytes(message: Message) -> tuple[int, int]:
    """(bytes, objects) of ``message`` as Flower sends it: every object of its tree, deflated, byte-exact. Where
    Flower's serialization is the one ``COUNT_SOURCE`` hashes, the message is deflated with each bytes value of its
    ConfigRecords emptied (``_hollow``) — a Message and a RecordDict name their children by a SHA-256 of fixed
    length, so only the ConfigRecords change size, each by what its emptied values take (``_hollow_record``)."""
    from contract.flower import get_all_nested_objects, no_object_id_recompute

    hollow, emptied = (message, 0) if why_counted_whole() else _hollow(message)
    with no_object_id_recompute():  # each object serialized for its id once, not once per ancestor
        objects = get_all_nested_objects(hollow).values()
        return sum(len(obj.deflate()) for obj in objects) + emptied, len(objects)


def _hollow(message: Message) -> tuple[Message, int]:
    """``message`` with every bytes value of its ConfigRecords emptied (the same metadata, error and other
    records), and how many bytes emptying them took off its deflated objects."""
    from flwr.app import ConfigRecord, RecordDict

    from contract.flower import make_message

    if not message.has_content():
        return message, 0
    records: dict[str, Any] = {}
    emptied = 0
    for name, record in message.content.items():
        if isinstance(record, ConfigRecord):
            record, taken = _hollow_record(record)
            emptied += taken
        records[name] = record
    return make_message(metadata=message.metadata, content=RecordDict(records)), emptied


def _hollow_record(record: ConfigRecord) -> tuple[ConfigRecord, int]:
    """``record`` with each bytes value emptied, and ``len(record.deflate()) - len(hollow.deflate())``.

    A deflated ConfigRecord is a head ending in its body's length in decimal, a divider, and the body: the
    protobuf ``ConfigRecord``, one length-prefixed ``Item`` per entry, which holds the length-prefixed
    ``ConfigRecordValue``, which holds the length-prefixed bytes (a oneof field: written even when empty). An
    emptied value of n bytes puts back n bytes and a longer length prefix at each of those three levels, and
    may add digits to the body's length in the head."""
    from flwr.app import ConfigRecord

    from contract.flower import ProtoConfigRecord, get_object_body

    lengths = {key: len(value) for key, value in record.items() if isinstance(value, bytes) and value}
    if not lengths:
        return record, 0
    hollow = ConfigRecord({key: b"" if key in lengths else value for key, value in record.items()})
    body = get_object_body(hollow.deflate(), ConfigRecord)
    grown = 0
    for item in ProtoConfigRecord.FromString(body).items:
        if item.key in lengths:
            value = item.value.ByteSize()
            full_value = value - _prefixed(0) + _prefixed(lengths[item.key])
            entry = item.ByteSize()
            full_entry = entry - _prefixed(value) + _prefixed(full_value)
            grown += _prefixed(full_entry) - _prefixed(entry)
    return hollow, grown + len(str(len(body) + grown)) - len(str(len(body)))


def _prefixed(length: int) -> int:
    """Bytes of a protobuf length-delimited field's length prefix and content: a varint of ``length``, 7 bits a
    byte, then ``length`` bytes."""
    return max(1, -(-length.bit_length() // 7)) + length


class _IdleBackoff:
    """The SuperNode's wait after an empty pull: ``IDLE_POLL_S[0]`` after a message, ×1.5 per empty pull up to
    ``IDLE_POLL_S[1]``: a message that follows a reply soon (the next round) is pulled at once, and an idle
    node costs the SuperLink a few requests a second."""

    def __init__(self) -> None:
        self.delay = IDLE_POLL_S[0]

    def received(self) -> None:
        self.delay = IDLE_POLL_S[0]

    def grow(self) -> None:
        self.delay = min(self.delay * 1.5, IDLE_POLL_S[1])

    def wait(self) -> None:
        time.sleep(self.delay)
        self.grow()


class NodeSignals:
    """What a device's SuperNode loop (``_Pipeline``) and its agent's channel (``fl_client.channel``) tell each other
    in the SuperNode's process: how many messages were stored (their tasks may be claimed) and how many replies the
    agent handed over (the loop may push them), counts a waiter compares with what it saw, and how many more messages
    the agent takes now (``wanted``: the loop polls the SuperLink fast while it takes one). ``state``: the
    SuperNode's NodeState, once its loop has started. ``told``: an agent talks over the channel, so replies are
    told; without one the loop looks for them every ``REPLY_POLL_S``, as before."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.state: Any = None
        self.stored = 0
        self.replies = 0
        self.wanted = 1
        self.told = False

    def _bump(self, **changes: Any) -> None:
        with self._changed:
            for name, value in changes.items():
                setattr(self, name, value)
            self._changed.notify_all()

    def attach(self, state: Any) -> None:
        if self.state is None:
            self._bump(state=state)

    def message_stored(self) -> None:
        self._bump(stored=self.stored + 1)

    def reply_stored(self) -> None:
        self._bump(replies=self.replies + 1, told=True)

    def want(self, count: int) -> None:
        self._bump(wanted=count, told=True)

    def wants(self) -> bool:
        return self.wanted > 0

    def replied_since(self, seen: int) -> bool:
        return self.replies != seen

    def stored_since(self, seen: int) -> bool:
        return self.stored != seen

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``predicate()`` holds (checked at each signal) or ``timeout_s`` has passed; whether it holds."""
        with self._changed:
            return self._changed.wait_for(predicate, max(timeout_s, 0.0))


class _Prefetched:
    """A NodeState whose reply listing was already taken: ``_Pipeline`` lists the replies first (listing marks
    them taken) and hands Flower's ``_push_messages`` the same list, so that it never waits for one."""

    def __init__(self, state: Any, replies: list[Any]) -> None:
        self._state, self._replies = state, replies

    def get_messages_legacy(self, **_: Any) -> list[Any]:
        return self._replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class _Pipeline:
    """The SuperNode's loop (``start_client_internal``: pull a message, then ``_push_messages``, which waits for
    its reply) made to pull and push independently. The pull reports a message even when there was none, so the
    loop always goes on to its push, and tells the agent's channel of each message it stored.

    Where the agent talks over the channel (``NodeSignals.told``), replies go out on a thread of their own as soon
    as the agent hands one over (``_push_forever``): a reply never waits behind a message being pulled, nor a message
    behind a reply being pushed, as DGA's overlap. The loop's push is then only its wait before the next pull: none
    after a message, the idle poll otherwise, and ``SLOW_POLL_S`` while the agent wants no message (until it comes to
    want one). Without the channel, the push sends the replies that exist and returns; after a pull that found
    nothing it first waits for one up to the idle poll, looking every ``REPLY_POLL_S``."""

    def __init__(
        self, pull: Callable[..., int | None], push: Callable[..., None], idle: _IdleBackoff, signals: NodeSignals
    ) -> None:
        self._pull, self._push, self._idle, self._signals = pull, push, idle, signals
        self._pulled = False
        self._pusher: threading.Thread | None = None
        self._confirmer: ThreadPoolExecutor | None = None

    def pull(self, *args: Any, **kwargs: Any) -> int:
        self._signals.attach(kwargs.get("state"))
        told = self._signals.told
        if told:  # the agent may claim a message as soon as its objects are stored, and the loop pulls the next one
            kwargs["confirm_message_received"] = self._confirm_later(kwargs["confirm_message_received"])
        run_id = self._pull(*args, **kwargs)
        self._pulled = run_id is not None
        if self._pulled:
            self._idle.received()
            if not told:
                self._signals.message_stored()
        return NO_RUN if run_id is None else run_id

    def _confirm_later(self, confirm: Callable[[int, str], None]) -> Callable[[int, str], None]:
        """``confirm`` (ConfirmMessageReceived: a link round trip, after the message's objects are stored) sent on
        the confirmer's thread, in order, instead of in the loop: the agent is told of the message at once, and the
        loop asks for the next one while the SuperLink is told of this one."""
        if self._confirmer is None:
            self._confirmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="confirm")

        def confirm_later(run_id: int, message_id: str) -> None:
            self._signals.message_stored()
            assert self._confirmer is not None
            self._confirmer.submit(_logged(confirm, f"confirming message {message_id}"), run_id, message_id)

        return confirm_later

    def push(self, *, state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        if not self._signals.told:
            self._push_ready(state, object_store, send, push_object)
            return
        if self._pusher is None:
            self._pusher = threading.Thread(
                target=self._push_forever, args=(state, object_store, send, push_object), daemon=True, name="push"
            )
            self._pusher.start()
        self._wait_to_pull()

    def _push_ready(self, state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        deadline = time.monotonic() + (0.0 if self._pulled else self._idle.delay)
        while not (replies := list(state.get_messages_legacy(is_reply=True))):
            if time.monotonic() >= deadline:
                if not self._pulled:
                    self._idle.grow()
                return
            time.sleep(REPLY_POLL_S)
        self._push(state=_Prefetched(state, replies), object_store=object_store, send=send, push_object=push_object)
        self._idle.received()

    def _wait_to_pull(self) -> None:
        signals = self._signals
        if self._pulled:
            return
        if signals.wanted > 0:
            time.sleep(self._idle.delay)
            self._idle.grow()
        else:
            signals.wait_for(signals.wants, SLOW_POLL_S)

    def _push_forever(self, state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        """Push each reply the agent hands over, as soon as it does (Flower's ``_push_messages``, handed the replies
        listed, so that it never waits for one)."""
        signals = self._signals
        while True:
            seen = signals.replies  # before looking: a reply handed over meanwhile is news to the wait
            try:
                if replies := list(state.get_messages_legacy(is_reply=True)):
                    self._push(
                        state=_Prefetched(state, replies), object_store=object_store, send=send, push_object=push_object
                    )
                    self._idle.received()
                    continue
            except Exception:  # Flower's push logs each message's failure itself; anything else is said here
                log.exception("edgefl: pushing the SuperNode's replies failed; going on")
            signals.wait_for(functools.partial(signals.replied_since, seen), SLOW_POLL_S)


def _logged(call: Callable[..., None], what: str) -> Callable[..., None]:
    """``call``, its failure logged (it runs where no one waits for it)."""

    def logged(*args: Any) -> None:
        try:
            call(*args)
        except Exception:
            log.exception("edgefl: %s failed", what)

    return logged


class _TunedClock:
    """Stands in for the ``time`` module inside ``flwr.supernode.start_client_internal``: its two literal sleeps
    are replaced; every other call reaches ``time`` unchanged."""

    def __init__(self, idle: _IdleBackoff) -> None:
        self._idle = idle

    def sleep(self, seconds: float) -> None:
        if seconds == STOCK_IDLE_S:
            self._idle.wait()
        else:
            time.sleep(REPLY_POLL_S if seconds == STOCK_REPLY_S else seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _set_defaults(function: Callable[..., Any], **defaults: float) -> None:
    function.__kwdefaults__.update(defaults)  # type: ignore[union-attr]


def _apply(signals: NodeSignals) -> None:
    from contract.flower import ProtobufClient, inflatable_utils
    from contract.flower import supernode_loop as loop

    idle = _IdleBackoff()
    pipeline = _Pipeline(loop._pull_and_store_message, loop._push_messages, idle, signals)
    loop.time = _TunedClock(idle)  # type: ignore[attr-defined]
    loop._pull_and_store_message = pipeline.pull  # type: ignore[attr-defined]
    loop._push_messages = pipeline.push  # type: ignore[attr-defined]
    _set_defaults(
        inflatable_utils.pull_objects,
        initial_backoff=RETRY_BACKOFF_S[0], backoff_cap=RETRY_BACKOFF_S[1], max_concurrent_pulls=CONCURRENCY,
        max_time=PULL_MAX_S,
        max_tries_per_object=None,  # 500 short retries would give up on a long upload; max_time bounds it
    )  # fmt: skip
    _set_defaults(inflatable_utils.push_objects, max_concurrent_pushes=CONCURRENCY)
    _set_defaults(inflatable_utils.push_object_contents_from_iterable, max_concurrent_pushes=CONCURRENCY)
    inflatable_utils.get_num_workers = lambda max_concurrent: max_concurrent  # type: ignore[assignment]
    ProtobufClient.__init__ = _kept_alive(ProtobufClient.__init__)  # type: ignore[method-assign]


def _kept_alive(init: Callable[..., None]) -> Callable[..., None]:
    """Flower's ``ProtobufClient.__init__`` (``TUNED_SOURCE``: it makes ``httpx.Client(verify=verify,
    timeout=timeout, follow_redirects=True)``), then the same client on ``BulkApart``'s pools, each httpx's default
    but that it keeps idle connections ``KEEPALIVE_S`` (objects on pools of one connection each: ``WarmLanes``)."""

    @functools.wraps(init)
    def kept_alive(self: Any, base_url: str, *, verify: Any = True, timeout: float = 30.0, **rest: Any) -> None:
        init(self, base_url, verify=verify, timeout=timeout, **rest)
        self._client.close()
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S)
        one = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_S)
        transport = BulkApart(
            lambda: httpx.HTTPTransport(verify=verify, limits=limits),
            lambda: httpx.HTTPTransport(verify=verify, limits=one),
        )
        self._client = httpx.Client(timeout=timeout, follow_redirects=True, transport=transport)

    return kept_alive


class BulkApart(httpx.BaseTransport):
    """An httpx transport that sends objects up, objects down and every other request each on connections of their
    own (``BULK_PATHS``), so a connection that carries a model carries models the same way every round; each object
    goes on the idle connection of its kind that has carried the most bytes its way (``WarmLanes``).

    TCP's windows are a connection's and a direction's: a connection that last carried an update up, or only small
    requests, starts a model down at the initial window and ramps up over round trips (BBR's start-up like cubic's
    slow start: ~5 round trips for 0.4 MB, 1.1 s over a 300 ms link), and the receiver's window grows the same way
    (``tcp_rmem``'s autotuning doubles it each round trip that fills it). httpx's one pool hands a request the oldest
    idle connection; with DGA's two messages in flight an update goes up while the next model comes down, and both
    landed on connections cold in their direction: DGA's path was 1.5-1.7x FedAvg's over long-distance."""

    def __init__(
        self, make_pool: Callable[[], httpx.BaseTransport], make_lane: Callable[[], httpx.BaseTransport]
    ) -> None:
        self.pools: dict[str, httpx.BaseTransport] = {
            kind: WarmLanes(make_lane, down=kind == "/pull-object") for kind in BULK_PATHS
        }
        self.pools[""] = make_pool()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        kind = next((kind for kind in BULK_PATHS if request.url.path.endswith(kind)), "")
        return self.pools[kind].handle_request(request)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


class _Lane:
    """One connection of a ``WarmLanes`` (an httpx pool of one), and the bytes it carried its way while open."""

    def __init__(self, pool: httpx.BaseTransport) -> None:
        self.pool = pool
        self.carried = 0
        self.busy = False
        self.last_used = 0.0


class WarmLanes(httpx.BaseTransport):
    """Connections of one kind (objects down, or objects up), each an httpx pool of one; a request goes on the idle
    one that has carried the most bytes its way (``down``: response bodies, else request bodies), a new one when
    none is idle. A connection's windows grow with what it carries, so a model pulled again after the SuperLink said
    it was not there yet goes where the last model went instead of where the oldest idle connection is; of a
    message's three objects asked for at once, the first to ask takes that connection, and Flower asks for a
    message's leaves first, the payload among them. A connection idle past ``KEEPALIVE_S`` has been closed: it
    counts as new."""

    def __init__(
        self, make_lane: Callable[[], httpx.BaseTransport], down: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._make_lane, self._down, self._clock = make_lane, down, clock
        self._lanes: list[_Lane] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        lane = self._take()
        try:
            response = lane.pool.handle_request(request)
        except BaseException:
            self._give_back(lane, 0)
            raise
        sent = 0 if self._down else int(request.headers.get("content-length", 0))
        if response.is_closed:  # a response made whole from bytes: nothing left to read on the connection
            self._give_back(lane, sent + (len(response.content) if self._down else 0))
        else:
            response.stream = _CountedStream(
                response.stream, lambda received: self._give_back(lane, sent + (received if self._down else 0))
            )
        return response

    def _take(self) -> _Lane:
        with self._lock:
            now = self._clock()
            idle = [lane for lane in self._lanes if not lane.busy]
            for lane in idle:
                if now - lane.last_used > KEEPALIVE_S:
                    lane.carried = 0
            if idle:
                lane = max(idle, key=lambda lane: lane.carried)
            else:
                lane = _Lane(self._make_lane())
                self._lanes.append(lane)
            lane.busy = True
            return lane

    def _give_back(self, lane: _Lane, carried: int) -> None:
        with self._lock:
            lane.carried += carried
            lane.busy, lane.last_used = False, self._clock()

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.pool.close()


class _CountedStream(httpx.SyncByteStream):
    """A response body that counts its bytes as they are read and reports them once, when it is closed."""

    def __init__(self, stream: Any, done: Callable[[int], None]) -> None:
        self._stream, self._done = stream, done
        self._read, self._closed = 0, False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            self._read += len(chunk)
            yield chunk

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            if not self._closed:
                self._closed = True
                self._done(self._read)


def tune(signals: NodeSignals | None = None) -> str:
    """Shorten Flower's waits in this process if the check passes; returns ``fast`` or ``stock`` (idempotent).
    ``signals``: what the SuperNode's loop tells its agent's channel, and is told by it (``NodeSignals``)."""
    global _applied
    if _applied is None:
        reason = why_stock()
        if reason is None:
            _apply(signals or NodeSignals())
            _applied = FAST
        else:
            log.warning("edgefl: Flower's stock message path (%s)", reason)
            _applied = STOCK
    return _applied


def why_pulled_whole() -> str | None:
    """None when ``pull_replies`` may pull different nodes' replies side by side; otherwise why the grid's own
    ``pull_messages`` is used (one line)."""
    return "Flower's message path is stock here" if _applied != FAST else _pull_source_differs()


@functools.cache
def _pull_source_differs() -> str | None:
    return _why_differs(PULL_SOURCE, "pulls replies by")


class UploadPace:
    """How long a node's reply may take to come whole once it is listed. Its first replies: ``PULL_MAX_S``. Then
    ``PACE_FACTOR`` × the slowest of its last ``PACE_WINDOW`` (at least ``PULL_MIN_S``), doubled for each reply
    given up on since its last one came (at most ``PULL_MAX_S``): a reply the gateway refused (413) or whose device
    went quiet mid-upload holds its round ~10 s instead of 60 s, and an honest reply larger than the node's usual
    (a resend of several updates) is given longer each time it is asked again."""

    def __init__(self) -> None:
        self._seconds: dict[int, collections.deque[float]] = {}
        self._given_up: dict[int, int] = {}
        self._lock = threading.Lock()

    def allowed_s(self, node_id: int) -> float:
        with self._lock:
            seconds = self._seconds.get(node_id)
            if not seconds:
                return PULL_MAX_S
            paced = max(PULL_MIN_S, PACE_FACTOR * max(seconds)) * 2 ** self._given_up.get(node_id, 0)
            return min(PULL_MAX_S, paced)

    def came(self, node_id: int, seconds: float) -> None:
        with self._lock:
            self._seconds.setdefault(node_id, collections.deque(maxlen=PACE_WINDOW)).append(seconds)
            self._given_up.pop(node_id, None)

    def gave_up(self, node_id: int) -> None:
        with self._lock:
            self._given_up[node_id] = self._given_up.get(node_id, 0) + 1


def pull_replies(grid: Grid, message_ids: list[str], pace: UploadPace | None = None) -> Iterator[Message]:
    """The replies the SuperLink lists for ``message_ids``, each as soon as its own objects are in (``pull_listed``,
    through the grid's Runtime API client); elsewhere (module docstring) the grid's own ``pull_messages``."""
    from contract.flower import HttpGrid

    if why_pulled_whole() is not None or type(grid) is not HttpGrid:
        yield from grid.pull_messages(message_ids)
        return
    yield from pull_listed(grid._runtime_client, grid.node, grid._run.run_id, message_ids, pace)


def pull_listed(
    client: Any, node: Any, run_id: int, message_ids: list[str], pace: UploadPace | None = None
) -> Iterator[Message]:
    """Flower's ``HttpGrid.pull_messages`` call by call over the Runtime API ``client`` (the list, each reply's
    objects, its receipt confirmed), with the replies of different nodes pulled side by side: each is given once
    its own objects are in and one node's replies in the order they were listed, as Flower's grid gives them (the
    server's bookkeeping of what a node holds follows its replies in order). A reply whose objects cannot be had
    within the time ``pace`` allows its node (``PULL_MAX_S`` without one) comes as Flower's "message unavailable"
    error reply."""
    pace = pace or UploadPace()
    import httpx

    from contract.flower import PullAppMessagesRequest

    try:
        listed = client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code != httpx.codes.REQUEST_ENTITY_TOO_LARGE:
            raise
        log.error("edgefl: the SuperLink refused to list replies (%s): too many asked at once", exc)
        return
    replies = list(zip(listed.messages_list, listed.message_object_trees, strict=True))
    by_node: dict[int, list[tuple[Any, Any]]] = {}
    for reply in replies:
        by_node.setdefault(reply[0].metadata.src_node_id, []).append(reply)
    if len(by_node) <= 1:  # most polls: nothing, or one node's replies
        yield from (_pull_reply(client, node, run_id, *reply, pace) for reply in replies)
        return
    pulled: queue.SimpleQueue[Message | BaseException] = queue.SimpleQueue()

    def pull_in_order(node_replies: list[tuple[Any, Any]]) -> None:
        try:
            for reply in node_replies:
                pulled.put(_pull_reply(client, node, run_id, *reply, pace))
        except BaseException as exc:  # raised where the replies are taken
            pulled.put(exc)

    with ThreadPoolExecutor(max_workers=min(len(by_node), CONCURRENCY), thread_name_prefix="reply") as pool:
        for node_replies in by_node.values():
            pool.submit(pull_in_order, node_replies)
        for _ in replies:
            item = pulled.get()
            if isinstance(item, BaseException):
                raise item
            yield item


def _pull_reply(client: Any, node: Any, run_id: int, proto: Any, tree: Any, pace: UploadPace) -> Message:
    """One listed reply, as ``HttpGrid.pull_messages`` brings each: its objects, its receipt confirmed, the message
    inflated with its id; or Flower's error reply when its objects cannot be had within what ``pace`` allows."""
    from flwr.app import Error, Metadata

    from contract.flower import (
        SYSTEM_MESSAGE_TYPE,
        ConfirmMessageReceivedRequest,
        ErrorCode,
        ObjectPullError,
        inflatable_utils,
        inflate_object_from_contents,
        iterate_object_tree,
        make_message,
        make_pull_object_fn_protobuf,
        now,
    )

    message_id = proto.metadata.message_id
    metadata = Metadata(
        run_id=run_id, message_id="", src_node_id=node.node_id, dst_node_id=node.node_id,
        message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
        reply_to_message_id=proto.metadata.reply_to_message_id, created_at=now().timestamp(),
    )  # fmt: skip
    object_ids = [subtree.object_id for subtree in iterate_object_tree(tree)]
    if len(object_ids) > REPLY_OBJECTS:  # not edgefl's shape: refused before any of it is pulled
        client.ConfirmMessageReceived(
            ConfirmMessageReceivedRequest(node=node, run_id=run_id, message_object_id=message_id)
        )
        reason = f"edgefl: the reply lists {len(object_ids)} objects, an edgefl reply {REPLY_OBJECTS}: not pulled"
        return make_message(metadata=metadata, error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason))
    source, started = proto.metadata.src_node_id, time.monotonic()
    allowed = pace.allowed_s(source)
    try:
        pull_object = make_pull_object_fn_protobuf(pull_object_protobuf=client.PullObject, node=node, run_id=run_id)
        contents = inflatable_utils.pull_objects(object_ids=object_ids, pull_object_fn=pull_object, max_time=allowed)
    except ObjectPullError as exc:
        pace.gave_up(source)
        expired = "The sender may not have completed the upload before the object-push session expired."
        reason = f"{UNDELIVERED} {expired} {exc} (waited {allowed:.0f} s)"  # Flower's words, then ours
        return make_message(metadata=metadata, error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=reason))
    pace.came(source, time.monotonic() - started)
    client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=node, run_id=run_id, message_object_id=message_id))
    message = inflate_object_from_contents(message_id, contents)
    set_message_id(message, message_id)
    return message
