"""Flower's own FedAvg, for side-by-side comparison (``--strategy flower-fedavg``): the built-in
``flwr.serverapp.strategy.FedAvg.start`` loop (``send_and_receive``, one Array per tensor) with the quickstart
ClientApp of ``fl_client.baseline``, which trains in-process in a fresh process per message.

It writes the same rounds.jsonl and summary.json as edgefl's own engine. Server-side evaluation runs inside
Flower's loop here, so its time is subtracted from ``wall_s``: both columns measure the federation alone."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from contract.flower import meter_grid
from contract.run_folder import (
    MESSAGES,
    ROUNDS,
    SUMMARY,
    MessageTrip,
    RunFolder,
    read_rounds,
    summarize,
    summary_bytes,
)
from contract.settings import RunConfig
from contract.transport import STOCK
from contract.wire import WireSize, wire_size
from fl_server.app import run_app
from fl_server.engine import evaluation_sample, wait_for_nodes
from ml.data import load_dataset
from ml.models import build_model
from ml.trainer import evaluate

log = logging.getLogger("edgefl.baseline")

app = ServerApp()


class _Meter:
    """Counts serialized bytes through a grid and records each message round trip, by wrapping its push/pull on
    the instance (``contract.flower.meter_grid``, refused on Flower code it was not checked against), so that
    Flower's own ``send_and_receive`` (which calls them) is what runs."""

    def __init__(self, grid: Grid, folder: RunFolder) -> None:
        self.up = self.down = 0
        self.replied: set[int] = set()  # partitions whose replies came since the last round closed
        self._sent: dict[str, tuple[int, float, WireSize]] = {}

        def metered_push(push):  # type: ignore[no-untyped-def]
            def push_messages(messages):  # type: ignore[no-untyped-def]
                messages = list(messages)
                sent_at = time.monotonic()
                ids = list(push(messages))
                for message, message_id in zip(messages, ids, strict=True):
                    size = wire_size(message)
                    self.down += size.bytes
                    self._sent[message_id] = (message.metadata.dst_node_id, sent_at, size)
                return ids

            return push_messages

        def metered_pull(pull):  # type: ignore[no-untyped-def]
            def pull_messages(message_ids):  # type: ignore[no-untyped-def]
                replies = list(pull(message_ids))
                for reply in replies:
                    self._record(folder, reply)
                return replies

            return pull_messages

        meter_grid(grid, metered_push, metered_pull)

    def _record(self, folder: RunFolder, reply: Message) -> None:
        pulled_at, size = time.monotonic(), wire_size(reply)
        self.up += size.bytes
        message_id = reply.metadata.reply_to_message_id
        node, sent_at, sent = self._sent.pop(message_id)
        metrics = {} if reply.has_error() else reply.content["metrics"]
        partition = int(metrics.get("partition-id", -1))
        if not reply.has_error():
            self.replied.add(partition)
        train_s = float(metrics.get("train-s", 0.0))
        trip = MessageTrip(
            message_id=message_id,
            node=node,
            partition=partition,
            sent_at=sent_at,
            round_trip_s=pulled_at - sent_at,
            train_s=train_s,
            held_s=train_s,  # Flower's ClientApp process holds the message while it starts: that is its path
            path_s=pulled_at - sent_at - train_s,
            rounds=[],
            bytes_down=sent.bytes,
            bytes_up=size.bytes,
            objects_down=sent.objects,
            objects_up=size.objects,
        )
        folder.append(MESSAGES, dataclasses.asdict(trip))

    def take(self) -> tuple[int, int, list[int]]:
        """Bytes up and down and the partitions that replied, since the last call."""
        out = (self.up, self.down, sorted(self.replied))
        self.up = self.down = 0
        self.replied = set()
        return out


def run_baseline(grid: Grid, config: RunConfig, folder: RunFolder) -> None:
    torch.set_num_threads(1)
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed, config.model)
    test = evaluation_sample(dataset.x_test, dataset.y_test, config.eval_examples, config.seed)  # as edgefl's runs
    meter = _Meter(grid, folder)
    wait_for_nodes(grid, config.clients)
    clock = {"t0": 0.0, "eval_s": 0.0}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        started = time.monotonic()
        if server_round == 0:
            clock["t0"] = started
            return MetricRecord({})
        wall = started - clock["t0"] - clock["eval_s"]
        loss = accuracy = None
        if config.evaluates(server_round):
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = evaluate(model, *test)
            log.info("round %d  accuracy %.4f  wall %.1f s", server_round, accuracy, wall)
        up, down, clients = meter.take()
        folder.append(
            ROUNDS,
            {
                "round": server_round,
                "wall_s": wall,
                "test_loss": loss,
                "test_accuracy": accuracy,
                "eval_examples": len(test[1]) if accuracy is not None else 0,
                "bytes_up": up,
                "bytes_down": down,
                "clients": clients,
                "closed_by": "all" if len(clients) == config.per_round else "partial",
                "client_train_s": None,
                "rejected": [],
            },
        )
        clock["eval_s"] += time.monotonic() - started
        return MetricRecord({} if accuracy is None else {"accuracy": accuracy, "loss": loss})

    strategy = FedAvg(  # partial participation: Flower's own sampler (not seeded by the run's seed)
        fraction_train=config.per_round / config.clients,
        fraction_evaluate=0.0,
        min_train_nodes=config.per_round,
        min_available_nodes=config.clients,
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=config.rounds,
        train_config=ConfigRecord({k: v for k, v in config.client_job().as_dict().items() if not isinstance(v, bool)}),
        evaluate_fn=evaluate_fn,
    )
    summary = summarize(config.as_dict(), read_rounds(folder.path), read_rounds(folder.path, MESSAGES))
    folder.write(SUMMARY, summary_bytes({**summary, "transport": STOCK}))


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_app(context, lambda config, folder: run_baseline(grid, config, folder))
