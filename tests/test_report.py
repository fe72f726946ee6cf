"""Bytes and time to target in summary.json, and ``edgefl report``'s table and plots across runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from contract.run_folder import ROUNDS, SUMMARY, RunFolder, summarize, summary_bytes
from contract.settings import build_config
from edgefl.report import (
    ReportError,
    accuracy_gap,
    gap_lines,
    load_run,
    mean_interval,
    plot_seeds,
    regime_line,
    report,
    seeds_table,
)


def _run(path: Path, accuracies: list[float], bytes_per_round: int, **settings) -> Path:
    """A finished run folder whose round r took 2·r seconds and moved bytes_per_round each way."""
    path.mkdir()
    config = dataclasses.replace(build_config(target_accuracy=0.8, **settings), rounds=len(accuracies))
    folder = RunFolder(path)
    rows = []
    for r, accuracy in enumerate(accuracies, 1):
        row = {"round": r, "wall_s": 2.0 * r, "test_accuracy": accuracy, "test_loss": 1 - accuracy,
               "bytes_up": bytes_per_round, "bytes_down": bytes_per_round,
               "clients": [0, 1], "rejected": []}  # fmt: skip
        folder.append(ROUNDS, row)
        rows.append(row)
    folder.write(SUMMARY, summary_bytes(summarize(config.as_dict(), rows, [])))
    return path


def test_bytes_and_time_to_target_count_through_the_first_round_at_the_target(tmp_path: Path) -> None:
    dense = _run(tmp_path / "dense", [0.5, 0.81, 0.7, 0.9], 1_000_000)
    sparse = _run(tmp_path / "sparse", [0.4, 0.6, 0.85, 0.86], 5_000, compress="stc:0.01", compress_down="int8")
    never = _run(tmp_path / "never", [0.1, 0.2], 10)
    text, plots = report([dense, sparse, never], tmp_path / "report")
    header, _, dense_row, sparse_row, never_row = text.splitlines()
    assert "MB to target" in header and "fewer bytes to target" in header
    assert "| 4.000 | 1.00x | 1.00x |" in dense_row  # 2 rounds x 2 MB; time and bytes ratios to itself
    # 3 rounds x 10 kB = 0.030 MB, 6 s against 4 s (0.67x), 4 MB / 30 kB = 133x fewer bytes
    assert sparse_row.startswith("| fedavg +stc:0.01/int8 |") and "| 0.030 | 0.67x | 133.33x |" in sparse_row
    assert "| — | — | — |" in never_row
    assert sorted(p.name for p in plots) == ["accuracy_vs_bytes.png", "accuracy_vs_rounds.png", "accuracy_vs_time.png"]
    assert all(p.stat().st_size > 1000 for p in plots)


def test_a_run_records_its_message_path_and_round_training_and_says_what_dga_can_gain(tmp_path: Path) -> None:
    """R is the median path of the messages that carried training (the identify message carries none), T the
    median training per round they carried; a round not evaluated (``--eval-every``) has no accuracy and the
    summary and plots skip it."""
    config = build_config(rounds=3, eval_every=2)
    assert [config.evaluates(r) for r in (1, 2, 3)] == [False, True, True]  # every 2nd, and the last
    rows = [{"round": r, "wall_s": 5.0 * r, "test_accuracy": None if r == 1 else 0.5 + 0.1 * r, "test_loss": 1.0,
             "bytes_up": 1, "bytes_down": 1, "clients": [0], "rejected": []} for r in (1, 2, 3)]  # fmt: skip
    trips = [
        {"path_s": 0.4, "train_s": 0.0, "rounds": []},
        {"path_s": 6.0, "train_s": 4.0, "rounds": [1]},
        {"path_s": 8.0, "train_s": 8.0, "rounds": [2, 3]},
        {"path_s": 10.0, "train_s": 6.0, "rounds": [4, 5, 6]},
    ]
    summary = summarize(config.as_dict(), rows, trips)
    assert (summary["message_path_s"], summary["round_train_s"]) == (8.0, 4.0)
    assert (summary["final_accuracy"], summary["best_accuracy"]) == (0.8, 0.8)
    counted = [{**row, "eval_examples": 0 if row["test_accuracy"] is None else 500} for row in rows]
    assert summarize(config.as_dict(), counted, trips)["eval_examples"] == 500  # the examples its accuracy is of
    line = regime_line({**summary, "link_profile": "long-distance"})
    assert "R = 8.00 s" in line and "T = 4.00 s" in line and "R/T = 2.00" in line
    assert "at most 3.00x" in line and "D >= 2" in line
    assert "not measured" in regime_line({**summarize(config.as_dict(), rows, trips[:1]), "link_profile": "lan"})


def test_a_mean_over_seeds_has_its_t_interval() -> None:
    """Three seeds 1, 2, 3: mean 2, sample sd 1, t(0.975, 2 df) = 4.303, half-width 4.303/√3; one seed is its own
    interval; none is an error."""
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(4.3027 / 3**0.5, rel=1e-4) and mean - low == high - mean
    assert mean_interval([0.7]) == [0.7, 0.7, 0.7]
    narrower = mean_interval([1.0, 2.0, 3.0], level=0.5)
    assert low < narrower[1] < narrower[2] < high
    with pytest.raises(ReportError, match="no values"):
        mean_interval([])


def _summary(accuracy: float | None, *, strategy: str = "fedavg", to_target: float | None = None,
             per_round: float = 2.0, examples: int = 2000) -> dict:  # fmt: skip
    return {"strategy": strategy, "link_profile": "lan", "final_accuracy": accuracy, "eval_examples": examples,
            "time_to_target_s": to_target, "seconds_per_round": per_round}  # fmt: skip


def test_a_runs_accuracy_gap_has_the_evaluations_standard_error_and_says_when_it_is_within_two() -> None:
    """0.50 and 0.52 on 2,000 examples each: a gap of +2 points, SE √(0.25/2000 + 0.2496/2000) = 1.58 points, so
    within 2 SE; 0.60 against 0.50 is beyond. A run scored on fewer examples has the wider error."""
    gap, se = accuracy_gap(_summary(0.50), _summary(0.52))
    assert gap == pytest.approx(2.0) and se == pytest.approx(100 * (0.25 / 2000 + 0.52 * 0.48 / 2000) ** 0.5)
    assert accuracy_gap(_summary(0.5, examples=500), _summary(0.52, examples=500))[1] == pytest.approx(2 * se, rel=1e-3)
    assert accuracy_gap(_summary(0.5), _summary(None)) is None
    assert accuracy_gap(_summary(0.5, examples=0), _summary(0.5)) is None  # a run that recorded no count (older)
    near, far = gap_lines([_summary(0.50), _summary(0.52, strategy="dga:2"), _summary(0.60, strategy="dga:4")])
    assert near.startswith("- dga:2 against fedavg: final accuracy +2.00 points") and "within 2 SE" in near
    assert "+10.00 points" in far and "beyond 2 SE" in far


def test_runs_over_seeds_are_tabled_as_means_with_their_intervals_paired_by_seed() -> None:
    """DGA against FedAvg over three seeds: the gap and the speedups are per seed, against FedAvg's run of the same
    seed; the speedup to target counts only the seeds where both reached it (two of three here)."""
    fedavg = [_summary(0.80, to_target=40.0), _summary(0.82, to_target=50.0), _summary(0.78, to_target=None)]
    dga = [_summary(a, strategy="dga:2", to_target=t, per_round=1.0)
           for a, t in ((0.79, 20.0), (0.80, 25.0), (0.78, 30.0))]  # fmt: skip
    header, _, fedavg_row, dga_row = seeds_table([fedavg, dga]).splitlines()
    assert "gap (points)" in header and "reached target" in header
    assert fedavg_row.startswith("| fedavg | lan | 3 | 0.8000 [") and "| +0.00 [+0.00, +0.00] |" in fedavg_row
    gap = mean_interval([-1.0, -2.0, 0.0])
    assert f"| {gap[0]:+.2f} [{gap[1]:+.2f}, {gap[2]:+.2f}] |" in dga_row
    assert "| 3 of 3 |" in dga_row and "| 2 of 3 |" in fedavg_row
    # to target 40/20 and 50/25 (the third seed's FedAvg never reached it); per round 2 s against 1 s, every seed
    assert dga_row.endswith("| 2.00x [2.00, 2.00] | 2.00x [2.00, 2.00] |")


def test_runs_over_seeds_are_plotted_as_a_mean_in_a_band(tmp_path: Path) -> None:
    groups = []
    for strategy, base in (("fedavg", 0.5), ("dga:2", 0.6)):
        runs = []
        for seed in range(3):
            run = _run(tmp_path / f"{strategy}-{seed}", [base + 0.01 * seed, base + 0.1], 1000,
                       strategy=strategy, seed=seed)  # fmt: skip
            runs.append(load_run(run))
        groups.append(runs)
    plots = plot_seeds(groups, tmp_path, "two strategies, three seeds")
    assert sorted(p.name for p in plots) == ["accuracy_vs_bytes.png", "accuracy_vs_rounds.png", "accuracy_vs_time.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    assert groups[0][0][0]["eval_examples"] is None  # these rows, written by hand, record no count
