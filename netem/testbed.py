"""An emulated multi-host testbed on one machine: a server namespace and one namespace per client.

Every client namespace ``efl-<tag>-c<i>`` has one link, device ``efl-srv`` (10.99.<i+1>.2/30, default route
to the server), to the server namespace ``efl-<tag>-srv`` (device ``efl-c<i>``, 10.99.<i+1>.1/30). The server
answers on ``server_ip`` (10.99.0.1, on its loopback) through every link. New namespaces inherit the host's
default TCP congestion control (bbr on the CI machines, cubic on Raspberry Pi OS and most laptops); they may
only switch to one in the host's ``net.ipv4.tcp_allowed_congestion_control``.

Backends, chosen per testbed:

- ``netem``: veth pairs, and :func:`netem.tc.apply` of the whole link on the client end.
- ``tbf+tun`` (kernels without netem): each link is a pair of TUN devices joined by a ``python -m
  netem.tunlink`` process doing delay, jitter and loss; the rate is a kernel tbf on the client's TUN device
  (up on its egress, down on its ingress through an ifb), again with :func:`netem.tc.apply`.
- ``none``: every link is an unshaped veth pair (all links ``lan``).

Faults: :meth:`Testbed.set_link_up` takes a client's link down and up (both ends, like a pulled cable), on any
backend; :meth:`Testbed.loss_burst` and :meth:`Testbed.stall` drop a fraction of a link's packets, or hold them
all, for some seconds — done by the user-space forwarder, so only with ``tbf+tun``.

Measured with ``tbf+tun`` on a 2-core CI VM (UDP echo p50, TCP goodput): long-distance 300.0-300.3 ms for
300; home-wifi 2.03-2.08 ms for 2, goodput 14.2-14.4 of 15 and 28.9-29.4 of 30 Mbit/s (TCP/IP headers are
~3.5%); an unshaped link adds ~0.2 ms round trip to a veth pair's 0.06 ms and tops out at ~550 Mbit/s.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from types import TracebackType

from pyroute2 import IPRoute, netns

from netem import contain_pyroute2_children, tc
from netem.profiles import Link, LinkError, LinkProfile

CLIENT_DEVICE = "efl-srv"
SERVER_IP = "10.99.0.1"
READY_TIMEOUT_S = 10.0
EXIT_TIMEOUT_S = 5.0
MAX_CLIENTS = 254
_TAG = re.compile(r"[A-Za-z0-9]{1,24}")
_UNSHAPED = LinkProfile(delay_ms=0.0)


def _link_ips(i: int) -> tuple[str, str]:
    """(server end, client end) of client ``i``'s link, in 10.99.<i+1>.0/30."""
    return f"10.99.{i + 1}.1", f"10.99.{i + 1}.2"


def _rate_only(profile: LinkProfile) -> LinkProfile:
    return _UNSHAPED if profile.rate_mbit is None else LinkProfile(delay_ms=0.0, rate_mbit=profile.rate_mbit)


def _kill_and_wait(pids: list[int]) -> None:
    """SIGKILL processes by PID and wait until they are gone (pidfd; they need not be our children)."""
    pidfds = []
    for pid in pids:
        try:
            pidfds.append(os.pidfd_open(pid))
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for pidfd in pidfds:
        select.select([pidfd], [], [], EXIT_TIMEOUT_S)
        os.close(pidfd)


def _first_line(fd: int, timeout_s: float) -> bytes:
    """What a child wrote on ``fd`` up to its first newline, its exit, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = os.read(fd, 64)
        if not chunk:
            break
        line += chunk
    return line


def cleanup_stale(prefix: str = "efl-") -> list[str]:
    """Kill every process inside, then remove, each network namespace whose name starts with ``prefix``.

    For what a crashed run left behind (its link forwarders live in its server namespace); do not call it
    while a testbed with that prefix is in use. Returns the removed namespaces.
    """
    contain_pyroute2_children()
    stale = sorted(name for name in netns.listnetns() if name.startswith(prefix))
    pids = netns.ns_pids()
    _kill_and_wait([pid for name in stale for pid in pids.get(name, [])])
    for name in stale:
        netns.remove(name)
    return stale


def _choose_backend(links: list[Link]) -> str:
    if not any(link.shaped for link in links):
        return "none"
    return "netem" if tc.kernel_has_netem() else "tbf+tun"


class Testbed:
    """Context manager; everything it creates is removed on exit, also after exceptions and Ctrl-C."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, links: list[Link], tag: str) -> None:
        if not links or len(links) > MAX_CLIENTS:
            raise LinkError(f"a testbed has 1 to {MAX_CLIENTS} clients, got {len(links)}")
        if not _TAG.fullmatch(tag):
            raise LinkError(f"testbed tag {tag!r} must be 1-24 letters or digits")
        if os.geteuid() != 0:
            raise LinkError("the namespaced testbed needs root (network namespaces); run it with sudo")
        contain_pyroute2_children()
        self.links = list(links)
        self.server_ns = f"efl-{tag}-srv"
        self.client_ns = [f"efl-{tag}-c{i}" for i in range(len(links))]
        in_use = sorted(set(netns.listnetns()) & {self.server_ns, *self.client_ns})
        if in_use:
            raise LinkError(f"testbed tag {tag!r} is in use (namespace {in_use[0]} exists); pick another tag")
        self.backend = _choose_backend(self.links)
        self.server_ip = SERVER_IP
        self.client_ips = [_link_ips(i)[1] for i in range(len(links))]
        self.forwarders: list[subprocess.Popen] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def netns_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def _build(self) -> None:
        for ns in (self.server_ns, *self.client_ns):
            netns.create(ns)
            with IPRoute(netns=ns) as ip:
                ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
        with IPRoute(netns=self.server_ns) as ip:
            ip.addr("add", index=ip.link_lookup(ifname="lo")[0], address=SERVER_IP, prefixlen=32)
        for i, link in enumerate(self.links):
            if self.backend == "tbf+tun":
                self._start_forwarder(i, link)
            else:
                with IPRoute(netns=self.server_ns) as ip:
                    peer = {"ifname": CLIENT_DEVICE, "net_ns_fd": self.client_ns[i]}
                    ip.link("add", ifname=f"efl-c{i}", kind="veth", peer=peer)
            self._address_link(i)
            if self.backend == "netem":
                tc.apply(CLIENT_DEVICE, link, self.client_ns[i])
            elif self.backend == "tbf+tun":
                kernel_part = replace(link, up=_rate_only(link.up), down=_rate_only(link.down))
                tc.apply(CLIENT_DEVICE, kernel_part, self.client_ns[i])

    def _address_link(self, i: int) -> None:
        server_end, client_end = _link_ips(i)
        with IPRoute(netns=self.server_ns) as ip:
            index = ip.link_lookup(ifname=f"efl-c{i}")[0]
            ip.link("set", index=index, state="up")
            ip.addr("add", index=index, address=server_end, prefixlen=30)
        with IPRoute(netns=self.client_ns[i]) as ip:
            index = ip.link_lookup(ifname=CLIENT_DEVICE)[0]
            ip.link("set", index=index, state="up")
            ip.addr("add", index=index, address=client_end, prefixlen=30)
            ip.route("add", dst="0.0.0.0/0", gateway=server_end)

    def set_link_up(self, i: int, up: bool) -> None:
        """Take client ``i``'s link down at both ends, or bring it back up with the client's default route
        (the kernel drops routes through a device that goes down)."""
        self._check_client(i)
        server_end, _ = _link_ips(i)
        state = "up" if up else "down"
        with IPRoute(netns=self.server_ns) as ip:
            ip.link("set", index=ip.link_lookup(ifname=f"efl-c{i}")[0], state=state)
        with IPRoute(netns=self.client_ns[i]) as ip:
            ip.link("set", index=ip.link_lookup(ifname=CLIENT_DEVICE)[0], state=state)
            if up:
                ip.route("replace", dst="0.0.0.0/0", gateway=server_end)

    def loss_burst(self, i: int, loss_pct: float, seconds: float) -> None:
        """For the next ``seconds``, client ``i``'s link drops ``loss_pct`` % of the packets both ways, on top of
        its profile's loss. Returns once the forwarder applies it."""
        self._inject(i, f"loss {loss_pct:g} {seconds:g}")

    def stall(self, i: int, seconds: float) -> None:
        """For the next ``seconds``, client ``i``'s link delivers nothing; what it holds goes out afterwards."""
        self._inject(i, f"stall {seconds:g}")

    def _check_client(self, i: int) -> None:
        if not 0 <= i < len(self.client_ns):
            raise LinkError(f"no client {i} on this testbed (clients 0..{len(self.client_ns) - 1})")

    def _inject(self, i: int, command: str) -> None:
        """Send a fault command to client ``i``'s forwarder (see :mod:`netem.tunlink`) and wait for its answer."""
        self._check_client(i)
        if self.backend != "tbf+tun":
            raise LinkError(f"loss bursts and stalls need the tbf+tun backend; this testbed uses {self.backend}")
        forwarder = self.forwarders[i]
        forwarder.stdin.write(command.encode() + b"\n")
        forwarder.stdin.flush()
        answer = _first_line(forwarder.stdout.fileno(), READY_TIMEOUT_S).decode().strip()
        if answer != "ok":
            raise LinkError(f"the link forwarder for client {i} refused {command!r}: {answer or 'no answer'}")

    def _start_forwarder(self, i: int, link: Link) -> None:
        """Start client ``i``'s tunlink process and wait for its ``ready`` line (it has made both TUNs)."""
        argv = [
            sys.executable,
            "-m",
            "netem.tunlink",
            f"--client={self.client_ns[i]}/{CLIENT_DEVICE}",
            f"--server={self.server_ns}/efl-c{i}",
            f"--up={json.dumps(asdict(link.up))}",
            f"--down={json.dumps(asdict(link.down))}",
        ]
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the testbed, which then stops the forwarder itself
        )
        self.forwarders.append(process)
        if _first_line(process.stdout.fileno(), READY_TIMEOUT_S) != b"ready\n":
            process.kill()
            errors = process.stderr.read().decode(errors="replace").strip().splitlines()
            reason = errors[-1] if errors else f"not ready within {READY_TIMEOUT_S:g} s"
            raise LinkError(f"the link forwarder for client {i} did not start: {reason}")

    def close(self) -> None:
        """Stop the forwarders (by PID) and any process left in the namespaces; remove the namespaces."""
        for process in self.forwarders:
            process.terminate()
            try:
                process.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                stream.close()
        self.forwarders.clear()
        existing = set(netns.listnetns())
        ours = [ns for ns in (self.server_ns, *self.client_ns) if ns in existing]
        pids = netns.ns_pids()
        _kill_and_wait([pid for ns in ours for pid in pids.get(ns, [])])
        for ns in ours:
            netns.remove(ns)
