"""Who serves the Runtime API the agent dials. Its port is picked free and released before the SuperNode binds
it, so another local user could bind it first, receive the device's updates and hand it models. Every new
connection to the Runtime API is checked before a byte is sent on it: Linux lists each TCP socket with the uid
that opened it (``/proc/net/tcp``, ``/proc/net/tcp6``; an accepted connection carries its listener's), and the
server end of this very connection must be this process's user's. The SuperNode edgefl starts for an agent runs
as the agent's user; another process of that user could read the node's secret anyway."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

import httpx

from contract.flower import ProtobufCall, ProtobufRequestContext

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
CONNECTED = "connection.connect_tcp.complete"  # httpcore's trace event: the TCP connection is open, nothing sent


class NotOurSuperNode(httpx.TransportError):
    """The Runtime API's port is held by a process of another user; ``str()`` is one line."""


def _endpoint(field: str) -> tuple[str, int]:
    """``ADDRESS:PORT`` of a ``/proc/net/tcp*`` line (the address's 32-bit words in host byte order) as
    (IP, port); an IPv4-mapped IPv6 address as its IPv4 address."""
    address, port = field.split(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def server_end_owner(sock: socket.socket) -> int | None:
    """The uid that owns the server end of the connected local TCP socket ``sock`` (its listener's), or None when
    the system does not list it (the server closed it meanwhile)."""
    local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
    ports = f":{peer[1]:04X}", f":{local[1]:04X}"  # compared first: the tables may list thousands of sockets
    for table in TCP_TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6
            continue
        for fields in (line.split() for line in lines):  # sl, local, remote, st, queues, timer, retransmits, uid
            if not (fields[1].endswith(ports[0]) and fields[2].endswith(ports[1])):
                continue
            if (_endpoint(fields[1]), _endpoint(fields[2])) == (peer, local):
                return int(fields[7])
    return None


def check_own_server(sock: socket.socket) -> None:
    """Raise NotOurSuperNode unless the server end of ``sock`` belongs to this process's user."""
    owner, me = server_end_owner(sock), os.geteuid()
    if owner != me:
        host, port = sock.getpeername()[:2]
        held = f"is held by uid {owner}" if owner is not None else "has no listener this system lists"
        raise NotOurSuperNode(
            f"refused the Runtime API at {host}:{port}: the port {held}, not by this agent's user (uid {me}), so it "
            "is not this device's SuperNode; nothing was sent to it"
        )


class OwnSuperNodeOnly:
    """A Flower protobuf client interceptor: each new connection its requests open is checked with
    ``check_own_server`` as soon as it is open, and closed unused when it is not the agent's user's."""

    def intercept(self, context: ProtobufRequestContext, call_next: ProtobufCall) -> httpx.Response:
        context.request.extensions["trace"] = _check_new_connection
        return call_next(context)


def _check_new_connection(event: str, info: dict[str, Any]) -> None:
    if event != CONNECTED:
        return
    stream = info["return_value"]
    try:
        check_own_server(stream.get_extra_info("socket"))
    except NotOurSuperNode:
        stream.close()
        raise
