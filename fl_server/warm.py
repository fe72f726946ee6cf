"""Flower's ``flwr-serverapp`` process, started warm: forked from a fork server that imported Flower's server and
edgefl's ServerApp once (``edgefl.forkserver``, ``--command``), instead of a fresh interpreter importing them for
every run (~1 s of CPU before the process asks the SuperLink for its run). The fork runs Flower's own
``flwr-serverapp`` entry point, with the arguments, environment and streams SuperExec gave the shim it started."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable

COMMAND = "flwr-serverapp"
forked = False  # this process is a ServerApp forked warm (said in the run's server.log: fl_server.app)
SERVERAPP = "fl_server.app"  # edgefl's ServerApp (Flower's FedAvg baseline, which imports torch, is not preloaded)


def entry_point() -> Callable[[], None]:
    """The installed flwr's ``flwr-serverapp`` console script: the function its command runs."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name=COMMAND)
    return script.load()


def preload() -> None:
    """Import what every ServerApp process imports before its run: Flower's server, then edgefl's ServerApp."""
    entry_point()
    importlib.import_module(SERVERAPP)


def main() -> None:
    global forked
    forked = True
    entry_point()()
