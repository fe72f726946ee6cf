"""The attacking device of ``bench/hostile_clients.py``: edgefl's own edge agent (``fl_client.node``, unchanged)
whose replies, in the rounds its plan names, carry attacks instead of its honest update. The attacks live here,
with the benchmark, and take effect in this process only: the agent users run has none of this.

    python bench/hostile_agent.py --plan PLAN.json  <the arguments of python -m fl_client.node>

The agent trains every round honestly. In an attacked round (``Plan``) its reply is swapped for the round's one
attack that fails a reply (a malformed reply, a round the device may not send: ``REPLY``; or an update the server
cannot use, which it counts as the round's answer: ``FINAL``): a round that has its quorum does not wait for a node
that failed since the model moved (``strategies.rounds``), so a second attack in the same round might never be
sent. When the server asks again, the honest update answers. A forged
message (``FORGED``: a reply to a message the device was not sent) goes out on the Runtime API task that answered
the round before, kept open until the other device's SuperNode receives its message of the round (the device reads
the other's logs, as if they had leaked). Every reply sent is a line of the plan's log."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict

import fl_client.app
import fl_client.node
import fl_client.tasks
from contract.messages import TrainReply
from contract.wire import HEADER, INT32_MAX, MAX_UPDATES, PAYLOAD, RECORD, parse_instruction, parse_reply, reply_content
from strategies.codecs import CODECS, Layout, parse_codec, server_compressor
from strategies.codecs.base import DENSE_HEADER, FORMAT_VERSION, layout_info
from strategies.codecs.dense import dense_payload
from strategies.codecs.stc import STC_HEADER

REPLY, FINAL, FORGED = "reply", "final", "forged"  # how an attack is delivered (see the module's docstring)
HUGE_REPLY_MB = 15  # over what a reply of the bench's run may carry (contract.uploads): refused at the gateway (413)
OVER_GATEWAY_MB = 17  # over what the gateway takes with no run under way too (16 MB)
EXTRA_RECORDS = 50  # objects of a reply over edgefl's shape (3), each small enough to pass the gateway: 15 MB in all
FORGED_MARKER_S = 4321.0  # a forged reply's train-s (plus its index): how the benchmark finds one the server took
VICTIM_WAIT_S = 60.0  # how long the device waits for the other device's next message
TTL_MARGIN_S = 60.0  # a forged reply expires this much before the message it claims to answer (Flower's check)
# A codec's spec for a valid payload to break, and where its header holds the count checked against the layout.
CODEC_SPECS = {"none": "none", "topk": "topk:0.01", "stc": "stc:0.01", "dgc": "dgc:0.99", "powersgd": "powersgd:2",
               "onebit": "onebit", "terngrad": "terngrad", "threshold": "threshold:0.001", "int8": "int8",
               "qsgd": "qsgd:16"}  # fmt: skip
COUNT_FIELDS = {"none": (1, "<I", "P=2**32-1"), "onebit": (1, "<I", "P=2**32-1"), "terngrad": (1, "<I", "P=2**32-1"),
                "topk": (5, "<I", "k=2**32-1"), "threshold": (5, "<I", "count=2**32-1"),
                "dgc": (5, "<I", "count=2**32-1"), "stc": (5, "<I", "k=2**32-1"), "int8": (5, "<I", "levels=2**32-1"),
                "qsgd": (5, "<I", "levels=2**32-1"), "powersgd": (5, "<H", "rank=65535")}  # fmt: skip


@dataclass(frozen=True)
class Victim:
    """Another device, as the attacker learns it: its node, the message it holds unanswered, its partition."""

    node: int
    message_id: str
    partition: int
    size: int


@dataclass(frozen=True)
class Target:
    """What an attack is made from: the server's message it answers, the device's honest reply to it (for a forged
    attack, built before training: its previous one), the model's layout, the device's honest reply of an earlier
    round, and the other device."""

    message: Message
    honest: TrainReply
    layout: Layout
    previous: TrainReply | None = None
    answered: str = ""  # the id of a message the device answered earlier
    victim: Victim | None = None
    marker: float = 0.0


@dataclass(frozen=True)
class Attack:
    name: str
    delivery: str  # REPLY, FINAL or FORGED
    build: Callable[[Target], RecordDict | Message]
    needs_history: bool = False  # made from a reply of an earlier round: never scheduled in round 1


# ----- replies with a header the server must refuse ------------------------------------------------------------
SENTINEL = "\x00raw\x00"


def _content(header_text: str, payload: bytes) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({HEADER: header_text, PAYLOAD: payload})})


def _header(t: Target) -> tuple[dict[str, Any], bytes]:
    record = reply_content(t.honest).config_records[RECORD]
    return json.loads(str(record[HEADER])), bytes(record[PAYLOAD])


def raw_field(field: str, raw: str) -> Callable[[Target], RecordDict]:
    """The honest reply with ``field`` (of the reply, or of its update) written as the JSON text ``raw``."""

    def build(t: Target) -> RecordDict:
        header, payload = _header(t)
        (header if field in header else header["updates"][0])[field] = SENTINEL
        return _content(json.dumps(header).replace(json.dumps(SENTINEL), raw), payload)

    return build


def _header_edit(edit: Callable[[dict[str, Any], bytes], tuple[str, bytes]]) -> Callable[[Target], RecordDict]:
    return lambda t: _content(*edit(*_header(t)))


def _many_updates(header: dict[str, Any], payload: bytes) -> tuple[str, bytes]:
    empty = {**header["updates"][0], "size": 0}
    header["updates"] = [header["updates"][0]] + [empty] * MAX_UPDATES
    return json.dumps(header), payload


def _size_past_payload(header: dict[str, Any], payload: bytes) -> tuple[str, bytes]:
    header["updates"][0]["size"] = len(payload) + 1
    return json.dumps(header), payload


def _long_stype(header: dict[str, Any], payload: bytes) -> tuple[str, bytes]:
    header["updates"][0]["stype"] = "edgefl.none.v1" + "x" * 100
    return json.dumps(header), payload


def _other_partition(t: Target) -> RecordDict:
    other = abs(t.honest.partition_id - 1)  # a partition of the run's (it has at least two)
    return reply_content(dataclasses.replace(t.honest, partition_id=other))


def _inflated_partition(t: Target) -> RecordDict:
    return reply_content(dataclasses.replace(t.honest, partition_size=t.honest.partition_size * 1000))


# ----- replies whose update the server must refuse ---------------------------------------------------------------
def _with_update(t: Target, **changes: Any) -> RecordDict:
    update = dataclasses.replace(t.honest.updates[0], **changes)
    return reply_content(dataclasses.replace(t.honest, updates=(update,)))


def update_with(**changes: Any) -> Callable[[Target], RecordDict]:
    return lambda t: _with_update(t, **changes)


def _replayed(t: Target) -> RecordDict:
    """The update of the round before, sent again as it was (its round included)."""
    previous = t.previous or t.honest
    return reply_content(dataclasses.replace(t.honest, updates=previous.updates[:1]))


def _future(t: Target) -> RecordDict:
    return _with_update(t, round=t.honest.updates[0].round + 2)


def _weight(examples: Callable[[int], int]) -> Callable[[Target], RecordDict]:
    return lambda t: _with_update(t, num_examples=examples(t.honest.partition_size))


def dense_update(t: Target) -> np.ndarray:
    """The honest update as the server decodes it."""
    update = t.honest.updates[0]
    return server_compressor(update.stype).decode(update.payload, t.layout)


def codec_payload(codec: str, vector: np.ndarray, layout: Layout) -> tuple[str, bytearray]:
    """A valid payload of ``codec`` for ``vector``, made by its own client-side compressor."""
    compressor, memory = CODECS[codec].make(parse_codec(CODEC_SPECS[codec]), layout, 1, 4)
    state = memory.compressor_state(1, np.random.default_rng(1))
    return compressor.stype, bytearray(compressor.encode(vector, layout, state))


def malformed(codec: str, how: str) -> Callable[[Target], RecordDict]:
    """A payload of ``codec``'s wire type, ``how``: truncated (its second half cut), oversized (16 bytes more) or
    with its header's count (entries, levels, rank; P for the codecs with none) at the field's maximum."""

    def build(t: Target) -> RecordDict:
        stype, payload = codec_payload(codec, dense_update(t), t.layout)
        if how == "truncated":
            payload = payload[: len(payload) // 2]
        elif how == "oversized":
            payload += bytes(16)
        else:
            offset, kind, _ = COUNT_FIELDS[codec]
            struct.pack_into(kind, payload, offset, 2 ** (8 * struct.calcsize(kind)) - 1)
        return _with_update(t, stype=stype, payload=bytes(payload))

    return build


def _nan_value(t: Target) -> RecordDict:
    vector = dense_update(t).copy()
    vector[len(vector) // 2] = np.nan
    return _with_update(t, stype="edgefl.none.v1", payload=dense_payload(vector))


def _infinite_scale(t: Target) -> RecordDict:
    stype, payload = codec_payload("topk", dense_update(t), t.layout)
    struct.pack_into("<f", payload, 9, math.inf)  # SPARSE_HEADER <BIIf: the scale
    return _with_update(t, stype=stype, payload=bytes(payload))


def _overflowing_factors(t: Target) -> RecordDict:
    stype, payload = codec_payload("powersgd", dense_update(t), t.layout)
    head = struct.calcsize("<BIH")
    floats = np.full((len(payload) - head) // 4, 1e30, dtype="<f4")
    return _with_update(t, stype=stype, payload=bytes(payload[:head]) + floats.tobytes())


def _stc_bomb(t: Target) -> RecordDict:
    """STC's costliest payload: P − 1 positions (every gap 0, Rice parameter 0), decoded to the last one before
    the one bad bit, in the position codes' padding, is found."""
    size = layout_info(t.layout).size
    count = size - 1 if (size - 1) % 8 else size - 2  # the codes end inside their last byte: a padding bit to set
    stream = np.zeros(math.ceil(count / 8) * 8, dtype=np.uint8)
    stream[count] = 1  # the first padding bit
    signs = bytes(math.ceil(count / 8))
    payload = STC_HEADER.pack(FORMAT_VERSION, size, count, 1e-4, 0) + np.packbits(stream).tobytes() + signs
    return _with_update(t, stype="edgefl.stc.v1", payload=payload)


def huge_reply(megabytes: int) -> Callable[[Target], RecordDict]:
    def build(t: Target) -> RecordDict:
        size = layout_info(t.layout).size
        payload = DENSE_HEADER.pack(FORMAT_VERSION, size) + bytes(megabytes << 20)
        return _with_update(t, stype="edgefl.none.v1", payload=payload)

    return build


def many_records(count: int, each_bytes: int) -> Callable[[Target], RecordDict]:
    """The honest reply with ``count`` records more, each one object under the run's upload bound (each different:
    Flower stores an object by its content's hash, once): the gateway passes every upload, and the SuperLink stores
    them before the ServerApp sees the reply's shape."""

    def build(t: Target) -> RecordDict:
        content = reply_content(t.honest)
        for i in range(count):
            content.config_records[f"extra-{i}"] = ConfigRecord({PAYLOAD: i.to_bytes(4) + bytes(each_bytes - 4)})
        return content

    return build


# ----- forged messages: replies to a message this device was not sent --------------------------------------------
def forged(reply_to: Callable[[Target], str], as_victim: bool) -> Callable[[Target], Message]:
    """A reply carrying the device's previous update (as this round's, with a marked training time) that claims to
    answer ``reply_to``'s message; ``as_victim``: sent in the other device's name (its node, partition and size)."""

    def build(t: Target) -> Message:
        previous = t.previous or t.honest
        victim = t.victim
        update = dataclasses.replace(previous.updates[0], round=t.honest.updates[0].round, train_s=t.marker)
        partition, size = (
            (victim.partition, victim.size) if victim else (previous.partition_id, previous.partition_size)
        )
        content = reply_content(dataclasses.replace(previous, partition_id=partition, partition_size=size,
                                                    updates=(update,)))  # fmt: skip
        reply = Message(content, reply_to=t.message)
        metadata = reply.metadata.__dict__
        metadata["_reply_to_message_id"] = reply_to(t)
        metadata["_ttl"] = max(1.0, metadata["_ttl"] - TTL_MARGIN_S)
        if as_victim and victim:
            metadata["_src_node_id"] = victim.node
        return reply

    return build


def _victims_message(t: Target) -> str:
    return t.victim.message_id if t.victim else ""


def _made_up(t: Target) -> str:
    return hashlib.sha256(f"not a message {t.message.metadata.message_id}".encode()).hexdigest()


def _catalogue() -> list[Attack]:
    attacks = []
    for field in ("size", "round", "num-examples", "partition-id"):
        for label, raw in (("1e400", "1e400"), ("Infinity", "Infinity"), ("NaN", "NaN"), ("10**400", "1" + "0" * 400)):
            attacks.append(Attack(f"{field}={label}", REPLY, raw_field(field, raw)))
    attacks += [
        Attack("partition-size=10**400", REPLY, raw_field("partition-size", "1" + "0" * 400)),
        Attack("held-s=Infinity", REPLY, raw_field("held-s", "Infinity")),
        Attack("train-s=1e400", REPLY, raw_field("train-s", "1e400")),
        Attack("loss=NaN", REPLY, raw_field("loss", "NaN")),
        Attack("round=0", REPLY, raw_field("round", "0")),
        Attack("num-examples=-5", REPLY, raw_field("num-examples", "-5")),
        Attack("stype of 114 characters", REPLY, _header_edit(_long_stype)),
        Attack(f"{MAX_UPDATES + 1} updates", REPLY, _header_edit(_many_updates)),
        Attack("size past the payload", REPLY, _header_edit(_size_past_payload)),
        Attack("header nested 100000 deep", REPLY, lambda t: _content("[" * 100000 + "]" * 100000, b"")),
        Attack("header not JSON", REPLY, lambda t: _content("{partition-id: 3", b"")),
        Attack("partition-id of another device", REPLY, _other_partition),
        Attack("partition-size x1000", REPLY, _inflated_partition),
        Attack("replayed update (the round before)", REPLY, _replayed, needs_history=True),
        Attack("future round (+2)", REPLY, _future),
        Attack("round=2**31-1", REPLY, update_with(round=INT32_MAX)),
        Attack("reply_to a made-up message", FORGED, forged(_made_up, as_victim=False)),
        Attack("reply_to its own answered message", FORGED, forged(lambda t: t.answered, as_victim=False)),
        Attack("reply_to another node's message", FORGED, forged(_victims_message, as_victim=False)),
        Attack("reply_to another node's message in its name", FORGED, forged(_victims_message, as_victim=True)),
        Attack("num-examples x1000", FINAL, _weight(lambda size: size * 1000)),
        Attack("num-examples=2**31-1", FINAL, _weight(lambda size: INT32_MAX)),
        Attack("unknown wire type", FINAL, update_with(stype="edgefl.bogus.v1")),
        Attack("none: NaN value", FINAL, _nan_value),
        Attack("topk: scale Infinity", FINAL, _infinite_scale),
        Attack("powersgd: factors overflow", FINAL, _overflowing_factors),
        Attack("stc: a position per entry, one bad bit (decoder bomb)", FINAL, _stc_bomb),
        Attack(f"{HUGE_REPLY_MB} MB reply (decoder bomb)", FINAL, huge_reply(HUGE_REPLY_MB)),
        Attack(
            f"{EXTRA_RECORDS} extra records of 0.3 MB (each under the upload bound)",
            REPLY,
            many_records(EXTRA_RECORDS, 300_000),
        ),
        Attack(f"{OVER_GATEWAY_MB} MB reply (over the gateway's body cap)", FINAL, huge_reply(OVER_GATEWAY_MB)),
    ]
    for codec, (_, _, count) in COUNT_FIELDS.items():
        attacks += [
            Attack(f"{codec}: truncated", FINAL, malformed(codec, "truncated")),
            Attack(f"{codec}: oversized", FINAL, malformed(codec, "oversized")),
            Attack(f"{codec}: {count}", FINAL, malformed(codec, "count")),
        ]
    return attacks


ATTACKS: dict[str, Attack] = {attack.name: attack for attack in _catalogue()}


# ----- the plan ------------------------------------------------------------------------------------------------
def attacked_rounds(rounds: int, honest_every: int) -> list[int]:
    """Rounds K, 2K, 3K, ... are honest (K = ``honest_every``); the others, round 1 first, are attacked."""
    return [r for r in range(1, rounds + 1) if r % honest_every]


def rounds_needed(names: list[str], honest_every: int) -> int:
    """The fewest rounds whose attacked rounds hold every attack of ``names`` but the forged ones, one each (at least
    one round)."""
    attacked = max(1, sum(ATTACKS[name].delivery != FORGED for name in names))
    rounds = 1
    while len(attacked_rounds(rounds, honest_every)) < attacked:
        rounds += 1
    return rounds


def schedule(names: list[str], rounds: int, honest_every: int) -> dict[int, list[str]]:
    """Each attacked round's attacks: one that fails a reply (REPLY or FINAL) each, in order, those made from an
    earlier round's reply last; the forged ones (which count for nobody, and go out on the task that answered the
    round before) dealt round-robin from the second attacked round on, first in their round."""
    attacked = attacked_rounds(rounds, honest_every)
    failing = sorted((n for n in names if ATTACKS[n].delivery != FORGED), key=lambda n: ATTACKS[n].needs_history)
    forged = [n for n in names if ATTACKS[n].delivery == FORGED]
    if len(failing) > len(attacked) or not attacked:
        raise ValueError(f"{len(failing)} attacks need a round each; {rounds} rounds attack in {len(attacked)}: use "
                         f"--rounds {rounds_needed(names, honest_every)}")  # fmt: skip
    plan: dict[int, list[str]] = {r: [] for r in attacked}
    carriers = attacked[1:] or attacked
    for i, name in enumerate(forged):
        plan[carriers[i % len(carriers)]].append(name)
    for round_, name in zip(attacked, failing, strict=False):
        plan[round_].append(name)
    return {r: names_ for r, names_ in plan.items() if names_}


@dataclass(frozen=True)
class Plan:
    """What the attacking device does: the attacks of each round, where it logs what it sent, and where it learns
    another device's node and messages (its SuperNode's and agent's logs: as if they had leaked)."""

    rounds: dict[int, list[str]]
    log: Path
    victim_supernode_log: Path
    victim_agent_log: Path

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"rounds": {str(r): n for r, n in self.rounds.items()}, "log": str(self.log),
                                    "victim_supernode_log": str(self.victim_supernode_log),
                                    "victim_agent_log": str(self.victim_agent_log)}, indent=1))  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> Plan:
        raw = json.loads(path.read_text())
        rounds = {int(r): names for r, names in raw["rounds"].items()}
        unknown = sorted({n for names in rounds.values() for n in names} - set(ATTACKS))
        if unknown:
            raise ValueError(f"unknown attacks in {path}: {unknown}")
        return cls(rounds, Path(raw["log"]), Path(raw["victim_supernode_log"]), Path(raw["victim_agent_log"]))


# ----- the attacking ClientApp -----------------------------------------------------------------------------------
_task = threading.local()  # the task this thread serves: ``forge``, the round whose forged messages it will carry


class Attacker:
    """The ClientApp the agent's TaskServer runs: the real one (``app``), its replies swapped as ``plan`` says.

    A round's forged messages go out on the task that answered the round before: it is kept open (``forging``)
    until the other device's SuperNode receives its message of the round, and they are pushed at once, before
    that device can answer it."""

    def __init__(self, app: Callable[[Message, Context], Message], plan: Plan) -> None:
        self.app = app
        self.plan = plan
        self.lock = threading.Lock()
        self.pending: dict[int, list[Attack]] = {}  # an attacked round → its attacks not sent yet
        self.honest: dict[int, TrainReply] = {}  # an attacked round → the agent's reply, sent after its attacks
        self.previous: dict[int, TrainReply | None] = {}  # an attacked round → the honest reply before it
        self.last_honest: TrainReply | None = None
        self.answered = ""  # the id of the last message the device answered honestly
        self.forged = 0

    def __call__(self, message: Message, context: Context) -> Message:
        instr = parse_instruction(message.content)  # the server's own message: trusted here
        with self.lock:
            if instr.asks_for_rounds and instr.broadcast is None and instr.next_round in self.honest:
                return self._next(instr.next_round, message)  # asked again for a round it answered with an attack
            self._drop_before(instr.next_round)
        reply = self.app(message, context)
        if reply.has_error():
            return reply
        parsed = parse_reply(reply.content)
        with self.lock:
            round_ = parsed.updates[0].round if parsed.updates else 0
            attacks = [ATTACKS[n] for n in self.plan.rounds.get(round_, []) if ATTACKS[n].delivery != FORGED]
            if not attacks:
                if parsed.updates:
                    self.last_honest, self.answered = parsed, message.metadata.message_id
                    self._last_of_round(round_, message)
                return reply
            if round_ in self.honest:  # asked again with the global model: the round's attacks went already
                return self._next(round_, message)
            self.pending[round_], self.honest[round_] = attacks, parsed
            self.previous[round_] = self.last_honest
            self.last_honest = parsed
            return self._next(round_, message)

    def _next(self, round_: int, message: Message) -> Message:
        """The next reply of an attacked round: its next attack, or once none is left, the honest one; each echoes
        the key of the message it answers, as the device's own ClientApp does."""
        honest = dataclasses.replace(self.honest[round_], reply_key=parse_instruction(message.content).reply_key)
        if not self.pending[round_]:
            self._log(round_, "honest", REPLY, answers=message.metadata.message_id)
            self.answered = message.metadata.message_id
            self._last_of_round(round_, message)
            return Message(reply_content(honest), reply_to=message)
        attack = self.pending[round_].pop(0)
        target = Target(message, honest, _layout(), self.previous[round_])
        content = attack.build(target)
        assert isinstance(content, RecordDict)
        self._log(round_, attack.name, attack.delivery, answers=message.metadata.message_id)
        if attack.delivery == FINAL:
            self._last_of_round(round_, message)
        return Message(content, reply_to=message)

    def _last_of_round(self, round_: int, message: Message) -> None:
        """This task answers ``round_`` for the last time: it carries the next round's forged messages, if any."""
        if any(ATTACKS[n].delivery == FORGED for n in self.plan.rounds.get(round_ + 1, [])):
            _task.forge = (round_ + 1, message)

    def _drop_before(self, round_: int) -> None:
        """A message for a later round: the rounds before it are closed; attacks not sent in them are logged."""
        for old in [r for r in self.honest if r < round_]:
            for attack in self.pending.pop(old):
                self._log(old, attack.name, attack.delivery, skipped="the round closed before it was sent")
            del self.honest[old], self.previous[old]

    def forging(self, push_output: Callable[..., None]) -> Callable[..., None]:
        """``fl_client.tasks._push_output``, the end of a task, that first pushes the forged messages it carries."""

        def push(client: Any, *args: Any) -> None:
            forge, _task.forge = getattr(_task, "forge", None), None
            if forge:
                self._forge(*forge, client)
            push_output(client, *args)

        return push

    def _forge(self, round_: int, answered: Message, client: Any) -> None:
        """Push ``round_``'s forged messages on the task that answered ``answered`` (the message of the round
        before) once the other device's SuperNode has received its message of ``round_``."""
        names = [n for n in self.plan.rounds[round_] if ATTACKS[n].delivery == FORGED]
        victim = self._victim()
        if self.last_honest is None or victim is None:
            why = "no honest update to forge from" if self.last_honest is None else "the other device got no message"
            for name in names:
                self._log(round_, name, FORGED, skipped=why)
            return
        # Its own message's key is the only one the device has: the victim's message carries another.
        base = TrainReply(self.last_honest.partition_id,
                          (dataclasses.replace(self.last_honest.updates[0], round=round_),),
                          partition_size=self.last_honest.partition_size,
                          reply_key=parse_instruction(answered.content).reply_key)  # fmt: skip
        for name in names:
            self.forged += 1
            marker = FORGED_MARKER_S + self.forged
            reply = ATTACKS[name].build(
                Target(answered, base, _layout(), self.last_honest, self.answered, victim, marker)
            )
            assert isinstance(reply, Message)
            stopped = {}
            try:
                fl_client.tasks._push_reply(client, reply)
            except Exception as exc:  # whatever its own SuperNode answered is the outcome
                stopped = {"push_refused": f"{type(exc).__name__}: {exc}"}
            self._log(round_, name, FORGED, answers=answered.metadata.message_id,
                      target=reply.metadata.reply_to_message_id, as_node=reply.metadata.src_node_id,
                      victim_node=victim.node, marker=marker, **stopped)  # fmt: skip

    def _victim(self) -> Victim | None:
        """The other device (its node, partition, size, and the message it holds unanswered), read from its logs
        once its SuperNode receives a message it had not yet; None if none comes within VICTIM_WAIT_S."""
        pattern = r"(Receiving|Sending): train message \(ID: ([0-9a-f]+)\)"
        seen = {found[1] for found in re.findall(pattern, _read(self.plan.victim_supernode_log))}
        deadline = time.monotonic() + VICTIM_WAIT_S
        while time.monotonic() < deadline:
            supernode = _read(self.plan.victim_supernode_log)
            messages = re.findall(pattern, supernode)
            nodes = re.findall(r"SuperNode ID: (\d+)", supernode)
            sessions = re.findall(r"partition (\d+) \((\d+) examples\)", _read(self.plan.victim_agent_log))
            if messages and messages[-1][0] == "Receiving" and messages[-1][1] not in seen and nodes and sessions:
                partition, size = sessions[-1]
                return Victim(int(nodes[-1]), messages[-1][1], int(partition), int(size))
            time.sleep(0.005)
        return None

    def _log(self, round_: int, attack: str, delivery: str, **fields: Any) -> None:
        line = {"round": round_, "attack": attack, "delivery": delivery, "time": time.time(), **fields}
        with self.plan.log.open("a") as log:
            log.write(json.dumps(line) + "\n")


def _layout() -> Layout:
    session = fl_client.app._agent._session  # the agent's current run: its model's layout
    return session.layout


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--plan", type=Path, required=True)
    args, node_argv = parser.parse_known_args(argv)
    attacker = Attacker(fl_client.app.app, Plan.load(args.plan))
    fl_client.app.app = attacker  # fl_client.node serves fl_client.app.app, imported once the agent is built
    fl_client.tasks._push_output = attacker.forging(fl_client.tasks._push_output)
    fl_client.node.main(node_argv)


if __name__ == "__main__":
    main()
