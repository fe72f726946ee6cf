"""Serving a SuperNode's tasks from this long-lived process over Flower's Runtime API, with the SuperNode in
``--isolation process``. Flower's own ``flwr-clientapp`` serves ONE task and exits, so Flower starts a process
(and imports the model's libraries) for every message; here the loop goes on and the ClientApp keeps its state.

Per task, the calls ``flwr-clientapp`` makes: AcquireTask (signed with the SuperExec secret when the node has
one) → PullTaskInput, PullMessages, PullObject × n, ConfirmMessageReceived → the ClientApp → PushMessages,
PushObject × m → PushTaskOutput. A heartbeat keeps the task claimed while the ClientApp works (Flower fails a
task that sends none for 60 s). The Runtime API listens on the device's loopback only, and the agent sends
nothing on a connection whose other end is not its own user's (``fl_client.runtime_owner``).

Tasks are served side by side, up to ``MAX_TASKS`` at once: edgefl's SuperNode hands over every message queued
for it (``contract.transport``), and the agent holds each until it has an update to answer it with.

Where the SuperNode serves the device's channel (``fl_client.channel``: the same calls over a Unix socket, in the
SuperNode's process) the agent uses it: a claim waits until there is a task (``WaitForTask``) instead of asking
every 5–100 ms, and the agent tells the SuperNode how many more messages it takes now (``Wanted``: the most the
server keeps at it, ``most_held``, less those it holds unanswered), so that the SuperNode asks the SuperLink for
another only while it takes one. Elsewhere it claims over Flower's HTTP Runtime API, as ``flwr-clientapp`` does.

A task whose message this process has pulled is kept on disk (``HeldTask``, one file per task in the held-tasks
folder) until it is finished: an agent that died holding some (kill -9, out of memory, a power cut of the agent's
container) and is restarted beside the same SuperNode answers them with an error as soon as it is back, so the
server sends its model again at once instead of after Flower's 60 s task expiry. A task whose reply was pushed
is marked so before the task is finished, and only finished on restart: it is never answered twice (and were the
agent killed between the push and the mark, Flower's SuperLink refuses a second reply to the same message)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from google.protobuf.message import DecodeError

from contract.errors import PeerError
from contract.flower import (
    AcquireTaskRequest,
    ErrorCode,
    HeartbeatSender,
    MessageProto,
    Node,
    PullAppMessagesRequest,
    PullTaskInputRequest,
    PushAppMessagesRequest,
    PushTaskOutputRequest,
    RetryInvoker,
    RuntimeHttpClient,
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SendTaskHeartbeatRequest,
    SubStatus,
    SuperExecAuthHttpInterceptor,
    TaskIdentity,
    TaskType,
    constant,
    context_from_proto,
    context_to_proto,
    get_all_nested_objects,
    get_object_tree,
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
    make_push_object_fn_protobuf,
    message_from_proto,
    message_to_proto,
    no_object_id_recompute,
    pull_and_inflate_object_from_tree,
    push_objects,
    refuse_unless_runtime_api,
    remove_content_from_message,
    set_message_id,
)
from contract.transport import CONCURRENCY, RETRY_BACKOFF_S
from fl_client.channel import ChannelClient, RuntimeRefused
from fl_client.runtime_owner import NotOurSuperNode, OwnSuperNodeOnly

log = logging.getLogger("edgefl.tasks")

COMPONENT = "flwr-clientapp"  # what this process is to the SuperNode's version check
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"
POLL_S = (0.005, 0.1)  # an empty AcquireTask is retried after 5 ms, ×1.5 each time, up to 100 ms
RECONNECT_S = 0.5  # the SuperNode is not (yet, or no longer) up
LOG_PREFIX = "served task "
INPUT_WAIT_S = 5.0  # the task's message is stored right after the task: wait this long for it at most
MAX_TASKS = 4  # tasks served at once: the server keeps at most a few messages in flight per node
RESENDS = 5  # tries of a request whose kept-alive connection the SuperNode closed before reading it
RESEND_S = 0.05
RESENT = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)
ABANDONED = "the agent restarted while serving this message"
CLAIM_WAIT_S = 1.0  # a claim over the channel waits this long for a task, then the loop looks at its stop
GONE = (httpx.TransportError, ConnectionError)  # the SuperNode is not (yet, or no longer) up: HTTP, or the channel
REFUSED = (httpx.HTTPStatusError, RuntimeRefused)  # the SuperNode refused a call (HTTP, or the channel)


class MissingTaskInput(PeerError, RuntimeError):
    """The SuperNode gave a task without its message; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class TaskTiming:
    """Monotonic times of one task in this process (comparable with the server's on one host)."""

    message_id: str
    claimed: float
    pulled: float
    answered: float
    pushed: float

    def log_line(self) -> str:
        return LOG_PREFIX + json.dumps(self.__dict__)

    @classmethod
    def from_log(cls, text: str) -> list[TaskTiming]:
        """Every task timing in an agent's log."""
        found = re.findall(re.escape(LOG_PREFIX) + r"(\{.*\})", text)
        return [cls(**json.loads(payload)) for payload in found]


@dataclass(frozen=True)
class HeldTask:
    """A claimed task whose message this agent pulled: its token, the message without its content (enough to
    address a reply to it), and whether its reply was pushed (then only the task's end is left to tell)."""

    task_id: int
    token: str
    message: Message
    answered: bool = False

    SUFFIX = ".task"

    @classmethod
    def path(cls, folder: Path, task_id: int) -> Path:
        return folder / f"{task_id}{cls.SUFFIX}"

    def save(self, folder: Path) -> None:
        """Written whole (rename) and readable by this user only: the token answers the task."""
        proto = message_to_proto(remove_content_from_message(self.message)).SerializeToString()
        record = {"task_id": self.task_id, "token": self.token, "message": base64.b64encode(proto).decode(),
                  "answered": self.answered}  # fmt: skip
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.path(folder, self.task_id)
        partial = path.with_name(path.name + ".partial")
        partial.unlink(missing_ok=True)
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            json.dump(record, out)
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> HeldTask | None:
        """The task a previous agent held, or None: none (a record is written whole or not at all), or one that
        cannot be read (logged)."""
        try:
            record = json.loads(path.read_text())
            proto = MessageProto.FromString(base64.b64decode(record["message"]))
            return cls(record["task_id"], record["token"], message_from_proto(proto), record.get("answered") is True)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, DecodeError) as exc:
            log.warning("%s does not hold a task (%s: %s); left unanswered", path, type(exc).__name__, exc)
            return None


class TaskServer:
    """Claims the tasks of the SuperNode whose Runtime API is at ``address`` (HOST:PORT) and runs ``app`` on
    each, up to ``MAX_TASKS`` at once (a thread each), until ``stop`` is set. ``secret``: the SuperNode's SuperExec
    auth secret, if any; ``held_dir``: where the tasks being served are kept (``HeldTask``), None to keep none."""

    def __init__(
        self, address: str, app: ClientApp | None, secret: bytes | None = None, held_dir: Path | None = None
    ) -> None:
        """``app`` may be set later, before ``serve`` (``fl_client.node`` answers held tasks before it imports the
        agent). Refused (``EdgeflError``, one line) unless the installed flwr's ``flwr-clientapp`` is the code
        this serves tasks as (``contract.flower.RUNTIME_SOURCE``): there is no stock client to fall back to."""
        refuse_unless_runtime_api()
        self.address = address
        self.port = int(address.rsplit(":", 1)[1])
        self.app = app
        self.held_dir = held_dir
        self.most_held: Callable[[], int] = lambda: 1  # the most messages the server keeps here (EdgeAgent.most_held)
        interceptors = [OwnSuperNodeOnly(), RuntimeVersionHttpInterceptor(component_name=COMPONENT)]
        if secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE}))
        self._http_claims = RuntimeHttpClient.from_server_address(address, True, None, interceptors)
        self._channel: ChannelClient | None = None  # claims over the channel, once it answered
        self._hints: ChannelClient | None = None
        self._serving = threading.BoundedSemaphore(MAX_TASKS)
        self._held = 0  # tasks claimed and not yet answered
        self._told: int | None = None  # what the SuperNode was last told the agent wants
        self._holding = threading.Lock()

    def serve(self, stop: threading.Event) -> None:
        """Serve until ``stop``: first the tasks a previous agent held, then every task claimed; a SuperNode that
        is not (yet) up, or a port held by another user's process, is retried every ``RECONNECT_S``."""
        delay, state, abandoned = POLL_S[0], "", self.held_dir is not None
        try:
            while not stop.is_set():
                try:
                    if abandoned:
                        self.answer_abandoned()
                        abandoned = False
                    claimed = self.claim_one()
                except NotOurSuperNode as exc:
                    if state != "refused":
                        log.error("%s; waiting for this device's SuperNode", exc)
                    state = "refused"
                    self._drop_channel()
                    stop.wait(RECONNECT_S)
                    continue
                except GONE as exc:
                    if state != "down":
                        log.warning("no SuperNode at %s (%s); retrying every %.1f s", self.address, exc, RECONNECT_S)
                    state = "down"
                    self._drop_channel()
                    stop.wait(RECONNECT_S)
                    continue
                except REFUSED as exc:
                    log.warning("the SuperNode refused a claim (%s); going on", exc)
                    claimed = False
                if state != "up":
                    way = "over the device's channel" if self._channel else "over its HTTP Runtime API"
                    log.info("serving the tasks of the SuperNode at %s %s", self.address, way)
                    state = "up"
                delay = POLL_S[0] if claimed else min(delay * 1.5, POLL_S[1])
                if not claimed and self._channel is None:  # a channel's claim waited for a task itself
                    stop.wait(delay)
        finally:
            self._drop_channel()

    def claim_one(self) -> bool:
        """Claim one pending task and serve it in a thread of its own; False when there was none to claim, or
        ``MAX_TASKS`` are being served. Over the channel it waits for a task, or a place, up to ``CLAIM_WAIT_S``."""
        channel = self._claims()
        if not (self._serving.acquire(timeout=CLAIM_WAIT_S) if channel else self._serving.acquire(blocking=False)):
            return False
        try:
            request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
            claim = channel.WaitForTask(request, CLAIM_WAIT_S) if channel else self._http_claims.AcquireTask(request)
        except BaseException:
            self._serving.release()
            raise
        if not (claim.HasField("task") and claim.token):
            self._serving.release()
            return False
        claimed = time.monotonic()
        self._hold(+1)
        log.info("claimed task %d", claim.task.task_id)
        args = (claim.task.task_id, claim.token, claimed)
        threading.Thread(target=self.serve_claimed, args=args, daemon=True, name=f"task-{claim.task.task_id}").start()
        return True

    def _claims(self) -> ChannelClient | None:
        """The channel to claim over, connected (and the SuperNode told what the agent wants) once it answers; None
        when the SuperNode serves none: claims go over HTTP."""
        if self._channel is None:
            try:
                channel = ChannelClient(self.port)
            except (ConnectionRefusedError, FileNotFoundError):
                return None
            try:
                hints = ChannelClient(self.port)
            except BaseException:
                channel.close()
                raise
            self._channel, self._hints, self._told = channel, hints, None
            self.tell_wanted()
        return self._channel

    def _drop_channel(self) -> None:
        for client in (self._channel, self._hints):
            if client is not None:
                client.close()
        self._channel = self._hints = None

    def _hold(self, change: int) -> None:
        with self._holding:
            self._held += change
        self.tell_wanted()

    def tell_wanted(self) -> None:
        """Tell the SuperNode, over the channel, how many more messages the agent takes now: the most the server keeps
        at this device less those it holds unanswered (once per change)."""
        with self._holding:
            wanted, hints = max(self.most_held() - self._held, 0), self._hints
            if hints is None or wanted == self._told:
                return
            self._told = wanted
            try:
                hints.Wanted(wanted)
            except GONE:  # the SuperNode is gone: the serving loop finds out and connects again
                self._told = None

    def serve_claimed(self, task_id: int, token: str, claimed: float) -> None:
        """Serve the claimed task ``task_id`` to its end: its message in, the app, the reply out."""
        try:
            client = self._task_client(token)
        except GONE as exc:
            log.warning("task %d: the SuperNode went away (%s)", task_id, exc)
            self._hold(-1)
            self._serving.release()
            return
        heartbeat = HeartbeatSender(lambda: _heartbeat(client, task_id))
        heartbeat.start()
        try:
            self._serve(client, task_id, token, claimed)
        except GONE as exc:
            log.warning("task %d: the SuperNode went away (%s)", task_id, exc)
        except REFUSED as exc:  # e.g. a task whose SuperNode restarted meanwhile: it is gone
            log.warning("task %d: the SuperNode refused a request (%s)", task_id, exc)
        finally:
            heartbeat.stop()
            client.close()
            if self.held_dir:  # kept only by an agent that dies serving the task
                HeldTask.path(self.held_dir, task_id).unlink(missing_ok=True)
            self._hold(-1)
            self._serving.release()

    def answer_abandoned_if_up(self) -> None:
        """``answer_abandoned`` now if this device's SuperNode answers; otherwise ``serve`` does once it is up."""
        try:
            self.answer_abandoned()
        except GONE as exc:  # NotOurSuperNode too
            log.info("the held tasks are answered once the SuperNode is up (%s)", exc)

    def answer_abandoned(self) -> None:
        """Answer, with an error, the tasks a previous agent held when it died (``HeldTask``), and finish those
        it had answered; the SuperNode refuses for a task it already failed itself (60 s without heartbeats)."""
        if self.held_dir is None:
            return
        for record in sorted(self.held_dir.glob("*" + HeldTask.SUFFIX)):
            if held := HeldTask.load(record):
                client = self._task_client(held.token)
                try:
                    if held.answered:
                        _push_output(client, None, SubStatus.COMPLETED, "")
                        log.info("finished task %d, which the previous agent had answered", held.task_id)
                    else:
                        error = Error(ErrorCode.CLIENT_APP_CRASHED, ABANDONED)
                        _push_reply(client, Message(error, reply_to=held.message))
                        _push_output(client, None, SubStatus.FAILED, ABANDONED)
                        log.warning("answered task %d, which the previous agent held: %s", held.task_id, ABANDONED)
                except REFUSED as exc:
                    log.warning("the SuperNode no longer holds task %d of the previous agent (%s)", held.task_id, exc)
                finally:
                    client.close()
            record.unlink(missing_ok=True)

    def _task_client(self, token: str) -> RuntimeHttpClient | ChannelClient:
        """A client for the task that ``token`` claims: over the channel where the SuperNode serves one, otherwise
        over its HTTP Runtime API. A held task's pooled HTTP connection may sit idle
        past the SuperNode's keep-alive (5 s) and be closed just as the reply goes out on it ("disconnected without
        sending a response", or reset): such a request is sent again on a new connection, as Flower's SuperNode
        resends its own (``flwr.supercore.retry``); a reply half-pushed would otherwise hold the SuperNode, which
        waits for its objects, forever."""
        with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
            return ChannelClient(self.port, token)
        return RuntimeHttpClient.from_server_address(
            self.address, True, None,
            [OwnSuperNodeOnly(), RuntimeVersionHttpInterceptor(component_name=COMPONENT),
             RuntimeTokenHttpInterceptor(token)],
            retry_invoker=RetryInvoker(lambda: constant(RESEND_S), RESENT, RESENDS, None, jitter=None),
        )  # fmt: skip

    def _serve(self, client: RuntimeHttpClient | ChannelClient, task_id: int, token: str, claimed: float) -> None:
        message = context = None
        status, details = SubStatus.FAILED, "the ClientApp failed"
        try:
            message, context = _pull_input(client)
            if self.held_dir:
                HeldTask(task_id, token, message).save(self.held_dir)
            pulled = time.monotonic()
            reply = self.app(message, context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # the server is told, as flwr-clientapp tells it
            log.exception("task failed")
            details = f"{type(exc).__name__}: {exc}"
            if message is None:
                _push_output(client, context, status, details)
                return
            pulled = time.monotonic()
            reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, details), reply_to=message)
        answered = time.monotonic()
        try:
            _push_reply(client, reply)
            if self.held_dir:  # answered: an agent restarted from here on only finishes the task
                HeldTask(task_id, token, message, answered=True).save(self.held_dir)
        finally:
            _push_output(client, context, status, details)
        log.info(TaskTiming(message.metadata.message_id, claimed, pulled, answered, time.monotonic()).log_line())


def _heartbeat(client: RuntimeHttpClient | ChannelClient, task_id: int) -> bool:
    """One task heartbeat; a refused one (the task expired) is logged, not turned into SIGINT as Flower's is."""
    try:
        if not client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success:
            log.warning("the SuperNode no longer holds task %d", task_id)
    except GONE:
        return False
    except REFUSED as exc:
        log.warning("the SuperNode refused the heartbeat of task %d (%s)", task_id, exc)
    return True


def _pull_input(client: RuntimeHttpClient | ChannelClient) -> tuple[Message, Context]:
    """The task's message and context, as ``flwr-clientapp`` pulls them but with edgefl's retry backoff: the
    objects may still be on their way from the SuperLink."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context = context_from_proto(res.context)
    deadline = time.monotonic() + INPUT_WAIT_S
    while not (pulled := client.PullMessages(PullAppMessagesRequest())).messages_list:
        if time.monotonic() > deadline:
            raise MissingTaskInput(f"the SuperNode stored no message for task {res.task_id}")
        time.sleep(RETRY_BACKOFF_S[0])
    node, tree = Node(node_id=context.node_id), pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        max_concurrent_pulls=CONCURRENCY,
        initial_backoff=RETRY_BACKOFF_S[0],
        backoff_cap=RETRY_BACKOFF_S[1],
        max_tries_per_object=None,  # the objects may take long over a slow link; Flower's 2 h max_time holds
    )
    set_message_id(message, tree.object_id)
    return message, context


def _push_reply(client: RuntimeHttpClient | ChannelClient, reply: Message) -> None:
    """The reply and its objects to the SuperNode; each object is serialized for its id once and once to send."""
    node, run_id = Node(node_id=reply.metadata.src_node_id), reply.metadata.run_id
    with no_object_id_recompute():
        objects = get_all_nested_objects(reply)
        set_message_id(reply, reply.object_id)
        pushed = client.PushMessages(
            PushAppMessagesRequest(
                messages_list=[message_to_proto(remove_content_from_message(reply))],
                message_object_trees=[get_object_tree(reply)],
            )
        )
        push_objects(
            objects,
            make_push_object_fn_protobuf(client.PushObject, node, run_id, pushed.session_id),
            object_ids_to_push=set(pushed.objects_to_push),
            max_concurrent_pushes=CONCURRENCY,
        )


def _push_output(client: RuntimeHttpClient | ChannelClient, context: Context | None, status: str, details: str) -> None:
    client.PushTaskOutput(
        PushTaskOutputRequest(
            context=context_to_proto(context) if context else None, sub_status=status, details=details
        )
    )
