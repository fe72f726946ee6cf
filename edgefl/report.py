"""Reading finished runs back: the per-run plots, and ``edgefl report`` — one table and one plot across runs.

Ratios are against the first run given: speedup to target (time-to-target ratio; — when either run missed the
target), fewer bytes to target (ratio of the bytes up + down spent until the target was first reached) and
speedup per round (ratio of wall-clock seconds per round)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from contract.errors import EdgeflError
from contract.run_folder import PLOT_BYTES, PLOT_ROUNDS, PLOT_TIME, SUMMARY, read_rounds
from strategies.dga import regime_bounds


class ReportError(EdgeflError, ValueError):
    """A folder that is not a finished run; ``str()`` is one line."""


def mean_interval(values: list[float], level: float = 0.95) -> list[float]:
    """[mean, low, high]: the mean of ``values`` (one per seed) with its Student-t interval at ``level`` (the
    sample standard deviation, n − 1 degrees of freedom); one value is its own interval."""
    from scipy.stats import t

    n = len(values)
    if n == 0:
        raise ReportError("no values to average")
    mean = sum(values) / n
    if n == 1:
        return [mean, mean, mean]
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    half = float(t.ppf((1 + level) / 2, n - 1)) * sd / n**0.5
    return [mean, mean - half, mean + half]


def load_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    path = run_dir / SUMMARY
    if not path.exists():
        raise ReportError(f"{run_dir} is not a finished edgefl run (no {SUMMARY})")
    return json.loads(path.read_text()), read_rounds(run_dir)


def label(summary: dict[str, Any]) -> str:
    """e.g. ``fedavg +stc:0.01`` (same codec both ways) or ``dga:2 +topk:0.01/int8`` (up/down)."""
    up, down = summary.get("compress", "none"), summary.get("compress_down", "none")
    codecs = up if up == down else f"{up}/{down}"
    return summary["strategy"] if codecs == "none" else f"{summary['strategy']} +{codecs}"


def cumulative_mb(rows: list[dict[str, Any]]) -> list[float]:
    """Megabytes up + down spent by the end of each round."""
    total, out = 0, []
    for r in rows:
        total += r["bytes_up"] + r["bytes_down"]
        out.append(total / 1e6)
    return out


X_AXES = (
    (lambda rows: [r["wall_s"] for r in rows], "wall-clock time (s)", PLOT_TIME),
    (lambda rows: [r["round"] for r in rows], "round", PLOT_ROUNDS),
    (cumulative_mb, "MB on the wire, up + down (log)", PLOT_BYTES),
)


def plot_runs(runs: list[tuple[dict[str, Any], list[dict[str, Any]]]], out: Path, title: str) -> list[Path]:
    """accuracy against wall-clock time, rounds and cumulative bytes, one line per run; returns the PNG paths."""
    paths = []
    links = {summary["link_profile"] for summary, _ in runs}
    names = [label(s) if len(links) == 1 else f"{label(s)}, {s['link_profile']}" for s, _ in runs]
    for x_values, x_label, file_name in X_AXES:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, (_, rows) in zip(names, runs, strict=True):
            points = [(x, r["test_accuracy"]) for x, r in zip(x_values(rows), rows, strict=True)]
            points = [(x, accuracy) for x, accuracy in points if accuracy is not None]  # evaluated (--eval-every)
            ax.plot(*zip(*points, strict=True), marker=".", label=name)
        paths.append(
            _save(fig, ax, out / file_name, x_label, "test accuracy", title, runs[0][0].get("target_accuracy"))
        )
    return paths


def _save(fig: Any, ax: Any, path: Path, x_label: str, y_label: str, title: str, target: float | None) -> Path:
    """An accuracy plot's axes, target line and legend, written to ``path`` (a log x for bytes)."""
    if path.name == PLOT_BYTES:
        ax.set_xscale("log")
    if target:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_seeds(groups: list[list[tuple[dict[str, Any], list[dict[str, Any]]]]], out: Path, title: str) -> list[Path]:
    """Like ``plot_runs`` for runs over several seeds (``groups[i]``: one strategy's runs): one line per strategy,
    the mean accuracy over its seeds at each evaluated round, in a band of its 95 % interval; x is the round, the
    mean wall-clock time or the mean bytes by then. Returns the PNG paths."""
    paths = []
    for x_values, x_label, file_name in X_AXES:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for runs in groups:
            rounds = min(len(rows) for _, rows in runs)
            at = [i for i in range(rounds) if all(rows[i]["test_accuracy"] is not None for _, rows in runs)]
            if not at:
                continue
            per_run = [x_values(rows) for _, rows in runs]
            xs = [sum(x[i] for x in per_run) / len(runs) for i in at]
            bands = [mean_interval([rows[i]["test_accuracy"] for _, rows in runs]) for i in at]
            line = ax.plot(xs, [b[0] for b in bands], marker=".", label=f"{label(runs[0][0])} ({len(runs)} seeds)")
            ax.fill_between(xs, [b[1] for b in bands], [b[2] for b in bands], color=line[0].get_color(), alpha=0.2)
        target = groups[0][0][0].get("target_accuracy")
        paths.append(_save(fig, ax, out / file_name, x_label, "test accuracy (mean, 95 % interval)", title, target))
    return paths


def plot_single(run_dir: Path) -> list[Path]:
    summary, rows = load_run(run_dir)
    title = f"{label(summary)} — {summary['dataset']} {summary['partition']}, {summary['link_profile']}"
    return plot_runs([(summary, rows)], run_dir, title)


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def ratio(base: dict[str, Any], other: dict[str, Any], key: str) -> float | None:
    """base[key] / other[key], None when either is missing (e.g. a run that never reached its target)."""
    return base[key] / other[key] if base.get(key) and other.get(key) else None


def table(summaries: list[dict[str, Any]]) -> str:
    """A markdown table; the speedup columns are against the first run."""
    head = (
        "| strategy | link | rounds | final acc | best acc | time to target (s) | wall (s) | s/round "
        "| R (s) | T (s) | rounds/h | local steps/s | MB up | MB down | MB to target | speedup to target "
        "| fewer bytes to target | speedup per round |"
    )
    lines = [head, "|" + "---|" * 18]
    for s in summaries:
        to_target, bytes_to_target, per_round = (
            ratio(summaries[0], s, key) for key in ("time_to_target_s", "bytes_to_target", "seconds_per_round")
        )
        mb_to_target = None if s.get("bytes_to_target") is None else s["bytes_to_target"] / 1e6
        lines.append(
            f"| {label(s)} | {s['link_profile']} | {s['rounds']} | {_fmt(s['final_accuracy'], '.4f')} "
            f"| {_fmt(s['best_accuracy'], '.4f')} | {_fmt(s['time_to_target_s'])} | {_fmt(s['wall_clock_s'])} "
            f"| {_fmt(s['seconds_per_round'], '.2f')} | {_fmt(s.get('message_path_s'), '.2f')} "
            f"| {_fmt(s.get('round_train_s'), '.2f')} | {_fmt(s['rounds_per_hour'], '.0f')} "
            f"| {_fmt(s['local_steps_per_s'], '.1f')} | {s['bytes_up'] / 1e6:.2f} | {s['bytes_down'] / 1e6:.2f} "
            f"| {_fmt(mb_to_target, '.3f')} | {_times(to_target)} | {_times(bytes_to_target)} | {_times(per_round)} |"
        )
    return "\n".join(lines)


def accuracy_gap(base: dict[str, Any], other: dict[str, Any]) -> tuple[float, float] | None:
    """``other``'s final accuracy less ``base``'s, in points, and the standard error of that gap from the evaluation
    alone: each accuracy a proportion of its ``eval_examples`` test examples (binomial), the two taken as
    independent, sqrt(p₁(1 − p₁)/n₁ + p₂(1 − p₂)/n₂). The runs score the same examples, so this overstates the
    evaluation's part; a seed's training noise is not in it (``edgefl compare --seeds``). None without both."""
    p1, p2 = base.get("final_accuracy"), other.get("final_accuracy")
    n1, n2 = base.get("eval_examples"), other.get("eval_examples")
    if p1 is None or p2 is None or not n1 or not n2:
        return None
    return 100 * (p2 - p1), 100 * (p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2) ** 0.5


def gap_lines(summaries: list[dict[str, Any]]) -> list[str]:
    """For one seed: each run's final accuracy against the first's, with the evaluation's standard error of the gap
    (``accuracy_gap``) and whether the gap is within two of it."""
    lines = []
    for s in summaries[1:]:
        found = accuracy_gap(summaries[0], s)
        if found is None:
            continue
        gap, se = found
        verdict = "within 2 SE: this one seed does not tell them apart" if abs(gap) <= 2 * se else "beyond 2 SE"
        lines.append(f"- {label(s)} against {label(summaries[0])}: final accuracy {gap:+.2f} points, the evaluation's "
                     f"standard error {se:.2f} points ({s['eval_examples']} test examples): {verdict}")  # fmt: skip
    return lines


def seeds_table(groups: list[list[dict[str, Any]]]) -> str:
    """A markdown table of runs over several seeds, one row per strategy (``groups[i]``: its summaries, one per seed,
    in the same seed order for every strategy): each figure the mean over seeds with its 95 % interval; the gap and
    the speedups are against the first strategy's run of the same seed, time and speedup to target over the seeds
    where both reached it."""
    head = ("| strategy | link | seeds | final acc | gap (points) | time to target (s) | reached target "
            "| speedup to target | speedup per round |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    first = groups[0]
    for runs in groups:
        pairs = list(zip(first, runs, strict=True))
        to_target = [ratio(b, r, "time_to_target_s") for b, r in pairs]
        cells = [
            _interval([r["final_accuracy"] for r in runs], ".4f"),
            _interval([_points(b["final_accuracy"], r["final_accuracy"]) for b, r in pairs], "+.2f"),
            _interval([r["time_to_target_s"] for r in runs if r.get("time_to_target_s") is not None], ".1f"),
            f"{sum(r.get('time_to_target_s') is not None for r in runs)} of {len(runs)}",
            _interval([x for x in to_target if x is not None], ".2f", "x"),
            _interval([ratio(b, r, "seconds_per_round") for b, r in pairs], ".2f", "x"),
        ]
        lines.append(f"| {label(runs[0])} | {runs[0]['link_profile']} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _points(base: float | None, other: float | None) -> float | None:
    return None if base is None or other is None else 100 * (other - base)


def _interval(values: list[Any], spec: str, unit: str = "") -> str:
    if not values or any(v is None for v in values):
        return "—"
    mean, low, high = mean_interval(values)
    if len(values) == 1:
        return f"{format(mean, spec)}{unit}"
    return f"{format(mean, spec)}{unit} [{format(low, spec)}, {format(high, spec)}]"


def regime_line(summary: dict[str, Any]) -> str:
    """What a run measured of its regime — the message path R, a round's training T — and what DGA can gain there
    (``strategies.dga.regime_bounds``)."""
    path_s, round_s = summary.get("message_path_s"), summary.get("round_train_s")
    where = f"{label(summary)} over {summary['link_profile']}"
    if not path_s or not round_s:
        return f"{where}: no message carried training, so R and T were not measured"
    return f"{where}: measured {regime_text(path_s, round_s)}"


def regime_text(path_s: float, round_s: float) -> str:
    """R, T, R/T and DGA's bounds there, as one clause."""
    gain, delay = regime_bounds(path_s, round_s)
    return (
        f"message path R = {path_s:.2f} s, a round's training T = {round_s:.2f} s, R/T = {path_s / round_s:.2f}: "
        f"DGA finishes rounds at most {gain:.2f}x as fast as FedAvg and hides R with D >= {delay}"
    )


def report(run_dirs: list[Path], out: Path) -> tuple[str, list[Path]]:
    runs = [load_run(d) for d in run_dirs]
    out.mkdir(parents=True, exist_ok=True)
    first = runs[0][0]
    plots = plot_runs(runs, out, f"{first['dataset']} {first['partition']}, {first['clients']} clients")
    text = table([s for s, _ in runs])
    (out / "report.md").write_text(text + "\n")
    return text, plots
