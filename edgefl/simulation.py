"""A run on Flower's Simulation Engine (``--federation simulation``): Flower's ``run_simulation`` with edgefl's
simulated server (``fl_server.simulation``: the deployment's server loop on a virtual clock) and ClientApp
(``fl_client.simulation``: the deployment's agent session, kept in Flower's node state), one virtual SuperNode
per partition.

``python -m edgefl.simulation RUN_DIR`` runs the ``config.toml`` in RUN_DIR (``edgefl run`` starts it in a process
of its own and follows it). Ray is started on this machine, or joined at ``--ray-address`` (``auto``, or the
head's HOST:PORT): a cluster started with ``ray start --head`` here and ``ray start --address HEAD:6379`` on every
other machine, each with edgefl installed at the same path and the data set in place.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

from contract.run_folder import CONFIG, RunFolder
from contract.settings import RunConfig, load_config
from fl_client.simulation import app as client_app
from fl_server.app import run_in_folder
from fl_server.engine import ServerLoop
from fl_server.simulation import ModelledArrivals, host_step_s


def backend_config(config: RunConfig) -> dict[str, Any]:
    """Ray: one CPU per virtual client at a time (as many actors as cores); a cluster's head when given."""
    init_args: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if config.ray_address:
        init_args["address"] = config.ray_address
    return {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init_args}


def simulate(config: RunConfig, run_dir: Path) -> None:
    """Run ``config`` on the Simulation Engine, writing ``run_dir`` as a deployment's server does."""
    folder = RunFolder(run_dir)
    server_app = ServerApp()
    step_s = config.clock_step_s or host_step_s(config)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        ServerLoop(grid, config, folder, ModelledArrivals(config, step_s)).run()

    simulation = backend_config(config)
    run_in_folder(folder, lambda: run_simulation(server_app, client_app, config.clients, backend_config=simulation))


if __name__ == "__main__":
    run_directory = Path(sys.argv[1])
    simulate(load_config(run_directory / CONFIG), run_directory)
