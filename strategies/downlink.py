"""Compressed downlink: the server broadcasts the global model as compressed deltas with error feedback.

The server owns one broadcast reference x̂ shared by all clients. When it first sends the global model of round
a (the newest round b < a it broadcast before), it compresses the reference's distance to the exact global
model (DoubleSqueeze, Tang et al. 2019, with the residual held implicitly):

    v_a = w_a − x̂_b = Δ̄ + e_b,    δ_a = C(v_a),    x̂_a = x̂_b + decode(δ_a),    e_a = w_a − x̂_a = v_a − decode(δ_a)

where Δ̄ is the aggregated update since b and e the error-feedback residual (what C left out so far), so the
reference never drifts from the global model by more than one compression error. Clients train from x̂ (what
they received); the server keeps and evaluates its exact w.

A client known to hold x̂_b gets the chain δ_{..a} of the deltas after b; a client with nothing (its first
message, a fresh or rejoined client) or one whose chain is no longer kept or would be larger than the model
gets x̂_a dense. With the lossless codec `none`, x̂ equals w bit for bit.

A client may build x̂ of the start round itself (round 0: the model initialised from the run's seed): then
the server's first broadcast to it has no parts and costs no model bytes. Every broadcast names the sha256 of
the x̂ it yields, which the client checks, so a client whose own x̂ differs (another torch build initialising
differently) refuses it and is sent x̂ dense instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import numpy as np

from contract.errors import PeerError
from strategies.codecs import CodecError, CodecSpec, Layout, make_client_codec, server_compressor
from strategies.codecs.base import dense_payload_size, layout_info
from strategies.codecs.dense import NoCompression, dense_payload
from strategies.fedavg import apply_update

DENSE_STYPE = NoCompression.stype
NO_BASE = -1


class DownlinkError(PeerError, ValueError):
    """A broadcast that cannot be applied; str() is one human-readable line."""


def model_digest(params: np.ndarray) -> str:
    """The first 16 hex digits of the sha256 of a model's float32 bytes."""
    return hashlib.sha256(np.asarray(params, dtype=np.float32).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Part:
    """One encoded step of a broadcast: applying it yields the reference x̂ of `round`."""

    round: int
    stype: str
    payload: bytes


@dataclass(frozen=True)
class Broadcast:
    """The global model as one message carries it: parts applied in order to x̂ of `base_round` (none when the
    client holds the newest x̂ already), or, with base_round = NO_BASE, a single dense part that is x̂ itself.
    `sha256` is `model_digest` of the x̂ the client holds afterwards ("": not checked)."""

    base_round: int
    parts: tuple[Part, ...]
    sha256: str = ""

    @property
    def round(self) -> int:
        """The round of the reference the client holds once it has applied every part."""
        return self.parts[-1].round if self.parts else self.base_round

    def header(self) -> dict[str, Any]:
        """The metadata of the parts (their payloads concatenated are `blob()`)."""
        return {
            "base-round": self.base_round,
            "rounds": [p.round for p in self.parts],
            "stypes": [p.stype for p in self.parts],
            "sizes": [len(p.payload) for p in self.parts],
            "sha256": self.sha256,
        }

    def blob(self) -> bytes:
        return b"".join(p.payload for p in self.parts)

    @classmethod
    def parse(cls, header: Mapping[str, Any], blob: bytes) -> Broadcast:
        """The inverse of `header()`/`blob()`; raises DownlinkError for anything inconsistent."""
        try:
            base = _integer(header["base-round"])
            columns = [list(header[key]) for key in ("rounds", "stypes", "sizes")]
            sha256 = str(header["sha256"])
            rounds, sizes = [_integer(r) for r in columns[0]], [_integer(z) for z in columns[2]]
        except (KeyError, TypeError, ValueError) as exc:
            raise DownlinkError(f"broadcast metadata is incomplete or not numeric: {exc}") from None
        if len({len(c) for c in columns}) != 1 or (base == NO_BASE and not columns[0]):
            raise DownlinkError("broadcast metadata columns are empty or differ in length")
        stypes = [str(s) for s in columns[1]]
        if any(size < 0 for size in sizes) or sum(sizes) != len(blob):
            raise DownlinkError(f"broadcast part sizes {sizes} do not add up to the {len(blob)}-byte bundle")
        if base < NO_BASE or any(later <= earlier for earlier, later in pairwise([base, *rounds])):
            raise DownlinkError(f"broadcast rounds {rounds} do not strictly increase from base round {base}")
        if base == NO_BASE and (len(rounds) != 1 or stypes[0] != DENSE_STYPE):
            raise DownlinkError(f"a broadcast without a base must be one {DENSE_STYPE} part")
        ends = list(accumulate(sizes))
        starts = [0, *ends][: len(ends)]
        parts = tuple(Part(r, s, blob[a:b]) for r, s, a, b in zip(rounds, stypes, starts, ends, strict=True))
        return cls(base, parts, sha256)


def _integer(value: Any) -> int:
    """A JSON integer of a broadcast's metadata; raises DownlinkError for anything else (a float, ±Infinity, a
    bool)."""
    if type(value) is not int:
        raise DownlinkError(f"{str(value)[:24]!r} is not an integer")
    return value


def apply_part(reference: np.ndarray, part: Part, layout: Layout) -> np.ndarray:
    """x̂ + decode(δ) with the server's own decoder for the part's wire type (server and clients alike)."""
    return apply_update(reference, server_compressor(part.stype).decode(part.payload, layout))


def reference_delta(target: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """v = target − x̂ in float32 such that x̂ + v rounds to target exactly: where the float32 difference loses a
    bit (a weight crossing a power of two), it is moved by one unit in the last place."""
    delta = target - reference
    reached = reference + delta
    miss = reached != target
    delta[miss] = np.nextafter(delta[miss], np.where(reached[miss] < target[miss], np.inf, -np.inf).astype(np.float32))
    return delta


class BroadcastEncoder:
    """Server side: the broadcast reference x̂, and the deltas of the last rounds for clients that hold an
    older x̂ (kept while together no larger than the dense model: a longer chain would never be sent)."""

    def __init__(
        self, codec: CodecSpec, initial_params: np.ndarray, layout: Layout, seed: int = 0, start_round: int = 0
    ) -> None:
        """`initial_params` is the global model after `start_round` (a resumed run's checkpoint)."""
        self.codec = make_client_codec(codec, layout, seed)
        self.layout = layout
        self.dense_size = dense_payload_size(layout_info(layout).size)
        self.reference = np.asarray(initial_params, dtype=np.float32).copy()
        self.round = start_round
        self.digest = model_digest(self.reference)
        self._chain_base = start_round
        self._chain: list[Part] = []

    def broadcast(self, round_: int, global_params: np.ndarray, held_round: int = NO_BASE) -> Broadcast:
        """What to send a client that holds x̂ of `held_round` (NO_BASE: nothing) of the global model
        `global_params` after round `round_` (the newest round; it advances x̂ the first time it is seen)."""
        # the server broadcasts its newest round, which only grows
        assert round_ >= self.round, f"round {round_} is older than the broadcast reference's round {self.round}"
        if round_ > self.round:
            self._advance(round_, global_params)
        if held_round == self.round:
            return Broadcast(held_round, (), self.digest)
        chain = self._chain_after(held_round)
        if chain and sum(len(p.payload) for p in chain) <= self.dense_size:
            return Broadcast(held_round, tuple(chain), self.digest)
        return Broadcast(NO_BASE, (Part(self.round, DENSE_STYPE, dense_payload(self.reference)),), self.digest)

    def _advance(self, round_: int, global_params: np.ndarray) -> None:
        v = reference_delta(np.asarray(global_params, dtype=np.float32), self.reference)
        stype, payload = self.codec.compress(v, round_)
        part = Part(round_, stype, payload)
        self.reference = apply_part(self.reference, part, self.layout)
        self.round = round_
        self.digest = model_digest(self.reference)
        self._chain.append(part)
        while sum(len(p.payload) for p in self._chain) > self.dense_size:
            self._chain_base = self._chain.pop(0).round

    def _chain_after(self, held_round: int) -> list[Part]:
        """The kept deltas that take x̂ from `held_round` to the newest round; [] when that is not possible."""
        if held_round == self._chain_base:
            return self._chain
        starts = [i + 1 for i, p in enumerate(self._chain) if p.round == held_round]
        return self._chain[starts[0] :] if starts else []


class BroadcastDecoder:
    """Client side: the reference x̂ this client holds and its round (NO_BASE before the first broadcast)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.round = NO_BASE
        self.reference: np.ndarray | None = None

    def hold(self, round_: int, reference: np.ndarray) -> None:
        """Take x̂ of `round_` as built here (the seeded start model), without a broadcast."""
        self.reference, self.round = np.asarray(reference, dtype=np.float32).copy(), round_

    def receive(self, broadcast: Broadcast) -> np.ndarray:
        """Apply a broadcast and return the new x̂ (a copy); raises DownlinkError when it does not continue
        from the x̂ held here or a part does not decode for this model. Deltas that end at or before the round
        held here (a message sent before a newer model reached this client) change nothing."""
        stale = broadcast.base_round not in (NO_BASE, self.round) and broadcast.round <= self.round
        if stale and self.reference is not None:
            return self.reference.copy()
        if broadcast.base_round not in (NO_BASE, self.round):
            raise DownlinkError(
                f"the broadcast continues from round {broadcast.base_round} but this client holds round {self.round}"
            )
        try:
            if broadcast.base_round == NO_BASE:
                (part,) = broadcast.parts
                reference = server_compressor(part.stype).decode(part.payload, self.layout)
            else:
                reference = self.reference
                for part in broadcast.parts:
                    reference = apply_part(reference, part, self.layout)
        except CodecError as exc:
            raise DownlinkError(f"broadcast of round {broadcast.round}: {exc}") from None
        if broadcast.sha256 and model_digest(reference) != broadcast.sha256:
            raise DownlinkError(
                f"the global model of round {broadcast.round} here has sha256 {model_digest(reference)}, the "
                f"server's {broadcast.sha256} (a start model built differently?): it is sent whole next"
            )
        self.reference, self.round = reference, broadcast.round
        return reference.copy()
