"""How edgefl lays its messages out in Flower's: ONE ConfigRecord ``edgefl`` holding a JSON ``header`` and the
``payload`` bytes. A Flower message is a tree of objects, each fetched or stored by its own HTTP request over the
device's link; this layout is the smallest tree Flower allows — Message, RecordDict, ConfigRecord — so a message
costs one round of parallel object requests each way, whatever the model or the number of updates it carries.

Down: the header holds the job, the rounds to train and the broadcast's parts; the payload is the broadcast's
parts concatenated. Up: the header holds the partition, one entry per update (round, codec wire type, size,
examples, training time, loss), the device's health and transport, and how long the agent held the message;
the payload is the updates' payloads concatenated. The sizes in a header must add up to its payload exactly."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

from contract.messages import TrainInstruction, TrainReply
from strategies.downlink import Broadcast, DownlinkError
from strategies.rounds import Update

RECORD = "edgefl"
HEADER, PAYLOAD = "header", "payload"


class WireError(ValueError):
    """A message that is not edgefl's layout; ``str()`` is the one-line reason the receiver logs."""


def _content(header: dict[str, Any], payload: bytes) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({HEADER: json.dumps(header), PAYLOAD: payload})})


def _header_and_payload(content: RecordDict) -> tuple[dict[str, Any], bytes]:
    try:
        record = content.config_records[RECORD]
        header, payload = json.loads(str(record[HEADER])), record[PAYLOAD]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"not an edgefl message ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict) or not isinstance(payload, bytes):
        raise WireError("the edgefl record's header is not an object or its payload is not bytes")
    return header, payload


def instruction_content(instr: TrainInstruction) -> RecordDict:
    header: dict[str, Any] = {"job": instr.job, "next-round": instr.next_round, "last-round": instr.last_round}
    payload = b""
    if instr.broadcast is not None:
        header["broadcast"], payload = instr.broadcast.header(), instr.broadcast.blob()
    return _content(header, payload)


def parse_instruction(content: RecordDict) -> TrainInstruction:
    """Raises WireError on anything malformed."""
    header, payload = _header_and_payload(content)
    try:
        broadcast = Broadcast.parse(header["broadcast"], payload) if "broadcast" in header else None
        if broadcast is None and payload:
            raise WireError(f"{len(payload)} payload bytes without a broadcast")
        return TrainInstruction(str(header["job"]), int(header["next-round"]), int(header["last-round"]), broadcast)
    except (KeyError, TypeError, ValueError, DownlinkError) as exc:
        raise WireError(f"malformed instruction: {exc}") from None


def reply_content(reply: TrainReply) -> RecordDict:
    header = {
        "partition-id": reply.partition_id,
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
    }
    return _content(header, b"".join(u.payload for u in reply.updates))


def parse_reply(content: RecordDict) -> TrainReply:
    """Raises WireError on anything malformed; the server then refuses the whole reply."""
    header, payload = _header_and_payload(content)
    try:
        updates, offset = [], 0
        for entry in header["updates"]:
            size = int(entry["size"])
            if size < 0 or offset + size > len(payload):
                raise WireError("update sizes do not add up to the payload")
            loss = entry["loss"]
            updates.append(Update(int(entry["round"]), str(entry["stype"]), payload[offset : offset + size],
                                  int(entry["num-examples"]), float(entry["train-s"]),
                                  math.nan if loss is None else float(loss)))  # fmt: skip
            offset += size
        if offset != len(payload):
            raise WireError("update sizes do not add up to the payload")
        health = header["health"]
        if not isinstance(health, dict):
            raise WireError("health is not an object")
        held_s = float(header["held-s"])
        if not 0 <= held_s < math.inf:
            raise WireError(f"held-s is {held_s}, not a duration")
        return TrainReply(int(header["partition-id"]), tuple(updates), health, str(header["transport"]), held_s)
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed reply: {exc}") from None


def train_message(instr: TrainInstruction, node: int) -> Message:
    return Message(instruction_content(instr), dst_node_id=node, message_type="train")


@dataclass(frozen=True)
class WireSize:
    """A message as Flower sends it: ``bytes`` of every object of its tree, deflated, and ``objects``, the
    number of objects (each its own HTTP request over the link)."""

    bytes: int
    objects: int


def wire_size(message: Message) -> WireSize:
    with no_object_id_recompute():  # each object serialized for its id once, not once per ancestor
        objects = get_all_nested_objects(message).values()
        return WireSize(sum(len(obj.deflate()) for obj in objects), len(objects))
