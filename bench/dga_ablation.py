"""DGA's correction term, ablated: final and best test accuracy with and without the correction for several
delays D, next to FedAvg (D = 0), on non-IID data — the paper's ablation (Zhu et al. 2021, Table: ResNet-18 /
CIFAR-10, w/o → with correction: D=5 88.7→89.2, D=10 86.9→89.3, D=15 85.5→89.0, D=20 84.2→88.7).

The in-process simulation with EXACT staleness of bench/sim.py: only the algorithm differs between the rows.

    python bench/dga_ablation.py [--delays 2,4,8] [--rounds 40] [--partition dirichlet:0.1] [--lr-schedule cosine]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from results import print_row_done, write_result
from sim import simulate

from contract.settings import LR_SCHEDULES, build_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.1")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delays", default="2,4,8")
    parser.add_argument("--with-correction-only", action="store_true", help="skip the rows without correction")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dga-ablation"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    lines = [f"{args.dataset} {args.partition}, {args.clients} clients, {args.rounds} rounds x {args.local_steps} "
             f"local steps, lr {args.lr} ({args.lr_schedule}), momentum {args.momentum}, exact staleness", "",
             "| strategy | final acc | best acc |", "|---|---|---|"]  # fmt: skip
    corrections = (True,) if args.with_correction_only else (False, True)
    configs = [(0, True)] + [(d, c) for d in map(int, args.delays.split(",")) for c in corrections]

    figures = {}
    for delay, correction in configs:
        started = time.monotonic()
        strategy = "fedavg" if delay == 0 else f"dga:{delay}" + ("" if correction else ":nocorrection")
        config = build_config(
            strategy=strategy, dataset=args.dataset, partition=args.partition, clients=args.clients,
            rounds=args.rounds, local_steps=args.local_steps, batch_size=args.batch_size, lr=args.lr,
            momentum=args.momentum, lr_schedule=args.lr_schedule, seed=args.seed,
        )  # fmt: skip
        acc = simulate(config).accuracy
        name = (
            "fedavg (D=0)" if delay == 0 else f"dga D={delay} " + ("with" if correction else "without") + " correction"
        )
        lines.append(f"| {name} | {acc[-1]:.4f} | {max(acc):.4f} |")
        figures[name] = {"final_accuracy": acc[-1], "best_accuracy": max(acc)}
        print_row_done(name, acc, started)
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
