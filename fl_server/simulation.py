"""The server of a run on Flower's Simulation Engine (``--federation simulation``, started by
``edgefl.simulation``): the deployment's server loop, round engine, strategies and codecs, on a virtual clock.

The clock: the server keeps a modelled time instead of this host's. A message pushed at time s to partition j is
answered at s + ``netem.clock.ClientModel.cycle_s`` of j's link and device, its bytes each way, the local steps
its reply trained and how many cycles j made before. Replies are taken in that order, not in the order Ray
finishes them: a reply is taken once every message in flight has been answered (none can then arrive earlier,
since a message sent later is answered later), so asynchronous strategies (DGA, FedBuff) see the arrival order the
links and devices imply, and a round's deadline passes at its modelled time. rounds.jsonl's ``wall_s`` and the
summary's times are modelled seconds; ``real_s`` in each row is this host's.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.serverapp import Grid

from contract.messages import TrainReply
from contract.run_folder import RunFolder
from contract.settings import RunConfig
from contract.transport import SIMULATION
from contract.wire import WireSize, wire_size
from fl_server.engine import ServerLoop, parsed_reply
from ml.data import load_dataset
from ml.models import build_model
from ml.trainer import LocalTrainer
from netem.clock import MESSAGE_FIXED_S, MESSAGE_RTTS, POOLED_CONNECTIONS, ClientModel, client_models
from netem.fleet import devices_for, links_for
from netem.profiles import BUILTIN_LINKS
from strategies.rounds import ClosedRound

STEP_SAMPLES = 50  # timed local steps (after 5 untimed) that set this host's seconds per step


def host_step_s(config: RunConfig) -> float:
    """This host's median seconds per local step of the run's model and batch on one thread: the clock's unit.
    Measure it while nothing else runs (before Ray starts its workers)."""
    torch.set_num_threads(1)
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed)
    rows = np.arange(min(len(dataset.y_train), 50 * config.batch_size))
    trainer = LocalTrainer(model, dataset.x_train.subset(rows), dataset.y_train[rows], config.batch_size,
                           config.lr, config.momentum, config.seed)  # fmt: skip
    trainer.train_steps(5)
    samples = []
    for _ in range(STEP_SAMPLES):
        t0 = time.perf_counter()
        trainer.train_steps(1)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


class SimulatedServerLoop(ServerLoop):
    """``ServerLoop`` on the virtual clock: replies are taken in modelled arrival order (module docstring)."""

    def __init__(self, grid: Grid, config: RunConfig, folder: RunFolder, step_s: float) -> None:
        """``step_s``: this host's seconds per local step (``host_step_s``, measured before Ray starts)."""
        super().__init__(grid, config, folder, SIMULATION)
        torch.set_num_threads(1)
        self.step_s = step_s
        links = links_for(config) or [BUILTIN_LINKS["lan"]] * config.clients
        self.models: list[ClientModel] = client_models(links, devices_for(config), self.step_s)
        self.cycles: Counter[int] = Counter()  # partition → message cycles it made (the first pay slow start)
        self.clock = 0.0
        self.arrivals: list[tuple[float, int, Message, Any, WireSize]] = []  # a heap of (modelled arrival, seq,
        # reply, parsed reply, its size): replies Ray has finished that the clock has not reached yet
        self.seq = itertools.count()
        self.real_t0 = time.monotonic()

    def now(self) -> float:
        return self.clock

    def summary_extra(self) -> dict[str, Any]:
        return {
            "transport": SIMULATION,
            "clock": {
                "host_step_s": self.step_s,
                "message_fixed_s": MESSAGE_FIXED_S,
                "message_rtts": MESSAGE_RTTS,
                "pooled_connections": POOLED_CONNECTIONS,
            },
            "real_s": time.monotonic() - self.real_t0,
        }

    def _pull(self) -> bool:
        arrived = {reply.metadata.reply_to_message_id for _, _, reply, _, _ in self.arrivals}
        waiting = [msg_id for msg_id in self.outstanding if msg_id not in arrived]
        replies = list(self.grid.pull_messages(waiting)) if waiting else []
        for reply in replies:
            self._arrive(reply)
        if not self.arrivals or len(self.arrivals) < len(self.outstanding):
            return bool(replies)
        at = self.arrivals[0][0]
        deadline = self.engine.deadline_at
        if deadline is not None and self.clock <= deadline < at:
            self.clock = deadline  # the deadline comes first: a round it closes sends the next before `at`
            if self._close_rounds():
                return True
        _, _, reply, parsed, size = heapq.heappop(self.arrivals)
        self.clock = max(self.clock, at)
        self._settle(reply, parsed, size, self.clock)
        return True

    def _arrive(self, reply: Message) -> None:
        """A reply Ray has finished: when it arrives on the clock. Identity answers are taken at once (the clock
        starts with the first round)."""
        parsed, size = parsed_reply(reply), wire_size(reply)
        sent = self.outstanding[reply.metadata.reply_to_message_id]
        if sent.identify:
            self._settle(reply, parsed, size, self.clock)
            return
        steps = len(parsed.updates) * self.config.local_steps if isinstance(parsed, TrainReply) else 0
        partition = self.partition_of[sent.node]
        cycle_index = self.cycles[partition]
        self.cycles[partition] += 1
        at = sent.sent_at + self.models[partition].cycle_s(sent.size.bytes, steps, size.bytes, cycle_index)
        heapq.heappush(self.arrivals, (at, next(self.seq), reply, parsed, size))

    def _row(self, closed: ClosedRound, wall_s: float) -> dict[str, Any]:
        return {**super()._row(closed, wall_s), "real_s": time.monotonic() - self.real_t0}
