"""How edgefl lays its messages out in Flower's: ONE ConfigRecord ``edgefl`` holding a JSON ``header`` and the
``payload`` bytes. A Flower message is a tree of objects, each fetched or stored by its own HTTP request over the
device's link; this layout is the smallest tree Flower allows — Message, RecordDict, ConfigRecord — so a message
costs one round of parallel object requests each way, whatever the model or the number of updates it carries.

Down: the header holds the job, the rounds to train, the broadcast's parts and the number of float32 values of the
strategy's vector for the device (``state``: SCAFFOLD's correction; 0: none); the payload is the broadcast's parts
concatenated, then that vector. Up: the header holds the partition and its size, one entry per update (round, codec wire
type, size, examples, training time, loss), the device's health and transport, and how long the agent held the
message; the payload is the updates' payloads concatenated. The sizes in a header must add up to its payload
exactly, and every field must be of its kind and in its range (the limits below), or the reply is refused."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from contract.errors import PeerError
from contract.messages import TrainInstruction, TrainReply
from contract.transport import message_bytes
from strategies.downlink import Broadcast
from strategies.rounds import Update

RECORD = "edgefl"
HEADER, PAYLOAD = "header", "payload"

# What a message's fields may hold. A reply comes from a device the server cannot trust: each field must be a JSON
# value of its kind in its range, or the whole reply is refused with the field, what it held and what it may be.
INT32_MAX = 2**31 - 1
MAX_ROUND = INT32_MAX  # a round number fits in int32: no run has more rounds
MAX_PARTITION = INT32_MAX  # a partition index fits in int32: no split has more partitions
MAX_EXAMPLES = INT32_MAX  # a partition's examples fit in int32 (the server checks them against the partition)
MAX_SECONDS = 30 * 24 * 3600  # a round's training or a held message lasting 30 days is no measurement
MAX_MAGNITUDE = 1e30  # |loss| or a health reading: far above any real one, and a sum of many stays finite
MAX_UPDATES = 1024  # updates in one reply: far above the D + 1 ≤ 65 rounds an agent may have ready (DGA's D ≤ 64)
MAX_NAME = 64  # characters of a wire type, a transport or a health item's name or text
MAX_HEALTH_ITEMS = 16  # a device's health report is a handful of readings (edge.health.health_snapshot)
MAX_REASON = 300  # characters of a client's error reason as the server logs it


class WireError(PeerError, ValueError):
    """A message that is not edgefl's layout; ``str()`` is the one-line reason the receiver logs."""


def _shown(value: Any) -> str:
    """A value as a reason quotes it: its repr, cut short (a 400-digit number is not a log line)."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}...({len(text)} characters)"


def _integer(value: Any, name: str, low: int, high: int) -> int:
    """A JSON integer in [low, high]: not a bool, a float, a string or a number out of range."""
    if type(value) is not int or not low <= value <= high:
        raise WireError(f"{name} is {_shown(value)}, not an integer in [{low}, {high}]")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    """A finite JSON number in [low, high] (an integer too); not a bool, a string, NaN or ±Infinity."""
    if type(value) not in (int, float) or not low <= value <= high:  # NaN fails the comparison
        raise WireError(f"{name} is {_shown(value)}, not a number in [{low:g}, {high:g}]")
    return float(value)  # in range, so an integer converts without overflow


def _name(value: Any, name: str) -> str:
    """A JSON string of 1 to MAX_NAME printable characters (no newline, no escape sequence)."""
    if type(value) is not str or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise WireError(f"{name} is {_shown(value)}, not a name of 1 to {MAX_NAME} printable characters")
    return value


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """A peer's text as one printable line of at most ``limit`` characters: a newline, a carriage return or an
    escape sequence in a client's error reason would otherwise start a line of the server's log of its own choosing
    (the log a submitter's ``flwr log --stream`` mirrors) or drive the reader's terminal."""
    shown = "".join(ch if ch.isprintable() else " " for ch in text[: limit + 1])
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def error_reason(reply: Message) -> str:
    """An error reply's reason (``Message.error``), as ``one_line`` shows it."""
    return one_line(str(reply.error.reason))


def _health(value: Any) -> dict[str, Any]:
    """A device's health report: a few named readings, each a finite number, a short text, true/false or null."""
    if type(value) is not dict or len(value) > MAX_HEALTH_ITEMS:
        raise WireError(f"health is {_shown(value)}, not an object of at most {MAX_HEALTH_ITEMS} readings")
    for key, reading in value.items():
        _name(key, "a health reading's name")
        if type(reading) in (int, float):
            _number(reading, f"health reading {key!r}", -MAX_MAGNITUDE, MAX_MAGNITUDE)
        elif reading is not None and type(reading) is not bool:
            _name(reading, f"health reading {key!r}")
    return value


def _content(header: dict[str, Any], payload: bytes) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({HEADER: json.dumps(header), PAYLOAD: payload})})


def _header_and_payload(content: RecordDict) -> tuple[dict[str, Any], bytes]:
    try:
        record = content.config_records[RECORD]
        header, payload = json.loads(str(record[HEADER])), record[PAYLOAD]
    except (KeyError, TypeError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise WireError(f"not an edgefl message ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict) or not isinstance(payload, bytes):
        raise WireError("the edgefl record's header is not an object or its payload is not bytes")
    return header, payload


def instruction_content(instr: TrainInstruction) -> RecordDict:
    header: dict[str, Any] = {"job": instr.job, "next-round": instr.next_round, "last-round": instr.last_round,
                              "reply-key": instr.reply_key, "resend": instr.resend}  # fmt: skip
    payload = b""
    if instr.broadcast is not None:
        header["broadcast"], payload = instr.broadcast.header(), instr.broadcast.blob()
    state = b"" if instr.state is None else np.ascontiguousarray(instr.state, dtype="<f4").tobytes()
    header["state"] = len(state) // 4
    return _content(header, payload + state)


def parse_instruction(content: RecordDict) -> TrainInstruction:
    """Raises WireError on anything malformed."""
    header, payload = _header_and_payload(content)
    try:
        values = _integer(header.get("state", 0), "state", 0, len(payload) // 4)
        state = np.frombuffer(payload[len(payload) - 4 * values :], "<f4") if values else None
        payload = payload[: len(payload) - 4 * values]
        if state is not None and "broadcast" not in header:
            raise WireError("a strategy state without a broadcast")
        broadcast = Broadcast.parse(header["broadcast"], payload) if "broadcast" in header else None
        if broadcast is None and payload:
            raise WireError(f"{len(payload)} payload bytes without a broadcast")
        if type(header["job"]) is not str:
            raise WireError(f"job is {_shown(header['job'])}, not a text")
        next_round = _integer(header["next-round"], "next-round", 0, MAX_ROUND)
        last_round = _integer(header["last-round"], "last-round", 0, MAX_ROUND)
        reply_key = _name(header["reply-key"], "reply-key")
        if type(header["resend"]) is not bool:
            raise WireError(f"resend is {_shown(header['resend'])}, not true or false")
        return TrainInstruction(header["job"], next_round, last_round, broadcast, reply_key, header["resend"], state)
    except (KeyError, ValueError) as exc:  # WireError and DownlinkError are ValueErrors
        raise WireError(f"malformed instruction: {exc}") from None


def reply_content(reply: TrainReply) -> RecordDict:
    header = {
        "partition-id": reply.partition_id,
        "partition-size": reply.partition_size,
        "updates": [
            {
                "round": u.round,
                "stype": u.stype,
                "size": len(u.payload),
                "num-examples": u.num_examples,
                "train-s": u.train_s,
                "loss": u.loss if math.isfinite(u.loss) else None,
            }
            for u in reply.updates
        ],
        "health": reply.health,
        "transport": reply.transport,
        "held-s": reply.held_s,
        "reply-key": reply.reply_key,
    }
    return _content(header, b"".join(u.payload for u in reply.updates))


def parse_reply(content: RecordDict) -> TrainReply:
    """Raises WireError on anything malformed (a field missing, of another kind or out of its range; sizes that
    do not add up to the payload); the server then refuses the whole reply with its reason.

    Every field is checked before an update's payload is cut from the reply's: a refused reply copies none of
    it. (A reply of one update is not copied at all: its payload is the reply's whole payload.)"""
    header, payload = _header_and_payload(content)
    try:
        entries = header["updates"]
        if type(entries) is not list or len(entries) > MAX_UPDATES:
            raise WireError(f"updates is {_shown(entries)}, not a list of at most {MAX_UPDATES} updates")
        checked, offset = [], 0
        for index, entry in enumerate(entries):
            size, update = _update(entry, len(payload) - offset, f"update {index}: ")
            checked.append((offset, size, update))
            offset += size
        if offset != len(payload):
            raise WireError(f"update sizes add up to {offset} bytes, the payload has {len(payload)}")
        partition_id = _integer(header["partition-id"], "partition-id", 0, MAX_PARTITION)
        health = _health(header["health"])
        transport = _name(header["transport"], "transport")
        held_s = _number(header["held-s"], "held-s", 0, MAX_SECONDS)
        partition_size = _integer(header["partition-size"], "partition-size", 0, MAX_EXAMPLES)
        key = _name(header["reply-key"], "reply-key")
    except KeyError as exc:
        raise WireError(f"malformed reply: no field {exc}") from None
    except WireError as exc:
        raise WireError(f"malformed reply: {exc}") from None
    updates = tuple(replace(u, payload=payload[at : at + size]) for at, size, u in checked)
    return TrainReply(partition_id, updates, health, transport, held_s, partition_size, key)


def _update(entry: Any, room: int, where: str) -> tuple[int, Update]:
    """An entry of a reply's header, checked: its ``size`` (at most ``room``, the payload bytes the entries
    before it left) and its update, whose payload ``parse_reply`` cuts once the whole reply is checked."""
    if type(entry) is not dict:
        raise WireError(f"{where}{_shown(entry)} is not an object")
    size = _integer(entry["size"], f"{where}size", 0, room)
    loss = entry["loss"]
    return size, Update(
        _integer(entry["round"], f"{where}round", 1, MAX_ROUND),
        _name(entry["stype"], f"{where}stype"),
        b"",
        _integer(entry["num-examples"], f"{where}num-examples", 1, MAX_EXAMPLES),
        _number(entry["train-s"], f"{where}train-s", 0, MAX_SECONDS),
        math.nan if loss is None else _number(loss, f"{where}loss", -MAX_MAGNITUDE, MAX_MAGNITUDE),
    )


def reply_key(message: Message) -> str:
    """The reply key of an instruction message the server built (``train_message``), read from its header only."""
    return _header_and_payload(message.content)[0]["reply-key"]


def train_message(instr: TrainInstruction, node: int) -> Message:
    return Message(instruction_content(instr), dst_node_id=node, message_type="train")


@dataclass(frozen=True)
class WireSize:
    """A message as Flower sends it: ``bytes`` of every object of its tree, deflated, and ``objects``, the
    number of objects (each its own HTTP request over the link)."""

    bytes: int
    objects: int


def wire_size(message: Message) -> WireSize:
    """``message``'s size as Flower sends it, byte-exact (``contract.transport.message_bytes``: without
    serializing a 15 MB payload again where Flower's serialization is the one it mirrors)."""
    return WireSize(*message_bytes(message))
