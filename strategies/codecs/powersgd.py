"""PowerSGD (Vogels, Karimireddy, Jaggi — NeurIPS 2019): rank-r factors with one warm-started power iteration.

Each tensor viewed as a matrix M ∈ R^{m×n} (a conv kernel as [out, in·k·k]) with (m + n)·r < m·n is sent as
    P = M Q,   P̂ = orthogonalize(P),   Q ← Mᵀ P̂,   C(M) = P̂ Qᵀ
with Q warm-started from the previous round (held by the client's memory, with the error-feedback residual).
Other tensors (dim ≤ 1, or too small to gain) are sent dense.

Averaging: in the paper all workers share Q, so the server can average P (and then Q) and the average stays
low-rank, at the cost of two communication rounds. Here each client's payload decodes to its own P̂ Qᵀ and the
server averages the decoded matrices: one round, exact average of what each client sent, not low-rank.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from strategies.codecs.base import (
    FORMAT_VERSION,
    Codec,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    Vector,
    check_finite,
    checked_state,
    layout_info,
    matrix_shape,
    read_header,
)
from strategies.codecs.memory import ResidualMemory
from strategies.spec import Parameter

POWERSGD_HEADER = struct.Struct("<BIH")  # version, P, rank


@dataclass(frozen=True)
class Block:
    """One tensor as an m×n matrix at `start` of the flat update; `compressed` when (m + n)·r < m·n."""

    index: int
    start: int
    rows: int
    cols: int
    compressed: bool


@lru_cache(maxsize=32)
def powersgd_plan(layout: Layout, rank: int) -> tuple[Block, ...]:
    """The blocks of a layout at a given rank."""
    info = layout_info(layout)
    blocks = []
    for index, (start, shape) in enumerate(zip(info.starts, info.shapes, strict=True)):
        rows, cols = matrix_shape(shape)
        compressed = len(shape) >= 2 and (rows + cols) * rank < rows * cols
        blocks.append(Block(index, int(start), rows, cols, compressed))
    return tuple(blocks)


def powersgd_payload_size(layout: Layout, rank: int) -> int:
    """Header + float32 factors P̂ (m×r) and Q (n×r) of compressed blocks + float32 entries of the others."""
    floats = sum((b.rows + b.cols) * rank if b.compressed else b.rows * b.cols for b in powersgd_plan(layout, rank))
    return POWERSGD_HEADER.size + 4 * floats


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Wire: header (version, P, rank u16) + per tensor in layout order either P̂ then Q (float32, row-major)
    or the dense float32 entries. Size: `powersgd_payload_size`. encode needs `state.warm_start[i]` (n×r)
    for every compressed tensor i, as PowerSGDMemory provides, and replaces it with the new Q."""

    rank: int = 2
    stype = "edgefl.powersgd.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        parts = []
        for block in powersgd_plan(layout, self.rank):
            entries = v[block.start : block.start + block.rows * block.cols]
            if not block.compressed:
                parts.append(entries)
                continue
            matrix = entries.reshape(block.rows, block.cols)
            p_hat, _ = np.linalg.qr(matrix @ state.warm_start[block.index])
            q = matrix.T @ p_hat
            state.warm_start[block.index] = q
            parts += [p_hat.ravel(), q.ravel()]
        header = POWERSGD_HEADER.pack(FORMAT_VERSION, v.size, self.rank)
        return header + np.concatenate(parts).astype("<f4").tobytes()

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        (rank,) = read_header(payload, POWERSGD_HEADER, layout, self.stype)
        if rank < 1:
            raise MalformedUpdate(f"{self.stype}: rank must be ≥ 1, the header says {rank}")
        expected = powersgd_payload_size(layout, rank)
        if len(payload) != expected:
            raise MalformedUpdate(
                f"{self.stype}: rank-{rank} factors for this layout take {expected} bytes, "
                f"the payload has {len(payload)}"
            )
        floats = np.frombuffer(payload, dtype="<f4", offset=POWERSGD_HEADER.size)
        check_finite(floats, "factors", self.stype)
        out = np.empty(layout_info(layout).size, dtype=np.float32)
        cursor = 0
        for block in powersgd_plan(layout, rank):
            size = block.rows * block.cols
            if block.compressed:
                p_hat = floats[cursor : cursor + block.rows * rank].reshape(block.rows, rank)
                cursor += block.rows * rank
                q = floats[cursor : cursor + block.cols * rank].reshape(block.cols, rank)
                cursor += block.cols * rank
                with np.errstate(over="ignore", invalid="ignore"):  # rejected below if not finite
                    out[block.start : block.start + size] = (p_hat @ q.T).ravel()
            else:
                out[block.start : block.start + size] = floats[cursor : cursor + size]
                cursor += size
        check_finite(out, "decoded entries (factor products)", self.stype)
        return out


class PowerSGDMemory(ResidualMemory):
    """Error feedback plus the warm-start Q (n×r, initially standard normal) of every compressed tensor."""

    def __init__(self, layout: Layout, rank: int, seed: int) -> None:
        super().__init__(layout_info(layout).size)
        rng = np.random.default_rng(seed)
        self.warm_start = {
            b.index: rng.standard_normal((b.cols, rank), dtype=np.float32)
            for b in powersgd_plan(layout, rank)
            if b.compressed
        }

    def compressor_state(self, server_round: int, rng: np.random.Generator) -> CompressorState:
        return CompressorState(rng, warm_start=self.warm_start)

    def state_dict(self) -> dict[str, Vector]:
        factors = {f"warm_start.{index}": q.copy() for index, q in self.warm_start.items()}
        return {**super().state_dict(), **factors}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        shapes = {f"warm_start.{index}": q.shape for index, q in self.warm_start.items()}
        arrays = checked_state(state, {"residual": self.residual.shape, **shapes})
        self.residual = arrays.pop("residual")
        self.warm_start = {int(name.removeprefix("warm_start.")): q for name, q in arrays.items()}


POWERSGD = Codec(
    "powersgd",
    Parameter("an integer rank in [1, 65535]", lambda x: 1 <= x <= 65535, integer=True),
    lambda spec, layout, seed, clients: (PowerSGD(int(spec.value)), PowerSGDMemory(layout, int(spec.value), seed)),
    PowerSGD(),
)
