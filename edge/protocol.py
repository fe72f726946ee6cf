"""The local socket protocol between Flower's short-lived ClientApp process and the long-lived edge agent.

A frame is ``!II`` (header length, blob length), a UTF-8 JSON header, then raw bytes. The ClientApp sends one
request frame and reads one reply frame per Flower message. Standard library only: it is imported by a
process that Flower starts afresh for every message."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LENGTHS = struct.Struct("!II")
MAX_HEADER = 16 * 1024 * 1024


class ProtocolError(ConnectionError):
    """The peer closed the connection or sent something that is not a frame."""


def _read_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ProtocolError("the peer closed the connection mid-frame")
        chunks += chunk
    return bytes(chunks)


def send_frame(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(_LENGTHS.pack(len(head), len(blob)) + head)
    if blob:
        sock.sendall(blob)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    head_len, blob_len = _LENGTHS.unpack(_read_exact(sock, _LENGTHS.size))
    if head_len > MAX_HEADER:
        raise ProtocolError(f"frame header of {head_len} bytes is too large")
    header = json.loads(_read_exact(sock, head_len))
    return header, _read_exact(sock, blob_len)


def call_agent(address: str, header: dict[str, Any], blob: bytes, timeout_s: float) -> tuple[dict[str, Any], bytes]:
    """One request/reply with the agent at a Unix socket path; raises ConnectionError if it is not there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        send_frame(sock, header, blob)
        return recv_frame(sock)
