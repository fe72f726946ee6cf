"""A device's agent process: the edge agent, serving the tasks of the SuperNode beside it.

    python -m fl_client.node --runtime-api 127.0.0.1:9094 --secret-file node.secret [--data-dir DIR]
        [--job job.json --partition-id I --num-partitions N] [--ready-file FILE] [--held-tasks DIR] [--parent-pid PID]

``--job`` loads the coming run's data and model before its first message, so round 1 does not pay for it.
SIGTERM or SIGINT stops it, and so does the end of process ``--parent-pid`` (``contract.parent``). A restarted
agent answers the tasks its predecessor held (``--held-tasks``) before it imports torch and builds the agent: on
a loaded device that takes tens of seconds, and Flower fails a task that sends no heartbeat for 60 s."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from contract.parent import watch_parent
from contract.transport import remembered_transport
from fl_client.tasks import TaskServer

if TYPE_CHECKING:
    from edge.agent import EdgeAgent

M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2  # malloc arenas: glibc's default, 8 per core, keeps what each serving thread freed in one of its own
TRANSPORT_CHECK = "from contract.transport import remember_transport; print(remember_transport())"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fl_client.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api", required=True, metavar="HOST:PORT", help="the SuperNode's Runtime API")
    parser.add_argument("--secret-file", type=Path, help="the SuperNode's --superexec-auth-secret-file")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--data-dir", default="", help="this device's folder of the data set (overrides the run's)")
    parser.add_argument(
        "--own-dataset", default="", metavar="NAME",
        help="the data set this device's owner named: the run's data folder is never read, and a hub data set "
        "(hf:) is loaded only when it is this one",
    )  # fmt: skip
    parser.add_argument("--job", type=Path, help="JSON job of the coming run: load its data before round 1")
    parser.add_argument("--ready-file", type=Path, help="written once the agent is ready (its data loaded)")
    parser.add_argument(
        "--held-tasks", type=Path, help="where the tasks being served are kept, so that a restarted agent answers them"
    )
    parser.add_argument("--partition-id", type=int, default=0)
    parser.add_argument("--num-partitions", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, help="stop once this process is gone (the launcher)")
    args = parser.parse_args(argv)
    _tune_malloc()
    transport = remembered_transport() or subprocess.Popen(
        [sys.executable, "-c", TRANSPORT_CHECK], stdout=subprocess.PIPE, text=True
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Runtime API request otherwise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid:
        watch_parent(args.parent_pid)
    secret = args.secret_file.read_bytes() if args.secret_file else None
    tasks = TaskServer(args.runtime_api, None, secret, args.held_tasks)
    tasks.answer_abandoned_if_up()
    agent = _agent(args, _transport(transport))
    from fl_client.app import app  # the ClientApp the agent is attached to

    tasks.app = app
    tasks.most_held = agent.most_held
    try:
        tasks.serve(stop)
    finally:
        agent.stop()


def preload() -> None:
    """Import what an agent imports before it serves (``edgefl.forkserver``: agents forked from one process that
    imported this once): torch, the edge agent, its device threads, the ClientApp."""
    import torch  # noqa: F401

    import edge.agent
    import edge.devices  # noqa: F401
    import fl_client.app  # noqa: F401


def _tune_malloc() -> None:
    """glibc's malloc (elsewhere nothing) as a device needs it: at most ``ARENAS`` arenas (the task threads, their
    object transfers and the trainer each take an arena of their own otherwise, and an arena keeps what was freed
    in it). Large blocks stay glibc's to place: mapping every block of 64 KB and more apart kept 35 MB less of an
    LSTM's rounds, but made each training step 2.5x the CPU (a CNN's activations mapped and faulted in anew)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_ARENA_MAX, ARENAS)


def _transport(check: str | subprocess.Popen[str]) -> str:
    """How this device's SuperNode moves messages (``contract.transport.why_stock``): remembered for the installed
    flwr (``remembered_transport``), or as the child process ``check`` found it: that check imports the SuperNode's
    loop and its database layer (~30 MB), which the agent never runs."""
    if isinstance(check, str):
        return check
    out, _ = check.communicate()
    if check.returncode != 0:
        raise subprocess.CalledProcessError(check.returncode, check.args)
    return out.strip()


def _agent(args: argparse.Namespace, transport: str) -> EdgeAgent:
    """The edge agent (torch imported here, after the held tasks are answered), with the coming run's session when
    ``--job`` is given, attached to the ClientApp; ``--ready-file`` written once it is ready."""
    import os

    import torch

    from edge.agent import EdgeAgent
    from edge.devices import AgentThreads
    from fl_client.app import attach

    torch.set_num_threads(args.threads)
    agent = EdgeAgent(args.data_dir, transport=transport, own_dataset=args.own_dataset)
    if args.job:
        agent.session_for(args.job.read_text(), args.partition_id, args.num_partitions, run_id=None)
    attach(agent)
    if args.ready_file:
        AgentThreads(os.getpid(), agent.trainer_tid).save(args.ready_file)
    return agent


if __name__ == "__main__":
    main()
