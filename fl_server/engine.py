"""The server's message loop: ``strategies.rounds.RoundEngine`` driven through Flower's non-blocking
``push_messages``/``pull_messages`` with a short poll — not ``send_and_receive``, which sleeps 3 s between
pulls and allows one message per node at a time. Replies are pulled in background threads (``ReplyPuller``): a
reply whose upload stalled never holds the loop past a round's deadline.

Closed rounds are evaluated on the held-out test split by ``Evaluator``'s threads, which append each round's row
and then checkpoint it, so the loop never waits on evaluation before sending the next round: at the lowest CPU
priority while rounds run, on every core once the last has closed; an evaluation that fails stops the run with its
error.

Clients come and go: the node set is re-read every ``NODE_REFRESH_S``. A new node is first asked which
partition it trains (``fl_server.membership``: admitted, a spare, or refused; asked again when Flower's error
rather than its agent's answers, ``refused_by_client``); an admitted node that vanished is retired (its messages
in flight are dropped, never counted) and a spare of its partition takes over, training it from the newest global
model. A restarted SuperNode gets a new node id: to the round engine it is a fresh client, sent the newest global
model. The first round starts once each of the run's partitions has a node. A node trains the partition it was
admitted for: a reply that names another, or declares another size, is refused.

Each update's ``num_examples`` is bounded by its partition's size (``strategies.rounds``): the run's split made
here from the evaluation's copy of the data set, as the devices make it (``split_sizes``), or where that cannot be
made, what the partition's first node declared (``fl_server.membership``).

One loop serves the deployment and a simulation: ``ServerLoop`` is given a ``ReplySource`` — where replies come
from and on which clock (``PulledReplies``: pulled from the SuperLink on this host's monotonic clock;
``fl_server.simulation.ModelledArrivals``: Ray's, in modelled arrival order on a virtual clock).

Resume: a run folder that holds a checkpoint continues from it (``edgefl run --resume``; ``RunState``): global
model, round, wall clock, the norm history of update validation, the server's global momentum (``gm=BETA``) and
the strategy's server state (SCAFFOLD's control variates); rows after the checkpoint's round are dropped. DGA's
server state is just the round and the global model; the clients restart from that model, so the rounds they had
trained or sent after the checkpoint are trained again — none is lost and none is applied twice."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Protocol

import numpy as np
from flwr.app import Error, Message
from flwr.serverapp import Grid

from contract.flower import ErrorCode
from contract.messages import TrainInstruction, TrainReply
from contract.run_folder import (
    GLOBAL_ONNX,
    MESSAGES,
    ROUNDS,
    SERVER_LOG,
    SUMMARY,
    Checkpoint,
    MessageTrip,
    RunFolder,
    read_rounds,
    summarize,
    summary_bytes,
    truncate_rounds,
)
from contract.settings import RunConfig
from contract.transport import FAST, STOCK, UNDELIVERED, UploadPace, pull_replies
from contract.uploads import posted, reply_bytes_at_most
from contract.wire import WireError, WireSize, error_reason, parse_reply, reply_key, train_message, wire_size
from fl_server.membership import Membership, PushRefused, RoundStuck
from fl_server.robust import make_aggregator, restore_rule, rule_state
from ml.data import DataError, Dataset, load_dataset, one_partition
from ml.model_card import model_card
from ml.onnx import INPUT_NAME, OUTPUT_NAME, inference_session, scores, with_parameters
from ml.schedule import scheduled_lr
from strategies.codecs import dense_payload_size
from strategies.downlink import BroadcastEncoder, model_digest
from strategies.fedavg import global_momentum
from strategies.registry import server_half
from strategies.rounds import (
    MAX_FAILED_REPLIES,
    ClosedRound,
    Rejection,
    Request,
    RoundEngine,
    Update,
)
from strategies.strategy import ServerHalf, ServerSetup
from strategies.validation import InfluenceBound

log = logging.getLogger("edgefl.server")

POLL_S = 0.02
PULL_INTERVAL_S = (0.02, 0.1)  # between pull calls: 20 ms after one that brought a reply, ×1.5 per empty one, up to
# 100 ms. Each call is a request the SuperLink serves (a few ms of its CPU): every 20 ms costs it a tenth of a core.
PULL_CALLS = 4  # pull calls at once at most (ReplyPuller)
PULL_STALLED_S = 2.0  # a pull call this old is waiting on an upload: another may start beside it
NODE_WAIT_S = 180.0
NODE_REFRESH_S = 1.0
EVALUATION_NICE = 19
EVALUATION_BATCH = 1000  # test examples per forward pass (the background worker may stop between two)
BACKGROUND, CLOSING = "background", "closing"  # the Evaluator's workers: while rounds run, and once they have ended


def parsed_reply(reply: Message) -> TrainReply | str | None:
    """A reply as edgefl's record, the reason it is malformed, or None for an error reply (``reply.error``)."""
    if reply.has_error():
        return None
    try:
        return parse_reply(reply.content)
    except WireError as exc:
        return str(exc)


def refused_by_client(error: Error) -> bool:
    """Whether an error reply is the client's own answer (its ClientApp raised: the agent refused the run, e.g. its
    partition does not fit, its data is missing, training diverged), not Flower's (the node went offline, the
    message or its reply expired, the task stopped sending heartbeats, the app could not be loaded)."""
    return error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION


def counts_against(error: Error) -> bool:
    """Whether an error reply counts as the node's failure: its own refusal (``refused_by_client``), or a reply it
    listed and never delivered (its objects not uploaded within ``contract.transport.PULL_MAX_S``: an upload the
    gateway refused as larger than the run allows, or one abandoned); not a message the network or Flower lost."""
    undelivered = error.code == ErrorCode.MESSAGE_UNAVAILABLE and str(error.reason).startswith(UNDELIVERED)
    return refused_by_client(error) or undelivered


def split_sizes(dataset: Dataset, config: RunConfig) -> dict[int, int] | None:
    """Each partition's training examples in the run's split, made from ``dataset`` as a device makes its own
    (``ml.data.one_partition``, cached on disk); None, said in one line, when the split cannot be made here."""
    try:
        return {
            p: len(one_partition(dataset, config.partition_spec, config.clients, config.seed, p))
            for p in range(config.clients)
        }
    except DataError as exc:
        log.warning("the run's split cannot be made here (%s): each partition's first node declares its size", exc)
        return None


def strategy_half(config: RunConfig, size: int) -> ServerHalf:
    """The server half of the run's strategy, for a model of ``size`` parameters."""
    job = config.client_job()
    setup = ServerSetup(
        size, config.clients, config.local_steps, job.local_momentum,
        lambda round_: scheduled_lr(config.lr, config.lr_schedule, round_, config.rounds),
    )  # fmt: skip
    return server_half(config.strategy_spec, setup)


def wait_for_nodes(grid: Grid, count: int, timeout_s: float = NODE_WAIT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} of {count} SuperNodes connected within {timeout_s:.0f} s")
        time.sleep(0.1)
    return nodes[:count]


def evaluation_sample(x: np.ndarray, y: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random sample of ``count`` test examples (all of them for 0): the same for every run with the
    same seed, so runs compared side by side are evaluated on identical examples."""
    if count <= 0 or count >= len(y):
        return x, y
    idx = np.sort(np.random.default_rng(seed).choice(len(y), size=count, replace=False))
    return x[idx], y[idx]


def _yield_cpu() -> None:
    """Run the calling thread at the lowest CPU priority (Linux nice is per thread). Evaluation is off the
    rounds' critical path — a round's wall time is taken when it closes — so on a host shared with clients
    it should use only CPU they leave idle, not slow their training."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), EVALUATION_NICE)


@dataclasses.dataclass
class _Evaluation:
    """One closed round waiting for its row: ``result`` is its (loss, accuracy), (None, None) when the round is
    not evaluated; ``taken_by`` which worker evaluates it."""

    row: dict[str, Any]
    checkpoint: Checkpoint
    result: tuple[float | None, float | None] | None = None
    taken_by: str = ""  # "" (no worker yet), BACKGROUND, or CLOSING


class Evaluator:
    """Evaluates the global model of each closed round that ``RunConfig.evaluates`` on the test split, appends the
    round's rounds.jsonl row (``test_accuracy`` and ``test_loss`` null for a round not evaluated), then writes its
    checkpoint (so rows never lag behind the checkpoint): rows in round order, each once.

    While rounds run, one worker thread evaluates at the lowest CPU priority (``_yield_cpu``): it takes only what
    the clients leave idle, so it never slows the training being timed, and its rows may fall behind. Once the
    last round has closed (``close``), the rounds still waiting are evaluated by normal-priority threads beside it,
    one per core (or, with fewer rounds left than cores, one per round on a share of the cores each), so the last row
    follows the last round within about one evaluation.

    A round is evaluated through onnxruntime, without torch: the model's card (``ml.model_card``: start parameters,
    layout, evaluation graph) with the round's parameters baked in (``ml.onnx.with_parameters``), on a session of the
    worker's threads; loss and accuracy in numpy, ``EVALUATION_BATCH`` examples at a time."""

    def __init__(self, config: RunConfig, folder: RunFolder) -> None:
        self.dataset = load_dataset(config.dataset, config.data_dir or None)
        test = self.dataset.x_test, self.dataset.y_test
        self.x, self.y = evaluation_sample(*test, config.eval_examples, config.seed)
        self.card = model_card(self.dataset, config.seed, config.model)
        self.folder = folder
        self.config = config
        self._waiting: list[_Evaluation] = []  # in round order, up to the first row not yet written
        self._lock = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._background = self._start_worker(BACKGROUND, threads=1)

    def submit(self, row: dict[str, Any], checkpoint: Checkpoint) -> None:
        item = _Evaluation(row, checkpoint, None if self.config.evaluates(checkpoint.round) else (None, None))
        with self._lock:
            self._waiting.append(item)
            self._lock.notify_all()
        self._write_done()

    def check(self) -> None:
        """Raise the error of an evaluation that failed (evaluating, writing its row or its checkpoint): the run
        stops there, its checkpoint the last one written whole."""
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Evaluate what is left, on every core at normal priority, and write its rows; raises the first evaluation
        that failed. The background worker stops within a batch: a round it was evaluating is evaluated again."""
        with self._lock:
            self._closing = True
            left = sum(item.result is None for item in self._waiting)
            self._lock.notify_all()
        cores = os.cpu_count() or 1
        workers = min(left, cores)
        closing = [self._start_worker(CLOSING, threads=cores // workers) for _ in range(workers)]
        for worker in [*closing, self._background]:
            worker.join()
        self._write_done()
        self.check()

    def _start_worker(self, kind: str, threads: int) -> threading.Thread:
        """A worker of ``kind`` whose sessions run on ``threads`` threads (1: its own thread only)."""
        worker = threading.Thread(target=self._work, args=(kind, threads), name=f"evaluate-{kind}", daemon=True)
        worker.start()
        return worker

    def _next(self, kind: str) -> _Evaluation | None:
        """The next round a worker of ``kind`` evaluates, None when it is done: the background worker takes rounds no
        one took, until ``close``; a closing worker takes those, then those the background worker holds (it may be
        starved of CPU: whichever ends first writes the row)."""
        with self._lock:
            while self._error is None and not (kind == BACKGROUND and self._closing):
                left = [item for item in self._waiting if item.result is None]
                free = [item for item in left if not item.taken_by]
                if kind == CLOSING:
                    free += [item for item in left if item.taken_by == BACKGROUND]
                if free:
                    free[0].taken_by = kind
                    return free[0]
                if self._closing:
                    return None
                self._lock.wait()
            return None

    def _work(self, kind: str, threads: int) -> None:
        if kind == BACKGROUND:
            _yield_cpu()
        while (item := self._next(kind)) is not None:
            try:
                result = self._evaluate(item.checkpoint.params, kind, threads)
            except BaseException as exc:  # raised in the loop's thread by check()
                with self._lock:
                    self._error = self._error or exc
                    self._lock.notify_all()
                return
            if result is None:  # the background worker, stopped by close(): a closing worker takes its round
                return
            with self._lock:
                item.result = item.result or result
            self._write_done()

    def _evaluate(self, params: np.ndarray, kind: str, threads: int) -> tuple[float, float] | None:
        """Mean loss and accuracy of ``params`` on the test examples, a batch of ``EVALUATION_BATCH`` at a time, on a
        session of ``threads`` threads; the background worker gives up (None) between batches once ``close`` has
        begun, so it is joined within one."""
        session = inference_session(with_parameters(self.card.graph, params, self.card.layout), threads)
        loss_sum, correct = 0.0, 0
        for start in range(0, len(self.y), EVALUATION_BATCH):
            if kind == BACKGROUND and self._closing:
                return None
            x, y = self.x[start : start + EVALUATION_BATCH], self.y[start : start + EVALUATION_BATCH]
            loss, right = scores(session.run([OUTPUT_NAME], {INPUT_NAME: x})[0], y)
            loss_sum, correct = loss_sum + loss, correct + right
        return loss_sum / len(self.y), correct / len(self.y)

    def _write_done(self) -> None:
        """Write the rows of the evaluated rounds at the head of the queue, then the newest one's checkpoint."""
        with self._lock:
            done = []
            while self._waiting and self._waiting[0].result is not None:
                done.append(self._waiting.pop(0))
            try:
                for item in done:
                    loss, accuracy = item.result or (None, None)
                    if accuracy is not None:
                        log.info("round %d  accuracy %.4f  loss %.4f  wall %.1f s", item.checkpoint.round,
                                 accuracy, loss, item.row["wall_s"])  # fmt: skip
                    examples = len(self.y) if accuracy is not None else 0
                    row = {**item.row, "test_loss": loss, "test_accuracy": accuracy, "eval_examples": examples}
                    self.folder.append(ROUNDS, row)
                if done:
                    self.folder.save_checkpoint(done[-1].checkpoint)
            except BaseException as exc:  # raised in the loop's thread by check()
                self._error = self._error or exc
            self._lock.notify_all()

    def export(self, params: np.ndarray) -> None:
        """The final global model as ONNX (the evaluation graph, its weights baked in), for devices that evaluate
        with onnxruntime (edgefl edge bench)."""
        self.folder.write(GLOBAL_ONNX, with_parameters(self.card.graph, params, self.card.layout))


@dataclasses.dataclass(frozen=True)
class Pulled:
    """A reply as a pull call took it: parsed (``parsed_reply``), measured, and when (``time.monotonic``)."""

    reply: Message
    parsed: TrainReply | str | None
    size: WireSize
    at: float


class ReplyPuller:
    """Pulls replies in daemon threads, so that the server loop never waits on an upload.

    Flower's SuperLink lists a reply once its message is pushed, before its objects have all arrived, and forgets
    the message it answers; the call that took the reply then waits for its objects — up to ``PULL_MAX_S`` when
    the device froze, lost its link mid-upload or had its upload refused, ~10 s for a node whose uploads came before
    (``contract.transport.UploadPace``, ``pace``). Meanwhile the loop goes on closing rounds at their deadlines,
    and once every running call is ``PULL_STALLED_S`` old another starts beside them and takes the other replies;
    another node's reply listed with the stalled one comes as soon as its own objects are in
    (``contract.transport.pull_replies`` pulls different nodes' replies side by side). To a call beside an older
    one the SuperLink answers the message the older call holds with "message unavailable": such answers are
    dropped, the older call brings the reply (a message that is gone indeed is answered so again once no older call
    runs). Listing is not atomic: two calls listing at one moment may both take a reply, and the loop settles the
    first copy only. Daemon threads: a call still waiting does not hold the server's exit."""

    def __init__(self, grid: Grid, calls: int = PULL_CALLS) -> None:
        self.grid = grid
        self.calls = calls
        self.pace = UploadPace()  # how long each node's next reply may take to come whole
        self._started: dict[int, float] = {}  # running calls: thread id → start
        self._lock = threading.Lock()
        self._pulled: queue.SimpleQueue[Pulled | BaseException] = queue.SimpleQueue()
        self._taken: list[Pulled | BaseException] = []  # what wait() took off the queue, for take()
        self._interval, self._last_start = PULL_INTERVAL_S[0], 0.0

    def poll(self, message_ids: list[str]) -> None:
        """Start a call that pulls whichever of ``message_ids`` have replies, unless calls are running that are
        not stalled (or ``calls`` are running), or the last one started less than the poll interval ago (20 ms
        after a reply, backing off to 100 ms while none comes)."""
        now = time.monotonic()
        with self._lock:
            running = self._started.values()
            if len(running) >= self.calls or any(now - start < PULL_STALLED_S for start in running):
                return
            if now - self._last_start < self._interval:
                return
            thread = threading.Thread(target=self._pull, args=(message_ids, bool(running)), name="pull", daemon=True)
            thread.start()
            self._started[thread.ident] = self._last_start = now

    def wait(self, timeout_s: float) -> None:
        """Return once a reply is pulled (or a call failed), or after ``timeout_s``: the loop's idle wait."""
        with contextlib.suppress(queue.Empty):
            self._taken.append(self._pulled.get(timeout=timeout_s))

    def take(self) -> list[Pulled]:
        """The replies pulled since the last call; raises the error of a call that failed."""
        items, self._taken = self._taken, []
        while True:
            try:
                items.append(self._pulled.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items  # type: ignore[return-value]

    def _pull(self, message_ids: list[str], beside_older: bool) -> None:
        brought = False
        try:
            for reply in pull_replies(self.grid, message_ids, self.pace):
                if beside_older and reply.has_error() and reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE:
                    continue  # an older call may hold it
                self._pulled.put(Pulled(reply, parsed_reply(reply), wire_size(reply), time.monotonic()))
                brought = True
        except BaseException as exc:  # handed to the loop's thread
            self._pulled.put(exc)
        finally:
            with self._lock:
                del self._started[threading.get_ident()]
                grown = min(self._interval * 1.5, PULL_INTERVAL_S[1])
                self._interval = PULL_INTERVAL_S[0] if brought else grown


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A message the server pushed and awaits the reply to."""

    node: int
    sent_at: float  # ServerLoop.now()
    size: WireSize
    identify: bool = False  # it asked the node which partition it trains (fl_server.membership)
    reply_key: str = ""  # what its reply must echo (contract.messages.TrainInstruction)


@dataclasses.dataclass
class Traffic:
    """Serialized bytes since the previous closed round, and refusals to report with it."""

    up: int = 0
    down: int = 0
    rejected: list[Rejection] = dataclasses.field(default_factory=list)

    def take(self) -> dict[str, Any]:
        out = {
            "bytes_up": self.up,
            "bytes_down": self.down,
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
        }
        self.up, self.down, self.rejected = 0, 0, []
        return out


class RunState:
    """What a run keeps across processes: resumed from the run's checkpoint when it has one (``--resume``), and
    checkpointed after each closed round — the global model and its round, the wall clock, the norm history of
    update validation, global momentum (``gm=BETA``), the strategy's server state (``ServerHalf.state``) and the
    aggregation rule's (``fl_server.robust.rule_state``)."""

    def __init__(self, config: RunConfig, folder: RunFolder, start_params: np.ndarray) -> None:
        """``start_params``: the seeded start model, for a run without a checkpoint. Rows after the checkpoint's
        round are dropped."""
        self.start = folder.read_checkpoint() or Checkpoint(0, start_params)
        truncate_rounds(folder.path, self.start.round)
        size = self.start.params.size
        self.validator = InfluenceBound(history=self.start.recent_norms)
        self.momentum = global_momentum(config.codec_spec, size, self.start.momentum)
        self.strategy = strategy_half(config, size)
        self.strategy.restore(self.start.strategy)
        self.aggregator = make_aggregator(config.aggregate_spec)
        restore_rule(self.aggregator, self.start.aggregate)

    def checkpoint(self, closed: ClosedRound, wall_s: float) -> Checkpoint:
        """The state after ``closed``, at the run's wall clock ``wall_s``."""
        norms = self.validator.history_rows()
        return Checkpoint(closed.round, closed.global_params, wall_s, norms, closed.momentum, closed.strategy_state,
                          rule_state(self.aggregator))  # fmt: skip


class ReplySource(Protocol):
    """Where the loop's replies come from, and on which clock: the deployment's, pulled from the SuperLink on this
    host's monotonic clock (``PulledReplies``), or a simulation's, taken from Ray in modelled arrival order on a
    virtual clock (``fl_server.simulation.ModelledArrivals``). The loop calls these and nothing else of it; the
    source drives the loop through its public methods (``push_requests``, ``send``, ``settle``,
    ``close_rounds``)."""

    transport: str  # how this server moves messages (contract.transport)

    def attach(self, loop: ServerLoop) -> None:
        """The loop it serves, once, when the loop is made."""
        ...

    def now(self) -> float:
        """The run's clock."""
        ...

    def start(self) -> None:
        """Every partition has its node and the clock runs."""
        ...

    def push(self) -> bool:
        """Send what is due now; whether anything was."""
        ...

    def pull(self) -> bool:
        """Settle the replies that have arrived by now; whether any did."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Nothing to do: wait up to ``timeout_s`` for a reply."""
        ...

    def round_closed(self, closed: ClosedRound, now: float) -> None:
        """A round closed at ``now`` (its row and checkpoint are the loop's)."""
        ...

    def row(self) -> dict[str, Any]:
        """Columns of its own for a closed round's row."""
        ...

    def summary(self) -> dict[str, Any]:
        """What summary.json says about how the run was carried."""
        ...


class PulledReplies:
    """The deployment's replies: pulled from the SuperLink in background threads (``ReplyPuller``), on this host's
    monotonic clock; every message is the round engine's next request (``ServerLoop.push_requests``)."""

    def __init__(self, grid: Grid, transport: str) -> None:
        self.transport = transport
        self.puller = ReplyPuller(grid)

    def attach(self, loop: ServerLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return time.monotonic()

    def start(self) -> None:
        pass

    def push(self) -> bool:
        return self.loop.push_requests()

    def pull(self) -> bool:
        """Settle the replies pulled meanwhile and pull again. A reply to a message no longer outstanding (its
        node was retired, or a second copy: ``ReplyPuller``) is dropped."""
        settled = False
        for p in self.puller.take():
            if p.reply.metadata.reply_to_message_id in self.loop.outstanding:
                self.loop.settle(p.reply, p.parsed, p.size, p.at)
                settled = True
        if self.loop.outstanding:
            self.puller.poll(list(self.loop.outstanding))
        return settled

    def wait(self, timeout_s: float) -> None:
        self.puller.wait(timeout_s)

    def round_closed(self, closed: ClosedRound, now: float) -> None:
        pass

    def row(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}


class ServerLoop:
    """One run's server: membership, the round engine, the messages in flight, traffic, evaluation, resume and
    the summary, driven by its ``ReplySource``."""

    def __init__(self, grid: Grid, config: RunConfig, folder: RunFolder, source: ReplySource) -> None:
        self.grid = grid
        self.source = source
        self.transport = {-1: source.transport}  # this server's, then each partition's as its replies report it
        self.config = config
        self.folder = folder
        job = config.client_job()
        self.job = job.to_json()
        self.evaluator = Evaluator(config, folder)
        sizes = split_sizes(self.evaluator.dataset, config)
        self.members = Membership(sizes or {}, split=sizes is not None)
        card = self.evaluator.card
        self.state = RunState(config, folder, card.params)
        start = self.state.start
        self.strategy = self.state.strategy
        self.engine = RoundEngine(
            start.params,
            card.layout,
            rounds=config.rounds,
            num_clients=config.clients,
            quorum=config.quorum,
            deadline_s=config.round_deadline_s,
            start_round=start.round,
            aggregator=self.state.aggregator,
            validator=self.state.validator,
            clients_build_start=start.round == 0,  # a client's Session builds the seeded start model itself
            momentum=self.state.momentum,
            sampler=job.sampler(),
            strategy=self.strategy,
            window=job.window,
            partition_sizes=self.members.sizes,
        )
        self.wall_offset_s = start.wall_s
        self.broadcaster = BroadcastEncoder(  # --compress-down: clients are sent x̂, see strategies.downlink
            config.downlink_spec, self.engine.global_params, self.engine.layout, config.seed, self.engine.aggregated
        )
        self.traffic = Traffic()
        self.outstanding: dict[str, InFlight] = {}
        self.health: dict[int, dict[str, Any]] = {}  # newest report per partition: peak RSS, temperature
        self.t0 = 0.0
        source.attach(self)

    def run(self) -> None:
        self._admit_first_nodes()
        log.info(
            "%d partitions admitted; %s for rounds %d..%d from the global model of round %d (sha256 %s)",
            len(self.members.admitted), self.config.strategy, self.engine.aggregated + 1, self.config.rounds,
            self.engine.aggregated, model_digest(self.engine.global_params),
        )  # fmt: skip
        self.t0 = self.now() - self.wall_offset_s
        self.engine.start_clock(self.now())
        self.source.start()
        refreshed = time.monotonic()
        try:
            while not self.engine.done:
                if time.monotonic() - refreshed >= NODE_REFRESH_S:
                    self._refresh_nodes()
                    refreshed = time.monotonic()
                busy = self.source.push()
                busy |= self.source.pull()
                self.close_rounds()
                self.evaluator.check()
                if not busy:
                    self.source.wait(POLL_S)
        finally:
            self.evaluator.close()
        self.evaluator.export(self.engine.global_params)
        summary = summarize(
            self.config.as_dict(), read_rounds(self.folder.path), read_rounds(self.folder.path, MESSAGES)
        )
        carried = {"transport": FAST if set(self.transport.values()) == {FAST} else STOCK, **self.source.summary()}
        self.folder.write(SUMMARY, summary_bytes({**summary, **carried}))

    def now(self) -> float:
        """The run's clock (its source's)."""
        return self.source.now()

    def _round_closed(self, closed: ClosedRound, now: float) -> None:
        """A round closed at ``now``: its row and checkpoint go to the evaluator."""
        if closed.step_refused:
            log.warning("round %d left the global model where it was: %s", closed.round, closed.step_refused)
        for partition in closed.clipped:
            log.warning("round %d: partition %d's update was clipped to the bound the others set", closed.round,
                        partition)  # fmt: skip
        self.evaluator.submit(self._row(closed, now - self.t0), self.state.checkpoint(closed, now - self.t0))
        self.source.round_closed(closed, now)

    def message(self, node: int, request: Request) -> Message:
        """The message of ``request``, its global model as the broadcast delivers it (``--compress-down``)."""
        broadcast = None
        if request.global_round is not None:
            broadcast = self.broadcaster.broadcast(request.global_round, request.global_params, request.held_round)
        instr = TrainInstruction(
            self.job, request.next_round, request.last_round, broadcast, resend=request.resend, state=request.state
        )
        return train_message(instr, node)

    def _admit_first_nodes(self) -> None:
        """Wait until the run's N partitions each have a node (the clock starts after)."""
        wait_for_nodes(self.grid, self.config.clients)
        deadline = time.monotonic() + NODE_WAIT_S
        while len(self.members.admitted) < self.config.clients:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only partitions {sorted(self.members.admitted.values())} of {self.config.clients} have a "
                    f"node after {NODE_WAIT_S:.0f} s; see {self.folder.path / SERVER_LOG}"
                )
            self._refresh_nodes()
            if not (self.source.push() | self.source.pull()):
                self.source.wait(POLL_S)

    def _refresh_nodes(self) -> None:
        """Retire the admitted nodes that left (their messages in flight are dropped, never counted); new ones are
        asked who they are, and a spare takes over the partition of a node that left."""
        for node in self.members.connected(set(self.grid.get_node_ids())):
            self.engine.retire(node)
            self.outstanding = {msg_id: m for msg_id, m in self.outstanding.items() if m.node != node}

    def push_requests(self) -> bool:
        """Ask the new nodes who they are and send every admitted node the round engine's next requests; whether
        anything was sent."""
        messages = self.identify_messages()
        for node, partition in sorted(self.members.admitted.items()):
            while (request := self.engine.next_request(node, partition)) is not None:
                messages.append((self.message(node, request), False))
        return bool(self.send(messages))

    def identify_messages(self) -> list[tuple[Message, bool]]:
        """A new node is first asked which partition it trains (``fl_server.membership``)."""
        return [(train_message(TrainInstruction.identify(self.job), node), True) for node in self.members.to_ask()]

    def send(self, messages: list[tuple[Message, bool]]) -> list[str]:
        """Push (message, asks who the node is) pairs; each is then outstanding until its reply is settled."""
        if not messages:
            return []
        sent_at = self.now()
        ids = list(self.grid.push_messages([msg for msg, _ in messages]))
        for (msg, identify), msg_id in zip(messages, ids, strict=True):
            if msg_id is None:
                raise PushRefused(f"the SuperLink refused a message to node {msg.metadata.dst_node_id}")
            size = wire_size(msg)
            self.outstanding[msg_id] = InFlight(msg.metadata.dst_node_id, sent_at, size, identify, reply_key(msg))
            self.traffic.down += size.bytes
        return ids

    def settle(self, reply: Message, parsed: TrainReply | str | None, size: WireSize, pulled_at: float) -> None:
        """Take a pulled reply (``parsed``: see ``parsed_reply``; ``size``: its ``wire_size``) and log its trip."""
        message_id = reply.metadata.reply_to_message_id
        sent = self.outstanding.pop(message_id)
        self.traffic.up += size.bytes
        forged = isinstance(parsed, TrainReply) and parsed.reply_key != sent.reply_key
        if forged:
            parsed = f"its reply key is not the message's: not answered by node {sent.node}, which the message went to"
            log.warning("refused a reply to node %d's message %s: %s", sent.node, message_id, parsed)
        updates: tuple[Update, ...] = ()
        if forged and sent.identify:  # the node itself has not answered who it is: ask it again
            self.members.retry(sent.node, str(parsed))
        elif forged:  # the node's own reply will be refused as a duplicate: it is asked to send its updates again
            self.engine.lost(sent.node)
            self.traffic.rejected.append(Rejection(self._partition(sent.node), -1, str(parsed)))
        else:
            updates = (self._identified if sent.identify else self._receive)(sent.node, reply, parsed)
        held_s = parsed.held_s if isinstance(parsed, TrainReply) else 0.0
        trip = MessageTrip(
            message_id=message_id,
            node=sent.node,
            partition=self._partition(sent.node),
            sent_at=sent.sent_at,
            round_trip_s=pulled_at - sent.sent_at,
            train_s=sum(u.train_s for u in updates),
            held_s=held_s,
            path_s=pulled_at - sent.sent_at - held_s,
            rounds=[u.round for u in updates],
            bytes_down=sent.size.bytes,
            bytes_up=size.bytes,
            objects_down=sent.size.objects,
            objects_up=size.objects,
        )
        self.folder.append(MESSAGES, dataclasses.asdict(trip))

    def _partition(self, node: int) -> int:
        """The partition ``node`` trains or waits for; −1 when not known (yet)."""
        partition = self.members.partition(node)
        return -1 if partition is None else partition

    def _identified(self, node: int, reply: Message, parsed: TrainReply | str | None) -> tuple[Update, ...]:
        """A node's answer to who it is: admitted, a spare, or refused (its agent's error says why); asked again
        when the error is Flower's (``refused_by_client``)."""
        if parsed is None and not refused_by_client(reply.error):
            self.members.retry(node, error_reason(reply))
        elif not isinstance(parsed, TrainReply):
            self.members.refuse(node, error_reason(reply) if parsed is None else parsed)
        elif not 0 <= parsed.partition_id < self.config.clients:
            self.members.refuse(
                node, f"it trains partition {parsed.partition_id}, not one of 0..{self.config.clients - 1}"
            )
        else:
            self.members.identified(node, parsed.partition_id, parsed.partition_size)
        return ()

    def _receive(self, node: int, reply: Message, parsed: TrainReply | str | None) -> tuple[Update, ...]:
        """Hand a reply's updates to the round engine; returns them (none for an error or a malformed reply)."""
        partition = self._partition(node)  # rejections name partitions
        size = self.members.sizes.get(partition)
        if isinstance(parsed, TrainReply) and (parsed.partition_id, parsed.partition_size) != (partition, size):
            parsed = (f"node {node} trains partition {partition} of {size} examples; its reply names partition "
                      f"{parsed.partition_id} of {parsed.partition_size}")  # fmt: skip
            log.warning("refused a reply: %s", parsed)
        if parsed is None:
            reason = error_reason(reply)
            self.engine.fail(node, raised=counts_against(reply.error))
            self.traffic.rejected.append(Rejection(partition, -1, f"client error: {reason}"))
            log.warning("node %d replied with an error: %s", node, reason)
            self._stop_if_stuck(node, reason)
            return ()
        if isinstance(parsed, str):
            log.warning("refused a reply from node %d: %s", node, parsed)
            self.engine.malformed(node)
            self.traffic.rejected.append(Rejection(partition, -1, parsed))
            return ()
        self.health[partition] = parsed.health
        self.transport[partition] = parsed.transport
        rejections = self.engine.receive(node, list(parsed.updates), partition)
        for rejection in rejections:
            log.warning("refused round %d from node %d: %s", rejection.round, node, rejection.reason)
            self.traffic.rejected.append(rejection)
        if rejections:
            self._stop_if_stuck(node, f"refused: {rejections[-1].reason}")
        return parsed.updates

    def _stop_if_stuck(self, node: int, reason: str) -> None:
        """Stop the run once its oldest open round can never close (e.g. training diverged: NaN, or updates refused
        as outliers): resending the global model would repeat the same failure forever."""
        if self.engine.stuck:
            raise RoundStuck(
                f"round {self.engine.aggregated + 1} cannot close: it needs {self.engine.min_clients} of "
                f"{self.engine.per_round} clients' updates and too few can still give one (a client whose last "
                f"{MAX_FAILED_REPLIES} replies failed or were refused counts as failed), the last from node "
                f"{node}: {reason}"
            )

    def close_rounds(self) -> bool:
        """Close what can be closed now; whether any round closed."""
        now = self.now()
        closed_rounds = self.engine.close_rounds(now)
        for closed in closed_rounds:
            self._round_closed(closed, now)
        return bool(closed_rounds)

    def _row(self, closed: ClosedRound, wall_s: float) -> dict[str, Any]:
        return {
            "round": closed.round,
            "wall_s": wall_s,
            "clients": sorted(closed.clients),
            "closed_by": closed.closed_by,
            "clipped": sorted(closed.clipped),
            "step_refused": closed.step_refused,
            "client_train_s": float(np.mean(closed.train_s or [math.nan])),
            "train_loss": float(np.mean([x for x in closed.losses if math.isfinite(x)] or [math.nan])),
            "client_health": {str(pid): report for pid, report in sorted(self.health.items())},
            **self.traffic.take(),
            **self.source.row(),
        }


def serve(grid: Grid, config: RunConfig, folder: RunFolder, transport: str) -> None:
    """Run ``config`` to its end; ``transport`` is how this process moves messages (``contract.transport``). Behind a
    gateway, object uploads are bounded by what a reply of this run may carry meanwhile (``contract.uploads``)."""
    loop = ServerLoop(grid, config, folder, PulledReplies(grid, transport))
    dense = dense_payload_size(loop.engine.global_params.size)
    with posted(reply_bytes_at_most(config.strategy_spec.delay, dense)):
        loop.run()
