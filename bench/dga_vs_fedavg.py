"""FedAvg against DGA over a slow link, measured side by side in one run (issue: DGA reaches the target
accuracy at least 2x sooner than edgefl's FedAvg, final accuracy within 1 point at equal rounds; the ratio
against Flower's own FedAvg printed too; DGA's local steps per second over the slow link at least 0.9x its
own rate over ``lan``).

Runs, one after another on this machine, all as real deployments in the namespaced testbed with the same data,
partition, seed, rounds and K:  edgefl fedavg, dga:D and Flower's FedAvg over ``--profile`` (default
long-distance), then dga:D over ``lan``.

    python bench/dga_vs_fedavg.py [--delay 4] [--rounds 20] [--target-accuracy 0.7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgefl.compare import run_dir_for
from edgefl.config import build_config
from edgefl.launcher import run
from edgefl.report import load_run, plot_runs, table


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "— (target not reached)"


def tail_mean(rows: list[dict], count: int = 3) -> float:
    """Round-to-round accuracy noise is ±1–2 points here; the mean of the last rounds is steadier."""
    return sum(r["test_accuracy"] for r in rows[-count:]) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="long-distance")
    parser.add_argument("--delay", type=int, default=8)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--partition", default="dirichlet:0.3")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--target-accuracy", type=float, default=0.78)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dga-vs-fedavg"))
    args = parser.parse_args()
    dga = f"dga:{args.delay}"
    plan = [("fedavg", args.profile), (dga, args.profile), ("flower-fedavg", args.profile), (dga, "lan")]
    results = {}
    for strategy, profile in plan:
        config = build_config(
            None, strategy=strategy, profile=profile, dataset=args.dataset, partition=args.partition,
            clients=args.clients, rounds=args.rounds, local_steps=args.local_steps,
            target_accuracy=args.target_accuracy, out=str(run_dir_for(args.out, profile, strategy)),
        )  # fmt: skip
        print(f"== {strategy} over {profile}", flush=True)
        results[strategy, profile] = load_run(run(config, lambda line: print("   " + line, flush=True)))
    slow = [results[s, args.profile] for s in ("fedavg", dga, "flower-fedavg")]
    plot_runs(slow, args.out, f"{args.dataset} {args.partition}, {args.clients} clients, {args.profile}")
    fed, dg, flw = (summary for summary, _ in slow)
    lan = results[dga, "lan"][0]
    target, steps = args.target_accuracy, dg["local_steps_per_s"] / lan["local_steps_per_s"]
    lines = [
        table([fed, dg, flw, lan]),
        "",
        f"time to {target:g} accuracy over {args.profile}: DGA "
        f"{ratio(fed['time_to_target_s'], dg['time_to_target_s'])} sooner than edgefl FedAvg, "
        f"{ratio(flw['time_to_target_s'], dg['time_to_target_s'])} sooner than Flower's FedAvg",
        f"final accuracy after {args.rounds} rounds: DGA {dg['final_accuracy']:.4f}, edgefl FedAvg "
        f"{fed['final_accuracy']:.4f} ({100 * (dg['final_accuracy'] - fed['final_accuracy']):+.2f} points)",
        f"mean test accuracy of the last 3 rounds: DGA {tail_mean(slow[1][1]):.4f}, edgefl FedAvg "
        f"{tail_mean(slow[0][1]):.4f} ({100 * (tail_mean(slow[1][1]) - tail_mean(slow[0][1])):+.2f} points)",
        f"latency hidden: DGA local steps/s over {args.profile} / over lan = {dg['local_steps_per_s']:.1f} / "
        f"{lan['local_steps_per_s']:.1f} = {steps:.2f}",
    ]
    text = "\n".join(lines)
    (args.out / "result.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
