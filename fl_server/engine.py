"""The server's message loop: ``strategies.rounds.RoundEngine`` driven through Flower's non-blocking
``push_messages``/``pull_messages`` with a short poll — not ``send_and_receive``, which sleeps 3 s between
pulls and allows one message per node at a time.

Closed rounds are evaluated on the held-out test split in a worker thread, which appends the round's row and then
checkpoints it, so the loop never waits on evaluation before sending the next round.

Clients come and go: the node set is re-read every ``NODE_REFRESH_S``; a node that vanished is retired (its
messages in flight are dropped) and a new one — a restarted SuperNode gets a new node id — is a fresh client,
sent the newest global model, so its agent starts a fresh session (model, DGA state, codec memory) from it.

Resume: a run folder that holds a checkpoint continues from it (``edgefl run --resume``): global model, round,
wall clock and the norm history of update validation; rows after the checkpoint's round are dropped. DGA's
server state is just the round and the global model; the clients restart from that model, so the rounds they
had trained or sent after the checkpoint are trained again — none is lost and none is applied twice."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid

from contract.messages import TrainInstruction
from contract.transport import FAST, STOCK
from contract.wire import WireError, WireSize, parse_reply, train_message, wire_size
from edge.data import load_dataset
from edge.models import build_model, get_flat_params, param_layout, set_flat_params
from edge.onnx import export_onnx
from edge.trainer import evaluate
from edgefl.config import RunConfig, client_job
from fl_server.results import (
    GLOBAL_ONNX,
    Checkpoint,
    MessageTrip,
    append_message,
    append_round,
    read_checkpoint,
    read_rounds,
    save_checkpoint,
    summarize,
    truncate_rounds,
    write_summary,
)
from fl_server.robust import make_aggregator
from strategies.downlink import BroadcastEncoder
from strategies.rounds import ClosedRound, Rejection, Request, RoundEngine, Update
from strategies.validation import NormOutlierFilter

log = logging.getLogger("edgefl.server")

POLL_S = 0.02
NODE_WAIT_S = 180.0
NODE_REFRESH_S = 1.0
EVALUATION_NICE = 19


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


class Evaluator:
    """Evaluates the global model of each closed round on the test split, appends its rounds.jsonl row, then
    writes its checkpoint (so rows never lag behind the checkpoint)."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.dataset = load_dataset(config.dataset, config.data_dir or None)
        test = self.dataset.x_test, self.dataset.y_test
        self.x, self.y = evaluation_sample(*test, config.eval_examples, config.seed)
        self.model = build_model(self.dataset, config.seed)
        self.run_dir = run_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluate", initializer=_yield_cpu)

    def submit(self, row: dict[str, Any], checkpoint: Checkpoint) -> None:
        self._pool.submit(self._evaluate, row, checkpoint)

    def _evaluate(self, row: dict[str, Any], c: Checkpoint) -> None:
        set_flat_params(self.model, c.params)
        loss, accuracy = evaluate(self.model, self.x, self.y)
        row = {**row, "test_loss": loss, "test_accuracy": accuracy}
        append_round(self.run_dir, row)
        save_checkpoint(self.run_dir, c.round, c.params, c.wall_s, c.recent_norms)
        log.info("round %d  accuracy %.4f  loss %.4f  wall %.1f s", row["round"], accuracy, loss, row["wall_s"])

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def export(self, params: np.ndarray) -> None:
        """The final global model as ONNX, for devices that evaluate with onnxruntime (edgefl edge bench)."""
        set_flat_params(self.model, params)
        export_onnx(self.model, self.dataset, self.run_dir / GLOBAL_ONNX)


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A message the server pushed and awaits the reply to."""

    node: int
    sent_at: float  # time.monotonic()
    size: WireSize


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


class ServerLoop:
    def __init__(self, grid: Grid, config: RunConfig, run_dir: Path, transport: str) -> None:
        self.grid = grid
        self.transport = {-1: transport}  # this server's, then each partition's as its replies report it
        self.config = config
        self.run_dir = run_dir
        self.job = client_job(config).to_json()
        self.evaluator = Evaluator(config, run_dir)
        model = self.evaluator.model
        start = read_checkpoint(run_dir) or Checkpoint(0, get_flat_params(model), 0.0, np.zeros(0))
        truncate_rounds(run_dir, start.round)
        self.validator = NormOutlierFilter(norms=start.recent_norms)
        self.engine = RoundEngine(
            start.params,
            param_layout(model),
            rounds=config.rounds,
            num_clients=config.clients,
            delay=config.strategy_spec.delay,
            quorum=config.quorum,
            deadline_s=config.round_deadline_s,
            start_round=start.round,
            aggregator=make_aggregator(config.aggregate),
            validator=self.validator,
        )
        self.wall_offset_s = start.wall_s
        self.broadcaster = BroadcastEncoder(  # --compress-down: clients are sent x̂, see strategies.downlink
            config.compress_down, self.engine.global_params, self.engine.layout, config.seed, self.engine.aggregated
        )
        self.traffic = Traffic()
        self.outstanding: dict[str, InFlight] = {}
        self.nodes: set[int] = set()
        self.partition_of: dict[int, int] = {}
        self.health: dict[int, dict[str, Any]] = {}  # newest report per partition: peak RSS, temperature
        self.t0 = 0.0

    def run(self) -> None:
        self.nodes = set(wait_for_nodes(self.grid, self.config.clients))
        log.info(
            "%d SuperNodes connected; %s for rounds %d..%d",
            len(self.nodes), self.config.strategy, self.engine.aggregated + 1, self.config.rounds,
        )  # fmt: skip
        self.t0 = time.monotonic() - self.wall_offset_s
        self.engine.start_clock(time.monotonic())
        refreshed = time.monotonic()
        try:
            while not self.engine.done:
                if time.monotonic() - refreshed >= NODE_REFRESH_S:
                    self._refresh_nodes()
                    refreshed = time.monotonic()
                busy = self._push()
                busy |= self._pull()
                self._close_rounds()
                if not busy:
                    time.sleep(POLL_S)
        finally:
            self.evaluator.close()
        self.evaluator.export(self.engine.global_params)
        transport = FAST if set(self.transport.values()) == {FAST} else STOCK
        summary = summarize(dataclasses.asdict(self.config), read_rounds(self.run_dir))
        write_summary(self.run_dir, {**summary, "transport": transport})

    def _message(self, node: int, request: Request) -> Message:
        broadcast = None
        if request.global_round is not None:
            broadcast = self.broadcaster.broadcast(request.global_round, request.global_params, request.held_round)
        return train_message(TrainInstruction(self.job, request.next_round, request.last_round, broadcast), node)

    def _refresh_nodes(self) -> None:
        """Retire the nodes that left (their messages in flight are dropped, never counted); take in new ones."""
        current = set(self.grid.get_node_ids())
        for node in self.nodes - current:
            log.warning("node %d left; its messages in flight are abandoned", node)
            self.engine.retire(node)
            self.outstanding = {msg_id: m for msg_id, m in self.outstanding.items() if m.node != node}
        for node in current - self.nodes:
            log.info("node %d joined; it starts from the global model of round %d", node, self.engine.aggregated)
        self.nodes = current

    def _push(self) -> bool:
        messages = []
        for node in sorted(self.nodes):
            while (request := self.engine.next_request(node)) is not None:
                messages.append(self._message(node, request))
        if not messages:
            return False
        sent_at = time.monotonic()
        ids = list(self.grid.push_messages(messages))
        for msg, msg_id in zip(messages, ids, strict=True):
            if msg_id is None:
                raise RuntimeError(f"the SuperLink refused a message to node {msg.metadata.dst_node_id}")
            size = wire_size(msg)
            self.outstanding[msg_id] = InFlight(msg.metadata.dst_node_id, sent_at, size)
            self.traffic.down += size.bytes
        return True

    def _pull(self) -> bool:
        if not self.outstanding:
            return False
        replies = list(self.grid.pull_messages(list(self.outstanding)))
        for reply in replies:
            message_id = reply.metadata.reply_to_message_id
            sent = self.outstanding.pop(message_id)
            pulled_at, size = time.monotonic(), wire_size(reply)
            self.traffic.up += size.bytes
            updates = self._receive(sent.node, reply)
            trip = MessageTrip(
                message_id=message_id,
                node=sent.node,
                partition=self.partition_of.get(sent.node, -1),
                sent_at=sent.sent_at,
                round_trip_s=pulled_at - sent.sent_at,
                train_s=sum(u.train_s for u in updates),
                rounds=[u.round for u in updates],
                bytes_down=sent.size.bytes,
                bytes_up=size.bytes,
                objects_down=sent.size.objects,
                objects_up=size.objects,
            )
            append_message(self.run_dir, trip)
        return bool(replies)

    def _receive(self, node: int, reply: Message) -> tuple[Update, ...]:
        """Hand a reply's updates to the round engine; returns them (none for an error or a malformed reply)."""
        partition = self.partition_of.get(node, -1)  # rejections name partitions (−1: not known yet)
        if reply.has_error():
            self.engine.fail(node)
            self.traffic.rejected.append(Rejection(partition, -1, f"client error: {reply.error.reason}"))
            log.warning("node %d replied with an error: %s", node, reply.error.reason)
            return ()
        try:
            parsed = parse_reply(reply.content)
        except WireError as exc:
            self.engine.receive(node, [])
            self.traffic.rejected.append(Rejection(partition, -1, str(exc)))
            return ()
        self.partition_of[node] = parsed.partition_id
        self.health[parsed.partition_id] = parsed.health
        self.transport[parsed.partition_id] = parsed.transport
        for rejection in self.engine.receive(node, list(parsed.updates), parsed.partition_id):
            log.warning("refused round %d from node %d: %s", rejection.round, node, rejection.reason)
            self.traffic.rejected.append(rejection)
        return parsed.updates

    def _close_rounds(self) -> None:
        now = time.monotonic()
        for closed in self.engine.close_rounds(now):
            wall_s = now - self.t0
            checkpoint = Checkpoint(closed.round, closed.global_params, wall_s, np.array(self.validator.norms))
            self.evaluator.submit(self._row(closed, wall_s), checkpoint)

    def _row(self, closed: ClosedRound, wall_s: float) -> dict[str, Any]:
        return {
            "round": closed.round,
            "wall_s": wall_s,
            "clients": sorted(closed.clients),
            "closed_by": closed.closed_by,
            "client_train_s": float(np.mean(closed.train_s)),
            "train_loss": float(np.mean([x for x in closed.losses if math.isfinite(x)] or [math.nan])),
            "client_health": {str(pid): report for pid, report in sorted(self.health.items())},
            **self.traffic.take(),
        }


def serve(grid: Grid, config: RunConfig, run_dir: Path, transport: str) -> None:
    """Run ``config`` to its end; ``transport`` is how this process moves messages (``contract.transport``)."""
    torch.set_num_threads(1)
    ServerLoop(grid, config, run_dir, transport).run()
