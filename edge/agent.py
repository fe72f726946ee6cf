"""The edge agent: the one long-lived part of a device that owns the model, the optimizer, the data partition,
the codec memory and the strategy's client half (DGA's bookkeeping), and trains continuously in a background
thread. No Flower here: ``fl_client.node`` serves the device's SuperNode tasks in the agent's process and hands
each message to ``EdgeAgent.train``.

A message may bring the newest global model; the agent takes it at once and trains the rounds it unlocks: a
round t needs the global model of round t − D − 1 (DGA's staleness bound; D = 0 is FedAvg's lock-step). The agent
holds every message it is given until it has an update to answer it with, and answers as soon as one is ready —
with every update ready then, usually one. With DGA the server keeps more than one message at the device
(``strategies.rounds``), so each round's update leaves as soon as it is trained while the next rounds train:
hiding a message path of R seconds behind training rounds of T seconds needs D ≥ ⌈R/T⌉ (with one message in
flight, D + 1 ≥ 2⌈R/T⌉). A held message is answered with nothing only once this run will train nothing more here.
An answered update is kept until the global model of its round arrives: when the server says a reply was lost
(``TrainInstruction.resend``), the message that says so is answered with every update kept, and the messages held
before it, whose replies the SuperLink would refuse, with nothing.
With partial participation the agent trains only the rounds its partition is sampled in (``strategies.sampling``).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from contract.errors import PeerError
from contract.messages import TrainInstruction, TrainReply
from contract.settings import ClientJob
from edge.health import health_snapshot
from ml.data import HF_PREFIX, Dataset, load_partition
from ml.models import build_model, get_flat_params, param_layout, set_flat_params
from ml.schedule import scheduled_lr
from ml.trainer import LocalTrainer
from strategies.codecs import make_client_codec
from strategies.downlink import BroadcastDecoder
from strategies.registry import client_half
from strategies.rounds import Update

log = logging.getLogger("edgefl.agent")

ENDED_RUNS_KEPT = 64  # ids of runs whose session was replaced, so that a late message of one is refused


class AgentError(PeerError, RuntimeError):
    """Training failed on this device; ``str()`` is the reason the server is told."""


class Session:
    """One run's state on this device. Everything that must outlive a Flower message lives here."""

    def __init__(
        self, job: ClientJob, partition_id: int, num_partitions: int, data_dir: str = "", data: Dataset | None = None
    ) -> None:
        """``data``: the partition when the caller has it (a simulation's cache), else it is loaded here."""
        self.job = job
        self.partition_id = partition_id
        if data is None:
            data = load_partition(
                job.dataset, data_dir or None, job.partition_spec, num_partitions, job.seed, partition_id
            )
        self.num_examples = len(data.y_train)
        self.model = build_model(data, job.seed, job.model)
        self.layout = param_layout(self.model)
        seed = job.seed * 1000 + partition_id
        self.trainer = LocalTrainer(
            self.model, data.x_train, data.y_train, job.batch_size, job.lr, job.local_momentum, seed
        )
        self.codec = make_client_codec(job.codec_spec, self.layout, seed=seed, num_clients=num_partitions)
        self.strategy = client_half(job.strategy_spec)  # the run's strategy on this device (strategies.registry)
        self.broadcast = BroadcastDecoder(self.layout)
        self.broadcast.hold(0, get_flat_params(self.model))  # the seeded start model: see strategies.downlink
        self.sampler = job.sampler()
        self.last_round = job.rounds
        self.next_round = 0
        self.advance_to(1)
        self.outbox: list[Update] = []
        self.kept: dict[int, Update] = {}  # round → its update as answered, until the global model of that round
        self.training = False
        self.error: str | None = None  # why training failed: the session trains no more

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the partition's rows (``attach`` them again after unpickling): how a simulated client's
        session lives in Flower's node state between messages (``fl_client.simulation``)."""
        trainer = copy.copy(self.trainer)
        trainer.x, trainer.y = None, None
        return {**self.__dict__, "trainer": trainer}

    def attach(self, data: Dataset) -> None:
        self.trainer.attach(data.x_train, data.y_train)

    def take_instruction(self, instr: TrainInstruction) -> None:
        """Take the global model a message brings (x̂, as the possibly compressed broadcast delivers it) and the
        first round it asks for."""
        if instr.broadcast is not None:
            size = sum(math.prod(shape) for _, shape in self.layout)
            if instr.state is not None and instr.state.size != size:  # checked before the decoder moves on
                raise AgentError(f"the strategy's vector has {instr.state.size} values, the model {size}")
            reference = self.broadcast.receive(instr.broadcast)
            self.strategy.receive_global(instr.broadcast.round, reference, instr.state)
            self.kept = {r: u for r, u in self.kept.items() if r > self.strategy.global_round}
        self.advance_to(instr.next_round)

    def train_next(self) -> None:
        """Train the next round from the strategy's start model and put its update in the outbox."""
        round_ = self.next_round
        self.finish_round(*self.train_one_round(round_, self.strategy.start_params()))

    def advance_to(self, round_: int) -> None:
        """The next round to train is the first one from ``round_`` on that this partition is sampled in."""
        first = max(self.next_round, round_)
        sampled = self.sampler.next_round(self.partition_id, first, self.last_round)
        self.next_round = self.last_round + 1 if sampled is None else sampled

    def can_train(self) -> bool:
        return self.error is None and self.next_round <= self.last_round and self.strategy.can_start(self.next_round)

    def reply_due(self) -> bool:
        """A held message is answered once an update is ready, or once this run will train nothing more here (a
        session that waits at the staleness bound holds it: the global model that unlocks the next round comes
        in a message of its own)."""
        finished = self.error is not None or self.next_round > self.last_round
        return bool(self.outbox) or (finished and not self.training)

    def finish_round(self, ready: Update, sent: np.ndarray) -> None:
        """Keep a trained round's update: in the outbox, and as sent (``sent``, what the server will decode) for
        the strategy (DGA's correction)."""
        self.strategy.record_sent(ready.round, sent)
        self.outbox.append(ready)
        self.advance_to(ready.round + 1)
        self.training = False

    def take_outbox(self) -> list[Update]:
        ready, self.outbox = self.outbox, []
        return ready

    def keep(self, answered: list[Update]) -> None:
        """Keep updates as answered, in case their reply is lost (a simulated client's never is: it keeps none)."""
        self.kept.update((u.round, u) for u in answered)

    def kept_from(self, round_: int) -> list[Update]:
        """The kept updates of rounds ``round_`` on, oldest first: what a reply lost on its way may have carried."""
        return [self.kept[r] for r in sorted(self.kept) if r >= round_]

    def with_kept(self, ready: list[Update], round_: int) -> list[Update]:
        """``ready`` (taken from the outbox) and every kept update of rounds ``round_`` on, oldest first, once each."""
        chosen = {u.round: u for u in self.kept_from(round_)} | {u.round: u for u in ready}
        return [chosen[r] for r in sorted(chosen)]

    def train_one_round(self, round_: int, start: np.ndarray, lr: float | None = None) -> tuple[Update, np.ndarray]:
        """K local steps from ``start`` at ``lr`` (by default the job's schedule) on the strategy's objective: the
        encoded update Δ = w_end − w_start, and Δ as the server will decode it (what DGA's correction must subtract
        later)."""
        t0 = time.perf_counter()
        set_flat_params(self.model, start)
        if lr is None:
            lr = scheduled_lr(self.job.lr, self.job.lr_schedule, round_, self.last_round)
        self.trainer.set_lr(lr)
        loss = self.trainer.train_steps(self.job.local_steps, self.strategy.objective(start))
        encoded = self.codec.encode(get_flat_params(self.model) - start, round_)
        update = Update(round_, encoded.stype, encoded.payload, self.num_examples, time.perf_counter() - t0, loss)
        return update, encoded.decoded


def check_partition(job: ClientJob, partition_id: int, num_partitions: int) -> None:
    """Raise AgentError unless this device's partition is one of the run's split."""
    if num_partitions != job.clients or not 0 <= partition_id < job.clients:
        reason = (f"this device is partition {partition_id} of {num_partitions}; the run {job.run!r} trains "
                  f"partitions 0..{job.clients - 1} of {job.clients}")  # fmt: skip
        log.error("refused: %s", reason)
        raise AgentError(reason)


class EdgeAgent:
    """The device's session (one run's at a time) and the one thread that trains it (``trainer_tid``: an emulated
    device runs it on a core of its own, ``edge.devices.DeviceCaps``). ``data_dir`` is this device's data folder
    (it wins over the run's); ``transport`` is how its SuperNode moves messages, told to the server.

    ``own_dataset``: the data set this device's owner named (``edgefl client --dataset``), for a device that does not
    take the server's word on its own files and network: the run's data folder (a path on the server's machine) is
    never read, only ``data_dir``, and a data set from the hub (``hf:``) is loaded only when it is this one. Empty:
    the device and the server are one operator's (the local launcher), and the run's data folder is used when the
    device has none."""

    def __init__(self, data_dir: str = "", transport: str = "stock", own_dataset: str = "") -> None:
        self.data_dir = data_dir
        self.transport = transport
        self.own_dataset = own_dataset
        self._cond = threading.Condition()
        self._building = threading.Lock()  # one session built at a time
        self._session: Session | None = None
        self._run_id: int | None = None  # Flower's id of the session's run; None: built ahead of its run (--job)
        self._job_text = ""
        self._ended: deque[int] = deque(maxlen=ENDED_RUNS_KEPT)
        self._arrivals = 0  # messages taken so far; the number of each is its place in that order
        self._lost_before = 0  # messages taken before this one were answered by someone else: see ``train``
        self._stop = False
        self._trainer = threading.Thread(target=self._train_forever, daemon=True, name="trainer")
        self._trainer.start()
        self.trainer_tid: int = self._trainer.native_id or 0

    def most_held(self) -> int:
        """The most messages the server keeps at this device for the current session's run (``ClientJob.most_held``;
        1 before any)."""
        session = self._session
        return session.job.most_held if session else 1

    # ----- the trainer thread -------------------------------------------------------------------------
    def _train_forever(self) -> None:
        """Train the current session's next round whenever it may start one, until ``stop``."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or (self._session is not None and self._session.can_train()))
                if self._stop:
                    return
                session = self._session
                round_ = session.next_round
                start = session.strategy.start_params()
                session.training = True
            try:
                ready, sent = session.train_one_round(round_, start)
            except Exception as exc:
                log.exception("training failed")
                with self._cond:  # the session trains no more: every reply says why
                    session.training = False
                    session.error = f"training round {round_} failed: {exc}"
                    self._cond.notify_all()
                continue
            with self._cond:  # DGA's bookkeeping changes only under the lock: the task thread reads it too
                session.finish_round(ready, sent)
                self._cond.notify_all()

    # ----- messages -----------------------------------------------------------------------------------
    def session_for(self, job_text: str, partition_id: int, num_partitions: int, run_id: int | None) -> Session:
        """The session of the run ``run_id`` (Flower's run id: a new run, and a resumed one, gets a fresh session
        even when its job is the same), built (data loaded, model made: seconds, once per run) on its first message;
        the job is parsed only then. Messages served side by side wait for the one that builds it. ``run_id`` None:
        the coming run's session, built before its first message (``--job``); the first run of that job takes it.
        One session is kept: a new run's replaces the previous run's, whose held messages are answered with an
        error, and a late message of an ended run is refused rather than training it again."""
        with self._building:
            current = self._session
            if current and current.partition_id == partition_id:
                if run_id is not None and run_id == self._run_id:
                    return current
                if self._run_id is None and job_text == self._job_text:  # built ahead of its run: this run's
                    self._run_id = run_id
                    return current
            if run_id in self._ended:
                reason = f"run {run_id} has ended on this device, which trains run {self._run_id} now"
                log.warning("refused: %s", reason)
                raise AgentError(reason)
            job = ClientJob.from_json(job_text)
            check_partition(job, partition_id, num_partitions)
            self._check_data_source(job)
            with self._cond:  # dropped before the new one is built: a device holds one run's data and model
                if current:  # its held messages are answered at once
                    current.error = current.error or f"this device now trains run {run_id}, partition {partition_id}"
                if self._run_id not in (None, run_id):
                    self._ended.append(self._run_id)
                self._session, self._run_id, self._job_text = None, None, ""
                self._cond.notify_all()
            del current
            data_dir = self.data_dir or ("" if self.own_dataset else job.data_dir)
            session = Session(job, partition_id, num_partitions, data_dir)
            with self._cond:
                self._session, self._run_id, self._job_text = session, run_id, job_text
                self._cond.notify_all()
        examples = session.num_examples
        log.info("new session: run %s, %s partition %d (%d examples)", run_id, job.dataset, partition_id, examples)
        return session

    def _check_data_source(self, job: ClientJob) -> None:
        """Refuse (AgentError, one line) a run whose data set this device would fetch from the hub on the server's
        word alone (``own_dataset``)."""
        if self.own_dataset and job.dataset.startswith(HF_PREFIX) and job.dataset != self.own_dataset:
            reason = (
                f"the run asks for the hub data set {job.dataset[:100]!r}; this device loads a hub data set only "
                f"when its owner names it (edgefl client --dataset), and it was given {self.own_dataset!r}"
            )
            log.warning("refused: %s", reason)
            raise AgentError(reason)

    def train(self, instr: TrainInstruction, partition_id: int, num_partitions: int, run_id: int) -> TrainReply:
        """Take the global model a message of the run ``run_id`` brings (if any), hold the message until a reply is
        due, and give every update ready; raises AgentError when training failed or the run does not fit this
        device. Several messages may be held at once (``fl_client.tasks``): the first to wake takes what is ready.
        A message that asks to resend is answered with every kept update from its round on (once there is one);
        the messages held before it are answered with nothing: a reply of theirs was taken, and one more would be
        refused."""
        taken = time.monotonic()
        session = self.session_for(instr.job, partition_id, num_partitions, run_id)
        if not instr.asks_for_rounds:
            return TrainReply(session.partition_id, (), health_snapshot(), self.transport, 0.0, session.num_examples)
        with self._cond:
            session.take_instruction(instr)
            self._arrivals += 1
            arrival = self._arrivals
            if instr.resend:
                self._lost_before = arrival
            self._cond.notify_all()

            def answerable() -> bool:
                superseded = arrival < self._lost_before
                return superseded or (instr.resend and bool(session.kept_from(instr.next_round))) or session.reply_due()

            self._cond.wait_for(lambda: self._stop or session.error or answerable())
            if session.error or self._stop:
                raise AgentError(session.error or "the agent is stopping")
            if arrival < self._lost_before:
                log.info("answering a message held before the server asked again with nothing: its reply was taken")
                ready = []
            else:
                ready = session.take_outbox()
                if instr.resend:
                    ready = session.with_kept(ready, instr.next_round)
                session.keep(ready)
            log.info(
                "reply: rounds %s, next round %d, global model of round %d, held %.2f s",
                [u.round for u in ready], session.next_round, session.strategy.global_round, time.monotonic() - taken,
            )  # fmt: skip
        return TrainReply(session.partition_id, tuple(ready), health_snapshot(), self.transport,
                          time.monotonic() - taken, session.num_examples)  # fmt: skip

    def stop(self) -> None:
        """Answer held messages with an error and return once the trainer thread has finished its round."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._trainer.join()
