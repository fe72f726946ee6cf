"""Every update codec, both directions, against dense FedAvg over a slow uplink: real deployments side by side.

One after another on this machine, each a real deployment in the namespaced testbed (``edgefl.launcher.run``)
with the same data (non-IID Fashion-MNIST, dirichlet:0.3, 4 clients), seed, rounds and K, over ``--profile``
(default ``rural-lte``: ~1 Mbit/s up, ~4 Mbit/s down, ~100 ms RTT, loss): edgefl FedAvg dense, then FedAvg with
each codec on the uplink and on the downlink (``--compress C --compress-down C``, the downlink without the
uplink's ``gm=``; ``UP/DOWN`` in ``--codecs`` gives the directions different codecs). Bytes are the Flower
objects that crossed the link, up + down; bytes and time to target count until a run first reaches
``--target-accuracy``.

Writes OUT/result.md (the table, also printed), OUT/result.json (``best_codec``: the codec that reaches the
target soonest; its ``bytes_to_target_ratio``, ``time_to_target_ratio`` and ``accuracy_delta_points`` against
dense FedAvg, and every codec's figures) and OUT/accuracy_vs_{time,rounds,bytes}.png.

    python bench/codecs.py [--codecs none,stc:0.0025,...] [--profile rural-lte] [--rounds 30] [--target-accuracy 0.8]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from results import add_deployment_arguments, write_result

from contract.run_folder import MESSAGES, read_rounds
from contract.settings import build_config
from edgefl.launcher import run
from edgefl.processes import LaunchError, interrupt_on_signals
from edgefl.report import load_run, plot_runs
from strategies.codecs import parse_codec

CODECS = (
    "none,stc:0.0025,stc:0.01,stc:0.03,stc:0.05,stc:0.03:gm=0.9,topk:0.01,dgc:0.999,powersgd:2,onebit,terngrad,"
    "threshold:0.05,int8,qsgd:16"
)


def downlink_of(up: str) -> str:
    """The uplink codec without its uplink-only option (global momentum): the same codec on the downlink."""
    return dataclasses.replace(parse_codec(up), global_momentum=None).label


def per_update_bytes(run_dir: Path) -> tuple[float, float]:
    """Mean bytes of one update up (per round a reply carries) and of one model-carrying message down."""
    trips = [t for t in read_rounds(run_dir, MESSAGES) if t["rounds"]]
    updates = sum(len(t["rounds"]) for t in trips)
    return sum(t["bytes_up"] for t in trips) / updates, sum(t["bytes_down"] for t in trips) / len(trips)


def ratio(base: float | None, other: float | None) -> float | None:
    """base / other; None when either is missing (a run that never reached the target)."""
    return base / other if base and other else None


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}x"


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", default=CODECS, help="comma-separated C or UP/DOWN codec specs; first: baseline")
    add_deployment_arguments(parser, "rural-lte", "runs/bench-codecs")
    args = parser.parse_args()
    interrupt_on_signals()
    codecs = args.codecs.split(",")
    runs, rows, figures = [], [], {}
    for i, name in enumerate(codecs, 1):
        up, _, down = name.partition("/")
        config = build_config(
            None, strategy="fedavg", profile=args.profile, dataset=args.dataset, partition=args.partition,
            clients=args.clients, rounds=args.rounds, local_steps=args.local_steps, seed=args.seed,
            lr_schedule=args.lr_schedule,
            target_accuracy=args.target_accuracy, compress=up, compress_down=down or downlink_of(up),
            out=str(args.out / name.replace(":", "-").replace("/", "+")),
        )  # fmt: skip
        print(f"== [{i}/{len(codecs)}] {name} over {args.profile}", flush=True)
        try:
            run_dir = run(config, lambda line: print("   " + line, flush=True))
        except LaunchError as exc:  # e.g. training diverged on every client: the table says so, the rest runs
            print(f"   failed: {exc}", flush=True)
            figures[name] = {"failed": str(exc)}
            continue
        runs.append(load_run(run_dir))
        figures[name] = measure(run_dir)
    if "failed" in figures[codecs[0]]:
        raise SystemExit(f"the baseline {codecs[0]} failed: {figures[codecs[0]]['failed']}")
    base = figures[codecs[0]]
    for name, f in figures.items():
        rows.append(f"| {name} | failed: {f['failed']} |" if "failed" in f else _row(name, f, base))
    reached = [name for name in codecs[1:] if figures[name].get("time_to_target_ratio")]
    best = max(reached, key=lambda name: figures[name]["time_to_target_ratio"], default=None)
    headline: dict[str, Any] = {"best_codec": best, "baseline": codecs[0], "profile": args.profile}
    for key in ("bytes_to_target_ratio", "time_to_target_ratio", "accuracy_delta_points"):
        headline[key] = figures[best][key] if best else None
    lines = [
        f"{args.dataset} {args.partition}, {args.clients} clients, {args.rounds} rounds x {args.local_steps} local "
        f"steps, {args.lr_schedule} lr, seed {args.seed}, over {args.profile}; real deployments, one after another; "
        f"target accuracy {args.target_accuracy:g}; ratios against {codecs[0]}",
        "",
        "| codec (up = down) | MB to target | fewer bytes | s to target | sooner | final acc | vs dense (points) "
        "| last 5 rounds, mean acc | B / update up | B / message down | s / round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        _verdict(headline, args.target_accuracy),
    ]
    plot_runs(runs, args.out, f"{args.dataset} {args.partition}, {args.clients} clients, {args.profile}")
    write_result(args.out, "\n".join(lines), {**headline, "codecs": figures})
    return 0


def measure(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures for the table."""
    summary, rows = load_run(run_dir)
    up_bytes, down_bytes = per_update_bytes(run_dir)
    return {
        "bytes_to_target": summary["bytes_to_target"],
        "time_to_target_s": summary["time_to_target_s"],
        "final_accuracy": summary["final_accuracy"],
        "last_5_mean_accuracy": sum(r["test_accuracy"] for r in rows[-5:]) / len(rows[-5:]),
        "bytes_up_per_update": up_bytes,
        "bytes_down_per_message": down_bytes,
        "seconds_per_round": summary["seconds_per_round"],
    }


def _row(name: str, f: dict[str, Any], base: dict[str, Any]) -> str:
    """The table row of codec `name`; adds its ratios against the baseline's figures to `f`."""
    f["bytes_to_target_ratio"] = ratio(base["bytes_to_target"], f["bytes_to_target"])
    f["time_to_target_ratio"] = ratio(base["time_to_target_s"], f["time_to_target_s"])
    f["accuracy_delta_points"] = 100 * (f["final_accuracy"] - base["final_accuracy"])
    return (
        f"| {name} | {_num(f['bytes_to_target'] and f['bytes_to_target'] / 1e6, '.3f')} "
        f"| {_x(f['bytes_to_target_ratio'])} | {_num(f['time_to_target_s'], '.1f')} "
        f"| {_x(f['time_to_target_ratio'])} | {f['final_accuracy']:.4f} | {f['accuracy_delta_points']:+.2f} "
        f"| {f['last_5_mean_accuracy']:.4f} | {f['bytes_up_per_update']:.0f} | {f['bytes_down_per_message']:.0f} "
        f"| {f['seconds_per_round']:.2f} |"
    )


def _verdict(headline: dict[str, Any], target: float) -> str:
    best = headline["best_codec"]
    if best is None:
        return f"No codec but the dense baseline (none) reached {target:g}."
    bytes_ratio, time_ratio, delta = (headline[k] for k in ("bytes_to_target_ratio", "time_to_target_ratio",
                                                            "accuracy_delta_points"))  # fmt: skip
    met = bytes_ratio >= 100, time_ratio >= 3, delta >= -1
    return (
        f"Best codec (soonest to {target:g}): {best}: {bytes_ratio:.0f}x fewer bytes to target (≥ 100x: "
        f"{'met' if met[0] else 'NOT met'}), {time_ratio:.2f}x sooner (≥ 3x: {'met' if met[1] else 'NOT met'}), "
        f"final accuracy {delta:+.2f} points at equal rounds (within 1: {'met' if met[2] else 'NOT met'})."
    )


if __name__ == "__main__":
    sys.exit(main())
