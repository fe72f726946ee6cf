"""The server of a run on Flower's Simulation Engine (``--federation simulation``, started by
``edgefl.simulation``): the deployment's server loop, round engine, strategies and codecs, on a virtual clock.

The clock: the server keeps a modelled time instead of this host's, and takes replies in modelled arrival order,
not in the order Ray finishes them, so asynchronous strategies see the arrival order the links and devices imply
and a round's deadline passes at its modelled time. rounds.jsonl's ``wall_s`` and the summary's times are
modelled seconds; ``real_s`` in each row is this host's. Two ways of timing a client:

- FedAvg and DGA with every client in every round run the deployment's pipeline (``edge.agent`` with two messages
  in flight, ``strategies.rounds``): each client is a ``netem.clock.ClientTimeline`` — one trainer, round after
  round, each round started once the trainer is free and a global model it may start from has reached the
  device (a global model reaches it ``down_s`` after its round closes), each update at the server ``up_s`` after
  it is trained. When the message for a client's next round is due to leave (``down_s`` before the round starts),
  Ray is sent a message that asks for the round open then, bringing the newest global model that will have
  reached the device when the round starts: each round trains from the model the deployment's agent would hold,
  and a slow client's round that closes before its message lands is still trained, and late, as on the testbed.
  The clock moves to the next departure or arrival once no message in flight can still arrive earlier.
- FedBuff and partial participation are timed per message: a message pushed at time s is answered, at DGA's
  staleness bound, at s + ``ClientModel.cycle_s`` of its bytes each way and the steps its reply trained; a reply
  is taken once every message in flight has been answered (none can then arrive earlier).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections import Counter
from typing import Any

import numpy as np
import torch
from flwr.app import Message

from contract.messages import TrainInstruction, TrainReply
from contract.settings import RunConfig
from contract.transport import SIMULATION
from contract.wire import WireSize, train_message, wire_size
from fl_server.engine import ServerLoop, parsed_reply
from ml.data import load_dataset
from ml.models import build_model
from ml.trainer import seconds_per_step
from netem.clock import (
    DEVICE_FIXED_S,
    DEVICE_S_PER_MB,
    MESSAGE_FIXED_S,
    MESSAGE_RTTS,
    POOLED_CONNECTIONS,
    ClientModel,
    ClientTimeline,
    client_models,
)
from netem.fleet import devices_for, links_for
from netem.profiles import BUILTIN_LINKS
from strategies.downlink import DENSE_STYPE, NO_BASE, Broadcast, Part, dense_payload, model_digest
from strategies.rounds import ClosedRound, Request


def host_step_s(config: RunConfig) -> float:
    """This host's median seconds per local step of the run's model and batch on one thread: the clock's unit.
    Measure it while nothing else runs (before Ray starts its workers)."""
    torch.set_num_threads(1)
    dataset = load_dataset(config.dataset, config.data_dir or None)
    model = build_model(dataset, config.seed, config.model)
    return seconds_per_step(model, dataset, config.batch_size, config.lr, config.momentum, config.seed)


class ModelledArrivals:
    """A simulation's ``ReplySource``: replies taken from Ray in modelled arrival order, on the virtual clock
    (module docstring)."""

    transport = SIMULATION

    def __init__(self, config: RunConfig, step_s: float) -> None:
        """``step_s``: this host's seconds per local step (``host_step_s``, measured before Ray starts)."""
        torch.set_num_threads(1)
        self.config = config
        self.step_s = step_s
        links = links_for(config) or [BUILTIN_LINKS["lan"]] * config.clients
        self.models: list[ClientModel] = client_models(links, devices_for(config), self.step_s, config.step_key)
        self.cycles: Counter[int] = Counter()  # partition → message cycles it made (the first pay slow start)
        self.last_model: dict[int, float] = {}  # partition → when its last model went either way (cold_share)
        self.timelines: dict[int, ClientTimeline] = {}  # partition → its pipeline, once the clock runs
        self.starting: dict[str, tuple[int, float]] = {}  # message → (partition, when its round starts)
        self.held: dict[int, int] = {}  # partition → the newest global round sent to it
        self.down_bytes = 0  # a message with a dense global model (measured when the clock starts)
        self.clock = 0.0
        self.arrivals: list[tuple[float, int, Message, Any, WireSize]] = []  # a heap of (modelled arrival, seq,
        # reply, parsed reply, its size): replies Ray has finished that the clock has not reached yet
        self.seq = itertools.count()
        self.real_t0 = time.monotonic()

    def attach(self, loop: ServerLoop) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.pipelined = (  # see the module docstring
            not loop.strategy.buffer and self.engine.sampler.everyone and self.config.compress_down == "none"
        )
        self.globals: dict[int, np.ndarray] = {self.engine.aggregated: self.engine.global_params}

    def now(self) -> float:
        return self.clock

    def wait(self, timeout_s: float) -> None:
        """Ray's workers are training what was sent: look again in ``timeout_s``."""
        time.sleep(timeout_s)

    def row(self) -> dict[str, Any]:
        return {"real_s": time.monotonic() - self.real_t0}

    def summary(self) -> dict[str, Any]:
        return {
            "transport": SIMULATION,
            "clock": {
                "host_step_s": self.step_s,
                "message_fixed_s": MESSAGE_FIXED_S,
                "message_rtts": MESSAGE_RTTS,
                "pooled_connections": POOLED_CONNECTIONS,
                "device_fixed_s": DEVICE_FIXED_S,
                "device_s_per_mb": DEVICE_S_PER_MB,
                "pipelined": self.pipelined,
            },
            "real_s": time.monotonic() - self.real_t0,
        }

    def start(self) -> None:
        if not self.pipelined:
            return
        start_round, params = self.engine.aggregated, self.engine.global_params
        first = wire_size(self._dense_message(0, Request(start_round + 1, start_round + 1, None, None)))
        self.down_bytes = wire_size(self._dense_message(0, Request(1, 1, start_round, params))).bytes
        for partition, model in enumerate(self.models):
            timeline = ClientTimeline(model, self.config.local_steps, self.engine.delay)
            timeline.next_round = start_round + 1
            if start_round == 0:  # every client builds the seeded start model itself: the first message names it
                timeline.arrivals.append((self.clock + model.down_s(first.bytes, 0), start_round))
            else:  # a resumed run: the first message brings the checkpoint's model, dense
                timeline.global_sent(self.clock, start_round, self.down_bytes)
            self.held[partition] = -1  # nothing delivered yet
            self.timelines[partition] = timeline

    def round_closed(self, closed: ClosedRound, now: float) -> None:
        if self.pipelined:
            self.globals[closed.round] = closed.global_params
            for old in [r for r in self.globals if r < closed.round - self.engine.delay - 1]:
                del self.globals[old]  # no round can start from it any more
            for timeline in self.timelines.values():
                timeline.global_sent(now, closed.round, self.down_bytes)

    def push(self) -> bool:
        if not self.pipelined:
            return self.loop.push_requests()
        busy = bool(self.loop.send(self.loop.identify_messages()))  # the rounds wait for the clock (start)
        for node, partition in sorted(self.loop.members.admitted.items()):
            if not self.timelines:
                break
            timing = self._departure(partition)
            if timing is None or timing[1] > self.clock:
                continue
            (start, leaves), timeline = timing, self.timelines[partition]
            newest = timeline.newest_by(start)
            fresh = newest if newest > self.held[partition] else None
            request = self.engine.assign(node, timeline.next_round, fresh, self.globals.get(newest))
            [msg_id] = self.loop.send([(self._dense_message(node, request), False)])
            if fresh is not None:
                self.held[partition] = fresh
            sent = self.loop.outstanding[msg_id]
            self.loop.outstanding[msg_id] = dataclasses.replace(sent, sent_at=leaves)
            self.starting[msg_id] = (partition, start)
            busy = True
        return busy

    def pull(self) -> bool:
        if self.timelines:
            return self._pull_pipelined()
        arrived = {reply.metadata.reply_to_message_id for _, _, reply, _, _ in self.arrivals}
        waiting = [msg_id for msg_id in self.loop.outstanding if msg_id not in arrived]
        replies = list(self.loop.grid.pull_messages(waiting)) if waiting else []
        for reply in replies:
            self._arrive(reply)
        if not self.arrivals or len(self.arrivals) < len(self.loop.outstanding):
            return bool(replies)
        at = self.arrivals[0][0]
        deadline = self.engine.deadline_at
        if deadline is not None and self.clock <= deadline < at:
            self.clock = deadline  # the deadline comes first: a round it closes sends the next before `at`
            if self.loop.close_rounds():
                return True
        _, _, reply, parsed, size = heapq.heappop(self.arrivals)
        self.clock = max(self.clock, at)
        self.loop.settle(reply, parsed, size, self.clock)
        return True

    def _dense_message(self, node: int, request: Request) -> Message:
        """The request with its global model dense: which model reaches a device first depends on the modelled
        clock, so the broadcast is not a delta of the one before (hence pipelined runs take ``--compress-down
        none``)."""
        broadcast = None
        if request.global_round is not None and request.held_round == request.global_round:  # it built it itself
            broadcast = Broadcast(request.held_round, (), model_digest(request.global_params))
        elif request.global_round is not None:
            part = Part(request.global_round, DENSE_STYPE, dense_payload(request.global_params))
            broadcast = Broadcast(NO_BASE, (part,), model_digest(request.global_params))
        instruction = TrainInstruction(
            self.loop.job, request.next_round, request.last_round, broadcast, state=request.state
        )
        return train_message(instruction, node)

    def _next_start(self, partition: int) -> float | None:
        """When the partition's next round starts (``ClientTimeline.start_s``); None while its last one is not back
        from Ray, it has none left, or no global model it may start from has been sent. A round that closed
        before its message left is skipped: the deployment's next message tells the agent to."""
        timeline = self.timelines[partition]
        timeline.next_round = max(timeline.next_round, self.engine.aggregated + 1)
        if timeline.next_round > self.config.rounds or any(p == partition for p, _ in self.starting.values()):
            return None
        return timeline.start_s()

    def _departure(self, partition: int) -> tuple[float, float] | None:
        """When the partition's next round starts, and when its message leaves the server: ``down_s`` before (it
        asks for the round open then, even if that round closes before the message lands); None: see
        ``_next_start``."""
        start = self._next_start(partition)
        if start is None:
            return None
        timeline = self.timelines[partition]
        return start, start - timeline.model.down_s(self.down_bytes, timeline.cycles)

    def _pull_pipelined(self) -> bool:
        """Take Ray's answers, then move the clock to the next event — a round's start (``push`` sends it) or an
        update's arrival (settled) — once no message Ray has not answered yet can arrive before it."""
        arrived = {reply.metadata.reply_to_message_id for _, _, reply, _, _ in self.arrivals}
        waiting = [msg_id for msg_id in self.loop.outstanding if msg_id not in arrived]
        replies = list(self.loop.grid.pull_messages(waiting)) if waiting else []
        for reply in replies:
            self._arrive(reply)
        answered = {reply.metadata.reply_to_message_id for _, _, reply, _, _ in self.arrivals}
        earliest = min(  # no unanswered message arrives before its training is done
            (
                start + self.timelines[p].round_s
                for msg_id, (p, start) in self.starting.items()
                if msg_id not in answered
            ),
            default=math.inf,
        )
        timings = [self._departure(partition) for partition in self.timelines]
        next_departure = min((leaves for _, leaves in filter(None, timings)), default=math.inf)
        next_arrival = self.arrivals[0][0] if self.arrivals else math.inf
        upcoming = min(next_departure, next_arrival)
        if upcoming == math.inf or upcoming > earliest:
            return bool(replies)
        deadline = self.engine.deadline_at
        if deadline is not None and self.clock <= deadline < upcoming:
            self.clock = deadline  # the deadline comes first
            if self.loop.close_rounds():
                return True
        self.clock = max(self.clock, upcoming)
        if next_departure <= next_arrival:
            return True  # push sends the message that leaves now
        _, _, reply, parsed, size = heapq.heappop(self.arrivals)
        self.loop.settle(reply, parsed, size, self.clock)
        return True

    def _arrive(self, reply: Message) -> None:
        """A reply Ray has finished: when it arrives on the clock. Identity answers are taken at once (the clock
        starts with the first round)."""
        parsed, size = parsed_reply(reply), wire_size(reply)
        message_id = reply.metadata.reply_to_message_id
        sent = self.loop.outstanding[message_id]
        if sent.identify:
            self.loop.settle(reply, parsed, size, self.clock)
            return
        if message_id in self.starting:
            partition, start = self.starting.pop(message_id)
            timeline = self.timelines[partition]
            at = timeline.train(start, size.bytes)
            parsed = self._on_device(parsed, partition, held_s=timeline.round_s)  # the rest of the trip: its path
            heapq.heappush(self.arrivals, (at, next(self.seq), reply, parsed, size))
            return
        steps = len(parsed.updates) * self.config.local_steps if isinstance(parsed, TrainReply) else 0
        partition = self.loop.members.admitted[sent.node]
        parsed = self._on_device(parsed, partition)
        cycle_index = self.cycles[partition]
        self.cycles[partition] += 1
        idle_s = sent.sent_at - self.last_model.get(partition, sent.sent_at)
        at = sent.sent_at + self.models[partition].cycle_s(sent.size.bytes, steps, size.bytes, cycle_index, idle_s)
        self.last_model[partition] = max(self.last_model.get(partition, at), at)
        heapq.heappush(self.arrivals, (at, next(self.seq), reply, parsed, size))

    def _on_device(self, parsed: TrainReply | str | None, partition: int, **changes: float) -> Any:
        """A reply as the client's device would have sent it: each update trained in the device's time (the
        clock's), not in the seconds this host's worker took; ``changes``: other fields of the reply."""
        if not isinstance(parsed, TrainReply):
            return parsed
        train_s = self.config.local_steps * self.models[partition].step_s
        updates = tuple(dataclasses.replace(update, train_s=train_s) for update in parsed.updates)
        return dataclasses.replace(parsed, updates=updates, **changes)
