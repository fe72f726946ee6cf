"""Compressed update codecs: client-side compressor + memory, server-side decode by wire type.

Client: `codec = make_client_codec(parse_codec("topk:0.01"), layout, seed)`; each round `codec.encode(u, server_round)`
gives the wire type, the payload and the update the server will decode from it. Server:
`server_compressor(stype).decode(payload, layout)`, which raises MalformedUpdate (one-line reason) for any
payload that is not a valid update for the layout.
"""

from strategies.codecs.base import (
    CodecError,
    Compressor,
    CompressorState,
    Layout,
    MalformedUpdate,
    dense_payload_size,
)
from strategies.codecs.client import ClientCodec, Encoded
from strategies.codecs.dgc import DGC_STAGES, DGCOptions
from strategies.codecs.registry import (
    CODECS,
    CodecSpec,
    make_client_codec,
    parse_codec,
    server_compressor,
)

__all__ = [
    "CODECS",
    "DGC_STAGES",
    "ClientCodec",
    "CodecError",
    "CodecSpec",
    "Compressor",
    "CompressorState",
    "DGCOptions",
    "Encoded",
    "Layout",
    "MalformedUpdate",
    "dense_payload_size",
    "make_client_codec",
    "parse_codec",
    "server_compressor",
]
