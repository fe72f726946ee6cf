"""The virtual clock of a simulated federation: how long a message cycle would take a client on its link and
device, so that a run on Flower's Simulation Engine reports modelled seconds instead of this host's.

A message cycle (the server pushes a message, the client trains the rounds it brings and replies) takes

    t = F + R·rtt + 8·b_down / r_down + s·σ + 8·b_up / r_up  [+ S(b_down) + S(b_up) in a client's first C cycles]

- F = ``MESSAGE_FIXED_S`` (0.48 s): edgefl's message path on loopback with no training — the SuperNode's poll,
  the Runtime API hand-over, the server's pull (``bench/message_path.py``, "agent, tuned" on loopback);
- R = ``MESSAGE_RTTS`` (5): the link round trips a cycle costs, the sequential requests of Flower's protocol
  counted in the same bench (PullMessages, the message's objects, ConfirmMessageReceived, PushMessages, the
  reply's objects). That bench's long-distance path (2.89 s) held 3 more, slow start on connections that had not
  carried a model yet, which is the last term;
- r: a direction's rate, capped where loss binds by TCP's steady-state throughput (Mathis et al. 1997):
  r ≤ (MSS / rtt)·√(3/2) / √p for loss p, with MSS = 1448 B;
- s local steps, σ = the host's measured seconds per step on one core divided by the device's share of a core
  (``edge.devices``: the same shares the testbed's CPU caps use);
- S(b) = slow start: what a transfer of b bytes costs over a warm one when it starts from TCP's initial window
  (IW = 10 segments, RFC 6928), which doubles every round trip until it holds the path's bandwidth-delay product
  (:func:`slow_start_s`). Flower's SuperNode moves a message's objects (Message, RecordDict, ConfigRecord:
  ``contract.wire``) in parallel HTTP/1.1 requests, each on a pooled TCP connection of its own, so a model meets
  each of C = ``POOLED_CONNECTIONS`` (3) connections new once each way. The clock charges these to a client's
  first C cycles; on the testbed they fall within about its first ten, whenever the model's request is given a
  connection that has not carried one yet. A connection closed after 5 s idle (httpx's and uvicorn's keep-alive)
  is replaced by a new one, cold again: that is left out.

Jitter averages out and is left out. The clock is a plain number the server advances from event to event
(``fl_server.simulation``); nothing here sleeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge.devices import DeviceProfile
from netem.profiles import Link, LinkProfile

MESSAGE_FIXED_S = 0.48
MESSAGE_RTTS = 5
MSS_BYTES = 1448
INITIAL_WINDOW_BYTES = 10 * MSS_BYTES
POOLED_CONNECTIONS = 3  # a message's objects each way, requested in parallel (contract.wire)


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
    """One simulated client: its link and its device's seconds per local step."""

    link: Link
    step_s: float

    def cycle_s(self, bytes_down: int, steps: int, bytes_up: int, cycle_index: int) -> float:
        """Seconds from the server's push to its pull of the reply, training ``steps`` local steps in between;
        ``cycle_index``: how many cycles this client made before (its first C pay slow start)."""
        rtt = self.link.rtt_ms / 1000
        down, up = rate_bps(self.link.down, rtt), rate_bps(self.link.up, rtt)
        transfer = 8 * bytes_down / down + 8 * bytes_up / up
        if cycle_index < POOLED_CONNECTIONS:
            transfer += slow_start_s(bytes_down, down, rtt) + slow_start_s(bytes_up, up, rtt)
        return MESSAGE_FIXED_S + MESSAGE_RTTS * rtt + transfer + steps * self.step_s


def device_step_s(device: DeviceProfile, host_step_s: float) -> float:
    """A device's seconds per local step from this host's one-core time: slower by its share of a core."""
    return host_step_s / (device.cpu_fraction or 1.0)


def client_models(links: list[Link], devices: list[DeviceProfile], host_step_s: float) -> list[ClientModel]:
    """Partition j's model from link j and device j."""
    return [ClientModel(link, device_step_s(device, host_step_s)) for link, device in zip(links, devices, strict=True)]
