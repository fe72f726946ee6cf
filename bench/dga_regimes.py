"""When does DGA pay? Its speedup to a converged target and its accuracy gap against FedAvg over a grid of regimes
— links x devices x models, hence of R/T (R the message path, T a round's training) — and of DGA's delay D, on
Flower's Simulation Engine with the virtual clock timing the deployment's pipeline (``fl_server.simulation``:
each round starts once the agent's trainer is free and a global model it may start from has reached the device,
each update leaves as soon as it is trained). Then the grid's testbed spot checks: grid points that real
deployments on the namespaced testbed ran with the same settings (the main job's ``edgefl compare`` runs and
``bench/dga_vs_fedavg.py``'s seed 0), each simulated again with its testbed run's round training T as the
clock's unit (``simulate_spots``, under OUT/spots), seconds per round side by side (aim: within 10 %).

The target: the CNN's is the main job's (0.78), LEAF's LSTM's its FedAvg's final accuracy (mean of its last 3
evaluations) less 1 point (as ``bench/dga_vs_fedavg.py``'s), a run counted as there when the mean of 3 consecutive
evaluations reaches it. T is the clock's: a round's K local steps at the device's share of this host's core.

    python bench/dga_regimes.py [--models cnn,leaf-lstm] [--delays 2,4] [--report-only] [--spots-only]
        [--runs runs]   # the testbed's runs of the spot checks: runs/compare, runs/bench-dga-vs-fedavg/seed-0

Writes OUT/result.md, OUT/result.json, OUT/regimes.png (the heat map: speedup to target by R/T and D) and one
simulated run folder per grid point and per spot check.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from dga_vs_fedavg import tail_mean, time_to_target
from results import write_result

from contract.run_folder import SUMMARY
from contract.settings import build_config
from edge.devices import device_profile
from edgefl.launcher import run
from edgefl.processes import interrupt_on_signals
from edgefl.report import load_run
from fl_server.simulation import host_step_s
from strategies.dga import regime_bounds

AIM = 0.10  # |simulated / testbed − 1| of seconds per round
SETTINGS = {  # each model on its own task, as the main job and bench/dga_vs_fedavg.py run them
    "cnn": {"dataset": "fashion-mnist", "partition": "dirichlet:0.3", "model": "cnn", "rounds": 16, "local_steps": 20,
            "lr_schedule": "cosine", "eval_examples": 2000, "target_accuracy": 0.78},
    "leaf-lstm": {"dataset": "shakespeare", "partition": "natural", "model": "leaf-lstm", "rounds": 60,
                  "local_steps": 5, "batch_size": 10, "lr": 0.6, "lr_schedule": "cosine", "eval_examples": 1000,
                  "eval_every": 3},
}  # fmt: skip
GRID = {  # links x devices per model: R/T from well below 1 to several
    "cnn": (("lan", "home-wifi", "long-distance", "satellite"), ("laptop", "rpi4")),
    "leaf-lstm": (("lan", "long-distance", "satellite"), ("rpi4",)),
}
SPOTS = {  # testbed run folders with a grid point's settings: (model, link, device, strategy) → folder under a root
    ("cnn", "home-wifi", "rpi4", "fedavg"): "compare/home-wifi/fedavg",
    ("cnn", "home-wifi", "rpi4", "dga:2"): "compare/home-wifi/dga-2",
    ("cnn", "long-distance", "rpi4", "fedavg"): "compare/long-distance/fedavg",
    ("cnn", "long-distance", "rpi4", "dga:2"): "compare/long-distance/dga-2",
    ("leaf-lstm", "long-distance", "rpi4", "fedavg"): "bench-dga-vs-fedavg/seed-0/long-distance/fedavg",
    ("leaf-lstm", "long-distance", "rpi4", "dga:4"): "bench-dga-vs-fedavg/seed-0/long-distance/dga-4",
    ("leaf-lstm", "lan", "rpi4", "dga:4"): "bench-dga-vs-fedavg/seed-0/lan/dga-4",
}


SPOTS_DIR = "spots"  # under OUT: the spot checks' simulations, each with its testbed run's T as the clock's unit


def point_dir(out: Path, model: str, link: str, device: str, strategy: str) -> Path:
    return out / model / f"{link}+{device}" / strategy.replace(":", "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,leaf-lstm")
    parser.add_argument("--delays", default="2,4", help="DGA's D at every grid point (FedAvg is D = 0)")
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="where the spot checks' testbed runs are")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dga-regimes"))
    parser.add_argument("--report-only", action="store_true", help="no runs: the result from the run folders")
    parser.add_argument("--spots-only", action="store_true", help="simulate only the spot checks (SPOTS); the map "
                        "from what OUT holds")  # fmt: skip
    args = parser.parse_args()
    interrupt_on_signals()
    strategies = ["fedavg", *(f"dga:{d}" for d in args.delays.split(","))]
    models = args.models.split(",")
    units = {  # this host's step of each model, measured before any run loads the machine
        model: None if args.report_only or args.spots_only else host_step_s(build_config(None, **SETTINGS[model]))
        for model in models
    }
    points: list[dict[str, Any]] = []
    for model in models:
        links, devices = GRID[model]
        for link in links:
            for device in devices:
                runs = {}
                for strategy in strategies:
                    folder = point_dir(args.out, model, link, device, strategy)
                    if not (args.report_only or args.spots_only):
                        print(f"== {model}, {link}, {device}: {strategy}", flush=True)
                        config = build_config(
                            None, **SETTINGS[model], strategy=strategy, profile=link, device_profile=device,
                            federation="simulation", clock_step_s=units[model], out=str(folder),
                        )  # fmt: skip
                        run(config, lambda line: None)
                    if (folder / SUMMARY).exists():
                        runs[strategy] = load_run(folder)
                if "fedavg" in runs and len(runs) > 1:
                    points += grid_points(model, link, device, runs)
    if not args.report_only:
        simulate_spots(args.runs, args.out / SPOTS_DIR)
    spots = spot_checks(args.runs, args.out / SPOTS_DIR)
    text, figures = report(points, spots, args.out)
    write_result(args.out, text, figures)
    return 0


def simulate_spots(runs_root: Path, out: Path) -> None:
    """Each spot check's grid point, simulated with its testbed run's round training T: the clock's unit set so that
    the device's K local steps take what the testbed run's took (``round_train_s``). This host's own speed drifts by
    tens of percent within a minute (its one-core step of the CNN measured 13.7 and 7.5 ms ten seconds apart), which
    no unit measured at another moment follows; so the spot checks test the clock's message path and its timing of
    the pipeline, and ``bench/device_calibration.py`` the device's speed."""
    for (model, link, device, strategy), folder in SPOTS.items():
        real_dir = runs_root / folder
        if not (real_dir / SUMMARY).exists():
            print(f"== no testbed run at {real_dir}: {model}, {link}, {device}, {strategy} left out", flush=True)
            continue
        real = load_run(real_dir)[0]
        unit = real["round_train_s"] / real["local_steps"] * (device_profile(device).shares().train or 1.0)
        print(f"== {model}, {link}, {device}: {strategy} (T {real['round_train_s']:.2f} s, as on the testbed)",
              flush=True)  # fmt: skip
        config = build_config(
            None, **SETTINGS[model], strategy=strategy, profile=link, device_profile=device, federation="simulation",
            clock_step_s=unit, out=str(point_dir(out, model, link, device, strategy)),
        )  # fmt: skip
        run(config, lambda line: None)


def grid_points(model: str, link: str, device: str, runs: dict[str, tuple[dict, list]]) -> list[dict[str, Any]]:
    """One row per DGA run of a (model, link, device): R and T (FedAvg's, the regime), the speedups and the gap."""
    fed, fed_rows = runs["fedavg"]
    target = SETTINGS[model].get("target_accuracy") or tail_mean(fed_rows) - 0.01
    fed_t = time_to_target(fed_rows, target)
    path_s, round_s = fed["message_path_s"], fed["round_train_s"]  # T: the clock's, as the run recorded it
    rows = []
    for strategy, (summary, rows_) in runs.items():
        if strategy == "fedavg":
            continue
        dga_t = time_to_target(rows_, target)
        rows.append({
            "model": model, "link": link, "device": device, "strategy": strategy,
            "delay": int(strategy.split(":")[1]), "target": target,
            "path_s": path_s, "round_s": round_s, "r_over_t": path_s / round_s,
            "bound": regime_bounds(path_s, round_s)[0], "delay_to_hide": regime_bounds(path_s, round_s)[1],
            "per_round_speedup": fed["seconds_per_round"] / summary["seconds_per_round"],
            "to_target_speedup": fed_t / dga_t if fed_t and dga_t else None,
            "accuracy_gap_points": 100 * (tail_mean(rows_) - tail_mean(fed_rows)),
        })  # fmt: skip
    return rows


def spot_checks(runs_root: Path, out: Path) -> list[dict[str, Any]]:
    """Seconds per round on the testbed against the simulated grid point with the same settings."""
    found = []
    for (model, link, device, strategy), folder in SPOTS.items():
        real_dir, sim_dir = runs_root / folder, point_dir(out, model, link, device, strategy)
        if not (real_dir / SUMMARY).exists() or not (sim_dir / SUMMARY).exists():
            continue
        real, sim = load_run(real_dir)[0], load_run(sim_dir)[0]
        found.append({
            "model": model, "link": link, "device": device, "strategy": strategy,
            "testbed_s_per_round": real["seconds_per_round"], "simulated_s_per_round": sim["seconds_per_round"],
            "error": sim["seconds_per_round"] / real["seconds_per_round"] - 1,
            "testbed_r_s": real["message_path_s"], "simulated_r_s": sim["message_path_s"],
            "testbed_t_s": real["round_train_s"], "simulated_t_s": sim["round_train_s"],
        })  # fmt: skip
    return found


def report(points: list[dict[str, Any]], spots: list[dict[str, Any]], out: Path) -> tuple[str, dict[str, Any]]:
    points = sorted(points, key=lambda p: (p["delay"], p["r_over_t"]))
    if points:
        heat_map(points, out / "regimes.png")
    else:
        print(f"no grid point has runs under {out}: no map drawn (run without --spots-only first)", flush=True)
    lines = [
        "| model | link | device | R s | T s | R/T | 1 + R/T | D that hides R | D | s/round speedup | target | "
        "speedup to target | accuracy gap (points) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {p['model']} | {p['link']} | {p['device']} | {p['path_s']:.2f} | {p['round_s']:.2f} | "
            f"{p['r_over_t']:.2f} | {p['bound']:.2f}x | {p['delay_to_hide']} | {p['delay']} | "
            f"{p['per_round_speedup']:.2f}x | {p['target']:.4f} | {times(p['to_target_speedup'])} | "
            f"{p['accuracy_gap_points']:+.2f} |"
            for p in points
        ),
        "",
        "Testbed spot checks (the same settings as real deployments on the namespaced testbed):",
        "",
        "| model | link | device | strategy | testbed s/round | simulated s/round | error | testbed R / T s "
        "| simulated R / T s |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {s['model']} | {s['link']} | {s['device']} | {s['strategy']} | {s['testbed_s_per_round']:.2f} | "
            f"{s['simulated_s_per_round']:.2f} | {s['error']:+.0%} | {s['testbed_r_s']:.2f} / {s['testbed_t_s']:.2f} "
            f"| {s['simulated_r_s']:.2f} / {s['simulated_t_s']:.2f} |"
            for s in spots
        ),
    ]
    worst = max((abs(s["error"]) for s in spots), default=math.nan)
    lines += ["", f"Largest spot-check error: {worst:.0%} (aim: within {AIM:.0%}, on at least 3 points: "
              f"{len([s for s in spots if abs(s['error']) <= AIM])} within)."]  # fmt: skip
    return "\n".join(lines), {"grid": points, "spot_checks": spots, "largest_spot_error": worst}


def times(value: float | None) -> str:
    return "— (not reached)" if value is None else f"{value:.2f}x"


def heat_map(points: list[dict[str, Any]], path: Path) -> None:
    """Speedup to target, by D (rows) and grid point ordered by R/T (columns), annotated with the accuracy gap."""
    delays = sorted({p["delay"] for p in points})
    columns = sorted({(p["r_over_t"], p["model"], p["link"], p["device"]) for p in points})
    grid = [[math.nan] * len(columns) for _ in delays]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(columns)), 1.4 + 0.9 * len(delays)))
    for p in points:
        i, j = delays.index(p["delay"]), columns.index((p["r_over_t"], p["model"], p["link"], p["device"]))
        grid[i][j] = p["to_target_speedup"] or math.nan
        speedup = "not\nreached" if p["to_target_speedup"] is None else f"{p['to_target_speedup']:.2f}x"
        ax.text(j, i, f"{speedup}\n{p['accuracy_gap_points']:+.1f} pt",
                ha="center", va="center", fontsize=7)  # fmt: skip
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=3.0, aspect="auto")
    ax.set_xticks(range(len(columns)), [f"{m}\n{link}\n{d}\nR/T {r:.2f}" for r, m, link, d in columns], fontsize=7)
    ax.set_yticks(range(len(delays)), [f"D = {d}" for d in delays])
    ax.set_title("DGA against FedAvg: speedup to target (simulated), and the final accuracy gap")
    fig.colorbar(image, ax=ax, label="speedup to target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
