"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally — ICLR 2018).

Per client and round, with g the update the client hands over (−η·∇f in the per-step setting, K = 1):

    g ← g · min(1, c·N^(−1/2) / ‖g‖₂)      local gradient clipping (c: global max norm, N clients)
    u ← m·u + g                             momentum correction
    v ← v + u                               local accumulation (velocity)
    send the top-k of |v| in every tensor with dim > 1 (dim ≤ 1 tensors, e.g. biases, go dense)
    v ← v − sent;  u ← u ⊙ ¬mask            momentum factor masking at the sparse indices sent

The memory holds the momentum, so a client using DGC must train with plain SGD (no optimizer momentum).
Sparsity warm-up: 75%, 93.75%, 98.4375%, 99.6%, each for a quarter of the warm-up rounds (default 4, one round
each; the paper spreads them over its first 4 epochs), then the target (99.9% in the paper).
The top-k threshold comes from a ~1% random sample and is refined while the count is off by >1.3x / <0.8x.
Since sent is float16-rounded, v keeps the rounding error instead of an exact zero: Σ sent + v_T = Σ_t u_t.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, get_args

import numpy as np
import numpy.typing as npt

from strategies.codecs.base import (
    FORMAT_VERSION,
    Codec,
    CodecError,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    Vector,
    check_count,
    check_finite,
    check_size,
    checked_state,
    layout_info,
    read_header,
)
from strategies.spec import Parameter

if TYPE_CHECKING:
    from strategies.codecs.registry import CodecSpec
from strategies.codecs.memory import Memory
from strategies.codecs.sparse import (
    SPARSE_HEADER,
    Indices,
    pack_sparse,
    sparse_values_bytes,
    unpack_sparse,
)

DGCStage = Literal["naive", "accumulate", "momentum", "warmup", "full"]
DGC_STAGES: tuple[DGCStage, ...] = get_args(DGCStage)
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.00390625)  # 75%, 93.75%, 98.4375%, 99.6% sparse in rounds 1–4
SAMPLE_FRACTION = 0.01
MAX_REFINEMENTS = 8
DGC_MOMENTUM = 0.9


@dataclass(frozen=True)
class DGCOptions:
    """Which parts of DGC are on. `for_stage` builds the rows of the paper's ablation table."""

    sparsity: float
    accumulate: bool = True
    momentum: float = DGC_MOMENTUM
    warmup: bool = True
    masking: bool = True
    clip_norm: float | None = None
    num_clients: int = 1
    warmup_rounds: int = len(WARMUP_DENSITIES)

    def __post_init__(self) -> None:
        if not 0 < self.sparsity < 1:
            raise CodecError(f"DGC sparsity must be in (0, 1), got {self.sparsity}")
        if not 0 <= self.momentum < 1:
            raise CodecError(f"DGC momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise CodecError(f"DGC clip norm must be positive and finite, got {self.clip_norm}")
        if self.num_clients < 1:
            raise CodecError(f"DGC needs num_clients ≥ 1 for its clipping share, got {self.num_clients}")
        if self.warmup_rounds < 1:
            raise CodecError(f"DGC warm-up must last at least 1 round, got {self.warmup_rounds}")

    @classmethod
    def for_stage(
        cls,
        sparsity: float,
        stage: DGCStage = "full",
        clip_norm: float | None = None,
        num_clients: int = 1,
        warmup_rounds: int = len(WARMUP_DENSITIES),
    ) -> DGCOptions:
        """Cumulative ablation: naive top-k (unsent entries dropped) → + local accumulation → + momentum
        correction → + sparsity warm-up → full DGC (+ momentum factor masking). Local clipping is on at any
        stage when `clip_norm` (the global max norm training would clip at) is given; `warmup_rounds` is the
        length of the sparsity warm-up where it is on."""
        level = DGC_STAGES.index(stage)
        return cls(
            sparsity,
            accumulate=level >= 1,
            momentum=DGC_MOMENTUM if level >= 2 else 0.0,
            warmup=level >= 3,
            masking=level >= 4,
            clip_norm=clip_norm,
            num_clients=num_clients,
            warmup_rounds=warmup_rounds,
        )

    def density(self, server_round: int) -> float:
        """Fraction of entries sent in round server_round (1-based), after the warm-up schedule."""
        target = 1.0 - self.sparsity
        if self.warmup and server_round <= self.warmup_rounds:
            stage = (server_round - 1) * len(WARMUP_DENSITIES) // self.warmup_rounds
            return max(WARMUP_DENSITIES[stage], target)
        return target


@dataclass(frozen=True)
class DGCPlan:
    """Which parts of a layout DGC sparsifies (dim > 1) and which it sends dense (dim ≤ 1)."""

    sparse_ranges: tuple[tuple[int, int], ...]
    dense_positions: npt.NDArray[np.int64]
    tensor_is_dense: npt.NDArray[np.bool_]


@lru_cache(maxsize=32)
def dgc_plan(layout: Layout) -> DGCPlan:
    """The DGC split of a layout."""
    info = layout_info(layout)
    is_dense = np.array([len(shape) <= 1 for shape in info.shapes])
    ranges = [(int(start), int(start + size)) for start, size in zip(info.starts, info.sizes, strict=True)]
    dense = [np.arange(start, stop) for (start, stop), dense in zip(ranges, is_dense, strict=True) if dense]
    positions = np.concatenate(dense) if dense else np.zeros(0, dtype=np.int64)
    positions.flags.writeable = is_dense.flags.writeable = False
    sparse = tuple(r for r, dense in zip(ranges, is_dense, strict=True) if not dense)
    return DGCPlan(sparse, positions, is_dense)


def sampled_top_k(magnitude: npt.NDArray[np.float32], k: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Sorted positions of the (about) k largest magnitudes, selected as DGC does.

    The threshold is the matching quantile of a ~1% random sample; while more than 1.3k entries pass it, it
    grows ×1.3, while fewer than 0.8k pass, it shrinks ×0.8. If more than k pass, the exact top-k of those is
    kept; if no refinement lands in [0.8k, 1.3k], the exact top-k of all entries.
    """
    size = magnitude.size
    sample = magnitude[rng.integers(0, size, max(1, math.ceil(SAMPLE_FRACTION * size)))]
    passing = min(sample.size, max(1, round(k / size * sample.size)))
    threshold = np.partition(sample, sample.size - passing)[sample.size - passing]
    for _ in range(MAX_REFINEMENTS):
        selected = np.flatnonzero(magnitude >= threshold)
        if selected.size > 1.3 * k:
            threshold *= 1.3
        elif selected.size < 0.8 * k:
            threshold *= 0.8
        else:
            break
    else:
        selected = np.arange(size)
    if selected.size > k:
        selected = np.sort(selected[np.argpartition(magnitude[selected], selected.size - k)[selected.size - k :]])
    return selected


class DGCCompressor(Compressor):
    """DGC's wire format: per-tensor sampled top-k of the dim > 1 tensors, dim ≤ 1 tensors dense.

    The density comes from CompressorState (the memory's warm-up schedule); each such tensor of n entries
    sends k = max(1, round(density·n)) or slightly fewer (see `sampled_top_k`).
    Wire: header (version, P, k, scale) + k sorted indices + k float16 v_i/scale + the dim ≤ 1 tensors as
    float32 in layout order. Size: 13 + k·(index bytes + 2) + 4·(entries of dim ≤ 1 tensors).
    """

    stype = "edgefl.dgc.v1"

    def encode(self, v: Vector, layout: Layout, state: CompressorState) -> bytes:
        plan = dgc_plan(layout)
        picks = [
            start + sampled_top_k(np.abs(v[start:stop]), max(1, round(state.density * (stop - start))), state.rng)
            for start, stop in plan.sparse_ranges
        ]
        indices = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
        scale, body = pack_sparse(indices, v[indices], v.size)
        dense = v[plan.dense_positions].astype("<f4").tobytes()
        return SPARSE_HEADER.pack(FORMAT_VERSION, v.size, indices.size, scale) + body + dense

    def decode(self, payload: bytes, layout: Layout) -> Vector:
        indices, values, dense = self._parts(payload, layout)
        out = np.zeros(layout_info(layout).size, dtype=np.float32)
        out[indices] = values
        out[dgc_plan(layout).dense_positions] = dense
        return out

    def _parts(self, payload: bytes, layout: Layout) -> tuple[Indices, Vector, npt.NDArray[np.float32]]:
        """Validated sparse indices and values, and the dense values."""
        count, scale = read_header(payload, SPARSE_HEADER, layout, self.stype)
        info, plan = layout_info(layout), dgc_plan(layout)
        check_count(count, 0, info.size - plan.dense_positions.size, "entries of the dim > 1 tensors", self.stype)
        sparse_bytes = sparse_values_bytes(count, info.size)
        check_size(payload, SPARSE_HEADER.size + sparse_bytes + 4 * plan.dense_positions.size, self.stype)
        indices, values = unpack_sparse(payload, SPARSE_HEADER.size, count, scale, info.size, self.stype)
        owners = np.searchsorted(info.starts, indices, side="right") - 1
        if plan.tensor_is_dense[owners].any():
            raise MalformedUpdate(f"{self.stype}: a sparse index lies in a dim ≤ 1 tensor, which is sent dense")
        dense = np.frombuffer(payload, dtype="<f4", offset=SPARSE_HEADER.size + sparse_bytes)
        check_finite(dense, "dense values", self.stype)
        return indices, values, dense


class DGCMemory(Memory):
    """DGC's client state: momentum u and velocity v (see the module docstring for the update rules)."""

    def __init__(self, layout: Layout, options: DGCOptions) -> None:
        self.options = options
        size = layout_info(layout).size
        self.maskable = np.ones(size, dtype=bool)
        self.maskable[dgc_plan(layout).dense_positions] = False
        self.momentum = np.zeros(size, dtype=np.float32)
        self.velocity = np.zeros(size, dtype=np.float32)

    def compensate(self, u: Vector) -> Vector:
        options = self.options
        if options.clip_norm is not None:
            limit = options.clip_norm / math.sqrt(options.num_clients)
            norm = float(np.linalg.norm(u))
            if norm > limit:
                u = u * np.float32(limit / norm)
        if options.momentum:
            self.momentum = options.momentum * self.momentum + u
            u = self.momentum
        return self.velocity + u if options.accumulate else u

    def update(self, v: Vector, sent: Vector) -> None:
        if self.options.accumulate:
            self.velocity = v - sent
        if self.options.masking:
            self.momentum[(sent != 0) & self.maskable] = 0

    def compressor_state(self, server_round: int, rng: np.random.Generator) -> CompressorState:
        return CompressorState(rng, density=self.options.density(server_round))

    def state_dict(self) -> dict[str, Vector]:
        return {"momentum": self.momentum.copy(), "velocity": self.velocity.copy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        shape = self.momentum.shape
        arrays = checked_state(state, {"momentum": shape, "velocity": shape})
        self.momentum, self.velocity = arrays["momentum"], arrays["velocity"]


def _make_dgc(spec: CodecSpec, layout: Layout, seed: int, clients: int) -> tuple[DGCCompressor, DGCMemory]:
    options = DGCOptions.for_stage(spec.value, spec.stage, spec.clip_norm, clients, spec.warmup_rounds)
    if spec.global_momentum is not None:  # the server applies the momentum: no momentum correction here
        options = replace(options, momentum=0.0)
    return DGCCompressor(), DGCMemory(layout, options)


CLIP_PARAMETER = Parameter("a positive clipping norm", lambda x: x > 0)
WARMUP_PARAMETER = Parameter("a whole number of warm-up rounds ≥ 1", lambda x: x >= 1, integer=True)
DGC = Codec("dgc", Parameter("a sparsity in (0, 1)", lambda x: 0 < x < 1), _make_dgc, DGCCompressor())
