"""The user-space link's timing and loss model, driven directly (no TUN device: a Unix datagram socket pair
stands in for the device a DelayLine writes to, so no root is needed)."""

from __future__ import annotations

import math
import random
import socket
import statistics
import struct
from collections.abc import Iterator

import pytest

from netem.profiles import LinkProfile
from netem.tunlink import CorrelatedUniform, DelayLine, WakeLatency

SEQUENCE = struct.Struct("!I")


@pytest.fixture
def wire() -> Iterator[tuple[socket.socket, socket.socket]]:
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    receiver.setblocking(False)
    with sender, receiver:
        yield sender, receiver


def _drain(receiver: socket.socket) -> list[int]:
    received = []
    while True:
        try:
            received.append(SEQUENCE.unpack(receiver.recv(64))[0])
        except BlockingIOError:
            return received


def _release_times(line: DelayLine, arrivals: list[float]) -> list[float]:
    """Push one packet per arrival time (sequence numbers 0, 1, ...) and return the release times queued."""
    for sequence, arrival in enumerate(arrivals):
        line.push(SEQUENCE.pack(sequence), arrival)
    return [release for release, _ in line.queue]


def test_jitter_keeps_one_direction_in_order(wire) -> None:
    """Packets 0.1 ms apart with ±5 ms jitter would be reordered by netem; here they leave in order."""
    sender, receiver = wire
    profile = LinkProfile(delay_ms=20.0, jitter_ms=5.0)
    line = DelayLine(profile, sender.fileno(), random.Random(1))
    arrivals = [i * 0.0001 for i in range(500)]
    releases = _release_times(line, arrivals)
    assert releases == sorted(releases)
    shortest_s = (profile.delay_ms - profile.jitter_ms) / 1000
    assert all(release - arrival >= shortest_s for release, arrival in zip(releases, arrivals, strict=True))
    line.release(now=max(releases))
    assert _drain(receiver) == list(range(500))
    assert not line.queue


def test_sparse_packets_see_uniform_jitter_around_the_delay(wire) -> None:
    sender, _ = wire
    profile = LinkProfile(delay_ms=20.0, jitter_ms=5.0)
    line = DelayLine(profile, sender.fileno(), random.Random(2))
    arrivals = [i * 0.1 for i in range(2000)]  # 100 ms apart: the FIFO rule never binds
    delays_ms = [(r - a) * 1000 for r, a in zip(_release_times(line, arrivals), arrivals, strict=True)]
    assert min(delays_ms) >= profile.delay_ms - profile.jitter_ms
    assert max(delays_ms) <= profile.delay_ms + profile.jitter_ms
    uniform_sd = 2 * profile.jitter_ms / math.sqrt(12)
    assert statistics.mean(delays_ms) == pytest.approx(profile.delay_ms, abs=4 * uniform_sd / math.sqrt(2000))
    assert statistics.pstdev(delays_ms) == pytest.approx(uniform_sd, rel=0.05)


def test_only_due_packets_are_released(wire) -> None:
    sender, receiver = wire
    line = DelayLine(LinkProfile(delay_ms=10.0), sender.fileno(), random.Random(3))
    _release_times(line, [0.0, 0.005])
    line.release(now=0.012)
    assert _drain(receiver) == [0]
    assert line.next_release() == pytest.approx(0.015)


def test_loss_fraction_is_binomial(wire) -> None:
    """n = 5000 at p = 3%: the dropped fraction stays within 4 standard deviations of p."""
    sender, _ = wire
    profile = LinkProfile(delay_ms=1.0, loss_pct=3.0)
    line = DelayLine(profile, sender.fileno(), random.Random(4))
    n = 5000
    kept = len(_release_times(line, [i * 0.001 for i in range(n)]))
    p = profile.loss_pct / 100
    assert 1 - kept / n == pytest.approx(p, abs=4 * math.sqrt(p * (1 - p) / n))


@pytest.mark.parametrize("correlation_pct", [0.0, 50.0, 90.0])
def test_correlated_draws_have_netems_lag_one_autocorrelation(correlation_pct: float) -> None:
    """u_n = (1 - ρ) U_n + ρ u_(n-1) has lag-1 autocorrelation ρ."""
    draw = CorrelatedUniform(correlation_pct, random.Random(5)).draw
    samples = [draw() for _ in range(20_000)]
    assert all(0.0 <= u < 1.0 for u in samples)
    autocorrelation = statistics.correlation(samples[:-1], samples[1:])
    assert autocorrelation == pytest.approx(correlation_pct / 100, abs=0.03)


def test_wake_latency_estimate_follows_overshoots_and_is_capped() -> None:
    latency = WakeLatency(weight=0.5, cap_s=0.001)
    for _ in range(30):
        latency.observe(0.0002)
    assert latency.estimate_s == pytest.approx(0.0002)
    for _ in range(30):
        latency.observe(0.5)  # a stall (the host was busy) counts as the cap, not as half a second
    assert latency.estimate_s == pytest.approx(0.001)
