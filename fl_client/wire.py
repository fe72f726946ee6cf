"""How edgefl lays out its Flower messages; the server glue and the ClientApp both use this.

Both directions carry their encoded parts concatenated into ONE Array whose stype is ``edgefl.bundle`` (one HTTP
request, not one per tensor or part); the ConfigRecord ``edgefl`` describes each part (round, codec wire type,
size) and the parts' sizes must add up to the bundle exactly.

Down (server → client, type ``train``): the job and the rounds to train, and — only when the client does not
have it yet — the global model as a ``strategies.downlink.Broadcast``: the model dense, or the compressed deltas
from the model the client holds. Up (reply): every update the client has ready, with its examples, time, loss."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from strategies.downlink import Broadcast

CONFIG = "edgefl"
ARRAYS = "arrays"
GLOBAL = "global"
UPDATES = "updates"
BUNDLE_STYPE = "edgefl.bundle"


@dataclass(frozen=True)
class TrainInstruction:
    """Server → client."""

    job: dict[str, Any]
    next_round: int
    last_round: int
    broadcast: Broadcast | None  # None when the client already holds the newest global model


@dataclass(frozen=True)
class UpdateMeta:
    round: int
    stype: str
    size: int
    num_examples: int
    train_s: float
    loss: float


@dataclass(frozen=True)
class TrainReply:
    """Client → server."""

    partition_id: int
    updates: list[UpdateMeta]
    blob: bytes
    health: dict[str, Any] = field(default_factory=dict)

    def payloads(self) -> list[bytes]:
        out, offset = [], 0
        for meta in self.updates:
            out.append(self.blob[offset : offset + meta.size])
            offset += meta.size
        return out


def instruction_content(instr: TrainInstruction) -> RecordDict:
    config = ConfigRecord(
        {
            "job": json.dumps(instr.job, sort_keys=True),
            "next-round": instr.next_round,
            "last-round": instr.last_round,
        }
    )
    content = RecordDict({CONFIG: config})
    if instr.broadcast is not None:
        config.update(instr.broadcast.header())
        content[ARRAYS] = ArrayRecord({GLOBAL: _bundle(instr.broadcast.blob())})
    return content


def parse_instruction(content: RecordDict) -> TrainInstruction:
    """Raises ValueError (or KeyError/TypeError) on anything malformed."""
    config = content[CONFIG]
    broadcast = None
    if ARRAYS in content.array_records or "base-round" in config:
        broadcast = Broadcast.parse(config, _unbundle(content, GLOBAL))
    return TrainInstruction(
        job=json.loads(str(config["job"])),
        next_round=int(config["next-round"]),
        last_round=int(config["last-round"]),
        broadcast=broadcast,
    )


def reply_content(reply: TrainReply) -> RecordDict:
    meta = reply.updates
    config = ConfigRecord(
        {
            "partition-id": reply.partition_id,
            "rounds": [m.round for m in meta],
            "stypes": [m.stype for m in meta],
            "sizes": [m.size for m in meta],
            "num-examples": [m.num_examples for m in meta],
            "train-s": [float(m.train_s) for m in meta],
            "loss": [float(m.loss) for m in meta],
            "health": json.dumps(reply.health),
        }
    )
    content = RecordDict({CONFIG: config})
    if meta:
        content[ARRAYS] = ArrayRecord({UPDATES: _bundle(reply.blob)})
    return content


def parse_reply(content: RecordDict) -> TrainReply:
    """Raises ValueError (or KeyError/TypeError) on anything malformed; the server refuses the whole reply."""
    config = content[CONFIG]
    columns = [list(config[k]) for k in ("rounds", "stypes", "sizes", "num-examples", "train-s", "loss")]
    if len({len(c) for c in columns}) != 1:
        raise ValueError("update metadata columns differ in length")
    updates = [
        UpdateMeta(int(r), str(s), int(z), int(n), float(t), float(lo))
        for r, s, z, n, t, lo in zip(*columns, strict=True)
    ]
    blob = _unbundle(content, UPDATES) if updates else b""
    if any(m.size < 0 for m in updates) or sum(m.size for m in updates) != len(blob):
        raise ValueError("update sizes do not add up to the bundle length")
    return TrainReply(int(config["partition-id"]), updates, blob, json.loads(str(config["health"])))


def _bundle(blob: bytes) -> Array:
    """Concatenated parts as one uint8 Array."""
    return Array(dtype="uint8", shape=(len(blob),), stype=BUNDLE_STYPE, data=blob)


def _unbundle(content: RecordDict, key: str) -> bytes:
    """The bytes of the bundle Array ``key``; raises KeyError when absent, ValueError for another stype."""
    array = content.array_records[ARRAYS][key]
    if array.stype != BUNDLE_STYPE:
        raise ValueError(f"unexpected bundle stype {array.stype!r}")
    return bytes(array.data)


def wire_bytes(message: Message) -> int:
    """Bytes of the message as Flower serializes it for the wire: every object of its tree, deflated."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
