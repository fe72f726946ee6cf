"""Codec specs ("topk:0.01", "dgc:0.999:momentum", ...), the client factory, server decoders by stype."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from strategies.codecs.base import CodecError, Compressor, Layout, MalformedUpdate, layout_info
from strategies.codecs.client import ClientCodec
from strategies.codecs.dense import NoCompression
from strategies.codecs.dgc import DGC_STAGES, WARMUP_DENSITIES, DGCCompressor, DGCMemory, DGCOptions, DGCStage
from strategies.codecs.memory import Memory, ResidualMemory
from strategies.codecs.powersgd import PowerSGD, PowerSGDMemory
from strategies.codecs.quantize import (
    INT8_STYPE,
    MAX_LEVELS,
    QSGD_STYPE,
    OneBit,
    StochasticQuantizer,
    TernGrad,
)
from strategies.codecs.sparse import Threshold, TopK

CODEC_NAMES = ("none", "topk", "dgc", "powersgd", "onebit", "terngrad", "threshold", "int8", "qsgd")
# name: (what its one parameter must be, test)
PARAMETERS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "topk": ("a ratio in (0, 1)", lambda x: 0 < x < 1),
    "dgc": ("a sparsity in (0, 1)", lambda x: 0 < x < 1),
    "powersgd": ("an integer rank in [1, 65535]", lambda x: x.is_integer() and 1 <= x <= 65535),
    "threshold": ("a threshold τ > 0", lambda x: 0 < x < math.inf),
    "qsgd": (
        f"an integer number of levels in [1, {MAX_LEVELS}]",
        lambda x: x.is_integer() and 1 <= x <= MAX_LEVELS,
    ),
}


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec string NAME[:VALUE], and for dgc NAME:SPARSITY[:STAGE][:clip=NORM][:warmup=ROUNDS].

    value: topk ratio, dgc sparsity, powersgd rank, threshold τ or qsgd levels; None for the others.
    stage: dgc ablation stage (naive, accumulate, momentum, warmup, full); clip_norm: dgc's global max norm;
    warmup_rounds: length of dgc's sparsity warm-up.
    """

    name: str
    value: float | None = None
    stage: DGCStage = "full"
    clip_norm: float | None = None
    warmup_rounds: int = len(WARMUP_DENSITIES)

    @property
    def holds_momentum(self) -> bool:
        """DGC's memory keeps the momentum (momentum correction): the client must then run plain SGD."""
        return self.name == "dgc" and self.stage in ("momentum", "warmup", "full")


def parse_codec(spec: str) -> CodecSpec:
    """Parse e.g. "none", "topk:0.01", "dgc:0.999", "dgc:0.999:momentum:clip=0.5:warmup=200", "powersgd:2", "onebit",
    "terngrad", "threshold:0.001", "int8", "qsgd:16"; raises CodecError (a ValueError) with one line."""
    name, *params = spec.strip().split(":")
    if name not in CODEC_NAMES:
        raise CodecError(f"unknown codec {name!r} in {spec!r}; known: {', '.join(CODEC_NAMES)}")
    if name not in PARAMETERS:
        if params:
            raise CodecError(f"codec {name!r} takes no parameters, got {spec!r}")
        return CodecSpec(name)
    requirement, valid = PARAMETERS[name]
    value = _number(params[0]) if params else None
    if value is None or not valid(value):
        raise CodecError(f"codec {name!r} needs {requirement} as in '{name}:VALUE', got {spec!r}")
    if name == "dgc":
        return _dgc_spec(value, params[1:], spec)
    if len(params) > 1:
        raise CodecError(f"codec {name!r} takes one parameter, got {spec!r}")
    return CodecSpec(name, value)


def _dgc_spec(sparsity: float, options: list[str], spec: str) -> CodecSpec:
    """The stage, clip and warm-up options of a dgc spec."""
    stages = [option for option in options if option in DGC_STAGES]
    clips = [option.removeprefix("clip=") for option in options if option.startswith("clip=")]
    warmups = [option.removeprefix("warmup=") for option in options if option.startswith("warmup=")]
    if len(stages) + len(clips) + len(warmups) != len(options) or max(map(len, (stages, clips, warmups))) > 1:
        raise CodecError(
            f"dgc options are one stage of {', '.join(DGC_STAGES)}, one 'clip=NORM' and one 'warmup=ROUNDS', "
            f"got {spec!r}"
        )
    clip_norm = _number(clips[0]) if clips else None
    if clips and (clip_norm is None or not 0 < clip_norm < math.inf):
        raise CodecError(f"dgc clip norm must be a positive number, got {spec!r}")
    warmup = _number(warmups[0]) if warmups else float(len(WARMUP_DENSITIES))
    if warmup is None or not warmup.is_integer() or warmup < 1:
        raise CodecError(f"dgc warm-up must be a whole number of rounds ≥ 1, got {spec!r}")
    return CodecSpec("dgc", sparsity, stages[0] if stages else "full", clip_norm, int(warmup))


def _number(text: str) -> float | None:
    """A float, or None when the text is not one."""
    try:
        return float(text)
    except ValueError:
        return None


def make_client_codec(spec: str, layout: Layout, seed: int, num_clients: int = 1) -> ClientCodec:
    """The codec a client holds for this spec and model layout.

    seed must differ between clients (e.g. the partition id): with the round it drives all randomness.
    num_clients is DGC's N for the local clipping share c·N^(−1/2) (ignored by the other codecs).
    """
    parsed = parse_codec(spec)
    size = layout_info(layout).size
    compressor: Compressor
    memory: Memory
    match parsed.name:
        case "none":
            compressor, memory = NoCompression(), Memory()
        case "topk":
            compressor, memory = TopK(parsed.value), ResidualMemory(size)
        case "dgc":
            options = DGCOptions.for_stage(
                parsed.value, parsed.stage, parsed.clip_norm, num_clients, parsed.warmup_rounds
            )
            compressor, memory = DGCCompressor(), DGCMemory(layout, options)
        case "powersgd":
            rank = int(parsed.value)
            compressor, memory = PowerSGD(rank), PowerSGDMemory(layout, rank, seed)
        case "onebit":
            compressor, memory = OneBit(), ResidualMemory(size)
        case "terngrad":
            compressor, memory = TernGrad(), Memory()
        case "threshold":
            compressor, memory = Threshold(parsed.value), ResidualMemory(size)
        case "int8":
            compressor, memory = StochasticQuantizer(INT8_STYPE, 127, "max"), Memory()
        case "qsgd":
            compressor, memory = StochasticQuantizer(QSGD_STYPE, int(parsed.value), "l2"), Memory()
    return ClientCodec(compressor, memory, layout, seed)


SERVER_COMPRESSORS: dict[str, Compressor] = {
    compressor.stype: compressor
    for compressor in (
        NoCompression(),
        TopK(),
        DGCCompressor(),
        PowerSGD(),
        OneBit(),
        TernGrad(),
        Threshold(),
        StochasticQuantizer(INT8_STYPE, 127, "max"),
        StochasticQuantizer(),
    )
}


def server_compressor(stype: str) -> Compressor:
    """The decoder for a payload's wire type; raises MalformedUpdate for an unknown one."""
    try:
        return SERVER_COMPRESSORS[stype]
    except KeyError:
        raise MalformedUpdate(f"unknown update type {stype!r}; known: {', '.join(SERVER_COMPRESSORS)}") from None
