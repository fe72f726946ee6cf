"""Compressed update codecs: client-side compressor + memory, server-side decode/accumulate by wire type.

Client: `codec = make_client_codec("topk:0.01", layout, seed)`; each round `stype, payload = codec.encode(u,
server_round)`. Server: `server_compressor(stype).accumulate(acc, payload, layout, weight)` or `.decode(...)`,
which raise MalformedUpdate (one-line reason) for any payload that is not a valid update for the layout.
"""

from strategies.codecs.base import (
    CodecError,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    dense_payload_size,
)
from strategies.codecs.client import ClientCodec
from strategies.codecs.dgc import DGC_STAGES, DGCOptions
from strategies.codecs.registry import (
    CODEC_NAMES,
    CodecSpec,
    make_client_codec,
    parse_codec,
    server_compressor,
)

__all__ = [
    "CODEC_NAMES",
    "DGC_STAGES",
    "ClientCodec",
    "CodecError",
    "CodecSpec",
    "Compressor",
    "CompressorState",
    "DGCOptions",
    "Layout",
    "MalformedUpdate",
    "dense_payload_size",
    "make_client_codec",
    "parse_codec",
    "server_compressor",
]
