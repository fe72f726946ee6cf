"""The server's round engine as a state machine: the scheduling every strategy shares (rounds, quorum, deadline,
rejoin, sampling, what is accepted once).

It decides what each client is sent and when, hands each accepted update to the strategy's server half
(``strategies.strategy.ServerHalf``: its sum, its step, its D and FedBuff's K, the vector a client is sent with a
global model), and closes rounds in order. It knows nothing of Flower: the glue in ``fl_server`` turns each
``Request`` into a message and each reply into ``Update``s.

Every message to a client carries the newest global model (when the client does not have it yet) and asks
for the updates it has ready; the client holds it until it has one (``edge.agent``). A client may train round t
once it holds the global model of round t − D − 1, so a message that brings the global model of round a lets it
train up to round a + D + 1. Up to ``window`` messages are kept in flight per client. With one (FedAvg, FedBuff,
partial participation) a client is sent nothing until the global model moves on, unless it has not yet given the
update the oldest open round waits for. With two (DGA, every client in every round) the client always holds a
message to answer when its next round is trained, so each round's update leaves as soon as it is ready while the
next rounds train, and a new global model is sent as soon as it exists, beyond the window. With a message path of
R seconds and rounds of T seconds, hiding the path then needs D ≥ ⌈R/T⌉ (with one in flight, D + 1 ≥ 2⌈R/T⌉: a
client replies, then waits a whole path for the next message to answer).

With partial participation (a ``Sampler`` of M of the N partitions per round) a client is asked only for the
rounds its partition is sampled in, and sent a message only when one of them is unlocked; ``strategies.sampling``
says what DGA's staleness bound and correction mean for a client that sat out rounds. A round closes when every
client sampled for it has answered it, or — stragglers — once ``quorum`` of them have contributed to it and
``deadline_s`` has passed since it became the oldest open round.

FedBuff (``buffer`` K ≥ 1, with D = 0) has no rounds to wait for: a "round" is a server step, which closes once K
usable updates are buffered, from whichever model each was trained on (a stale one enters the open step, weighted
by ``strategies.fedbuff.staleness_weight``; one that finds K there already, the next); a client is sent the
newest model after each step it did not yet contribute to, so it gives at most one update per step. A step closes
with fewer once every client sampled for it has answered it, some with an update refused as unusable (below): it
could never gather K.

A contribution is accepted once: late (its round is closed), repeated, or beyond what the client could legally
have trained is refused with the reason, and so is a payload that does not decode, or an update whose weight,
``num_examples``, is not positive or is more than its partition has (``partition_sizes``; the agent reports its
partition's size, ``edge.agent.Session.num_examples``, whatever the K local steps drew of it), so that no client
can set the mean by its weight alone; every update taken is clipped to the bound the other clients' norms set
(``strategies.validation``). An update refused as unusable still answers its round: the client has moved on and
will not train that round again, so the round closes without it (a round nobody could contribute to leaves the
global model where it was). A client whose last ``MAX_FAILED_REPLIES`` replies were all errors, malformed or
wholly refused as unusable is taken to fail for good; once one does and the oldest open round can no longer gather
its quorum without it, the engine is ``stuck``. A client is sent at most ``MAX_FAILED_REPLIES`` messages after
failures while the global model stays where it is: a node cannot make the server answer each bad reply with a new
message; and a round that has its quorum does not wait for a client that failed since the model last moved.

Clients come and go: a node that vanished is retired (its messages in flight are abandoned, never counted) and
a new node is a fresh client, sent the newest global model first (as deltas from the start model when
``clients_build_start``: every client builds the round-0 model from the run's seed itself). Updates are
accepted at most once per (partition, round), so a device that comes back under a new node id cannot
contribute a round twice, and a reply is whole or refused, so no aggregate holds part of an update.

Aggregation is the strategy's streaming sum (FedAvg's example-weighted mean) unless an ``Aggregator`` (a robust
rule, see ``fl_server.robust``) is given; then the round's decoded updates are kept until it closes. With a
``ServerMomentum`` (the codecs' ``gm=BETA``) a closed round moves the global model by the momentum mᵗ, not Δ̄ᵗ."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from strategies.codecs import Layout, MalformedUpdate, server_compressor
from strategies.fedavg import FedAvgServer, ServerMomentum, apply_update
from strategies.sampling import Sampler
from strategies.strategy import Contribution, RoundSum, ServerHalf
from strategies.validation import InfluenceBound, l2_norm, model_bound

MAX_FAILED_REPLIES = 5

Aggregator = Callable[[list[tuple[np.ndarray, int]]], np.ndarray]
"""A round's (dense update, num_examples) pairs → the update applied to the global model."""


@dataclass(frozen=True)
class Update:
    """One client's encoded update for one round: made by its agent, carried by one reply, taken in here."""

    round: int
    stype: str
    payload: bytes
    num_examples: int
    train_s: float = 0.0
    loss: float = float("nan")


@dataclass(frozen=True)
class Request:
    """What to send one client now. ``global_round`` is None when the client already has the newest model;
    ``held_round`` is the global round the client is known to hold (−1: none, or unsure after a failure)."""

    next_round: int
    last_round: int
    global_round: int | None
    global_params: np.ndarray | None
    held_round: int = -1
    resend: bool = False  # a reply of the client's was lost: it sends again every update it kept (edge.agent)
    state: np.ndarray | None = None  # with a global model: the strategy's vector for this client (message_state)


@dataclass(frozen=True)
class Rejection:
    """An update refused, and why; ``invalid``: the update itself is unusable (malformed, an outlier, ...), not
    merely late or repeated."""

    client: int
    round: int
    reason: str
    invalid: bool = True


@dataclass
class ClosedRound:
    round: int
    global_params: np.ndarray  # the global model after this round
    clients: list[int]
    train_s: list[float]
    losses: list[float]
    closed_by: str  # "all", "deadline" or (FedBuff) "buffer"
    momentum: np.ndarray  # the server's momentum mᵗ after this round (empty without global momentum)
    strategy_state: dict[str, np.ndarray] = field(default_factory=dict)  # the server half's state() after it
    clipped: list[int] = field(default_factory=list)  # clients whose update was clipped to its bound
    step_refused: str | None = None  # why the round's step was not applied (its mean or new model not finite)


@dataclass
class _Client:
    delivered: int = -1  # newest global round sent to it (−1: nothing yet)
    received: int = 0  # newest round it contributed
    in_flight: int = 0  # messages sent to it and not answered yet
    resend_global: bool = False  # a message to it failed: it may not hold the global model it was sent
    resend_updates: bool = False  # a reply of its was lost: ask it to send its kept updates again
    behind: bool = False  # its newest update came late (e.g. it just rejoined): ask it for the newest round
    failures: int = 0  # replies in a row that were errors, malformed or had every update refused as invalid
    failed_round: int = -1  # the newest global round when it last failed (its error or a malformed reply)
    failed_in_round: int = 0  # its failures while the global model stayed at ``failed_round``
    source: int | None = None  # the partition its replies name (None: none yet; its node id stands for it)


@dataclass
class _OpenRound:
    mean: RoundSum  # the strategy's sum (strategies.strategy.ServerHalf.open)
    updates: list[tuple[np.ndarray, int]] = field(default_factory=list)  # kept only for an Aggregator
    clients: list[int] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)  # clients whose update was refused as unusable: they answered
    held: list[tuple[Contribution, np.ndarray]] = field(default_factory=list)  # no bound yet: bounded at the close
    clipped: list[int] = field(default_factory=list)

    @property
    def answered(self) -> set[int]:
        return {*self.clients, *self.refused}


def pipeline_window(delay: int, buffer: int, everyone: bool) -> int:
    """Messages in flight per client: two for DGA when every client trains every round (a client always holds a
    message to answer with its next round), one otherwise (FedAvg's lock-step, FedBuff's one update per step,
    partial participation's clients that sit out rounds)."""
    return 2 if delay > 0 and not buffer and everyone else 1


def most_in_flight(window: int) -> int:
    """The most messages a client of ``window`` holds at once: with more than one in flight, a new global model is
    sent beyond the window (``RoundEngine.next_request``)."""
    return window + 1 if window > 1 else window


class RoundEngine:
    def __init__(
        self,
        initial_params: np.ndarray,
        layout: Layout,
        rounds: int,
        num_clients: int,
        quorum: float = 1.0,
        deadline_s: float | None = None,
        start_round: int = 0,
        aggregator: Aggregator | None = None,
        validator: InfluenceBound | None = None,
        clients_build_start: bool = False,
        momentum: ServerMomentum | None = None,
        sampler: Sampler | None = None,
        strategy: ServerHalf | None = None,
        window: int = 1,
        partition_sizes: Mapping[int, int] | None = None,
    ) -> None:
        """``strategy``: its server half (FedAvg's when None), which sets D and FedBuff's K and sums the updates.
        ``window``: messages kept in flight per client (``pipeline_window`` for the strategy).
        ``partition_sizes``: partition → its training examples, the most an update of it may claim, read as updates
        come (``fl_server.membership`` fills it in as nodes join); None: unchecked."""
        assert 0 < quorum <= 1, f"quorum must be in (0, 1], got {quorum}"  # RunConfig checks it (ConfigError)
        self.strategy = strategy or FedAvgServer()
        assert not (self.strategy.buffer and aggregator), "FedBuff's buffer takes the plain mean"  # settings check it
        self.global_params = initial_params.astype(np.float32, copy=True)
        self.layout = layout
        self.rounds = rounds
        self.num_clients = num_clients
        self.sampler = sampler or Sampler(0, num_clients, num_clients)
        self.per_round = self.sampler.per_round
        self.delay = self.strategy.delay
        self.buffer = self.strategy.buffer
        self.min_clients = self.buffer or max(1, math.ceil(quorum * self.per_round))
        self.window = window
        self.deadline_s = deadline_s
        self.aggregated = start_round
        self.aggregator = aggregator
        self.validator = validator
        self._start_held = start_round if clients_build_start else -1
        self.momentum = momentum
        self.partition_sizes = partition_sizes
        self._clients: dict[int, _Client] = {}
        self._contributed: dict[int, set[int]] = {}  # partition → rounds it sent an update for
        self._open: dict[int, _OpenRound] = {}
        self._oldest_open_since: float | None = None

    @property
    def done(self) -> bool:
        return self.aggregated >= self.rounds

    @property
    def stuck(self) -> bool:
        """The oldest open round can never close: a client sampled for it that failed its last ``MAX_FAILED_REPLIES``
        replies will not answer it, and its usable updates plus the clients that may still answer it are fewer than
        the quorum."""
        round_ = self.aggregated + 1
        failing = {
            source
            for source, c in self._by_source().items()
            if c.failures >= MAX_FAILED_REPLIES and self.sampler.trains(source, round_)
        }
        if not failing:
            return False
        answered = {source for source, rounds in self._contributed.items() if round_ in rounds}
        open_round = self._open.get(round_)
        usable = len(open_round.clients) if open_round else 0
        answered |= open_round.answered if open_round else set()
        return usable + self.per_round - len(answered | failing) < self.min_clients

    def _by_source(self) -> dict[int, _Client]:
        """Each client by what it trains: its partition, or its node id while it has named none."""
        return {client if c.source is None else c.source: c for client, c in self._clients.items()}

    def start_clock(self, now: float) -> None:
        self._oldest_open_since = now

    def next_request(self, client: int, partition: int | None = None) -> Request | None:
        """The message to send ``client`` (training ``partition``; its node id stands for it when None) now, or
        None while one is in flight, none of the rounds it may train is sampled for it, or one would bring nothing
        new and ask for nothing a round waits for."""
        c = self._clients.setdefault(client, _Client())
        c.source = c.source if partition is None else partition
        new_global = self.aggregated > c.delivered or c.resend_global
        limit = most_in_flight(self.window) if new_global else self.window  # a new global model goes at once
        if self.done or c.in_flight >= limit or self._failed_enough(c):
            return None
        frontier = min(self.rounds, self.aggregated + self.delay + 1)
        if not self.sampler.everyone and c.received <= self.aggregated:
            frontier = min(frontier, self.aggregated + 1)  # nothing of its own in flight: see strategies.sampling
        next_round = max(c.received, self.aggregated) + 1
        if c.behind:  # skip the rounds that will close before its reply arrives, so that it catches up
            next_round = max(next_round, frontier)
        source = client if c.source is None else c.source
        next_round = self.sampler.next_round(source, next_round, frontier)
        if next_round is None or (self.buffer and source in self._open_answered()):
            return None
        if not new_global and (next_round > frontier or (self.window == 1 and c.received > self.aggregated)):
            return None
        c.in_flight += 1
        resend, c.resend_updates = c.resend_updates, False
        if not new_global:
            return Request(next_round, frontier, None, None, resend=resend)
        held_round = -1 if c.resend_global else max(c.delivered, self._start_held)
        c.delivered = self.aggregated
        c.resend_global = False
        state = self.strategy.message_state(source)
        return Request(next_round, frontier, self.aggregated, self.global_params, held_round, resend, state)

    def assign(self, client: int, round_: int, global_round: int | None, global_params: np.ndarray | None) -> Request:
        """A message that asks ``client`` for exactly ``round_``, bringing the global model of ``global_round`` when
        not None: how a simulated clock (``fl_server.simulation``) asks for what the deployment's agent would train
        next, from the global model that has reached the device by then."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight += 1
        if global_round is None:
            return Request(round_, round_, None, None)
        held_round = -1 if c.resend_global else max(c.delivered, self._start_held)
        c.delivered, c.resend_global = max(c.delivered, global_round), False
        state = self.strategy.message_state(client if c.source is None else c.source)
        return Request(round_, round_, global_round, global_params, held_round, state=state)

    def receive(self, client: int, updates: list[Update], partition: int | None = None) -> list[Rejection]:
        """Take one reply's updates; returns what was refused and why. ``partition`` (the reply's partition id;
        the node id when None) is what an update is accepted once per round for, and what closed rounds list."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight = max(0, c.in_flight - 1)
        source = client if partition is None else partition
        c.source = source
        rejections = []
        for item in updates:
            if rejection := self._admit(source, c, item):
                rejections.append(rejection)
        if updates:
            c.failures = c.failures + 1 if sum(r.invalid for r in rejections) == len(updates) else 0
        return rejections

    def fail(self, client: int, raised: bool = True) -> None:
        """A message to ``client`` came back as an error: it may not have the global model, so send it again, and a
        reply of its may have been lost, so ask for its kept updates again. ``raised``: the client itself failed
        (e.g. its training gave NaN), which counts toward ``stuck`` and toward ``MAX_FAILED_REPLIES`` a round; a
        message the network or the SuperLink lost does not."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight = max(0, c.in_flight - 1)
        c.resend_global = c.resend_updates = True
        c.failures += raised
        if raised:
            self._failed_once(c)

    def malformed(self, client: int) -> None:
        """``client``'s reply could not be read (``contract.wire``): its failure, and nothing else changes."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight = max(0, c.in_flight - 1)
        c.failures += 1
        self._failed_once(c)

    def lost(self, client: int) -> None:
        """The reply to a message to ``client`` was taken from someone else (and refused: it did not echo the
        message's key). Flower's SuperLink keeps one reply per message, so the client's own will be refused as a
        duplicate: its next message asks it to send again every update it has kept. Not counted as ``client``'s
        failure: Flower's SuperLink takes a reply to a message from any node that names it, so a wrong key says
        nothing of who sent it, and counting it would let one node make another fail."""
        c = self._clients.setdefault(client, _Client())
        c.in_flight = max(0, c.in_flight - 1)
        c.resend_updates = True

    def _failed_once(self, c: _Client) -> None:
        """One more failure of ``c``'s while the global model is where it is."""
        if c.failed_round != self.aggregated:
            c.failed_round, c.failed_in_round = self.aggregated, 0
        c.failed_in_round += 1

    def _failed_since_moved(self, c: _Client) -> bool:
        return c.failed_round == self.aggregated

    def _failed_enough(self, c: _Client) -> bool:
        """``c`` failed ``MAX_FAILED_REPLIES`` times since the global model last moved: it is sent nothing more
        until it moves (a node that answers every message wrongly cannot make the server send it thousands)."""
        return self._failed_since_moved(c) and c.failed_in_round >= MAX_FAILED_REPLIES

    def retire(self, client: int) -> None:
        """``client``'s node is gone: forget it and its messages in flight. Its updates already taken stay."""
        self._clients.pop(client, None)

    def _open_answered(self) -> set[int]:
        open_round = self._open.get(self.aggregated + 1)
        return open_round.answered if open_round else set()

    def _admit(self, source: int, c: _Client, item: Update) -> Rejection | None:
        contributed = self._contributed.setdefault(source, set())
        if item.round in contributed:
            return Rejection(source, item.round, "repeated: this client already sent an update for that round", False)
        if self.buffer and source in self._open_answered():
            return Rejection(source, item.round, "repeated: this client already gave an update to this step", False)
        if item.round <= self.aggregated and not self.buffer:
            contributed.add(item.round)
            c.received = max(c.received, item.round)
            c.behind = True
            return Rejection(source, item.round, "late: the round was already closed", False)
        if item.round > min(self.rounds, c.delivered + self.delay + 1):
            return Rejection(source, item.round, "unrequested: the client could not have trained that round yet")
        if not self.sampler.trains(source, item.round):
            return Rejection(source, item.round, "unrequested: the client is not sampled for that round")
        target = item.round
        if self.buffer:  # FedBuff: an update enters the first open step that has room (K updates) and not its client
            target = self.aggregated + 1
            while (step := self._open.get(target)) and (len(step.clients) >= self.buffer or source in step.answered):
                target += 1
        open_round = self._open.get(target) or _OpenRound(self._accumulator())
        self._open[target] = open_round
        contributed.add(item.round)
        c.received = max(c.received, item.round)
        update = self._decode(source, item)
        if isinstance(update, str):
            open_round.refused.append(source)
            return Rejection(source, item.round, update)
        contribution = Contribution(source, item.round, target, item.num_examples)
        bound = self.validator.bound(source) if self.validator else None
        if self.validator and bound is None:
            open_round.held.append((contribution, update))  # nobody else's norm is known yet: see _release_held
        else:
            self._take(open_round, contribution, update, bound)
        open_round.clients.append(source)
        open_round.train_s.append(item.train_s)
        open_round.losses.append(item.loss)
        c.behind = False
        return None

    def _take(
        self, open_round: _OpenRound, contribution: Contribution, update: np.ndarray, bound: float | None
    ) -> None:
        """An update into its round's sum (or the Aggregator's list), clipped to ``bound``
        (``strategies.validation``)."""
        if self.validator:
            clipped = self.validator.clip(contribution.source, update, bound)
            update = clipped.update
            if clipped.clipped:
                open_round.clipped.append(contribution.source)
        if self.aggregator:
            open_round.updates.append((update, contribution.num_examples))
        else:
            self.strategy.add(open_round.mean, update, contribution)

    def _release_held(self, open_round: _OpenRound) -> None:
        """The updates that came before any other client's norm was known, each bounded by the round's others (and
        any norm recorded since), or by the global model's norm when it has no other."""
        assert self.validator is not None  # only a validator holds updates
        norms = {contribution.source: l2_norm(update) for contribution, update in open_round.held}
        bounds = [self.validator.bound(c.source, norms) or model_bound(self.global_params) for c, _ in open_round.held]
        for (contribution, update), bound in zip(open_round.held, bounds, strict=True):
            self._take(open_round, contribution, update, bound)
        open_round.held.clear()

    def _accumulator(self) -> RoundSum:
        return self.strategy.open(self.global_params.size)

    def _decode(self, source: int, item: Update) -> np.ndarray | str:
        """The dense update, decoded once for validation and aggregation alike; or why it cannot be aggregated."""
        if item.num_examples <= 0:
            return "num_examples must be positive"
        if self.partition_sizes is not None:
            size = self.partition_sizes.get(source)
            if size is None:
                return f"num_examples cannot be checked: the size of partition {source} is not known"
            if item.num_examples > size:
                return f"num_examples {item.num_examples} is more than partition {source}'s {size} training examples"
        try:
            update = server_compressor(item.stype).decode(item.payload, self.layout)
        except MalformedUpdate as exc:
            return f"malformed: {exc}"
        return update

    def close_rounds(self, now: float) -> list[ClosedRound]:
        """Close every round that can be closed, oldest first, moving the global model."""
        closed = []
        while not self.done:
            round_ = self.aggregated + 1
            open_round = self._open.get(round_)
            count = len(open_round.clients) if open_round else 0
            if self.buffer:
                if count >= self.buffer:
                    how = "buffer"
                elif open_round and self._all_answered(round_, open_round):
                    how = "all"
                else:
                    break
            elif open_round and self._all_in(round_, open_round):
                how = "all"
            elif count >= self.min_clients and self._deadline_passed(now):
                how = "deadline"
            else:
                break
            del self._open[round_]
            refused = None
            if count:
                if open_round.held:
                    self._release_held(open_round)
                refused = self._step(open_round)
            self.aggregated = round_
            self._oldest_open_since = now
            closed.append(
                ClosedRound(
                    round_,
                    self.global_params,
                    open_round.clients,
                    open_round.train_s,
                    open_round.losses,
                    how,
                    self.momentum.buffer.copy() if self.momentum else np.zeros(0, np.float32),
                    self.strategy.state(),
                    open_round.clipped,
                    refused,
                )
            )
        return closed

    def _step(self, open_round: _OpenRound) -> str | None:
        """Move the global model by the round's step; or leave it where it was and say why: a mean update or a new
        model that is not finite is refused as a whole (the server's momentum too is left as it was)."""
        mean = self.aggregator(open_round.updates) if self.aggregator else open_round.mean.mean()
        if not np.isfinite(mean).all():
            return "the round's mean update is not finite"
        mean = self.strategy.close(open_round.mean, mean)
        before = self.momentum.buffer.copy() if self.momentum else None
        step = self.momentum.step(mean) if self.momentum else mean
        with np.errstate(over="ignore"):  # checked below
            params = apply_update(self.global_params, step)
        if not np.isfinite(params).all():
            if self.momentum and before is not None:
                self.momentum.buffer = before
            return "the new global model is not finite"
        self.global_params = params
        return None

    def _all_in(self, round_: int, open_round: _OpenRound) -> bool:
        """Every client sampled for ``round_`` has answered it, or (once it has its quorum) has failed since the global
        model last moved: the round does not wait for those (a node failing on purpose cannot hold every round to its
        deadline; an honest one that failed is asked again, and its update, if late, is refused as late)."""
        answered = len(open_round.clients) + len(open_round.refused)
        if answered >= self.per_round:
            return True
        if len(open_round.clients) < self.min_clients:
            return False
        given_up = sum(
            self._failed_since_moved(c) and self.sampler.trains(source, round_) and source not in open_round.answered
            for source, c in self._by_source().items()
        )
        return answered + given_up >= self.per_round

    def _all_answered(self, round_: int, open_round: _OpenRound) -> bool:
        """Every client sampled for FedBuff's step ``round_`` has answered it (a stale update that entered it from a
        client not sampled for it does not count)."""
        return sum(self.sampler.trains(source, round_) for source in open_round.answered) >= self.per_round

    @property
    def deadline_at(self) -> float | None:
        """When the oldest open round's deadline passes (on the clock of ``close_rounds``' ``now``), if it has one."""
        since = self._oldest_open_since
        return None if self.deadline_s is None or since is None else since + self.deadline_s

    def _deadline_passed(self, now: float) -> bool:
        return self.deadline_at is not None and now >= self.deadline_at
