"""Flower's ``flwr-serverapp`` process, started warm: forked from a fork server that imported Flower's server and
edgefl's ServerApp once (``edgefl.forkserver``, ``--command``), instead of a fresh interpreter importing them for
every run (~1 s of CPU before the process asks the SuperLink for its run). The fork runs Flower's own
``flwr-serverapp`` entry point, with the arguments, environment and streams SuperExec gave the shim it started."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable

from contract.flower import serverapp_command

forked = False  # this process is a ServerApp forked warm (said in the run's server.log: fl_server.app)
SERVERAPP = "fl_server.app"  # edgefl's ServerApp (Flower's FedAvg baseline, which imports torch, is not preloaded)


@functools.cache
def entry_point() -> Callable[[], None]:
    """The console script of the command SuperExec starts a ServerApp as (``serverapp_command``, which the fork
    server was started for): the function that command runs. Found once, in the server's preload."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name=serverapp_command())
    return script.load()


def preload() -> None:
    """Import what every ServerApp process imports before its run: Flower's server, then edgefl's ServerApp."""
    entry_point()
    importlib.import_module(SERVERAPP)


def main() -> None:
    global forked
    forked = True
    entry_point()()
