"""A device's agent process: the edge agent, serving the tasks of the SuperNode beside it.

    python -m fl_client.node --runtime-api 127.0.0.1:9094 --secret-file node.secret [--data-dir DIR]
        [--job job.json --partition-id I --num-partitions N] [--ready-file FILE] [--held-tasks DIR] [--parent-pid PID]

``--job`` loads the coming run's data and model before its first message, so round 1 does not pay for it.
SIGTERM or SIGINT stops it, and so does the end of process ``--parent-pid`` (``contract.parent``). A restarted
agent answers the tasks its predecessor held (``--held-tasks``) before it imports torch and builds the agent: on
a loaded device that takes tens of seconds, and Flower fails a task that sends no heartbeat for 60 s."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from contract.parent import watch_parent
from fl_client.tasks import TaskServer

if TYPE_CHECKING:
    from edge.agent import EdgeAgent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fl_client.node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api", required=True, metavar="HOST:PORT", help="the SuperNode's Runtime API")
    parser.add_argument("--secret-file", type=Path, help="the SuperNode's --superexec-auth-secret-file")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--data-dir", default="", help="this device's folder of the data set (overrides the run's)")
    parser.add_argument("--job", type=Path, help="JSON job of the coming run: load its data before round 1")
    parser.add_argument("--ready-file", type=Path, help="written once the agent is ready (its data loaded)")
    parser.add_argument(
        "--held-tasks", type=Path, help="where the tasks being served are kept, so that a restarted agent answers them"
    )
    parser.add_argument("--partition-id", type=int, default=0)
    parser.add_argument("--num-partitions", type=int, default=1)
    parser.add_argument("--parent-pid", type=int, help="stop once this process is gone (the launcher)")
    args = parser.parse_args(argv)
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
    agent = _agent(args)
    from fl_client.app import app  # the ClientApp the agent is attached to

    tasks.app = app
    try:
        tasks.serve(stop)
    finally:
        agent.stop()


def _agent(args: argparse.Namespace) -> EdgeAgent:
    """The edge agent (torch imported here, after the held tasks are answered), with the coming run's session when
    ``--job`` is given, attached to the ClientApp; ``--ready-file`` written once it is ready."""
    import os

    import torch

    from contract.transport import why_stock
    from edge.agent import EdgeAgent
    from edge.devices import AgentThreads
    from fl_client.app import attach

    torch.set_num_threads(args.threads)
    agent = EdgeAgent(args.data_dir, transport="stock" if why_stock() else "fast")
    if args.job:
        agent.session_for(args.job.read_text(), args.partition_id, args.num_partitions, run_id=None)
    attach(agent)
    if args.ready_file:
        AgentThreads(os.getpid(), agent.trainer_tid).save(args.ready_file)
    return agent


if __name__ == "__main__":
    main()
