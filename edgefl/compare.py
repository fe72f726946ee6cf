"""``edgefl compare``: several strategies on identical data, partitions, seeds and links, one after another
on the same machine, then one report — a markdown table per link profile (speedup against the first
strategy) and accuracy plots against wall-clock time and rounds, one line per strategy.

With no arguments it is edgefl's main job: FedAvg against DGA on non-IID Fashion-MNIST over emulated
home-wifi and long-distance links."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from contract.settings import RunConfig
from edgefl.launcher import run
from edgefl.report import load_run, plot_runs, table

DEFAULT_STRATEGIES = ("fedavg", "dga:2")
DEFAULT_PROFILES = ("home-wifi", "long-distance")
DEFAULTS = {
    "dataset": "fashion-mnist",
    "partition": "dirichlet:0.3",
    "clients": 4,
    "rounds": 20,
    "local_steps": 20,
    "lr_schedule": "cosine",
    "target_accuracy": 0.78,
    "out": "runs/compare",
}


def run_dir_for(out: Path, profile: str, strategy: str) -> Path:
    return out / profile.replace(",", "+") / strategy.replace(":", "-")


def compare(
    base: RunConfig, strategies: list[str], profiles: list[str], progress: Callable[[str], None] = print
) -> tuple[str, list[Path]]:
    out = Path(base.out)
    sections, plots = [], []
    total, done = len(strategies) * len(profiles), 0
    for profile in profiles:
        runs = []
        for strategy in strategies:
            done += 1
            progress(f"[{done}/{total}] {strategy} over {profile}")
            config = dataclasses.replace(
                base, strategy=strategy, profile=profile, out=str(run_dir_for(out, profile, strategy))
            )
            runs.append(load_run(run(config, progress)))
        plot_dir = out / profile.replace(",", "+")
        title = f"{base.dataset} {base.partition}, {base.clients} clients, {profile}"
        plots += plot_runs(runs, plot_dir, title)
        sections.append(f"### {profile}\n\n{table([summary for summary, _ in runs])}\n")
    text = "\n".join(sections)
    (out / "report.md").write_text(text)
    return text, plots
