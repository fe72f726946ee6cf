"""The edge agent: one long-lived process per device that owns the model, the optimizer, the data partition,
the codec memory and DGA's bookkeeping, and trains continuously in a background thread.

Flower's ClientApp (a fresh process per message) connects over a Unix socket with one ``train`` request per
message: the agent takes the newest global model if one is attached, trains the rounds that model unlocks and
answers with every update it has ready. A round t needs the global model of round t − D − 1 (DGA's staleness
bound; D = 0 is FedAvg's lock-step), so a message unlocks up to D + 1 rounds. The agent answers when it reaches
the bound — every message round trip then moves the pipeline on by D + 1 rounds; answering with the first
ready round instead would make each round wait two round trips — or earlier, when the rounds still left can
be trained during the round trip to the next message (``strategies.dga.reply_early``, from the round trip and
the round time it measures). Training goes on while messages, process start-ups and uploads happen; it pauses
only at the staleness bound.

    python -m edge.agent --socket /run/edgefl/agent.sock
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.data import load_dataset, partition_indices
from edge.health import health_snapshot
from edge.models import build_model, get_flat_params, param_layout, set_flat_params
from edge.protocol import ProtocolError, recv_frame, send_frame
from edge.trainer import LocalTrainer, scheduled_lr
from strategies.codecs import make_client_codec, parse_codec, server_compressor
from strategies.dga import DelayedAveragingClient, reply_early
from strategies.downlink import Broadcast, BroadcastDecoder

log = logging.getLogger("edgefl.agent")


@dataclass
class ReadyUpdate:
    round: int
    stype: str
    payload: bytes
    num_examples: int
    train_s: float
    loss: float


class Session:
    """One run's state on this device. Everything that must outlive a Flower message lives here."""

    def __init__(self, job: dict[str, Any], partition_id: int, num_partitions: int, data_dir: str = "") -> None:
        self.job = job
        self.partition_id = partition_id
        dataset = load_dataset(job["dataset"], data_dir or job.get("data-dir") or None)
        parts = partition_indices(dataset, job["partition"], num_partitions, job["seed"])
        idx = parts[partition_id]
        self.num_examples = len(idx)
        self.model = build_model(dataset, job["seed"])
        self.layout = param_layout(self.model)
        seed = job["seed"] * 1000 + partition_id
        momentum = 0.0 if parse_codec(job["codec"]).holds_momentum else job["momentum"]
        self.trainer = LocalTrainer(
            self.model, dataset.x_train[idx], dataset.y_train[idx], job["batch-size"], job["lr"], momentum, seed
        )
        self.codec = make_client_codec(job["codec"], self.layout, seed=seed, num_clients=num_partitions)
        self.dga = DelayedAveragingClient(job["delay"], job["correction"])
        self.broadcast = BroadcastDecoder(self.layout)
        self.last_round = job["rounds"]
        self.next_round = 1
        self.outbox: list[ReadyUpdate] = []
        self.training = False
        self.round_s: float | None = None  # moving averages: a round's training time,
        self.round_trip_s: float | None = None  # and the time from a reply to the next global model
        self.replied_at: float | None = None

    def can_train(self) -> bool:
        return self.next_round <= self.last_round and self.dga.can_start(self.next_round)

    def reply_due(self) -> bool:
        """At the staleness bound (or done), or early enough that the rounds left fill the round trip."""
        if not self.training and not self.can_train():
            return True
        bound = min(self.last_round, self.dga.global_round + self.dga.delay + 1)
        left = max(0, bound - self.next_round + 1)  # next_round is the round in progress while training
        return reply_early(len(self.outbox), left, self.dga.delay, self.round_s or 0.0, self.round_trip_s)

    def finish_round(self, ready: ReadyUpdate) -> None:
        self.outbox.append(ready)
        self.next_round = max(self.next_round, ready.round + 1)
        self.round_s = moving_average(self.round_s, ready.train_s)
        self.training = False

    def take_global(self, round_: int, params: np.ndarray, now: float) -> None:
        self.dga.receive_global(round_, params)
        if self.replied_at is not None:
            self.round_trip_s = moving_average(self.round_trip_s, now - self.replied_at)

    def take_outbox(self, now: float) -> list[ReadyUpdate]:
        ready, self.outbox = self.outbox, []
        self.replied_at = now
        return ready

    def train_one_round(self, round_: int, start: np.ndarray) -> tuple[ReadyUpdate, np.ndarray]:
        """K local steps from ``start``: the encoded update Δ = w_end − w_start, and Δ as the server will decode
        it (what DGA's correction must subtract later)."""
        t0 = time.perf_counter()
        set_flat_params(self.model, start)
        self.trainer.set_lr(scheduled_lr(self.job["lr"], self.job["lr-schedule"], round_, self.last_round))
        loss = self.trainer.train_steps(self.job["local-steps"])
        update = get_flat_params(self.model) - start
        stype, payload = self.codec.encode(update, round_)
        sent = server_compressor(stype).decode(payload, self.layout)
        return ReadyUpdate(round_, stype, payload, self.num_examples, time.perf_counter() - t0, loss), sent


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def moving_average(previous: float | None, sample: float, weight: float = 0.5) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


class EdgeAgent:
    def __init__(self, data_dir: str = "") -> None:
        self.data_dir = data_dir  # this device's data folder; overrides the run's data-dir
        self._cond = threading.Condition()
        self._session: Session | None = None
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
            with self._cond:  # DGA's bookkeeping changes only under the lock: the ClientApp thread reads it too
                session.dga.record_sent(round_, sent)
                session.finish_round(ready)
                self._cond.notify_all()

    # ----- requests from the ClientApp ----------------------------------------------------------------
    def _session_for(self, header: dict[str, Any]) -> Session:
        job, pid, n = header["job"], int(header["partition-id"]), int(header["num-partitions"])
        current = self._session
        if current and current.job == job and current.partition_id == pid:
            return current
        session = Session(job, pid, n, self.data_dir)  # loads data and builds the model: seconds, once per run
        with self._cond:
            self._session = session
            self._error = None
            self._cond.notify_all()
        threading.Thread(target=self._train_forever, args=(session,), daemon=True, name="trainer").start()
        log.info("new session: %s partition %d (%d examples)", job["dataset"], pid, session.num_examples)
        return session

    def preload(self, header: dict[str, Any]) -> None:
        self._session_for(header)

    def handle_train(self, header: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        session = self._session_for(header)
        with self._cond:
            if header["global-round"] >= 0:  # x̂, the model as the (compressed) broadcast delivers it
                reference = session.broadcast.receive(Broadcast.parse(header["broadcast"], blob))
                session.take_global(header["global-round"], reference, time.monotonic())
            session.next_round = max(session.next_round, int(header["next-round"]))
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._error or session.reply_due())
            if self._error:
                return {"error": self._error}, b""
            ready = session.take_outbox(time.monotonic())
            log.info(
                "reply: rounds %s, next round %d, global model of round %d; round trip %s s, round %s s",
                [u.round for u in ready], session.next_round, session.dga.global_round,
                _seconds(session.round_trip_s), _seconds(session.round_s),
            )  # fmt: skip
        meta = [
            {
                "round": u.round,
                "stype": u.stype,
                "size": len(u.payload),
                "num_examples": u.num_examples,
                "train_s": u.train_s,
                "loss": u.loss,
            }
            for u in ready
        ]
        reply = {"partition-id": session.partition_id, "updates": meta, "health": health_snapshot()}
        return reply, b"".join(u.payload for u in ready)

    def handle(self, header: dict[str, Any], blob: bytes) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        if op == "ping":
            return {"pong": os.getpid()}, b""
        if op == "train":
            return self.handle_train(header, blob)
        return {"error": f"unknown op {op!r}"}, b""

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


def _serve_connection(agent: EdgeAgent, conn: socket.socket) -> None:
    with conn:
        try:
            header, blob = recv_frame(conn)
            try:
                reply, out = agent.handle(header, blob)
            except Exception as exc:
                log.exception("request failed")
                reply, out = {"error": f"{type(exc).__name__}: {exc}"}, b""
            send_frame(conn, reply, out)
        except (ProtocolError, OSError) as exc:
            log.warning("connection dropped: %s", exc)


def serve(socket_path: str, preload: dict[str, Any] | None = None, data_dir: str = "") -> None:
    """Accept ClientApp connections until SIGTERM/SIGINT; one thread per connection. ``preload`` (a train
    header without the model) builds the session before the first message, so round 1 does not pay for it."""
    agent = EdgeAgent(data_dir)
    if preload:
        agent.preload(preload)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(16)

    def shutdown(*_: object) -> None:
        agent.stop()
        server.close()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    log.info("edge agent %d listening on %s", os.getpid(), socket_path)
    try:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                break
            threading.Thread(target=_serve_connection, args=(agent, conn), daemon=True).start()
    finally:
        if os.path.exists(socket_path):
            os.unlink(socket_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edge.agent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="Unix socket path to listen on")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--job", type=Path, help="JSON job of the coming run: load its data before round 1")
    parser.add_argument("--data-dir", default="", help="this device's folder of the data set (overrides the run's)")
    parser.add_argument("--partition-id", type=int, default=0)
    parser.add_argument("--num-partitions", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    preload = None
    if args.job:
        job = json.loads(args.job.read_text())
        preload = {"job": job, "partition-id": args.partition_id, "num-partitions": args.num_partitions}
    serve(args.socket, preload, args.data_dir)


if __name__ == "__main__":
    main()
