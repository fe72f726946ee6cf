"""The virtual clock of a simulated federation: how long a message cycle would take a client on its link and
device, so that a run on Flower's Simulation Engine reports modelled seconds instead of this host's.

A message cycle (the server pushes a message, the client trains the rounds it brings and replies) takes

    t = F + (F_d + H·(b_down + b_up)) / c + R·rtt + 8·b_down / r_down + s·σ + 8·b_up / r_up
        [+ S(b_down) + S(b_up) in a client's first C cycles]

- F = ``MESSAGE_FIXED_S``: edgefl's message path over a link with no delay, less the device's own work — the
  SuperNode's poll, the server's push and pull, the SuperLink;
- F_d = ``DEVICE_FIXED_S`` and H = ``DEVICE_S_PER_MB``: what the device itself spends on a message cycle, in
  seconds of one core of this host, besides and per MB of its bytes (its SuperNode's requests and TLS, Flower's
  object (de)serialization and hashing, the hand-over to the agent over the device's channel), taking 1/c as long
  on a device whose messaging cores are a share c of this host's (``contract.devices.DeviceShares.message``);
  the three measured on the testbed by ``bench/calibration.py --fit`` from FedAvg over lan with two model sizes on
  emulated Raspberry Pi 4s: the CPU their messaging cores spent on a cycle, and the message path
  (``fit_message_terms``);
- R = ``MESSAGE_RTTS`` (5): the link round trips a cycle costs, the sequential requests of Flower's protocol
  counted in the same bench (PullMessages, the message's objects, ConfirmMessageReceived, PushMessages, the
  reply's objects). That bench's long-distance path (2.89 s) held 3 more, slow start on connections that had not
  carried a model yet, which is the last term;
- r: a direction's rate, capped where loss binds by TCP's steady-state throughput (Mathis et al. 1997):
  r ≤ (MSS / rtt)·√(3/2) / √p for loss p, with MSS = 1448 B;
- s local steps, σ = the host's measured seconds per step on one core divided by the device's training share
  (``contract.devices``: the same shares the testbed's CPU caps use), or the step the device measured itself for
  the run's model (a profile file's ``train_step``);
- S(b) = slow start: what a transfer of b bytes costs over a warm one when it starts from TCP's initial window
  (IW = 10 segments, RFC 6928), which doubles every round trip until it holds the path's bandwidth-delay product
  (:func:`slow_start_s`). Flower's SuperNode moves a message's objects (Message, RecordDict, ConfigRecord:
  ``contract.wire``) in parallel HTTP/1.1 requests, each on a pooled TCP connection of its own, so a model meets
  each of C = ``POOLED_CONNECTIONS`` (3) connections new once each way: the clock charges these to a client's
  first C cycles. Connections idle for ``KEEPALIVE_S`` (60 s: what edgefl's SuperNode keeps them,
  ``contract.transport``; httpx's own is 5 s) are closed but for the one the SuperNode's polls keep open, so a
  model that goes more than that after the last model went either way (the pooled connections carry both ways'
  models) pays (C − 1)/C of S(b) in expectation (``cold_share``): FedAvg's way up when a round trains longer, DGA's
  pipeline, whose models go every round, mostly not. Since ``contract.transport.BulkApart`` the SuperNode keeps
  objects up, objects down and its polls on pools apart, so after such a spell a model meets only connections cold
  its way: the clock's (C − 1)/C, counted from a model either way, undercounts that case (rounds over 60 s apart);
  and since ``contract.transport.WarmLanes`` a model goes on the connection that carried the most its way when it
  is the first of its message's objects to ask (Flower asks for the leaves first; the rest race), so a client meets
  a new connection with a model about twice each way in a run (``bench/connections.py`` on twelve-round runs over
  long-distance: 7-11 of 44-48 transfers a run of four devices, FedAvg and DGA alike), where the clock charges its
  first C cycles. Neither is changed yet: both move the fitted constants below (``bench/calibration.py --fit``). A
  connection kept open keeps its window over an idle spell (``bench/idle_transfer.py``: on the testbed, with BBR, a
  transfer after 3 s idle takes what a warm one does; cubic with ``net.ipv4.tcp_slow_start_after_idle`` restarts
  from IW, which the clock does not model).

Jitter averages out and is left out. The cycle splits into the message's way down (F/2, F_d/2 and b_down's
handling, ``DOWN_RTTS`` round trips, the transfer) and the reply's way up (the rest): ``ClientTimeline`` times
the deployment's pipeline with them. The clock is a plain number the server advances from event to event
(``fl_server.simulation``); nothing here sleeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from contract.devices import DeviceProfile
from contract.transport import KEEPALIVE_S
from netem.profiles import Link, LinkProfile

RunKey = tuple[str, str, int]  # (model, data set, batch size): contract.settings.RunConfig.step_key

MESSAGE_FIXED_S = 0.431  # F, F_d and H: python bench/calibration.py --fit (rpi4, 4 clients, lan)
DEVICE_FIXED_S = 0.061  # this host's core-seconds a device spends on a message cycle besides its bytes, and per MB
DEVICE_S_PER_MB = 0.016  # of message it takes or sends
MESSAGE_RTTS = 5
DOWN_RTTS = 3  # of them on the message's way down: PullMessages, the objects, ConfirmMessageReceived
MSS_BYTES = 1448
INITIAL_WINDOW_BYTES = 10 * MSS_BYTES
POOLED_CONNECTIONS = 3  # a message's objects each way, requested in parallel (contract.wire)


def cold_share(cycle_index: int, idle_s: float) -> float:
    """How much of a transfer's slow start a model pays, in expectation: all of it in a client's first C cycles
    (every pooled connection new); ``idle_s`` past ``KEEPALIVE_S`` since a model last went either way, (C − 1)/C
    (the pooled connections closed but the one the SuperNode's polls keep open, and the model takes one of C at
    random); none while they are open."""
    if cycle_index < POOLED_CONNECTIONS:
        return 1.0
    return (POOLED_CONNECTIONS - 1) / POOLED_CONNECTIONS if idle_s > KEEPALIVE_S else 0.0


def rate_bps(direction: LinkProfile, rtt_s: float) -> float:
    """A direction's usable rate in bit/s: its cap, or TCP's loss-bound throughput when lower (inf if neither)."""
    rate = math.inf if direction.rate_mbit is None else direction.rate_mbit * 1e6
    if direction.loss_pct > 0 and rtt_s > 0:
        rate = min(rate, MSS_BYTES * 8 / rtt_s * math.sqrt(1.5) / math.sqrt(direction.loss_pct / 100))
    return rate


def slow_start_s(size_bytes: int, rate: float, rtt_s: float) -> float:
    """Seconds a transfer of ``size_bytes`` takes beyond a warm one (``8·size / rate``) when its window starts at
    IW and doubles each round trip: k round trips, less the bytes they carried at the rate, where k counts the
    windows sent before the rest fits in one or the window reaches the bandwidth-delay product."""
    if rtt_s <= 0:
        return 0.0
    bdp_bytes = rate * rtt_s / 8
    window, sent, trips = INITIAL_WINDOW_BYTES, 0, 0
    while sent + window < size_bytes and window < bdp_bytes:
        sent, window, trips = sent + window, 2 * window, trips + 1
    return trips * rtt_s - 8 * sent / rate


@dataclass(frozen=True)
class ClientModel:
    """One simulated client: its link, its device's seconds per local step, and its share of one core of this host
    (``contract.devices``), at which it handles messages: ``DEVICE_FIXED_S`` per cycle and ``DEVICE_S_PER_MB`` (Flower's
    object (de)serialization and hashing, its SuperNode's requests, the hand-over between SuperNode and agent) take
    1/share as long on the device."""

    link: Link
    step_s: float
    share: float = 1.0

    def device_s(self, size: int) -> float:
        """Seconds of the device's messaging cores one way of a message cycle takes, ``size`` bytes: half its fixed
        work and its bytes' (F_d/2 + H·MB)/c."""
        return (DEVICE_FIXED_S / 2 + DEVICE_S_PER_MB * size / 1e6) / self.share

    def _link_s(self, profile: LinkProfile, size: int, rtts: int, cycle_index: int, idle_s: float) -> float:
        rtt = self.link.rtt_ms / 1000
        rate = rate_bps(profile, rtt)
        cold = slow_start_s(size, rate, rtt) * cold_share(cycle_index, idle_s)
        return MESSAGE_FIXED_S / 2 + rtts * rtt + 8 * size / rate + cold

    def down_link_s(self, bytes_down: int, cycle_index: int, idle_s: float = 0.0) -> float:
        """The way down but the device's work: PullMessages, the objects, ConfirmMessageReceived (``DOWN_RTTS``),
        half the fixed cost and the transfer; ``cycle_index``: the client's cycles before, ``idle_s``: since its
        last model went either way (``cold_share``)."""
        return self._link_s(self.link.down, bytes_down, DOWN_RTTS, cycle_index, idle_s)

    def up_link_s(self, bytes_up: int, cycle_index: int, idle_s: float = 0.0) -> float:
        """The way up but the device's work: PushMessages and the objects, half the fixed cost, the transfer."""
        return self._link_s(self.link.up, bytes_up, MESSAGE_RTTS - DOWN_RTTS, cycle_index, idle_s)

    def down_s(self, bytes_down: int, cycle_index: int, idle_s: float = 0.0) -> float:
        """Seconds from the server's push until the agent holds the message, its messaging cores otherwise idle."""
        return self.down_link_s(bytes_down, cycle_index, idle_s) + self.device_s(bytes_down)

    def up_s(self, bytes_up: int, cycle_index: int, idle_s: float = 0.0) -> float:
        """Seconds from the agent's answer until the server has pulled it, its messaging cores otherwise idle."""
        return self.up_link_s(bytes_up, cycle_index, idle_s) + self.device_s(bytes_up)

    def cycle_s(self, bytes_down: int, steps: int, bytes_up: int, cycle_index: int, idle_s: float = 0.0) -> float:
        """Seconds from the server's push to its pull of the reply, training ``steps`` local steps in between; the
        message goes ``idle_s`` after the client's last model went either way, the reply the training after it."""
        train_s = steps * self.step_s
        down, up = self.down_s(bytes_down, cycle_index, idle_s), self.up_s(bytes_up, cycle_index, train_s)
        return down + train_s + up


@dataclass
class ClientTimeline:
    """One simulated client as the deployment's agent runs it (``edge.agent``, ``strategies.rounds``): one trainer
    that trains round after round, each from the newest global model that has reached the device and never past
    DGA's staleness bound (round t needs the global model of round t − D − 1); each round's update leaves as soon
    as it is trained (with two messages in flight the agent always holds one to answer). A global model reaches
    the device ``down_s`` after the round closes. The device's work on its messages (``ClientModel.device_s``) is
    a queue on its messaging cores, in the order it comes: a model coming down while an update goes up (DGA's
    pipeline) waits for the core the other holds. Plain numbers: ``fl_server.simulation`` drives it."""

    model: ClientModel
    steps: int
    delay: int
    free_at: float = 0.0  # when the trainer finishes the round it has started
    next_round: int = 1
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (when, global round), in sending order
    cycles: int = 0  # messages so far (the first C pay slow start)
    last_model: float = 0.0  # when its last model went either way, down or up (``cold_share``)
    messaging_free_at: float = 0.0  # when the device's messaging cores are done with the work queued on them

    def handled(self, ready: float, work: float) -> float:
        """When the messaging cores finish ``work`` seconds of a message's handling that can start at ``ready``: once
        they are done with what came before."""
        self.messaging_free_at = max(ready, self.messaging_free_at) + work
        return self.messaging_free_at

    def global_sent(self, at: float, round_: int, size: int) -> None:
        """The global model of ``round_`` left the server at ``at`` in a message of ``size`` bytes."""
        landed = at + self.model.down_link_s(size, self.cycles, at - self.last_model)
        arrival = self.handled(landed, self.model.device_s(size))
        self.arrivals.append((arrival, round_))
        self.last_model = max(self.last_model, landed)

    def start_s(self) -> float | None:
        """When the next round starts: once the trainer is free and a global model it may start from (round
        t − D − 1 or newer) has arrived; None while no such model has been sent."""
        needed = self.next_round - self.delay - 1
        arrived = [when for when, round_ in self.arrivals if round_ >= needed]
        return max(self.free_at, min(arrived)) if arrived else None

    def newest_by(self, at: float) -> int:
        """The newest global round that has reached the device by ``at`` (−1: none)."""
        return max((round_ for when, round_ in self.arrivals if when <= at), default=-1)

    @property
    def round_s(self) -> float:
        return self.steps * self.model.step_s

    def train(self, at: float, bytes_up: int) -> float:
        """The next round starts at ``at``: when its update (``bytes_up``) reaches the server."""
        done = at + self.round_s
        sent = self.handled(done, self.model.device_s(bytes_up))
        arrival = sent + self.model.up_link_s(bytes_up, self.cycles, sent - self.last_model)
        self.free_at, self.next_round, self.cycles = done, self.next_round + 1, self.cycles + 1
        self.last_model = max(self.last_model, arrival)
        return arrival


@dataclass(frozen=True)
class MessagePath:
    """One run of ``bench/calibration.py --fit``: a message cycle's bytes both ways (MB), its median message path R,
    the CPU its device's messaging cores spent on a cycle (seconds of this host's core) and their share c of it."""

    megabytes: float
    path_s: float
    cpu_s: float
    share: float


def fit_message_terms(small: MessagePath, large: MessagePath) -> tuple[float, float, float]:
    """(F, F_d, H) — ``MESSAGE_FIXED_S``, ``DEVICE_FIXED_S``, ``DEVICE_S_PER_MB`` — from two message sizes over a link
    with no delay: the device's CPU a cycle is F_d + H·MB (a line through the two), and the path R = F + (F_d + H·MB)/c,
    so F is what is left of R, the mean of the two."""
    per_mb = (large.cpu_s - small.cpu_s) / (large.megabytes - small.megabytes)
    fixed = small.cpu_s - per_mb * small.megabytes
    path = (small.path_s - small.cpu_s / small.share + large.path_s - large.cpu_s / large.share) / 2
    return path, fixed, per_mb


def client_model(link: Link, device: DeviceProfile, host_step_s: float, run: RunKey | None = None) -> ClientModel:
    """A client on ``link`` and ``device``: its step (``DeviceProfile.step_s``) and its messaging cores' share."""
    return ClientModel(link, device.step_s(host_step_s, run), device.shares().message or 1.0)


def client_models(
    links: list[Link], devices: list[DeviceProfile], host_step_s: float, run: RunKey | None = None
) -> list[ClientModel]:
    """Partition j's model from link j and device j."""
    return [client_model(link, device, host_step_s, run) for link, device in zip(links, devices, strict=True)]


def estimate_regime(
    link: Link, device: DeviceProfile, message_bytes: int, steps: int, host_step_s: float, run: RunKey | None = None
) -> tuple[float, float]:
    """The clock's message path R and round training T for a client on ``link`` and ``device`` whose messages carry
    ``message_bytes`` each way over warm connections and whose rounds are ``steps`` local steps."""
    model = client_model(link, device, host_step_s, run)
    path = model.down_s(message_bytes, POOLED_CONNECTIONS) + model.up_s(message_bytes, POOLED_CONNECTIONS)
    return path, steps * model.step_s
