"""The virtual clock of a simulated federation: how long a message cycle would take a client on its link and
device, so that a run on Flower's Simulation Engine reports modelled seconds instead of this host's.

A message cycle (the server pushes a message, the client trains the rounds it brings and replies) takes

    t = F + R·rtt + 8·b_down / r_down + s·σ + 8·b_up / r_up

- F = ``MESSAGE_FIXED_S`` (0.48 s): edgefl's message path on loopback with no training — the SuperNode's poll,
  the Runtime API hand-over, the server's pull (``bench/message_path.py``, "agent, tuned" on loopback);
- R = ``MESSAGE_RTTS`` (5): the link round trips a cycle costs, the sequential requests of Flower's protocol
  counted in the same bench (PullMessages, the message's objects, ConfirmMessageReceived, PushMessages, the
  reply's objects). That bench's long-distance path (2.89 s) held 3 more, TCP restarting from its initial window
  after idle; the calibration runs (``bench/calibration.py``: 4 Pi 4s, 1.8 s over long-distance) did not show
  them, and the clock leaves them out;
- r: a direction's rate, capped where loss binds by TCP's steady-state throughput (Mathis et al. 1997):
  r ≤ (MSS / rtt)·√(3/2) / √p for loss p, with MSS = 1448 B;
- s local steps, σ = the host's measured seconds per step on one core divided by the device's share of a core
  (``edge.devices``: the same shares the testbed's CPU caps use).

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


def rate_bps(direction: LinkProfile, rtt_s: float) -> float:
    """A direction's usable rate in bit/s: its cap, or TCP's loss-bound throughput when lower (inf if neither)."""
    rate = math.inf if direction.rate_mbit is None else direction.rate_mbit * 1e6
    if direction.loss_pct > 0 and rtt_s > 0:
        rate = min(rate, MSS_BYTES * 8 / rtt_s * math.sqrt(1.5) / math.sqrt(direction.loss_pct / 100))
    return rate


@dataclass(frozen=True)
class ClientModel:
    """One simulated client: its link and its device's seconds per local step."""

    link: Link
    step_s: float

    def cycle_s(self, bytes_down: int, steps: int, bytes_up: int) -> float:
        """Seconds from the server's push to its pull of the reply, training ``steps`` local steps in between."""
        rtt = self.link.rtt_ms / 1000
        transfer = 8 * bytes_down / rate_bps(self.link.down, rtt) + 8 * bytes_up / rate_bps(self.link.up, rtt)
        return MESSAGE_FIXED_S + MESSAGE_RTTS * rtt + transfer + steps * self.step_s


def device_step_s(device: DeviceProfile, host_step_s: float) -> float:
    """A device's seconds per local step from this host's one-core time: slower by its share of a core."""
    return host_step_s / (device.cpu_fraction or 1.0)


def client_models(links: list[Link], devices: list[DeviceProfile], host_step_s: float) -> list[ClientModel]:
    """Partition j's model from link j and device j."""
    return [ClientModel(link, device_step_s(device, host_step_s)) for link, device in zip(links, devices, strict=True)]
