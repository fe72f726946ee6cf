"""The device's channel between its SuperNode and its edge agent: Flower's Runtime API calls carried over a Unix
socket to the SuperNode's own process, not over HTTP, and the agent told of a task instead of asking for one.

Flower's SuperNode serves its Runtime API over HTTP (FastAPI on uvicorn). An agent serving its tasks that way
(``fl_client.tasks``, the SuperNode in ``--isolation process``) asked for a task every 5–100 ms and made about 13
requests a message, each ~3.5 ms of a host core between the two ends (~10 ms of a Raspberry Pi 4's): most of what
a message cycle cost a device (``bench/message_cost.py``). The channel carries the same calls — Flower's protobuf
requests and responses, answered in the SuperNode's process by the handler functions Flower's Runtime API router
calls, with the task its token names — as frames on the abstract Unix socket ``edgefl-runtime-PORT`` of the device's
network namespace (PORT: its Runtime API's). Two calls are edgefl's own: ``WaitForTask``, a claim that waits until
the SuperNode's loop stores a message (``contract.transport.NodeSignals``), and ``Wanted``, how many more messages
the agent takes now, by which that loop polls the SuperLink fast or only every ``SLOW_POLL_S``.

The SuperNode serves a channel only where its loop is tuned (``contract.transport.tune``) and ``CHANNEL_SOURCE`` holds
the installed router's code (``contract.flower``); otherwise the agent finds no channel and uses the HTTP API, as
Flower's own ``flwr-clientapp`` does. Only processes of the SuperNode's own user are served (the peer's uid,
``SO_PEERCRED``), and the agent sends nothing to a socket another user holds: an abstract name is whoever's binds it
first. A frame: its length (4 bytes), then for a call the method's number, the token's length, the longest wait in
milliseconds and the token, for an answer its status; then the protobuf body (a refusal's: its reason).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from contract.errors import PeerError
from contract.flower import CHANNEL_SOURCE, why_differs
from contract.transport import NodeSignals
from fl_client.runtime_owner import NotOurSuperNode

log = logging.getLogger("edgefl.channel")

SERVES = "serves its agent's Runtime API calls in its own process by"  # what edgefl does with CHANNEL_SOURCE's code
CALL, ANSWER = struct.Struct(">BHI"), struct.Struct(">B")  # after each frame's 4-byte length
LENGTH = struct.Struct(">I")
MAX_FRAME = 64 << 20  # an object is at most Flower's 5 MiB chunk, a message's own proto small: far above either
OK, REFUSED = 0, 1
CALL_TIMEOUT_S = 120.0  # a call's answer, beyond its own wait: the SuperNode is gone or stuck
WAIT_FOR_TASK, WANTED = "WaitForTask", "Wanted"
# Flower's Runtime API calls the agent makes (fl_client.tasks), then edgefl's two; a call travels as its number here
METHODS = (
    "AcquireTask", "SendTaskHeartbeat", "PullTaskInput", "PullMessages", "PullObject", "ConfirmMessageReceived",
    "PushMessages", "PushObject", "PushTaskOutput", WAIT_FOR_TASK, WANTED,
)  # fmt: skip
TYPES = {  # call -> (request, response), Flower's protobuf messages by their names in contract.flower
    "AcquireTask": ("AcquireTaskRequest", "AcquireTaskResponse"),
    "SendTaskHeartbeat": ("SendTaskHeartbeatRequest", "SendTaskHeartbeatResponse"),
    "PullTaskInput": ("PullTaskInputRequest", "PullTaskInputResponse"),
    "PullMessages": ("PullAppMessagesRequest", "PullAppMessagesResponse"),
    "PullObject": ("PullObjectRequest", "PullObjectResponse"),
    "ConfirmMessageReceived": ("ConfirmMessageReceivedRequest", "ConfirmMessageReceivedResponse"),
    "PushMessages": ("PushAppMessagesRequest", "PushAppMessagesResponse"),
    "PushObject": ("PushObjectRequest", "PushObjectResponse"),
    "PushTaskOutput": ("PushTaskOutputRequest", "PushTaskOutputResponse"),
    WAIT_FOR_TASK: ("AcquireTaskRequest", "AcquireTaskResponse"),
}
REPLIED = ("PushMessages", "PushObject", "PushTaskOutput")  # what may let the SuperNode's loop push a reply


class RuntimeRefused(PeerError, RuntimeError):
    """The SuperNode refused a call over the channel (Flower's refusal, e.g. a task it no longer holds); ``str()``
    is its reason."""


class ChannelGone(ConnectionError):
    """The channel closed, or did not answer within ``CALL_TIMEOUT_S`` beyond the call's own wait."""


def channel_name(port: int) -> str:
    return f"\0edgefl-runtime-{port}"


def why_no_channel() -> str | None:
    """None when the SuperNode may serve a channel; otherwise why not (one line)."""
    return why_differs(CHANNEL_SOURCE, SERVES)


def _peer_uid(sock: socket.socket) -> int:
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _send_frame(sock: socket.socket, head: bytes, body: bytes) -> None:
    sock.sendall(LENGTH.pack(len(head) + len(body)) + head + body)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelGone("the channel closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv_frame(sock: socket.socket) -> bytes:
    (size,) = LENGTH.unpack(_recv_exact(sock, LENGTH.size))
    if size > MAX_FRAME:
        raise ChannelGone(f"a frame of {size} bytes is over the channel's {MAX_FRAME}")
    return _recv_exact(sock, size)


def _proto(name: str) -> Any:
    import contract.flower as flower

    return getattr(flower, name)


# ----- the SuperNode's end ----------------------------------------------------------------------------------
class ChannelServer:
    """Serves the channel of the SuperNode whose Runtime API is on ``port``, in its process: each connection on a
    thread of its own, each call answered by Flower's handler (``_routes``) on the SuperNode's state once its loop
    has started (``signals.state``)."""

    def __init__(self, port: int, signals: NodeSignals) -> None:
        self.name = channel_name(port)
        self.signals = signals
        self._routes = _routes()
        self._listener: socket.socket | None = None

    def start(self) -> bool:
        """Listen; False (said in one line) when another process holds the name."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.name)
        except OSError as exc:
            listener.close()
            log.warning(
                "the channel %r is held by another process (%s): the agent uses the HTTP API", self.name[1:], exc
            )
            return False
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True, name="channel").start()
        return True

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if _peer_uid(conn) != os.geteuid():
                log.warning(
                    "refused a channel connection of uid %d: only this SuperNode's user is served", _peer_uid(conn)
                )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="channel-call").start()

    def _serve(self, conn: socket.socket) -> None:
        hinted, seen = False, Seen()
        with conn:
            while True:
                try:
                    method, token, wait_s, body = _parse_call(_recv_frame(conn))
                except (OSError, struct.error):  # gone, or not a call: the connection is dropped
                    break
                hinted = hinted or method == WANTED
                status, answer = self.handle(method, token, wait_s, body, seen)
                try:
                    _send_frame(conn, ANSWER.pack(status), answer)
                except OSError:
                    break
        if hinted:  # the agent that told what it wanted is gone: its SuperNode polls as for one that wants a message
            self.signals.want(1)

    def handle(self, method: str, token: str, wait_s: float, body: bytes, seen: Seen) -> tuple[int, bytes]:
        """(status, body) of one call: Flower's handler's response, or the reason it was refused; ``seen``: what its
        connection's last claim saw (``WaitForTask``)."""
        from contract.flower import FlowerError

        if method == WANTED:
            self.signals.want(int.from_bytes(body[:1] or b"\1", "big"))
            return OK, b""
        if method not in self._routes:
            return REFUSED, f"no such call: {method}".encode()
        request_type, handler, needs_task = self._routes[method]
        try:
            request = request_type.FromString(body)
            state = self._state(wait_s)
            if state is None:  # the loop has not started: no task exists yet
                return (REFUSED, b"no such task") if needs_task else (OK, b"")
            if method == WAIT_FOR_TASK:
                response = self._wait_for_task(handler, request, state, wait_s, seen)
            elif needs_task:
                task = state.get_task_by_token(token) if token else None
                if task is None:
                    return REFUSED, b"Runtime task-token authentication failed."  # Flower's words
                response = handler(request, state, task)
            else:
                response = handler(request, state)
        except FlowerError as exc:
            return REFUSED, f"{exc.message} (code {exc.code})".encode()
        except Exception as exc:  # a malformed call, or a handler that failed: the agent is told, the SuperNode goes on
            log.exception("channel call %s failed", method)
            return REFUSED, f"{type(exc).__name__}: {exc}".encode()
        if method in REPLIED:
            self.signals.reply_stored()
        return OK, response.SerializeToString()

    def _state(self, wait_s: float) -> Any:
        signals = self.signals
        if signals.state is None and wait_s > 0:
            signals.wait_for(lambda: signals.state is not None, wait_s)
        return signals.state

    def _wait_for_task(self, acquire: Callable[..., Any], request: Any, state: Any, wait_s: float, seen: Seen) -> Any:
        """``acquire``'s claim, made once the loop has stored a message since the connection's last claim found none
        (at once on its first), within ``wait_s``; an empty claim after that. Flower's loop makes a message's task
        before it pulls the message's objects: claimed then, the agent would ask for objects still on their way."""
        signals, deadline = self.signals, time.monotonic() + wait_s
        while True:
            stored = signals.stored
            if stored != seen.stored:
                claim = acquire(request, state)
                if claim.HasField("task"):
                    return claim
                seen.stored = stored
            left = deadline - time.monotonic()
            if left <= 0 or not signals.wait_for(partial(signals.stored_since, stored), left):
                return _proto(TYPES[WAIT_FOR_TASK][1])()


@dataclass
class Seen:
    """What a connection's last claim that found no task saw: the loop's count of stored messages (-1: none yet)."""

    stored: int = -1


def _parse_call(frame: bytes) -> tuple[str, str, float, bytes]:
    number, token_size, wait_ms = CALL.unpack_from(frame)
    start = CALL.size + token_size
    method = METHODS[number] if number < len(METHODS) else f"#{number}"
    return method, frame[CALL.size : start].decode(errors="replace"), wait_ms / 1000, frame[start:]


def _routes() -> dict[str, tuple[Any, Callable[..., Any], bool]]:
    """Each Flower call: (its request type, the handler Flower's Runtime API router gives it, whether it acts on the
    task its token names) — the router's dispatch, which ``CHANNEL_SOURCE`` checks."""
    from contract.flower import core_runtime_handlers as core
    from contract.flower import node_runtime_handlers as node

    handlers = {
        "AcquireTask": (node.acquire_task, False), "SendTaskHeartbeat": (core.send_task_heartbeat, True),
        "PullTaskInput": (node.pull_task_input, True), "PullMessages": (node.pull_messages, True),
        "PullObject": (node.pull_object, True), "ConfirmMessageReceived": (node.confirm_message_received, True),
        "PushMessages": (node.push_messages, True), "PushObject": (node.push_object, True),
        "PushTaskOutput": (node.push_task_output, True), WAIT_FOR_TASK: (node.acquire_task, False),
    }  # fmt: skip
    return {method: (_proto(TYPES[method][0]), handler, task) for method, (handler, task) in handlers.items()}


# ----- the agent's end ----------------------------------------------------------------------------------------
class ChannelClient:
    """Flower's Runtime API client calls (``RuntimeHttpClient``'s names and types) over the channel of the SuperNode
    whose Runtime API is on ``port``, for the task ``token`` names (none: claims and hints). Connects at once:
    ``ConnectionRefusedError`` or ``FileNotFoundError`` when no channel is served there, ``NotOurSuperNode`` when
    another user's process holds the name."""

    def __init__(self, port: int, token: str = "") -> None:
        self._token = token.encode()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(channel_name(port))
            if (owner := _peer_uid(self._sock)) != os.geteuid():
                raise NotOurSuperNode(
                    f"refused the channel {channel_name(port)[1:]!r}: it is held by uid {owner}, not by this agent's "
                    f"user (uid {os.geteuid()}), so it is not this device's SuperNode; nothing was sent to it"
                )
        except BaseException:
            self._sock.close()
            raise

    def call(self, method: str, body: bytes, wait_s: float = 0.0) -> bytes:
        """One call with ``body``; the answer's body, or ``RuntimeRefused`` with the SuperNode's reason, or
        ``ChannelGone``."""
        head = CALL.pack(METHODS.index(method), len(self._token), round(wait_s * 1000)) + self._token
        with self._lock:
            try:
                self._sock.settimeout(wait_s + CALL_TIMEOUT_S)
                _send_frame(self._sock, head, body)
                frame = _recv_frame(self._sock)
            except ChannelGone:
                raise
            except OSError as exc:  # a timeout too
                raise ChannelGone(f"the channel failed: {exc}") from exc
        (status,) = ANSWER.unpack_from(frame)
        if status != OK:
            raise RuntimeRefused(frame[ANSWER.size :].decode(errors="replace"))
        return frame[ANSWER.size :]

    def _flower(self, method: str, request: Any, wait_s: float = 0.0) -> Any:
        """A Flower call: its protobuf request, and its response parsed."""
        return _proto(TYPES[method][1]).FromString(self.call(method, request.SerializeToString(), wait_s))

    def AcquireTask(self, request: Any) -> Any:
        return self._flower("AcquireTask", request)

    def WaitForTask(self, request: Any, wait_s: float) -> Any:
        """``AcquireTask``, answered once the SuperNode has a task to give or after ``wait_s``."""
        return self._flower(WAIT_FOR_TASK, request, wait_s)

    def Wanted(self, count: int) -> None:
        """Tell the SuperNode how many more messages the agent takes now (at most 255)."""
        self.call(WANTED, bytes([min(max(count, 0), 255)]))

    def SendTaskHeartbeat(self, request: Any) -> Any:
        return self._flower("SendTaskHeartbeat", request)

    def PullTaskInput(self, request: Any) -> Any:
        return self._flower("PullTaskInput", request)

    def PullMessages(self, request: Any) -> Any:
        return self._flower("PullMessages", request)

    def PullObject(self, request: Any) -> Any:
        return self._flower("PullObject", request)

    def ConfirmMessageReceived(self, request: Any) -> Any:
        return self._flower("ConfirmMessageReceived", request)

    def PushMessages(self, request: Any) -> Any:
        return self._flower("PushMessages", request)

    def PushObject(self, request: Any) -> Any:
        return self._flower("PushObject", request)

    def PushTaskOutput(self, request: Any) -> Any:
        return self._flower("PushTaskOutput", request)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
