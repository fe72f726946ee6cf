"""The codec table: one row per codec (``base.Codec``), each declared by the codec's own module; the spec
parser, the client factory and the server's decoders are read off it.

Specs: ``none``, ``topk:RATIO``, ``stc:DENSITY``, ``dgc:SPARSITY[:STAGE][:clip=NORM][:warmup=ROUNDS]``,
``powersgd:RANK``, ``onebit``, ``terngrad``, ``threshold:TAU``, ``int8``, ``qsgd:LEVELS``. The sparse codecs
(topk, stc, dgc) take ``:gm=BETA`` on the uplink: global momentum, applied by the server
(``strategies.fedavg.ServerMomentum``) instead of by each client."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.codecs.base import Codec, Compressor, Layout, MalformedUpdate
from strategies.codecs.client import ClientCodec
from strategies.codecs.dense import NONE
from strategies.codecs.dgc import CLIP_PARAMETER, DGC, DGC_STAGES, WARMUP_DENSITIES, WARMUP_PARAMETER, DGCStage
from strategies.codecs.powersgd import POWERSGD
from strategies.codecs.quantize import INT8, ONEBIT, QSGD, TERNGRAD
from strategies.codecs.sparse import THRESHOLD, TOPK
from strategies.codecs.stc import STC
from strategies.spec import Parameter, SpecError, label, parse_spec

CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        NONE,
        TOPK,
        STC,
        DGC,
        POWERSGD,
        ONEBIT,
        TERNGRAD,
        THRESHOLD,
        INT8,
        QSGD,
    )
}
DECODERS: dict[str, Compressor] = {codec.decoder.stype: codec.decoder for codec in CODECS.values()}
GLOBAL_MOMENTUM_CODECS = ("topk", "stc", "dgc")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec spec. value: topk ratio, stc density, dgc sparsity, powersgd rank, threshold τ or qsgd
    levels (None for the others); stage, clip_norm, warmup_rounds: DGC's ablation stage, global clipping norm and
    sparsity warm-up length; global_momentum: β of the server's momentum (gm=BETA; None: off)."""

    name: str
    value: float | None = None
    stage: DGCStage = "full"
    clip_norm: float | None = None
    warmup_rounds: int = len(WARMUP_DENSITIES)
    global_momentum: float | None = None

    @property
    def plain_sgd(self) -> bool:
        """The momentum lives elsewhere, so the client must train with plain SGD: in DGC's memory (momentum
        correction) or on the server (global momentum)."""
        dgc_momentum = self.name == "dgc" and self.stage in ("momentum", "warmup", "full")
        return dgc_momentum or self.global_momentum is not None

    @property
    def label(self) -> str:
        options = [] if self.global_momentum is None else [f"gm={self.global_momentum:g}"]
        if self.name == "dgc":
            options += [] if self.stage == "full" else [self.stage]
            options += [] if self.clip_norm is None else [f"clip={self.clip_norm:g}"]
            options += [] if self.warmup_rounds == len(WARMUP_DENSITIES) else [f"warmup={self.warmup_rounds}"]
        return label(self.name, self.value, *sorted(options, key=lambda o: o.startswith("gm=")))


def parse_codec(text: str) -> CodecSpec:
    """e.g. "none", "topk:0.01:gm=0.9", "dgc:0.999:momentum:clip=0.5:warmup=200", "powersgd:2"; raises
    SpecError."""
    spec = parse_spec(text, "codec", {name: codec.parameter for name, codec in CODECS.items()}, options=True)
    momenta = [o for o in spec.options if o.startswith("gm=")]
    options = tuple(o for o in spec.options if not o.startswith("gm="))
    if momenta and (spec.name not in GLOBAL_MOMENTUM_CODECS or len(momenta) > 1):
        raise SpecError(f"one 'gm=BETA' is an option of the sparse codecs {', '.join(GLOBAL_MOMENTUM_CODECS)} only, "
                        f"got {text!r}")  # fmt: skip
    beta = parse_spec(momenta[0].replace("=", ":"), "codec option", GM).value if momenta else None
    if spec.name != "dgc":
        if options:
            extra = " and 'gm=BETA'" if spec.name in GLOBAL_MOMENTUM_CODECS else ""
            raise SpecError(f"codec {spec.name!r} takes {'one parameter' if spec.value is not None else 'none'}"
                            f"{extra}, got {text!r}")  # fmt: skip
        return CodecSpec(spec.name, spec.value, global_momentum=beta)
    return dataclasses.replace(_dgc_spec(spec.value, options, text), global_momentum=beta)


def _dgc_spec(sparsity: float | None, options: tuple[str, ...], text: str) -> CodecSpec:
    """The stage, clip and warm-up options of a dgc spec."""
    stages = [option for option in options if option in DGC_STAGES]
    clips = [parse_spec(o.replace("=", ":"), "dgc option", CLIP).value for o in options if o.startswith("clip=")]
    warmups = [parse_spec(o.replace("=", ":"), "dgc option", WARMUP).value for o in options if o.startswith("warmup=")]
    if len(stages) + len(clips) + len(warmups) != len(options) or max(map(len, (stages, clips, warmups))) > 1:
        raise SpecError(
            f"dgc options are one stage of {', '.join(DGC_STAGES)}, one 'clip=NORM' and one 'warmup=ROUNDS', "
            f"got {text!r}"
        )
    warmup = int(warmups[0]) if warmups else len(WARMUP_DENSITIES)
    return CodecSpec("dgc", sparsity, stages[0] if stages else "full", clips[0] if clips else None, warmup)


CLIP = {"clip": CLIP_PARAMETER}
WARMUP = {"warmup": WARMUP_PARAMETER}
GM = {"gm": Parameter("a momentum BETA in (0, 1)", lambda x: 0 < x < 1)}


def make_client_codec(spec: CodecSpec, layout: Layout, seed: int, num_clients: int = 1) -> ClientCodec:
    """The codec a client holds for this spec and model layout.

    seed must differ between clients (e.g. the partition id): with the round it drives all randomness.
    num_clients is DGC's N for the local clipping share c·N^(−1/2) (ignored by the other codecs).
    """
    compressor, memory = CODECS[spec.name].make(spec, layout, seed, num_clients)
    return ClientCodec(compressor, memory, layout, seed)


def server_compressor(stype: str) -> Compressor:
    """The decoder for a payload's wire type; raises MalformedUpdate for an unknown one."""
    try:
        return DECODERS[stype]
    except KeyError:
        raise MalformedUpdate(f"unknown update type {stype!r}; known: {', '.join(DECODERS)}") from None
