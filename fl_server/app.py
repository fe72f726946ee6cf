"""The ServerApp. Flower's SuperLink starts it for a run; the run's settings come in the app's run config
(``contract.settings.RunConfig.to_run_config``). A run submitted on this machine names its folder (``run-dir``);
one submitted from another (``--federation remote``) is written here, next to the server's own folder, and
echoed to the submitter (``contract.run_folder``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from contract.errors import EdgeflError
from contract.flower import add_exit_handler
from contract.parent import watch_parent
from contract.run_folder import (
    ECHO_KEY,
    ROUNDS,
    SERVER_ERROR,
    RunFolder,
    read_echo_key,
    remote_folder_name,
    truncate_rounds,
)
from contract.settings import RunConfig
from contract.transport import tune
from fl_server import warm
from fl_server.engine import serve

app = ServerApp()
STOPPED = "stopped before the run's end (flwr stop, or the server shut down)\n"
STARTED = {True: "forked warm (fl_server.warm)", False: "started by Flower's SuperExec"}


def run_folder_of(config: RunConfig, context: Context) -> RunFolder:
    """The folder a run writes: ``run-dir`` when the submitter shares this machine, else one under the
    server's own folder (the parent of FLWR_HOME, e.g. ``edgefl server --out``), echoed to the submitter: the
    folder of the run it resumes (``resume-folder``) when that holds a checkpoint, else a new one; its lines signed
    with the server's ``ECHO_KEY`` where ``edgefl server`` put one (a TLS server with submitters)."""
    if run_dir := str(context.run_config.get("run-dir", "")):
        return RunFolder(Path(run_dir))
    server = Path(os.environ.get("FLWR_HOME", ".flwr")).resolve().parent
    runs, key_file = server / "runs", server / ECHO_KEY
    key = read_echo_key(key_file) if key_file.is_file() else None
    resumed = str(context.run_config.get("resume-folder", ""))
    if resumed == Path(resumed).name and resumed not in ("", ".", ".."):
        folder = RunFolder(runs / resumed, echo=True, echo_key=key)
        if folder.checkpoint_path.is_file():
            return folder
    path = runs / remote_folder_name(config.name, context.run_id)
    path.mkdir(parents=True, exist_ok=True)
    return RunFolder(path, echo=True, echo_key=key)


def run_app(context: Context, body: Callable[[RunConfig, RunFolder], None]) -> None:
    """Run ``body`` on the run's settings and folder (``run_in_folder``). A resumed remote run first echoes its
    rounds.jsonl cut back to its checkpoint (the submitter's may run ahead), or fails when this server has no
    checkpoint of it."""
    config = RunConfig.from_run_config(context.run_config)
    folder = run_folder_of(config, context)
    resumed = str(context.run_config.get("resume-folder", ""))

    def run() -> None:
        if resumed:
            checkpoint = folder.read_checkpoint() if folder.path.name == resumed else None
            if checkpoint is None:
                raise EdgeflError(f"nothing to resume: this server has no checkpoint of the run {resumed[:100]!r}")
            truncate_rounds(folder.path, checkpoint.round)
            folder.resend(ROUNDS)
        body(config, folder)

    run_in_folder(folder, run)


def run_in_folder(folder: RunFolder, body: Callable[[], None]) -> None:
    """Run ``body`` with the server's log in the folder's ``server.log``; any failure is written to
    ``server_error.txt`` (one line) before it propagates. So is a stop (Flower's exit on a signal: ``flwr stop``,
    the server shutting down), while Flower still streams the log: an echoing folder's submitter gets the
    checkpoint with it."""
    handler = logging.FileHandler(folder.server_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("edgefl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    ended = threading.Event()  # the run's last word (its summary or its error) is written: once

    def last_word(text: str) -> None:
        if not ended.is_set():
            ended.set()
            folder.write(SERVER_ERROR, text.encode())

    add_exit_handler(lambda: last_word(STOPPED), run_before_force_exit=True)
    try:
        body()
    except BaseException as exc:
        logger.exception("server failed")
        last_word(f"{type(exc).__name__}: {exc}\n")
        raise
    finally:
        ended.set()  # Flower's exit after the run's end is no stop


@app.main()
def main(grid: Grid, context: Context) -> None:
    # Flower's ServerApp watches its parent (the SuperExec) with kill(pid, 0), which a dead parent no one has reaped
    # yet (a zombie: its own parent, the SuperLink, was killed) passes: the run would go on alone. This watch takes
    # a zombie for gone, and stops the app the way Flower's does (SIGINT: its exit handlers, then exit). A warm
    # ServerApp's parent is its fork server; its shim, SuperExec's child, passes SuperExec's end on as SIGINT.
    watch_parent(os.getppid(), signal.SIGINT)

    def body(config: RunConfig, folder: RunFolder) -> None:
        transport = tune()
        logging.getLogger("edgefl").info("Flower's message path: %s", transport)
        logging.getLogger("edgefl").info("this ServerApp process: %s", STARTED[warm.forked])
        serve(grid, config, folder, transport)

    run_app(context, body)
