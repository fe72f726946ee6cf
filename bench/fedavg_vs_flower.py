"""Seconds per round: edgefl's FedAvg against Flower's own FedAvg, measured side by side in one run.

Both run as real deployments (Flower's SuperLink and SuperNodes) on the same machine, data, partition, model,
seed and link, one after the other:
- ``flower-fedavg``: ``flwr.serverapp.strategy.FedAvg.start`` (``send_and_receive``, which sleeps 3 s between
  pulls; one Array per tensor) with the quickstart ClientApp that imports torch and loads its partition in
  the fresh process Flower starts for every message;
- ``fedavg``: edgefl's engine (push/pull with a 20 ms poll; three Flower objects per message) and the
  persistent edge agent serving its SuperNode's tasks, Flower's waits tuned (``contract.transport``).

Per-round time is the median of the gaps between consecutive rounds' wall clocks (round 1, which includes
start-up, is left out); server-side evaluation time is excluded from both.

    python bench/fedavg_vs_flower.py [--profile loopback --profile long-distance] [--rounds 8]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

from results import write_result

from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run

STRATEGIES = ("flower-fedavg", "fedavg")
TARGET_RATIO = 5.0  # edgefl FedAvg needs at least 5x fewer seconds per round


def seconds_per_round(rows: list[dict]) -> float:
    walls = [r["wall_s"] for r in rows]
    return statistics.median(b - a for a, b in itertools.pairwise(walls))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", action="append", help="link profile (repeatable; default loopback)")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-fedavg-vs-flower"))
    args = parser.parse_args()
    interrupt_on_signals()
    lines = [
        "| link | Flower FedAvg s/round | edgefl FedAvg s/round | ratio (Flower / edgefl) | MB per round "
        "(Flower / edgefl) |",
        "|---|---|---|---|---|",
    ]
    figures = {}
    for profile in args.profile or ["loopback", "long-distance"]:
        measured = {}
        for strategy in STRATEGIES:
            config = build_config(
                None, strategy=strategy, dataset=args.dataset, partition=args.partition, clients=args.clients,
                rounds=args.rounds, local_steps=args.local_steps, profile=profile,
                out=str(args.out / profile / strategy),
            )  # fmt: skip
            print(f"== {strategy} over {profile}", flush=True)
            summary, rows = load_run(run(config, lambda line: print("   " + line, flush=True)))
            mb = (summary["bytes_up"] + summary["bytes_down"]) / 1e6 / summary["rounds"]
            measured[strategy] = (seconds_per_round(rows), mb, summary["link_backend"])
        (flower, flower_mb, backend), (edgefl, edgefl_mb, _) = measured["flower-fedavg"], measured["fedavg"]
        figures[profile] = {"flower_seconds_per_round": flower, "edgefl_seconds_per_round": edgefl,
                            "ratio": flower / edgefl, "target_ratio": TARGET_RATIO}  # fmt: skip
        lines.append(f"| {profile} [{backend}] | {flower:.2f} | {edgefl:.2f} | {flower / edgefl:.2f}x "
                     f"| {flower_mb:.2f} / {edgefl_mb:.2f} |")  # fmt: skip
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
