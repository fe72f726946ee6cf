"""The server's round engine as a state machine, shared by FedAvg (D = 0) and DGA (D ≥ 1).

It decides what each client is sent and when, collects encoded updates into per-round weighted means, and
closes rounds in order. It knows nothing of Flower: the glue in ``fl_server`` turns each ``Request`` into a
message and each reply into ``Contribution``s.

Every message to a client carries the newest global model (when the client does not have it yet) and asks
for the updates it has ready. A client may train round t once it holds the global model of round t − D − 1,
so with D ≥ 1 the engine keeps a second message queued per client: the client then never waits on the
server between messages, and keeps training while its updates travel.

A round closes when every client has contributed, or — stragglers — once ``quorum`` of the clients have and
``deadline_s`` has passed since it became the oldest open round. A contribution is accepted once: late
(its round is closed), repeated, or beyond what the client could legally have trained is refused with the
reason, and so is a payload that does not decode."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from strategies.codecs import Layout, MalformedUpdate, server_compressor
from strategies.fedavg import WeightedMean, apply_update

MAX_IN_FLIGHT = 2


@dataclass(frozen=True)
class Contribution:
    """One client's update for one round, as it came off the wire."""

    round: int
    num_examples: int
    stype: str
    payload: bytes
    train_s: float = 0.0
    loss: float = float("nan")


@dataclass(frozen=True)
class Request:
    """What to send one client now. ``global_round`` is None when the client already has the newest model."""

    next_round: int
    last_round: int
    global_round: int | None
    global_params: np.ndarray | None


@dataclass(frozen=True)
class Rejection:
    client: int
    round: int
    reason: str


@dataclass
class ClosedRound:
    round: int
    global_params: np.ndarray  # the global model after this round
    clients: list[int]
    train_s: list[float]
    losses: list[float]
    closed_by: str  # "all" or "deadline"


@dataclass
class _Client:
    delivered: int = -1  # newest global round sent to it (−1: nothing yet)
    received: int = 0  # newest round it contributed
    in_flight: int = 0
    rounds: set[int] = field(default_factory=set)


@dataclass
class _OpenRound:
    mean: WeightedMean
    clients: list[int] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


class RoundEngine:
    def __init__(
        self,
        initial_params: np.ndarray,
        layout: Layout,
        rounds: int,
        num_clients: int,
        delay: int = 0,
        quorum: float = 1.0,
        deadline_s: float | None = None,
        start_round: int = 0,
    ) -> None:
        if not 0 < quorum <= 1:
            raise ValueError(f"quorum must be in (0, 1], got {quorum}")
        self.global_params = initial_params.astype(np.float32, copy=True)
        self.layout = layout
        self.rounds = rounds
        self.num_clients = num_clients
        self.delay = delay
        self.min_clients = max(1, math.ceil(quorum * num_clients))
        self.deadline_s = deadline_s
        self.aggregated = start_round
        self._clients: dict[int, _Client] = {}
        self._open: dict[int, _OpenRound] = {}
        self._oldest_open_since: float | None = None

    @property
    def done(self) -> bool:
        return self.aggregated >= self.rounds

    def start_clock(self, now: float) -> None:
        self._oldest_open_since = now

    def next_request(self, client: int) -> Request | None:
        """The message to send ``client`` now, or None when one would not let it make progress."""
        c = self._clients.setdefault(client, _Client())
        if self.done or c.in_flight >= MAX_IN_FLIGHT:
            return None
        next_round = max(c.received, self.aggregated) + 1
        frontier = min(self.rounds, self.aggregated + self.delay + 1)
        new_global = self.aggregated > c.delivered
        # Every message in flight returns at least one update, so only ask for updates it can still train.
        if not new_global and frontier - next_round + 1 <= c.in_flight:
            return None
        c.in_flight += 1
        if not new_global:
            return Request(next_round, frontier, None, None)
        c.delivered = self.aggregated
        return Request(next_round, frontier, self.aggregated, self.global_params)

    def receive(self, client: int, contributions: list[Contribution]) -> list[Rejection]:
        """Take one reply's updates; returns what was refused and why."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight = max(0, c.in_flight - 1)
        rejections = []
        for item in contributions:
            reason = self._admit(client, c, item)
            if reason:
                rejections.append(Rejection(client, item.round, reason))
        return rejections

    def _admit(self, client: int, c: _Client, item: Contribution) -> str | None:
        if item.round in c.rounds:
            return "repeated: this client already sent an update for that round"
        if item.round <= self.aggregated:
            c.rounds.add(item.round)
            c.received = max(c.received, item.round)
            return "late: the round was already closed"
        if item.round > min(self.rounds, c.delivered + self.delay + 1):
            return "unrequested: the client could not have trained that round yet"
        if item.num_examples <= 0:
            return "num_examples must be positive"
        open_round = self._open.get(item.round) or _OpenRound(WeightedMean(self.global_params.size))
        try:
            open_round.mean.add(server_compressor(item.stype), item.payload, self.layout, item.num_examples)
        except MalformedUpdate as exc:
            return f"malformed: {exc}"
        self._open[item.round] = open_round
        open_round.clients.append(client)
        open_round.train_s.append(item.train_s)
        open_round.losses.append(item.loss)
        c.rounds.add(item.round)
        c.received = max(c.received, item.round)
        return None

    def close_rounds(self, now: float) -> list[ClosedRound]:
        """Close every round that can be closed, oldest first, moving the global model."""
        closed = []
        while not self.done:
            round_ = self.aggregated + 1
            open_round = self._open.get(round_)
            count = len(open_round.clients) if open_round else 0
            if count >= self.num_clients:
                how = "all"
            elif count >= self.min_clients and self._deadline_passed(now):
                how = "deadline"
            else:
                break
            del self._open[round_]
            self.global_params = apply_update(self.global_params, open_round.mean.mean())
            self.aggregated = round_
            self._oldest_open_since = now
            closed.append(
                ClosedRound(round_, self.global_params, open_round.clients, open_round.train_s, open_round.losses, how)
            )
        return closed

    def _deadline_passed(self, now: float) -> bool:
        since = self._oldest_open_since
        return self.deadline_s is not None and since is not None and now - since >= self.deadline_s
