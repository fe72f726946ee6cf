"""Measure what a testbed link really does: UDP echo round trips and loss, TCP goodput each way.

Everything runs in this process: sockets are made inside the namespaces with ``pyroute2.netns.create_socket``
and served by one select loop, so no helper processes are needed and nothing outlives a measurement.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import statistics
import struct
import time
from dataclasses import dataclass

from pyroute2.netns import create_socket

from netem.testbed import Testbed

PROBE = struct.Struct("!Iqq")  # sequence number, client send time, server hold time (ns)
PROBE_SIZE = 64
TIMESPEC = struct.Struct("@qq")
SO_TIMESTAMPNS = 35  # Linux (asm-generic and x86); Python's socket module does not export it
CHUNK = 64 * 1024


@dataclass(frozen=True)
class LinkMeasurement:
    """Round trips in ms (NaN when no probe came back), loss as a fraction, TCP goodput in Mbit/s."""

    rtt_p50_ms: float
    rtt_p90_ms: float
    rtt_sd_ms: float
    loss_fraction: float
    probes: int
    up_mbit: float
    down_mbit: float


def _timestamped_udp(namespace: str) -> socket.socket:
    udp = create_socket(namespace, socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return udp


def _receive(udp: socket.socket) -> tuple[bytes, tuple[str, int], int]:
    """A datagram, its sender and the kernel's receive time (ns, CLOCK_REALTIME)."""
    payload, ancillary, _, address = udp.recvmsg(PROBE_SIZE, socket.CMSG_SPACE(TIMESPEC.size))
    [(_, _, stamp)] = ancillary  # the only ancillary data asked for: SO_TIMESTAMPNS
    seconds, nanoseconds = TIMESPEC.unpack(stamp)
    return payload, address, seconds * 1_000_000_000 + nanoseconds


def probe_rtts(
    testbed: Testbed, client_index: int, probes: int, interval_s: float, wait_s: float
) -> tuple[list[float], int]:
    """Send ``probes`` UDP probes ``interval_s`` apart from the client and echo them at the server.

    Returns the round trips (ms) of the replies that arrived within ``wait_s`` of the last send, and the
    number sent. As in TWAMP, a round trip is the reply's kernel receive time minus the send time minus the
    time the probe spent in the echo server, so this process's own wake-ups are not counted:

        rtt = (t_client_rx - t_client_tx) - (t_server_tx - t_server_rx)
    """
    server = _timestamped_udp(testbed.server_ns)
    server.bind((testbed.server_ip, 0))
    client = _timestamped_udp(testbed.client_ns[client_index])
    client.connect(server.getsockname())
    rtts: list[float] = []
    with server, client:
        start = time.monotonic()
        sent = 0
        deadline = start + (probes - 1) * interval_s + wait_s
        while len(rtts) < probes and time.monotonic() < deadline:
            if sent < probes and time.monotonic() >= start + sent * interval_s:
                client.send(PROBE.pack(sent, time.time_ns(), 0).ljust(PROBE_SIZE, b"\0"))
                sent += 1
            next_event = start + sent * interval_s if sent < probes else deadline
            readable, _, _ = select.select([server, client], [], [], max(0.0, next_event - time.monotonic()))
            if server in readable:
                payload, address, received_ns = _receive(server)
                sequence, sent_ns, _ = PROBE.unpack_from(payload)
                hold_ns = time.time_ns() - received_ns
                server.sendto(PROBE.pack(sequence, sent_ns, hold_ns).ljust(PROBE_SIZE, b"\0"), address)
            if client in readable:
                payload, _, received_ns = _receive(client)
                _, sent_ns, hold_ns = PROBE.unpack_from(payload)
                rtts.append((received_ns - sent_ns - hold_ns) / 1e6)
    return rtts, sent


def _tcp_pair(testbed: Testbed, client_index: int) -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of one TCP connection over the link."""
    with create_socket(testbed.server_ns, socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((testbed.server_ip, 0))
        listener.listen(1)
        client = create_socket(testbed.client_ns[client_index], socket.AF_INET, socket.SOCK_STREAM)
        client.settimeout(10.0)
        client.connect(listener.getsockname())
        listener.settimeout(10.0)
        server, _ = listener.accept()
    return server, client


def tcp_goodput(sender: socket.socket, receiver: socket.socket, warmup_s: float, duration_s: float) -> float:
    """Mbit/s the receiver gets during ``duration_s`` after a ``warmup_s`` of sending (slow start, bursts)."""
    sender.setblocking(False)
    receiver.setblocking(False)
    data = bytes(CHUNK)
    start = time.monotonic()
    window_start, window_end = start + warmup_s, start + warmup_s + duration_s
    counted = 0
    while (now := time.monotonic()) < window_end:
        readable, writable, _ = select.select([receiver], [sender], [], window_end - now)
        if sender in writable:
            with contextlib.suppress(BlockingIOError):  # writable, but not for a whole chunk
                sender.send(data)
        if receiver in readable:
            received = len(receiver.recv(CHUNK))
            if time.monotonic() >= window_start:
                counted += received
    return counted * 8 / duration_s / 1e6


def measure(
    testbed: Testbed,
    client_index: int,
    probes: int = 50,
    probe_interval_s: float = 0.02,
    probe_wait_s: float = 2.0,
    warmup_s: float = 1.0,
    duration_s: float = 3.0,
) -> LinkMeasurement:
    """Measure client ``client_index``'s link in about probes x interval + wait + 2 x (warmup + duration)."""
    rtts, sent = probe_rtts(testbed, client_index, probes, probe_interval_s, probe_wait_s)
    server, client = _tcp_pair(testbed, client_index)
    with server, client:
        up = tcp_goodput(client, server, warmup_s, duration_s)
    server, client = _tcp_pair(testbed, client_index)  # a fresh connection: no leftover upload in the way
    with server, client:
        down = tcp_goodput(server, client, warmup_s, duration_s)
    deciles = statistics.quantiles(rtts, n=10) if len(rtts) > 1 else [math.nan] * 9
    return LinkMeasurement(
        rtt_p50_ms=statistics.median(rtts) if rtts else math.nan,
        rtt_p90_ms=deciles[8],
        rtt_sd_ms=statistics.pstdev(rtts) if rtts else math.nan,
        loss_fraction=1 - len(rtts) / sent,
        probes=sent,
        up_mbit=up,
        down_mbit=down,
    )
