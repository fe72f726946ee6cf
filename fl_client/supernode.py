"""Flower's SuperNode with its fixed waits tuned (``contract.transport``) and, where the tuning and Flower's Runtime
API router are the code edgefl was checked against, the device's channel to its agent served beside its HTTP Runtime
API (``fl_client.channel``); every argument is ``flower-supernode``'s but ``--parent-pid PID``, given first: it stops
(as on SIGTERM) once that process is gone (``contract.parent``). edgefl starts it with ``--isolation process``: the
edge agent serves its tasks.

    python -m fl_client.supernode [--parent-pid PID] --insecure --superlink HOST:PORT --isolation process ...
"""

from __future__ import annotations

import argparse
import logging
import sys

from contract.parent import watch_parent
from contract.transport import FAST, NodeSignals, tune


def preload() -> None:
    """Import Flower's SuperNode (``edgefl.forkserver``: SuperNodes forked from one process that imported it
    once)."""
    from contract.flower import flower_supernode  # noqa: F401


def main() -> None:
    if sys.argv[1:2] == ["--parent-pid"]:
        watch_parent(int(sys.argv[2]))
        del sys.argv[1:3]
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("edgefl")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    signals = NodeSignals()
    transport = tune(signals)
    log.info("Flower's message path: %s", transport)
    flags = _flags()
    if transport == FAST and flags.isolation == "process":
        serve_channel(flags.port, signals)
    from contract.flower import flower_supernode

    flower_supernode()


def serve_channel(port: int, signals: NodeSignals) -> None:
    """The device's channel to the agent of the Runtime API on ``port`` (``fl_client.channel``), where Flower's router
    is the code it was checked against; said in one log line either way."""
    from fl_client.channel import ChannelServer, why_no_channel

    log = logging.getLogger("edgefl")
    reason = why_no_channel()
    if reason is not None:
        log.warning("no channel to the agent: %s; it claims tasks over the HTTP Runtime API", reason)
    elif ChannelServer(port, signals).start():
        log.info("serving the agent's Runtime API calls over the channel of port %d", port)


def _flags() -> argparse.Namespace:
    """The SuperNode's own ``--isolation`` and ``--port`` (Flower's defaults), read before Flower reads them all."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation", default="subprocess")
    parser.add_argument("--port", type=int, default=9094)
    return parser.parse_known_args(sys.argv[1:])[0]


if __name__ == "__main__":
    main()
