"""DGA with a codec both ways over a link that is slow AND long, against dense FedAvg and Flower's own FedAvg.

One after another on this machine, each a real deployment in the namespaced testbed with the same data
(non-IID Fashion-MNIST, dirichlet:0.3, 4 clients), seed, rounds and K, over ``--profile`` (default
``rural-lte-long``: rural LTE's ~1 Mbit/s up and ~4 Mbit/s down at ~300 ms RTT): Flower's FedAvg (stock,
dense), edgefl FedAvg dense, edgefl FedAvg with ``--codec`` both ways, and DGA:D with ``--codec`` both ways.
Time to target is printed side by side; result.json holds the time-to-target ratios of DGA + codec against
dense edgefl FedAvg and against Flower's FedAvg, and the ratio of seconds per round against Flower's (which
stands when Flower's run never reaches the target).

    python bench/slow_long_link.py [--codec stc:0.03] [--delay 2] [--profile rural-lte-long] [--rounds 30]
"""

from __future__ import annotations

import argparse
import sys

from results import add_deployment_arguments, write_result

from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run, plot_runs, ratio, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", default="stc:0.03")
    parser.add_argument("--delay", type=int, default=2, help="DGA's D")
    add_deployment_arguments(parser, "rural-lte-long", "runs/bench-slow-long-link")
    args = parser.parse_args()
    interrupt_on_signals()
    dga = f"dga:{args.delay}"
    plan = [("flower-fedavg", "none"), ("fedavg", "none"), ("fedavg", args.codec), (dga, args.codec)]
    runs = []
    for i, (strategy, codec) in enumerate(plan, 1):
        config = build_config(
            None, strategy=strategy, profile=args.profile, dataset=args.dataset, partition=args.partition,
            clients=args.clients, rounds=args.rounds, local_steps=args.local_steps, seed=args.seed,
            lr_schedule=args.lr_schedule,
            target_accuracy=args.target_accuracy, compress=codec, compress_down=codec,
            out=str(args.out / f"{strategy}+{codec}".replace(":", "-")),
        )  # fmt: skip
        print(f"== [{i}/{len(plan)}] {strategy} with {codec} over {args.profile}", flush=True)
        runs.append(load_run(run(config, lambda line: print("   " + line, flush=True))))
    summaries = [summary for summary, _ in runs]
    flower, dense, _, dga_codec = summaries
    figures = {
        "codec": args.codec,
        "strategy": dga,
        "vs_dense_fedavg_time_to_target": ratio(dense, dga_codec, "time_to_target_s"),
        "vs_flower_fedavg_time_to_target": ratio(flower, dga_codec, "time_to_target_s"),
        "vs_flower_fedavg_seconds_per_round": ratio(flower, dga_codec, "seconds_per_round"),
        "vs_dense_fedavg_bytes_to_target": ratio(dense, dga_codec, "bytes_to_target"),
        "accuracy_delta_points": 100 * (dga_codec["final_accuracy"] - dense["final_accuracy"]),
        "time_to_target_s": {f"{s['strategy']} +{s['compress']}": s["time_to_target_s"] for s in summaries},
    }
    to_dense = figures["vs_dense_fedavg_time_to_target"]
    to_flower = figures["vs_flower_fedavg_time_to_target"]
    lines = [
        f"{args.dataset} {args.partition}, {args.clients} clients, {args.rounds} rounds x {args.local_steps} local "
        f"steps over {args.profile}; target accuracy {args.target_accuracy:g}; speedups against Flower's FedAvg",
        "",
        table(summaries),
        "",
        f"{dga} +{args.codec}: time to {args.target_accuracy:g} "
        f"{'—' if to_dense is None else f'{to_dense:.2f}x'} sooner than dense edgefl FedAvg (aim ≥ 5x: "
        f"{'met' if (to_dense or 0) >= 5 else 'NOT met'}), {'—' if to_flower is None else f'{to_flower:.2f}x'} "
        f"sooner than Flower's FedAvg ({figures['vs_flower_fedavg_seconds_per_round']:.2f}x shorter rounds); final "
        f"accuracy {figures['accuracy_delta_points']:+.2f} points against dense edgefl FedAvg, "
        f"{100 * (dga_codec['final_accuracy'] - flower['final_accuracy']):+.2f} against Flower's FedAvg.",
    ]
    plot_runs(runs, args.out, f"{args.dataset} {args.partition}, {args.clients} clients, {args.profile}")
    write_result(args.out, "\n".join(lines), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
