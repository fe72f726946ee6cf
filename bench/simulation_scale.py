"""How far one machine takes a simulated population: 1000 virtual clients, 100 a round, on Flower's Simulation
Engine with Ray on this host.

One ``edgefl run --federation simulation`` (FedAvg, Fashion-MNIST, the mixed fleet of ``bench/simulation.py``)
while this process samples the memory of the whole run — the simulation process, Ray's own processes and its
workers, every descendant — as the sum of their proportional set sizes (PSS: a page shared by n processes counts
1/n in each, so Ray's shared object store is counted once). Printed: real seconds per round (rounds 2 on, after
Ray's start and the first contact with every client), peak memory, modelled seconds per round.

    python bench/simulation_scale.py [--clients 1000] [--per-round 100] [--rounds 10] [--strategy scaffold]

``--strategy scaffold`` measures SCAFFOLD's per-client state: the server keeps one model-sized control variate
per client that has trained (``strategies.scaffold``), and checkpoints them every round.

The partition is IID: flwr-datasets' Dirichlet partitioner cannot split Fashion-MNIST's 60,000 rows into 1000
partitions of at least 10 rows at α = 0.3 (it gives up after 10 draws), and scale, not accuracy, is measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np
from results import write_result
from simulation import FLEET_DEVICES, FLEET_LINKS

from contract.run_folder import read_rounds
from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals, process_tree
from edgefl.report import load_run

SAMPLE_S = 0.5


def tree_pss_bytes() -> int:
    """The summed PSS of this process's descendants (not this process: it only watches)."""
    total = 0
    for pid in process_tree([os.getpid()]):
        if pid == os.getpid():
            continue
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:"))
    return total


class PeakMemory:
    """Samples ``tree_pss_bytes`` every SAMPLE_S seconds in a thread until stopped; keeps the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, tree_pss_bytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", default="100")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--strategy", default="fedavg", help="fedavg (default) or another, e.g. scaffold")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-simulation-scale"))
    args = parser.parse_args()
    interrupt_on_signals()
    config = build_config(
        None, federation="simulation", dataset="fashion-mnist", partition="iid", clients=args.clients,
        clients_per_round=args.per_round, rounds=args.rounds, local_steps=args.local_steps, profile=FLEET_LINKS,
        device_profile=FLEET_DEVICES, eval_examples=2000, out=str(args.out / "run"), strategy=args.strategy,
    )  # fmt: skip
    with PeakMemory() as memory:
        run_dir = run(config)
    summary, _ = load_run(run_dir)
    rows = read_rounds(run_dir)
    real = np.diff([row["real_s"] for row in rows])  # rounds 2..R
    modelled = np.diff([0.0] + [row["wall_s"] for row in rows])
    figures = {
        "strategy": config.strategy,
        "clients": args.clients,
        "per_round": config.per_round,
        "rounds": args.rounds,
        "real_s_per_round": float(np.mean(real)),
        "real_s_first_round": rows[0]["real_s"],
        "real_s_total": summary["real_s"],
        "peak_memory_gb": memory.peak / 1e9,
        "modelled_s_per_round": float(np.mean(modelled)),
        "final_accuracy": summary["final_accuracy"],
    }
    text = "\n".join([
        f"{args.clients} virtual clients, {config.per_round} a round, {args.rounds} rounds of {args.local_steps} local "
        f"steps ({config.strategy}, Fashion-MNIST IID, devices {FLEET_DEVICES}, links {FLEET_LINKS}), on "
        f"{os.cpu_count()} cores:",
        "",
        "| real s/round (rounds 2 on) | real s, round 1 (with start-up) | real s, server loop | peak memory GB (PSS) "
        "| modelled s / round | final acc |",
        "|---|---|---|---|---|---|",
        f"| {figures['real_s_per_round']:.2f} | {figures['real_s_first_round']:.1f} | {figures['real_s_total']:.0f} | "
        f"{figures['peak_memory_gb']:.2f} | {figures['modelled_s_per_round']:.2f} | {figures['final_accuracy']:.4f} |",
    ])  # fmt: skip
    write_result(args.out, text, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
