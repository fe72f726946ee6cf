"""A real Flower deployment on loopback: Flower's own SuperLink and SuperNodes as separate processes, edge
agents beside them, the app submitted with ``flwr run``; then what it leaves behind (results, no processes)."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from edgefl.launcher import _flower_env
from fl_server.results import load_checkpoint
from tests.conftest import edgefl, processes_of, start_edgefl, wait_for_first_round

pytestmark = pytest.mark.federation

FAST = ["--dataset", "digits", "--partition", "iid", "--clients", "2", "--local-steps", "5", "--seed", "3"]


def test_two_supernodes_two_rounds_on_digits(run_dir: Path) -> None:
    done = edgefl("run", *FAST, "--rounds", "2", "--target-accuracy", "0.2", "--out", str(run_dir))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert {"wall_s", "test_loss", "test_accuracy", "bytes_up", "bytes_down", "client_train_s"} <= set(row)
        assert row["clients"] == [0, 1] and row["rejected"] == []
        assert all(row["client_health"][pid]["peak_rss_mb"] > 50 for pid in ("0", "1"))
        # Real serialized sizes: at least the float32 model each way, per client (digits CNN, > 10 kB).
        assert row["bytes_up"] > 2 * 4 * 10_000 and row["bytes_down"] > 2 * 4 * 10_000
    assert rows[0]["wall_s"] < rows[1]["wall_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 2 and summary["clients"] == 2
    assert summary["final_accuracy"] == rows[-1]["test_accuracy"]
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in rows)
    assert summary["link_profile"] == "loopback" and summary["link_backend"] == "loopback"
    assert summary["time_to_target_s"] is not None
    assert (run_dir / "config.toml").read_text().count("digits") == 1
    assert (run_dir / "accuracy_vs_time.png").stat().st_size > 1000
    assert (run_dir / "accuracy_vs_rounds.png").stat().st_size > 1000
    assert load_checkpoint(run_dir)[0] == 2
    assert (run_dir / "global.onnx").stat().st_size > 10_000
    assert "results:" in done.stdout


def test_dga_with_zero_delay_gives_fedavgs_global_model_bit_for_bit(tmp_path: Path) -> None:
    models = {}
    for strategy in ("fedavg", "dga:0"):
        out = tmp_path / strategy.replace(":", "-")
        done = edgefl("run", *FAST, "--rounds", "2", "--strategy", strategy, "--out", str(out))
        assert done.returncode == 0, done.stderr
        models[strategy] = load_checkpoint(out)[1]
        assert not processes_of(out)
    np.testing.assert_array_equal(models["fedavg"], models["dga:0"])


def test_ctrl_c_stops_every_process(run_dir: Path) -> None:
    proc = start_edgefl("run", *FAST, "--rounds", "50", "--out", str(run_dir))
    wait_for_first_round(proc, run_dir)
    assert processes_of(run_dir)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not processes_of(run_dir)


def test_flower_processes_find_this_pythons_scripts_without_an_activated_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SuperLink starts ``flower-superexec`` by name: it must be found when only ``.venv/bin/python`` was run."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    found = shutil.which("flower-superexec", path=_flower_env(tmp_path)["PATH"])
    assert found == str(Path(sys.executable).parent / "flower-superexec")
