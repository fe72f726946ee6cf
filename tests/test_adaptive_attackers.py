"""``bench/adaptive_attackers.py``, short: two attackers of eight, adaptive from round 1 on, against the server's
own round engine. Whatever they send, no accepted update of theirs is longer than the bound allows over the honest
clients' norms, the global model stays finite, a run that honest clients can no longer train says so, and the
result names each run's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from strategies.validation import NORM_FACTOR
from tests.conftest import REPO

ROUNDS = 4


def _bench(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "bench/adaptive_attackers.py", "--seeds", "2", "--rounds", str(ROUNDS), "--out", str(out),
            *args]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_two_adaptive_attackers_stay_within_the_bound_and_the_model_stays_finite(tmp_path: Path) -> None:
    done = _bench(tmp_path, "--rules", "mean,median", "--attacks", "colluding-flip,huge-first,ratchet")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["clients"], result["attackers"], result["seeds"], result["rounds"]) == (8, [6, 7], [0, 1], ROUNDS)
    rows = {(row["rule"], row["attack"]): row for row in result["rows"]}
    assert set(rows) == {(rule, attack) for rule in ("mean", "median")
                         for attack in ("colluding-flip", "huge-first", "ratchet")}  # fmt: skip
    for row in rows.values():
        assert row["influence_bound_held"] and row["model_finite_every_round"], row
        assert row["worst_norm_over_honest"] <= NORM_FACTOR * (1 + 1e-6), row
        mean, low, high = row["accuracy_delta_points"]
        assert low <= mean <= high
    # 3e38 in every value, answered first in round 1 before any norm is known: held and clipped like the rest
    assert rows[("mean", "huge-first")]["worst_norm_over_honest"] > 1, rows[("mean", "huge-first")]
    assert result["influence_bound_held"] and result["model_finite_every_round"]
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    assert "| mean | " in (tmp_path / "result.md").read_text()


def test_under_dga_each_round_is_trained_from_the_model_d_rounds_older_and_the_bound_holds(tmp_path: Path) -> None:
    """DGA's rounds through the engine's ``assign`` (a round r − D − 1 global model for round r): every round closes,
    the attackers stay within the bound, and the rounds before any global model moved train from the start."""
    done = _bench(tmp_path, "--strategy", "dga:2", "--rules", "mean", "--attacks", "flip-at-bound")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    [row] = result["rows"]
    assert result["strategy"] == "dga:2" and row["influence_bound_held"] and row["model_finite_every_round"], row
    assert row["runs_stuck_at"] == [] and row["worst_norm_over_honest"] <= NORM_FACTOR * (1 + 1e-6), row


def test_bad_arguments_are_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, said in [(("--attacks", "flip,nonsense"), "unknown attacks"), (("--rules", "mean,krum:x"), "bad --rules"),
                       (("--norm-factors", "1"), "every norm factor above 1"),
                       (("--compress", "bogus"), "unknown codec 'bogus'")]:  # fmt: skip
        done = _bench(tmp_path, *args)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_attacks_inside_the_honest_spread_are_as_short_as_their_definitions_and_mixing_takes_them(
    tmp_path: Path,
) -> None:
    """ALIE (μ − z·σ, capped at the bound), inner-product manipulation (−0.1·μ) and the withheld baseline (μ) against
    centered clipping with nearest-neighbour mixing: none longer than its definition allows over the longest honest
    update (IPM at most a tenth, the honest mean at most one), every round finite."""
    done = _bench(tmp_path, "--rules", "centered-clip:1:nnm", "--attacks", "alie,ipm,withheld")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {row["attack"]: row for row in json.loads((tmp_path / "result.json").read_text())["rows"]}
    assert set(rows) == {"alie", "ipm", "withheld"}
    assert rows["ipm"]["worst_norm_over_honest"] <= 0.1 * (1 + 1e-5), rows["ipm"]
    assert rows["withheld"]["worst_norm_over_honest"] <= 1 + 1e-5, rows["withheld"]
    assert 0 < rows["alie"]["worst_norm_over_honest"] <= NORM_FACTOR * (1 + 1e-6), rows["alie"]
    assert all(row["model_finite_every_round"] and row["influence_bound_held"] for row in rows.values())
