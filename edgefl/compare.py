"""``edgefl compare``: several strategies on identical data, partitions, seeds and links, one after another
on the same machine, then one report — a markdown table per link profile (speedup against the first
strategy) and accuracy plots against wall-clock time and rounds, one line per strategy. With ``--seeds N`` each
strategy runs over N seeds, and the table gives each figure's mean with its 95 % interval, the plots a band.

edgefl's runs over one link profile share one local federation — SuperLink, SuperNodes and edge agents start
once, as a real fleet's do, and each run is submitted to it in turn (its processes' logs are in OUT/PROFILE/logs);
Flower's own FedAvg runs in a deployment of its own.

With no arguments it is edgefl's main job: FedAvg against DGA on non-IID Fashion-MNIST, on emulated Raspberry Pi
4s over emulated home-wifi and long-distance links. Every run's message path R and round training T are printed
after it, with what DGA can gain there (``strategies.dga.regime_bounds``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contract.settings import RunConfig
from edgefl.launcher import app_for, local_federation, run, run_on
from edgefl.report import gap_lines, load_run, plot_runs, plot_seeds, regime_line, regime_text, seeds_table, table

DEFAULT_STRATEGIES = ("fedavg", "dga:2")
DEFAULT_PROFILES = ("home-wifi", "long-distance")
DEFAULTS = {
    "dataset": "fashion-mnist",
    "partition": "dirichlet:0.3",
    "clients": 4,
    "rounds": 16,
    "local_steps": 20,
    "lr_schedule": "cosine",
    "target_accuracy": 0.78,
    "eval_examples": 2000,
    "device_profile": "rpi4",
    "out": "runs/compare",
}


def run_dir_for(out: Path, profile: str, strategy: str) -> Path:
    return out / profile.replace(",", "+") / strategy.replace(":", "-")


def estimates(base: RunConfig, profiles: list[str]) -> list[str]:
    """Before the runs: the clock's R and T (``netem.clock.estimate_regime``) for every kind of client each profile's
    fleet holds, and what DGA could gain there; this host's seconds per step are measured first (a few seconds)."""
    from fl_server.simulation import host_step_s
    from ml.data import load_dataset
    from ml.models import build_model
    from netem.clock import estimate_regime
    from netem.fleet import devices_for, links_for
    from netem.profiles import BUILTIN_LINKS

    step_s = host_step_s(base)
    model = build_model(load_dataset(base.dataset, base.data_dir or None), base.seed, base.model)
    message_bytes = 4 * sum(p.numel() for p in model.parameters())  # one dense model
    lines = []
    for profile in profiles:
        config = dataclasses.replace(base, profile=profile)
        links = links_for(config) or [BUILTIN_LINKS["lan"]] * config.clients
        for link, device in dict.fromkeys(zip(links, devices_for(config), strict=True)):
            path_s, round_s = estimate_regime(link, device, message_bytes, config.local_steps, step_s, config.step_key)
            lines.append(f"{link.name}, {device.name}: the clock expects {regime_text(path_s, round_s)}")
    return lines


def compare(
    base: RunConfig,
    strategies: list[str],
    profiles: list[str],
    progress: Callable[[str], None] = print,
    seeds: int = 1,
) -> tuple[str, list[Path]]:
    """Every strategy over every profile, for ``seeds`` seeds from ``base.seed`` on (run folders
    ``OUT/PROFILE/STRATEGY``, with several seeds ``OUT/PROFILE/STRATEGY/seed-S``); per profile a table of the runs,
    and with one seed each run's accuracy gap to the first with the evaluation's standard error (``gap_lines``),
    with several the means over seeds with their 95 % intervals (``seeds_table``) and plots with bands."""
    out = Path(base.out)
    sections, plots = [], []
    total, done = len(strategies) * len(profiles) * seeds, 0
    for profile in profiles:
        runs: dict[str, list[tuple[dict[str, Any], list[dict[str, Any]]]]] = {strategy: [] for strategy in strategies}
        with contextlib.ExitStack() as stack:
            shared = None  # edgefl's runs over one link share a local federation: its devices start once
            for seed in range(base.seed, base.seed + seeds):
                for strategy in strategies:
                    folder = run_dir_for(out, profile, strategy)
                    folder = folder if seeds == 1 else folder / f"seed-{seed}"
                    config = dataclasses.replace(base, strategy=strategy, profile=profile, seed=seed, out=str(folder))
                    done += 1
                    progress(f"[{done}/{total}] {config.strategy} over {profile}, seed {seed}")
                    if config.federation != "local" or app_for(config) != "edgefl":
                        run_dir = run(config, progress)
                    else:
                        if shared is None:
                            home = out / profile.replace(",", "+")
                            shared = stack.enter_context(local_federation(config, home, progress))
                        run_dir = run_on(shared, config, progress)
                    runs[strategy].append(load_run(run_dir))
                    progress(regime_line(runs[strategy][-1][0]))
        plot_dir = out / profile.replace(",", "+")
        title = f"{base.dataset} {base.partition}, {base.clients} clients, {profile}"
        groups = list(runs.values())
        summaries = [summary for group in groups for summary, _ in group]
        regimes = "\n".join(f"- {regime_line(summary)}" for summary in summaries)
        if seeds == 1:
            plots += plot_runs([group[0] for group in groups], plot_dir, title)
            gaps = "\n".join(gap_lines(summaries))
            sections.append(f"### {profile}\n\n{table(summaries)}\n\n{gaps}\n\n{regimes}\n")
        else:
            plots += plot_seeds(groups, plot_dir, f"{title}, {seeds} seeds")
            means = seeds_table([[summary for summary, _ in group] for group in groups])
            each = [f"Seed {base.seed + i} (speedups against its {strategies[0]} run):\n\n"
                    + table([group[i][0] for group in groups]) for i in range(seeds)]  # fmt: skip
            sections.append(f"### {profile}, {seeds} seeds\n\n{means}\n\n" + "\n\n".join(each) + f"\n\n{regimes}\n")
    text = "\n".join(sections)
    (out / "report.md").write_text(text)
    return text, plots
