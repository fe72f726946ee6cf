"""A link emulated in user space, for kernels without netem: ``python -m netem.tunlink``.

The process opens one TUN device in the client's namespace and one in the server's, writes ``ready`` on
stdout (the testbed's readiness handshake), and forwards IP packets between them with the up profile's
delay, jitter and loss one way and the down profile's the other way. The TUN devices exist only while the
process runs; it exits when its stdin closes (so it dies with the testbed) or on SIGTERM. Rate limits are not
done here but by the kernel (tbf on the client's TUN device, see :mod:`netem.testbed`).

Faults are injected with lines on stdin, each acknowledged with ``ok`` (or ``error: REASON``) on stdout:

- ``loss PCT SECONDS``: for the next SECONDS, drop PCT % of the packets both ways, on top of the profile's loss;
- ``stall SECONDS``: for the next SECONDS, release nothing either way; what arrives meanwhile (and what was
  queued) is held, then released in order — a link that stops and resumes, as when a radio loses its signal.

Jitter without reordering: each packet's release time is

    t_release = max(t_arrival + delay + U(-jitter, +jitter), t_release of the previous packet)

so one direction stays FIFO, like netem with a rate (plain netem reorders under jitter). Back-to-back packets
therefore see the largest jitter draw among their predecessors; sparse traffic (pings) sees U(±jitter).
Correlation follows netem's recurrence for both the jitter and the loss draws:

    u_n = (1 - ρ) U_n + ρ u_{n-1},   ρ = correlation_pct / 100
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import random
import select
import struct
import sys
import time
from collections import deque

from pyroute2 import netns

from contract.errors import PeerError
from netem.profiles import LinkProfile

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
MAX_PACKET = 65535
READ_BATCH = 64  # packets read from one device before due packets are released again


class CorrelatedUniform:
    """Uniform [0, 1) draws with netem's correlation recurrence (see module docstring)."""

    def __init__(self, correlation_pct: float, rng: random.Random) -> None:
        self.rho = correlation_pct / 100
        self.rng = rng
        self.last = rng.random()

    def draw(self) -> float:
        self.last = (1 - self.rho) * self.rng.random() + self.rho * self.last
        return self.last


class DelayLine:
    """One direction: drops packets with probability loss_pct/100, releases the rest in order, delayed."""

    def __init__(self, profile: LinkProfile, out_fd: int, rng: random.Random) -> None:
        self.delay_s = profile.delay_ms / 1000
        self.jitter_s = profile.jitter_ms / 1000
        self.loss = profile.loss_pct / 100
        self.out_fd = out_fd
        self.jitter_draw = CorrelatedUniform(profile.correlation_pct, rng)
        self.loss_draw = CorrelatedUniform(profile.correlation_pct, rng)
        self.rng = rng
        self.queue: deque[tuple[float, bytes]] = deque()
        self.last_release = 0.0
        self.burst_loss = 0.0  # extra drop probability while ``now < burst_until``
        self.burst_until = 0.0
        self.held_until = 0.0  # a stall: nothing is released before this time

    def push(self, packet: bytes, now: float) -> None:
        if self.loss and self.loss_draw.draw() < self.loss:
            return
        if now < self.burst_until and self.rng.random() < self.burst_loss:
            return
        jitter = (2 * self.jitter_draw.draw() - 1) * self.jitter_s if self.jitter_s else 0.0
        self.last_release = max(now + self.delay_s + jitter, self.last_release)
        self.queue.append((self.last_release, packet))

    def next_release(self) -> float | None:
        return max(self.queue[0][0], self.held_until) if self.queue else None

    def release(self, now: float) -> None:
        while self.queue and max(self.queue[0][0], self.held_until) <= now:
            with contextlib.suppress(OSError):  # the stack refused it (device going down): a lost packet
                os.write(self.out_fd, self.queue.popleft()[1])


def open_tun(namespace: str, name: str) -> int:
    """A non-blocking TUN device ``name`` (no packet-info header) in ``namespace``, gone with the fd."""
    netns.setns(namespace, flags=0)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class WakeLatency:
    """How late this process wakes from a sleep: an EWMA of the overshoot of its timed waits.

    Timed waits end that much early, and packets that woke the process are back-dated by it (but not to
    before the wait began), so the host's wake-up latency is not added to the emulated delay.
    """

    def __init__(self, weight: float = 0.1, cap_s: float = 0.0005) -> None:
        self.estimate_s = 0.0
        self.weight = weight
        self.cap_s = cap_s

    def observe(self, overshoot_s: float) -> None:
        overshoot_s = min(max(overshoot_s, 0.0), self.cap_s)
        self.estimate_s += self.weight * (overshoot_s - self.estimate_s)


class FaultCommandError(PeerError, ValueError):
    """A fault command on stdin (from the testbed) that is not one of this module's; ``str()`` is the reason
    acknowledged with ``error:``."""


def inject(command: str, lines: list[DelayLine], now: float) -> None:
    """Apply one fault command (see the module docstring) to both directions; raises ValueError (FaultCommandError
    for an unknown command) if malformed."""
    name, *args = command.split()
    values = [float(a) for a in args]
    if name == "loss" and len(values) == 2 and 0 <= values[0] <= 100 and values[1] >= 0:
        for line in lines:
            line.burst_loss, line.burst_until = values[0] / 100, now + values[1]
    elif name == "stall" and len(values) == 1 and values[0] >= 0:
        for line in lines:
            line.held_until = now + values[0]
    else:
        raise FaultCommandError(f"unknown command {command!r}; expected 'loss PCT SECONDS' or 'stall SECONDS'")


def _read_commands(stdin: int, pending: bytearray, lines: list[DelayLine]) -> bool:
    """Apply the complete command lines on stdin, acknowledging each; False once stdin is closed."""
    chunk = os.read(stdin, 1024)
    pending += chunk
    while b"\n" in pending:
        command, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        try:
            inject(command.decode(), lines, time.monotonic())
            print("ok", flush=True)
        except ValueError as exc:
            print(f"error: {exc}", flush=True)
    return bool(chunk)


def forward(client_fd: int, server_fd: int, up: LinkProfile, down: LinkProfile) -> None:
    """Move packets between the two TUN devices until stdin closes."""
    rng = random.Random()
    lines = {client_fd: DelayLine(up, server_fd, rng), server_fd: DelayLine(down, client_fd, rng)}
    stdin = sys.stdin.fileno()
    commands = bytearray()
    latency = WakeLatency()
    while True:
        due = [t for line in lines.values() if (t := line.next_release()) is not None]
        slept_at = time.monotonic()
        timeout = max(0.0, min(due) - slept_at - latency.estimate_s) if due else None
        readable, _, _ = select.select([stdin, *lines], [], [], timeout)
        now = time.monotonic()
        if stdin in readable and not _read_commands(stdin, commands, list(lines.values())):
            return
        if readable:
            arrival = max(slept_at, now - latency.estimate_s)
            for fd in readable:
                if fd in lines:
                    _read_batch(fd, lines[fd], arrival)
        elif timeout:
            latency.observe(now - slept_at - timeout)
        now = time.monotonic()
        for line in lines.values():
            line.release(now)


def _read_batch(fd: int, line: DelayLine, now: float) -> None:
    for _ in range(READ_BATCH):
        try:
            line.push(os.read(fd, MAX_PACKET), now)
        except BlockingIOError:
            return


def _endpoint(text: str) -> tuple[str, str]:
    namespace, _, device = text.partition("/")
    if not namespace or not device:
        raise argparse.ArgumentTypeError(f"expected NAMESPACE/DEVICE, got {text!r}")
    return namespace, device


def _profile(text: str) -> LinkProfile:
    return LinkProfile(**json.loads(text))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m netem.tunlink", description=__doc__.splitlines()[0])
    parser.add_argument("--client", type=_endpoint, required=True, help="NAMESPACE/DEVICE of the client end")
    parser.add_argument("--server", type=_endpoint, required=True, help="NAMESPACE/DEVICE of the server end")
    parser.add_argument("--up", type=_profile, required=True, help="LinkProfile as JSON, client → server")
    parser.add_argument("--down", type=_profile, required=True, help="LinkProfile as JSON, server → client")
    args = parser.parse_args(argv)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake up on time, not 50 µs late
    # A wire does not wait for the CPU: without real-time priority a loaded host adds delay spikes of several
    # ms. Without a real-time quota (some containers, cgroups) delays are just less precise under load.
    with contextlib.suppress(PermissionError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    client_fd = open_tun(*args.client)
    server_fd = open_tun(*args.server)
    print("ready", flush=True)
    forward(client_fd, server_fd, args.up, args.down)


if __name__ == "__main__":
    main()
