"""How edgefl lays out its Flower messages; the server glue and the ClientApp both use this.

Down (server → client, type ``train``): ConfigRecord ``edgefl`` with the job and the rounds to train, and — only
when the client does not have it yet — the global model as ONE flat float32 Array (one HTTP request, not one
per tensor). Up (reply): ConfigRecord ``edgefl`` describing each update, and ALL updates concatenated into ONE
Array whose stype is ``edgefl.bundle``; each update keeps its codec's own wire type in the record."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

CONFIG = "edgefl"
ARRAYS = "arrays"
GLOBAL = "global"
UPDATES = "updates"
GLOBAL_STYPE = "edgefl.float32"
BUNDLE_STYPE = "edgefl.bundle"


@dataclass(frozen=True)
class TrainInstruction:
    """Server → client."""

    job: dict[str, Any]
    next_round: int
    last_round: int
    global_round: int  # −1 when no model is attached
    global_params: np.ndarray | None


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
            "global-round": instr.global_round,
        }
    )
    content = RecordDict({CONFIG: config})
    if instr.global_params is not None:
        params = np.ascontiguousarray(instr.global_params, dtype=np.float32)
        array = Array(dtype="float32", shape=(params.size,), stype=GLOBAL_STYPE, data=params.tobytes())
        content[ARRAYS] = ArrayRecord({GLOBAL: array})
    return content


def parse_instruction(content: RecordDict) -> TrainInstruction:
    config = content[CONFIG]
    params = None
    if ARRAYS in content.array_records:
        array = content.array_records[ARRAYS][GLOBAL]
        if array.stype != GLOBAL_STYPE:
            raise ValueError(f"unexpected global-model stype {array.stype!r}")
        params = np.frombuffer(array.data, dtype=np.float32)
    return TrainInstruction(
        job=json.loads(str(config["job"])),
        next_round=int(config["next-round"]),
        last_round=int(config["last-round"]),
        global_round=int(config["global-round"]),
        global_params=params,
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
        array = Array(dtype="uint8", shape=(len(reply.blob),), stype=BUNDLE_STYPE, data=reply.blob)
        content[ARRAYS] = ArrayRecord({UPDATES: array})
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
    blob = b""
    if updates:
        array = content.array_records[ARRAYS][UPDATES]
        if array.stype != BUNDLE_STYPE:
            raise ValueError(f"unexpected update bundle stype {array.stype!r}")
        blob = bytes(array.data)
    if any(m.size < 0 for m in updates) or sum(m.size for m in updates) != len(blob):
        raise ValueError("update sizes do not add up to the bundle length")
    return TrainReply(int(config["partition-id"]), updates, blob, json.loads(str(config["health"])))


def wire_bytes(message: Message) -> int:
    """Bytes of the message as Flower serializes it for the wire: every object of its tree, deflated."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
