"""Every update codec on non-IID Fashion-MNIST (dirichlet:0.3, 4 clients): uplink bytes per update (real payload
sizes) and the ratio to dense float32, final and best accuracy at equal rounds against dense FedAvg (in-process
simulation of bench/sim.py: same seed, rounds and K), and seconds per round over ``cellular-4g`` from real short
runs (edgefl.launcher.run in the namespaced testbed, as bench/dga_vs_fedavg.py does).

Writes OUT/result.md (one markdown table, also printed) and OUT/accuracy.png (accuracy against rounds).

    python bench/codecs.py [--codecs none,topk:0.01,...] [--rounds 30] [--timed-rounds 3] [--skip-timed]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from results import write_result
from sim import SimResult, simulate

from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run

CODECS = "none,topk:0.01,dgc:0.999,powersgd:2,onebit,terngrad,threshold:0.05,int8,qsgd:16"


def timed_seconds_per_round(args: argparse.Namespace, codec: str) -> float:
    """Seconds per round of a real deployment with this uplink codec over the link profile."""
    config = build_config(
        None, strategy="fedavg", profile=args.profile, dataset=args.dataset, partition=args.partition,
        clients=args.clients, rounds=args.timed_rounds, local_steps=args.local_steps, seed=args.seed,
        compress=codec, out=str(args.out / "timed" / codec.replace(":", "-")),
    )  # fmt: skip
    summary, _ = load_run(run(config, lambda line: print("   " + line, flush=True)))
    return summary["seconds_per_round"]


def plot(results: dict[str, SimResult], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for codec, result in results.items():
        ax.plot(result.eval_rounds, result.accuracy, label=codec, linewidth=2.5 if codec == "none" else 1.2)
    ax.set(xlabel="round", ylabel="test accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", default=CODECS, help="comma-separated codec specs; the first is the baseline")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="cellular-4g")
    parser.add_argument("--timed-rounds", type=int, default=3, help="rounds of each real run")
    parser.add_argument("--skip-timed", action="store_true", help="only the simulation: no real runs")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-codecs"))
    args = parser.parse_args()
    interrupt_on_signals()
    args.out.mkdir(parents=True, exist_ok=True)
    codecs = args.codecs.split(",")
    torch.set_num_threads(2)
    results: dict[str, SimResult] = {}
    for codec in codecs:
        started = time.monotonic()
        config = build_config(
            dataset=args.dataset, partition=args.partition, clients=args.clients, rounds=args.rounds,
            local_steps=args.local_steps, lr=args.lr, seed=args.seed, compress=codec,
        )  # fmt: skip
        results[codec] = result = simulate(config)
        print(f"{codec}: final {result.accuracy[-1]:.4f} ({time.monotonic() - started:.0f} s)", flush=True)
    seconds = {} if args.skip_timed else {codec: timed_seconds_per_round(args, codec) for codec in codecs}
    baseline = results[codecs[0]]
    lines = [
        f"{args.dataset} {args.partition}, {args.clients} clients, {args.rounds} rounds x {args.local_steps} local "
        f"steps, seed {args.seed}; accuracy from the in-process simulation, time from real {args.timed_rounds}-round "
        f"runs over {args.profile}",
        "",
        f"| codec | bytes / update | dense / codec | final acc | vs {codecs[0]} (points) | best acc | s / round |",
        "|---|---|---|---|---|---|---|",
    ]
    figures = {}
    for codec, result in results.items():
        size, final = result.bytes_per_update, result.accuracy[-1]
        delta = 100 * (final - baseline.accuracy[-1])
        time_s = f"{seconds[codec]:.1f}" if codec in seconds else "—"
        figures[codec] = {"bytes_per_update": size, "final_accuracy": final, "accuracy_delta_points": delta,
                          "seconds_per_round": seconds.get(codec)}  # fmt: skip
        lines.append(
            f"| {codec} | {size:.0f} | {result.dense_bytes / size:.1f}x | {final:.4f} | {delta:+.2f} "
            f"| {max(result.accuracy):.4f} | {time_s} |"
        )
    plot(results, args.out / "accuracy.png", f"{args.dataset} {args.partition}, {args.clients} clients")
    write_result(args.out, "\n".join(lines), figures)
    print(f"plot: {args.out / 'accuracy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
