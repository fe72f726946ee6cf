"""The ServerApp. Flower's SuperLink starts it for a run; run config ``run-dir`` points at the run's folder,
whose ``config.toml`` holds every setting."""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from contract.transport import tune
from edgefl.config import load_config
from fl_server.engine import serve
from fl_server.results import SERVER_ERROR

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_dir = Path(str(context.run_config["run-dir"]))
    handler = logging.FileHandler(run_dir / "server.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("edgefl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    transport = tune()
    logger.info("Flower's message path: %s", transport)
    try:
        serve(grid, load_config(run_dir / "config.toml"), run_dir, transport)
    except BaseException as exc:
        logger.exception("server failed")
        (run_dir / SERVER_ERROR).write_text(f"{type(exc).__name__}: {exc}\n")
        raise
