"""A real Flower deployment on loopback: Flower's own SuperLink and SuperNodes as separate processes, an edge
agent beside each serving its SuperNode's tasks, the app submitted with ``flwr run``; then what it leaves behind
(results, no processes)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from contract.run_folder import RunFolder, read_rounds
from contract.settings import parse_partition
from edge.devices import cpu_hierarchy
from edgefl.launcher import flower_env
from fl_client.tasks import TaskTiming
from fl_server.app import STARTED
from ml.data import load_dataset
from ml.models import build_model, get_flat_params, set_flat_params
from ml.partition import partition_indices
from tests.conftest import edgefl, processes_of, start_edgefl, wait_for_rows

pytestmark = pytest.mark.federation

FAST = ["--dataset", "digits", "--partition", "iid", "--clients", "2", "--local-steps", "5", "--seed", "3"]


def _tasks(run_dir: Path, client: int) -> list[TaskTiming]:
    """The tasks the agent of ``client`` served, from its log (one process: one log)."""
    return TaskTiming.from_log((run_dir / "logs" / f"agent-{client}.log").read_text())


def test_two_supernodes_three_rounds_on_digits(run_dir: Path) -> None:
    done = edgefl("run", *FAST, "--rounds", "3", "--target-accuracy", "0.2", "--out", str(run_dir))
    assert done.returncode == 0, done.stderr
    rows = read_rounds(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"wall_s", "test_loss", "test_accuracy", "bytes_up", "bytes_down", "client_train_s"} <= set(row)
        assert row["clients"] == [0, 1] and row["rejected"] == []
        assert all(row["client_health"][pid]["peak_rss_mb"] > 50 for pid in ("0", "1"))
        # Real serialized sizes: at least the float32 model each way, per client (digits CNN, > 10 kB),
        # except round 1's broadcast: clients build the seeded start model, the server sends its seed and hash.
        assert row["bytes_up"] > 2 * 4 * 10_000
        assert (row["bytes_down"] < 2 * 4 * 10_000) == (row["round"] == 1)
    assert rows[0]["wall_s"] < rows[1]["wall_s"] < rows[2]["wall_s"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 3 and summary["clients"] == 2
    assert summary["final_accuracy"] == rows[-1]["test_accuracy"]
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in rows)
    assert summary["link_profile"] == "loopback" and summary["link_backend"] == "loopback"
    assert summary["time_to_target_s"] is not None and summary["transport"] == "fast"
    assert (run_dir / "config.toml").read_text().count("digits") == 1
    assert (run_dir / "accuracy_vs_time.png").stat().st_size > 1000
    assert (run_dir / "accuracy_vs_rounds.png").stat().st_size > 1000
    assert RunFolder(run_dir).read_checkpoint().round == 3
    assert (run_dir / "global.onnx").stat().st_size > 10_000
    assert "results:" in done.stdout
    assert f"this ServerApp process: {STARTED[True]}" in (run_dir / "server.log").read_text()
    # Every message was answered by the one agent process of its client, none by a process of its own.
    messages = read_rounds(run_dir, "messages.jsonl")
    assert all(m["objects_down"] == m["objects_up"] == 3 for m in messages)
    assert sorted(len(m["rounds"]) for m in messages) == [0, 0, 1, 1, 1, 1, 1, 1]  # who are you?, then 3 rounds
    for client in (0, 1):
        served = {t.message_id for t in _tasks(run_dir, client)}
        assert served == {m["message_id"] for m in messages if m["partition"] == client}
        assert (run_dir / "logs" / f"agent-{client}.log").read_text().count("new session") == 1
    # And the global model is FedAvg's, as written independently below.
    np.testing.assert_allclose(RunFolder(run_dir).read_checkpoint().params, fedavg_3_rounds(), rtol=1e-5, atol=1e-6)


def _fedavg_written_here(rounds: int, steps: int, lr: float, momentum: float, seed: int) -> np.ndarray:
    """FedAvg as the paper writes it, independently of edgefl's engine and agent: each of 2 clients runs K
    steps of torch SGD (its momentum kept across rounds, its minibatches a seeded reshuffle per epoch) from the
    global model; the server adds the example-weighted mean of their updates."""
    dataset = load_dataset("digits")
    parts = partition_indices(dataset, parse_partition("iid"), 2, seed)
    models = [build_model(dataset, seed) for _ in parts]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    rngs = [np.random.default_rng(seed * 1000 + pid) for pid in range(2)]
    orders, positions = [rng.permutation(len(idx)) for rng, idx in zip(rngs, parts, strict=True)], [0, 0]
    global_params = get_flat_params(models[0])
    for _ in range(rounds):
        total = np.zeros(global_params.size, dtype=np.float64)
        for pid, (model, optimizer, idx) in enumerate(zip(models, optimizers, parts, strict=True)):
            set_flat_params(model, global_params)
            x, y = torch.from_numpy(dataset.x_train[idx]), torch.from_numpy(dataset.y_train[idx])
            for _ in range(steps):
                if positions[pid] + 32 > len(idx):
                    orders[pid], positions[pid] = rngs[pid].permutation(len(idx)), 0
                batch = torch.from_numpy(orders[pid][positions[pid] : positions[pid] + 32])
                positions[pid] += 32
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
            total += len(idx) * (get_flat_params(model) - global_params)
        global_params = (global_params + (total / sum(len(i) for i in parts)).astype(np.float32)).astype(np.float32)
    return global_params


@functools.cache
def fedavg_3_rounds() -> np.ndarray:
    """The FAST settings' 3 rounds of FedAvg (lr 0.05, momentum 0.9, seed 3), written here."""
    return _fedavg_written_here(rounds=3, steps=5, lr=0.05, momentum=0.9, seed=3)


@pytest.mark.xdist_group("federation-2-loopback")
def test_dga_with_zero_delay_is_fedavg_in_the_deployment(run_dir: Path, shared_federation) -> None:
    settings = {"partition": "iid", "local_steps": 5, "seed": 3, "eval_examples": 100}  # FAST's
    shared_federation(2).run(run_dir, **settings, rounds=3, strategy="dga:0")
    np.testing.assert_allclose(RunFolder(run_dir).read_checkpoint().params, fedavg_3_rounds(), rtol=1e-5, atol=1e-6)


HELD_QUOTA_US, HELD_PERIOD_US = 1_000, 1_000_000  # 0.1 % of a core: the smallest share a cgroup can give


@contextlib.contextmanager
def _starved(core: Path, version: int) -> Iterator[None]:
    """While inside: the threads on the emulated device core whose cgroup is ``core`` run at 0.1 % of a core, in a
    cgroup of the test's own inside it (the run's ``HostFollower`` sets the core's own quota again every 2 s and
    would undo a quota written there); then they go back to the core and that cgroup is removed."""
    threads = "tasks" if version == 1 else "cgroup.threads"
    held = core / f"held-{os.getpid()}"
    held.mkdir()
    try:
        if version == 1:  # a longer period first: the quota may not exceed it
            (held / "cpu.cfs_period_us").write_text(str(HELD_PERIOD_US))
            (held / "cpu.cfs_quota_us").write_text(str(HELD_QUOTA_US))
        else:
            (held / "cgroup.type").write_text("threaded")
            (held / "cpu.max").write_text(f"{HELD_QUOTA_US} {HELD_PERIOD_US}")
        for tid in (core / threads).read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (held / threads).write_text(tid)
        yield
    finally:
        for tid in (held / threads).read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (core / threads).write_text(tid)
        held.rmdir()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the rpi3 device profile's CPU cap needs root (cgroups)")
def test_a_round_longer_than_flowers_task_heartbeat_timeout_completes(run_dir: Path) -> None:
    """Flower fails a task that sends no heartbeat for 60 s; the agent's task heartbeats keep a long one alive. The
    round is long because its device's training thread (on a Raspberry Pi 3's training core, a cgroup CPU cap) is
    held to 0.1 % of a core for 64 s from the moment it is placed there, while the agent's other threads go on: a
    device starved of CPU, whatever this machine's speed, not one that burns a core of the machine for a
    minute. The launcher places the thread once the run is submitted: the round it holds is round 1 if that had
    not ended by then, else round 2."""
    timeout_s = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL
    args = ["--dataset", "digits", "--partition", "iid", "--clients", "1", "--rounds", "2", "--local-steps", "100"]
    proc = start_edgefl("run", *args, "--device-profile", "rpi3", "--eval-examples", "100", "--out", str(run_dir))
    version, root = cpu_hierarchy()
    core = root / f"edgefl-{proc.pid}-device-0" / "train"  # edgefl.launcher.device_caps's, under its pid
    threads, deadline = core / ("tasks" if version == 1 else "cgroup.threads"), time.monotonic() + 120
    while not (threads.exists() and threads.read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the agent's training thread was not placed on its core within 120 s"
        time.sleep(0.01)
    with _starved(core, version):
        until = time.monotonic() + timeout_s + 4  # the fault's length, as a link's outage is timed
        while time.monotonic() < until:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    trained = [m["train_s"] for m in read_rounds(run_dir, "messages.jsonl") if m["rounds"]]
    assert len(trained) == 2 and max(trained) > timeout_s, f"no round was long enough to test anything: {trained}"
    assert [r["rejected"] for r in read_rounds(run_dir)] == [[], []]


def test_a_failed_evaluation_stops_the_run_in_one_line_and_keeps_the_checkpoint(run_dir: Path) -> None:
    """A round's row and checkpoint are written by the evaluation thread: when that fails (here the checkpoint's
    temporary file cannot be written), the run stops with the error instead of going on without its rows."""
    proc = start_edgefl("run", *FAST, "--rounds", "200", "--eval-examples", "100", "--out", str(run_dir))
    wait_for_rows(run_dir, 1, "round 1", proc=proc)
    while not (run_dir / "checkpoint.npz").exists():  # round 1's is written right after its row
        assert proc.poll() is None
        time.sleep(0.05)
    (run_dir / "checkpoint.npz.tmp.npz").mkdir()  # where the next checkpoint is written first
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "the server failed" in err and "IsADirectoryError" in err, err
    checkpoint_round = RunFolder(run_dir).read_checkpoint().round
    assert 1 <= checkpoint_round < 200
    assert not (run_dir / "summary.json").exists()
    assert not processes_of(run_dir)


def test_ctrl_c_stops_every_process(run_dir: Path) -> None:
    proc = start_edgefl("run", *FAST, "--rounds", "200", "--out", str(run_dir))
    wait_for_rows(run_dir, 1, "round 1", proc=proc)
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
    found = shutil.which("flower-superexec", path=flower_env(tmp_path)["PATH"])
    assert found == str(Path(sys.executable).parent / "flower-superexec")


def test_compare_over_two_seeds_runs_each_strategy_per_seed_on_one_federation_and_tables_the_means(
    run_dir: Path,
) -> None:
    """``edgefl compare --seeds 2``: FedAvg and DGA each over seeds 3 and 4 on one local federation (each run's
    folder ``STRATEGY/seed-S``, its seed in its summary); the report's table has one row per strategy with the means
    over the two seeds and a row per run beneath, and the plots a band."""
    done = edgefl("compare", *FAST, "--rounds", "2", "--profile", "lan", "--strategies", "fedavg,dga:1",
                  "--seeds", "2", "--device-profile", "laptop", "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    for strategy in ("fedavg", "dga-1"):
        for seed in (3, 4):
            summary = json.loads((run_dir / "lan" / strategy / f"seed-{seed}" / "summary.json").read_text())
            assert summary["seed"] == seed and summary["rounds"] == 2 and summary["eval_examples"] > 0
    means, *seeds = (run_dir / "report.md").read_text().split("\nSeed ")
    assert [seed.split(" ", 1)[0] for seed in seeds] == ["3", "4"]  # a table of each seed's runs, paired
    runs = "".join(seeds)
    assert means.startswith("### lan, 2 seeds\n\n| strategy | link | seeds | final acc | gap (points) |")
    mean_rows = [line for line in means.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[:3] for row in mean_rows] == [["| fedavg", "lan", "2"], ["| dga:1", "lan", "2"]]
    assert mean_rows[0].split(" | ")[4] == "+0.00 [+0.00, +0.00]"  # FedAvg's gap to itself, seed by seed
    run_rows = [line for line in runs.splitlines() if line.startswith("| fedavg") or line.startswith("| dga:1")]
    assert len(run_rows) == 4
    assert (run_dir / "lan" / "accuracy_vs_rounds.png").stat().st_size > 1000
