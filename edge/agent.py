"""The edge agent: the one long-lived part of a device that owns the model, the optimizer, the data partition,
the codec memory and DGA's bookkeeping, and trains continuously in a background thread. No Flower here:
``fl_client.node`` serves the device's SuperNode tasks in the agent's process and hands each message to
``EdgeAgent.train``.

A message may bring the newest global model; the agent trains the rounds that model unlocks and answers with
every update it has ready. A round t needs the global model of round t − D − 1 (DGA's staleness bound; D = 0 is
FedAvg's lock-step), so a message unlocks up to D + 1 rounds. The agent answers when it reaches the bound —
every message round trip then moves the pipeline on by D + 1 rounds; answering with the first ready round
instead would make each round wait two round trips — or earlier, when the rounds still left can be trained
during the round trip to the next message (``strategies.dga.reply_early``, from the round trip and the round
time it measures). Training goes on while messages travel; it pauses only at the staleness bound. With partial
participation the agent trains only the rounds its partition is sampled in (``strategies.sampling``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import numpy as np

from contract.messages import TrainInstruction, TrainReply
from contract.settings import ClientJob
from edge.health import health_snapshot
from ml.data import Dataset, load_partition
from ml.models import build_model, get_flat_params, param_layout, set_flat_params
from ml.trainer import LocalTrainer, scheduled_lr
from strategies.codecs import make_client_codec
from strategies.dga import DelayedAveragingClient, reply_early
from strategies.downlink import BroadcastDecoder
from strategies.rounds import Update

log = logging.getLogger("edgefl.agent")


class AgentError(RuntimeError):
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
            data_dir = data_dir or job.data_dir or None
            data = load_partition(job.dataset, data_dir, job.partition, num_partitions, job.seed, partition_id)
        self.num_examples = len(data.y_train)
        self.model = build_model(data, job.seed)
        self.layout = param_layout(self.model)
        seed = job.seed * 1000 + partition_id
        momentum = 0.0 if job.codec_spec.plain_sgd else job.momentum
        self.trainer = LocalTrainer(self.model, data.x_train, data.y_train, job.batch_size, job.lr, momentum, seed)
        self.codec = make_client_codec(job.codec_spec, self.layout, seed=seed, num_clients=num_partitions)
        self.dga = DelayedAveragingClient(job.delay, job.correction)
        self.broadcast = BroadcastDecoder(self.layout)
        self.broadcast.hold(0, get_flat_params(self.model))  # the seeded start model: see strategies.downlink
        self.sampler = job.sampler()
        self.last_round = job.rounds
        self.next_round = 0
        self.advance_to(1)
        self.outbox: list[Update] = []
        self.training = False
        self.round_s: float | None = None  # moving averages: a round's training time,
        self.round_trip_s: float | None = None  # and the time from a reply to the next global model
        self.replied_at: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the partition's rows (``attach`` them again after unpickling): how a simulated client's
        session lives in Flower's node state between messages (``fl_client.simulation``)."""
        trainer = copy.copy(self.trainer)
        trainer.x, trainer.y = None, None
        return {**self.__dict__, "trainer": trainer}

    def attach(self, data: Dataset) -> None:
        self.trainer.attach(data.x_train, data.y_train)

    def take_instruction(self, instr: TrainInstruction, now: float) -> None:
        """Take the global model a message brings (x̂, as the possibly compressed broadcast delivers it) and the
        first round it asks for."""
        if instr.broadcast is not None:
            reference = self.broadcast.receive(instr.broadcast)
            self.take_global(instr.broadcast.round, reference, now)
        self.advance_to(instr.next_round)

    def train_next(self) -> None:
        """Train the next round from DGA's start model and put its update in the outbox."""
        round_ = self.next_round
        self.finish_round(*self.train_one_round(round_, self.dga.start_params()))

    def advance_to(self, round_: int) -> None:
        """The next round to train is the first one from ``round_`` on that this partition is sampled in."""
        first = max(self.next_round, round_)
        sampled = self.sampler.next_round(self.partition_id, first, self.last_round)
        self.next_round = self.last_round + 1 if sampled is None else sampled

    def can_train(self) -> bool:
        return self.next_round <= self.last_round and self.dga.can_start(self.next_round)

    def reply_due(self) -> bool:
        """At the staleness bound (or done), or early enough that the rounds left fill the round trip."""
        if not self.training and not self.can_train():
            return True
        bound = min(self.last_round, self.dga.global_round + self.dga.delay + 1)
        left = self.sampler.count(self.partition_id, self.next_round, bound)  # the round in progress counts
        return reply_early(len(self.outbox), left, self.dga.delay, self.round_s or 0.0, self.round_trip_s)

    def finish_round(self, ready: Update, sent: np.ndarray) -> None:
        """Keep a trained round's update: in the outbox, and as sent (``sent``, what the server will decode) for
        DGA's correction."""
        self.dga.record_sent(ready.round, sent)
        self.outbox.append(ready)
        self.advance_to(ready.round + 1)
        self.round_s = moving_average(self.round_s, ready.train_s)
        self.training = False

    def take_global(self, round_: int, params: np.ndarray, now: float) -> None:
        self.dga.receive_global(round_, params)
        if self.replied_at is not None:
            self.round_trip_s = moving_average(self.round_trip_s, now - self.replied_at)

    def take_outbox(self, now: float) -> list[Update]:
        ready, self.outbox = self.outbox, []
        self.replied_at = now
        return ready

    def train_one_round(self, round_: int, start: np.ndarray, lr: float | None = None) -> tuple[Update, np.ndarray]:
        """K local steps from ``start`` at ``lr`` (by default the job's schedule): the encoded update
        Δ = w_end − w_start, and Δ as the server will decode it (what DGA's correction must subtract later)."""
        t0 = time.perf_counter()
        set_flat_params(self.model, start)
        if lr is None:
            lr = scheduled_lr(self.job.lr, self.job.lr_schedule, round_, self.last_round)
        self.trainer.set_lr(lr)
        loss = self.trainer.train_steps(self.job.local_steps)
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


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def moving_average(previous: float | None, sample: float, weight: float = 0.5) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


class EdgeAgent:
    """The device's sessions (one per run) and their trainer threads. ``data_dir`` is this device's data
    folder (it wins over the run's); ``transport`` is how its SuperNode moves messages, told to the server."""

    def __init__(self, data_dir: str = "", transport: str = "stock") -> None:
        self.data_dir = data_dir
        self.transport = transport
        self._cond = threading.Condition()
        self._session: Session | None = None
        self._job_text = ""
        self._error: str | None = None
        self._stop = False

    # ----- the trainer thread -------------------------------------------------------------------------
    def _train_forever(self, session: Session) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._session is not session or session.can_train())
                if self._stop or self._session is not session:
                    return
                round_ = session.next_round
                start = session.dga.start_params()
                session.training = True
            try:
                ready, sent = session.train_one_round(round_, start)
            except Exception as exc:
                log.exception("training failed")
                with self._cond:
                    self._error = f"training round {round_} failed: {exc}"
                    session.training = False
                    self._cond.notify_all()
                return
            with self._cond:  # DGA's bookkeeping changes only under the lock: the task thread reads it too
                session.finish_round(ready, sent)
                self._cond.notify_all()

    # ----- messages -----------------------------------------------------------------------------------
    def session_for(self, job_text: str, partition_id: int, num_partitions: int) -> Session:
        """The session of this run, built (data loaded, model made: seconds, once per run) on its first message;
        the job is parsed only then."""
        current = self._session
        if current and self._job_text == job_text and current.partition_id == partition_id:
            return current
        job = ClientJob.from_json(job_text)
        check_partition(job, partition_id, num_partitions)
        session = Session(job, partition_id, num_partitions, self.data_dir)
        with self._cond:
            self._session, self._job_text = session, job_text
            self._error = None
            self._cond.notify_all()
        threading.Thread(target=self._train_forever, args=(session,), daemon=True, name="trainer").start()
        log.info("new session: %s partition %d (%d examples)", session.job.dataset, partition_id, session.num_examples)
        return session

    def train(self, instr: TrainInstruction, partition_id: int, num_partitions: int) -> TrainReply:
        """Take the global model the message brings (if any), wait until a reply is due, and give every update
        ready; raises AgentError when training failed or the run does not fit this device."""
        session = self.session_for(instr.job, partition_id, num_partitions)
        if not instr.asks_for_rounds:
            return TrainReply(session.partition_id, (), health_snapshot(), self.transport)
        with self._cond:
            session.take_instruction(instr, time.monotonic())
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._error or session.reply_due())
            if self._error:
                raise AgentError(self._error)
            ready = session.take_outbox(time.monotonic())
            log.info(
                "reply: rounds %s, next round %d, global model of round %d; round trip %s s, round %s s",
                [u.round for u in ready], session.next_round, session.dga.global_round,
                _seconds(session.round_trip_s), _seconds(session.round_s),
            )  # fmt: skip
        return TrainReply(session.partition_id, tuple(ready), health_snapshot(), self.transport)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
