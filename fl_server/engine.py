"""The server's message loop: ``strategies.rounds.RoundEngine`` driven through Flower's non-blocking
``push_messages``/``pull_messages`` with a short poll — not ``send_and_receive``, which sleeps 3 s between
pulls and allows one message per node at a time.

Closed rounds are checkpointed at once and evaluated on the held-out test split in a worker thread, so the
loop never waits on evaluation before sending the next round."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid

from edge.data import load_dataset
from edge.models import build_model, get_flat_params, param_layout, set_flat_params
from edge.onnx import export_onnx
from edge.trainer import evaluate
from edgefl.config import RunConfig, client_job
from fl_client.wire import TrainInstruction, instruction_content, parse_reply, wire_bytes
from fl_server.results import GLOBAL_ONNX, append_round, read_rounds, save_checkpoint, summarize, write_summary
from strategies.rounds import ClosedRound, Contribution, Rejection, Request, RoundEngine

log = logging.getLogger("edgefl.server")

POLL_S = 0.02
NODE_WAIT_S = 180.0


def wait_for_nodes(grid: Grid, count: int, timeout_s: float = NODE_WAIT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} of {count} SuperNodes connected within {timeout_s:.0f} s")
        time.sleep(0.1)
    return nodes[:count]


class Evaluator:
    """Evaluates the global model of each closed round on the test split and appends its rounds.jsonl row."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.dataset = load_dataset(config.dataset, config.data_dir or None)
        self.x, self.y = self.dataset.x_test, self.dataset.y_test
        self.model = build_model(self.dataset, config.seed)
        self.run_dir = run_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="evaluate")

    def submit(self, params: np.ndarray, row: dict[str, Any]) -> None:
        self._pool.submit(self._evaluate, params, row)

    def _evaluate(self, params: np.ndarray, row: dict[str, Any]) -> None:
        set_flat_params(self.model, params)
        loss, accuracy = evaluate(self.model, self.x, self.y)
        row = {**row, "test_loss": loss, "test_accuracy": accuracy}
        append_round(self.run_dir, row)
        log.info("round %d  accuracy %.4f  loss %.4f  wall %.1f s", row["round"], accuracy, loss, row["wall_s"])

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def export(self, params: np.ndarray) -> None:
        """The final global model as ONNX, for devices that evaluate with onnxruntime (edgefl edge bench)."""
        set_flat_params(self.model, params)
        export_onnx(self.model, self.dataset, self.run_dir / GLOBAL_ONNX)


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
    def __init__(self, grid: Grid, config: RunConfig, run_dir: Path) -> None:
        self.grid = grid
        self.config = config
        self.run_dir = run_dir
        self.job = client_job(config)
        self.evaluator = Evaluator(config, run_dir)
        model = self.evaluator.model
        self.engine = RoundEngine(
            get_flat_params(model),
            param_layout(model),
            rounds=config.rounds,
            num_clients=config.clients,
            delay=config.strategy_spec.delay,
            quorum=config.quorum,
            deadline_s=config.round_deadline_s,
        )
        self.traffic = Traffic()
        self.outstanding: dict[str, int] = {}
        self.partition_of: dict[int, int] = {}
        self.health: dict[int, dict[str, Any]] = {}  # newest report per partition: peak RSS, temperature
        self.t0 = 0.0

    def run(self) -> None:
        nodes = wait_for_nodes(self.grid, self.config.clients)
        log.info("%d SuperNodes connected; %s for %d rounds", len(nodes), self.config.strategy, self.config.rounds)
        self.t0 = time.monotonic()
        self.engine.start_clock(self.t0)
        try:
            while not self.engine.done:
                busy = self._push(nodes)
                busy |= self._pull()
                self._close_rounds()
                if not busy:
                    time.sleep(POLL_S)
        finally:
            self.evaluator.close()
        self.evaluator.export(self.engine.global_params)
        write_summary(self.run_dir, summarize(dataclasses.asdict(self.config), read_rounds(self.run_dir)))

    def _message(self, node: int, request: Request) -> Message:
        instr = TrainInstruction(
            self.job,
            request.next_round,
            request.last_round,
            -1 if request.global_round is None else request.global_round,
            request.global_params,
        )
        return Message(instruction_content(instr), dst_node_id=node, message_type="train")

    def _push(self, nodes: list[int]) -> bool:
        messages = []
        for node in nodes:
            while (request := self.engine.next_request(node)) is not None:
                messages.append(self._message(node, request))
        if not messages:
            return False
        ids = list(self.grid.push_messages(messages))
        for msg, msg_id in zip(messages, ids, strict=True):
            if msg_id is None:
                raise RuntimeError(f"the SuperLink refused a message to node {msg.metadata.dst_node_id}")
            self.outstanding[msg_id] = msg.metadata.dst_node_id
            self.traffic.down += wire_bytes(msg)
        return True

    def _pull(self) -> bool:
        if not self.outstanding:
            return False
        replies = list(self.grid.pull_messages(list(self.outstanding)))
        for reply in replies:
            node = self.outstanding.pop(reply.metadata.reply_to_message_id)
            self.traffic.up += wire_bytes(reply)
            self._receive(node, reply)
        return bool(replies)

    def _receive(self, node: int, reply: Message) -> None:
        if reply.has_error():
            self.engine.receive(node, [])
            self.traffic.rejected.append(Rejection(node, -1, f"client error: {reply.error.reason}"))
            log.warning("node %d replied with an error: %s", node, reply.error.reason)
            return
        try:
            parsed = parse_reply(reply.content)
        except (KeyError, TypeError, ValueError) as exc:
            self.engine.receive(node, [])
            self.traffic.rejected.append(Rejection(node, -1, f"malformed reply: {exc}"))
            return
        self.partition_of[node] = parsed.partition_id
        self.health[parsed.partition_id] = parsed.health
        contributions = [
            Contribution(m.round, m.num_examples, m.stype, payload, m.train_s, m.loss)
            for m, payload in zip(parsed.updates, parsed.payloads(), strict=True)
        ]
        for rejection in self.engine.receive(node, contributions):
            log.warning("refused round %d from node %d: %s", rejection.round, node, rejection.reason)
            self.traffic.rejected.append(rejection)

    def _close_rounds(self) -> None:
        now = time.monotonic()
        for closed in self.engine.close_rounds(now):
            save_checkpoint(self.run_dir, closed.round, closed.global_params)
            self.evaluator.submit(closed.global_params, self._row(closed, now))

    def _row(self, closed: ClosedRound, now: float) -> dict[str, Any]:
        return {
            "round": closed.round,
            "wall_s": now - self.t0,
            "clients": sorted(self.partition_of.get(n, -1) for n in closed.clients),
            "closed_by": closed.closed_by,
            "client_train_s": float(np.mean(closed.train_s)),
            "train_loss": float(np.mean([x for x in closed.losses if math.isfinite(x)] or [math.nan])),
            "client_health": {str(pid): report for pid, report in sorted(self.health.items())},
            **self.traffic.take(),
        }


def serve(grid: Grid, config: RunConfig, run_dir: Path) -> None:
    torch.set_num_threads(1)
    ServerLoop(grid, config, run_dir).run()
