"""The ServerApp. Flower's SuperLink starts it for a run; the run's settings come in the app's run config
(``contract.settings.RunConfig.to_run_config``). A run submitted on this machine names its folder (``run-dir``);
one submitted from another (``--federation remote``) is written here, next to the server's own folder, and
echoed to the submitter (``contract.run_folder``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from contract.run_folder import SERVER_ERROR, RunFolder
from contract.settings import RunConfig
from contract.transport import tune
from fl_server.engine import serve

app = ServerApp()


def run_folder_of(config: RunConfig, context: Context) -> RunFolder:
    """The folder a run writes: ``run-dir`` when the submitter shares this machine, else one under the
    server's own folder (the parent of FLWR_HOME, e.g. ``edgefl server --out``), echoed to the submitter."""
    if run_dir := str(context.run_config.get("run-dir", "")):
        return RunFolder(Path(run_dir))
    server = Path(os.environ.get("FLWR_HOME", ".flwr")).resolve().parent
    path = server / "runs" / f"{config.name}-{context.run_id}"
    path.mkdir(parents=True, exist_ok=True)
    return RunFolder(path, echo=True)


def run_app(context: Context, body: Callable[[RunConfig, RunFolder], None]) -> None:
    """Run ``body`` on the run's settings and folder (``run_in_folder``)."""
    config = RunConfig.from_run_config(context.run_config)
    folder = run_folder_of(config, context)
    run_in_folder(folder, lambda: body(config, folder))


def run_in_folder(folder: RunFolder, body: Callable[[], None]) -> None:
    """Run ``body`` with the server's log in the folder's ``server.log``; any failure is written to
    ``server_error.txt`` (one line) before it propagates."""
    handler = logging.FileHandler(folder.path / "server.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("edgefl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        body()
    except BaseException as exc:
        logger.exception("server failed")
        folder.write(SERVER_ERROR, f"{type(exc).__name__}: {exc}\n".encode())
        raise


@app.main()
def main(grid: Grid, context: Context) -> None:
    def body(config: RunConfig, folder: RunFolder) -> None:
        transport = tune()
        logging.getLogger("edgefl").info("Flower's message path: %s", transport)
        serve(grid, config, folder, transport)

    run_app(context, body)
