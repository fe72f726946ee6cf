"""``--federation simulation``: Flower's Simulation Engine (real Ray, real ClientApps) running edgefl's own round
engine and agent session, on the virtual clock of ``netem.clock``."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from contract.kernels import host_speeds
from contract.run_folder import RunFolder, read_rounds
from contract.settings import ConfigError, build_config
from edge.devices import device_profile
from edgefl import cli
from edgefl.processes import free_port
from netem.clock import (
    DEVICE_FIXED_S,
    DEVICE_S_PER_MB,
    KEEPALIVE_S,
    MESSAGE_FIXED_S,
    MESSAGE_RTTS,
    POOLED_CONNECTIONS,
    ClientModel,
    ClientTimeline,
    MessagePath,
    client_models,
    cold_share,
    fit_message_terms,
    rate_bps,
    slow_start_s,
)
from netem.profiles import BUILTIN_LINKS
from strategies.sampling import Sampler
from tests.conftest import edgefl, processes_of, start_edgefl, wait_for_rows

DIGITS = ["--dataset", "digits", "--partition", "iid", "--local-steps", "3"]
ONE_RAY = pytest.mark.xdist_group("ray")  # on one pytest-xdist worker, one after another: one Ray at a time


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A Ray head on this machine, started as a user starts one for ``--ray-address`` (``ray start --head``, here
    ``--block`` so that its processes end with it), that the simulations below join instead of starting Ray each;
    its address. Stopped after the last (SIGTERM: Ray stops every process it started), and found to leave nothing
    running in its session. The Ctrl-C test starts Ray itself: that its run stops Ray is what it tests."""
    temp_dir = tempfile.mkdtemp(prefix="efl-ray-")  # short: Ray's sockets live under it (a 107-byte path limit)
    port, output = free_port(), Path(temp_dir, "ray-start.log")
    with output.open("wb") as log:
        head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address",
             "127.0.0.1", "--port", str(port), "--num-cpus", str(os.cpu_count()), "--include-dashboard", "false",
             "--disable-usage-stats", "--temp-dir", temp_dir],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not Path(temp_dir, "ray_current_cluster").exists():  # written once the head is up
            assert head.poll() is None, f"ray start exited {head.returncode}: {output.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the Ray head did not come up within 120 s"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        head.wait(timeout=60)
        deadline = time.monotonic() + 30  # Ray's agents notice their raylet is gone and exit on their own
        while (left := _in_session(head.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"the Ray head left processes running: {left}"


def _in_session(session: int) -> list[int]:
    """The live processes of session ``session`` (Ray's processes stay in the session ``ray start`` began; their
    command lines are renamed ``ray::...``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state, _, _, sid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:4]
        except OSError:
            continue
        if int(sid) == session and state != "Z":
            found.append(int(pid))
    return found


def test_the_clock_adds_fixed_cost_round_trips_transfer_and_training() -> None:
    """rural-lte: 100 ms RTT, 1 Mbit/s up, 4 down, 0.5 % loss. TCP's loss bound (Mathis) is
    1448·8 / 0.1 · √1.5 / √0.005 = 2,006,406 bit/s: it binds down (4 Mbit/s), not up (1 Mbit/s). The device's
    own handling of the 0.15 MB takes 1/share as long on a device of that share of this host's core."""
    link = BUILTIN_LINKS["rural-lte"]
    assert rate_bps(link.down, 0.1) == pytest.approx(2_006_406, rel=1e-6)
    assert rate_bps(link.up, 0.1) == 1e6
    assert rate_bps(BUILTIN_LINKS["lan"].up, 0.0) == math.inf
    device = DEVICE_FIXED_S + DEVICE_S_PER_MB * 0.15
    for share in (1.0, 0.144):
        cycle = ClientModel(link, 0.1, share).cycle_s(bytes_down=100_000, steps=10, bytes_up=50_000, cycle_index=3)
        expected = MESSAGE_FIXED_S + device / share + 5 * 0.1 + 800_000 / 2_006_406 + 0.4 + 1.0
        assert cycle == pytest.approx(expected, rel=1e-6)
    assert MESSAGE_RTTS == 5


def test_slow_start_costs_a_model_round_trips_where_the_path_holds_more_than_the_initial_window() -> None:
    """IW = 10 · 1448 = 14,480 B, doubling: 14,480 + 28,960 + 57,920 + 115,840 = 217,200 B go in 4 round trips
    before the rest of a 424 kB model (206,800 B) fits the next window (231,680 B)."""
    assert slow_start_s(424_000, math.inf, 0.3) == pytest.approx(4 * 0.3)
    # 30 Mbit/s: the 4 round trips carried 217,200 B that a warm window sends at the rate anyway
    assert slow_start_s(424_000, 30e6, 0.3) == pytest.approx(1.2 - 8 * 217_200 / 30e6)
    # the path holds less than the initial window (home-wifi: 30 Mbit/s · 2 ms = 7.5 kB), or one window is enough
    assert slow_start_s(424_000, 30e6, 0.002) == 0.0
    assert slow_start_s(10_000, math.inf, 0.3) == 0.0
    assert slow_start_s(424_000, math.inf, 0.0) == 0.0
    long_distance = ClientModel(BUILTIN_LINKS["long-distance"], step_s=0.05)
    cycles = [long_distance.cycle_s(424_000, 20, 424_000, cycle_index=i) for i in range(POOLED_CONNECTIONS + 1)]
    assert cycles[:-1] == [pytest.approx(cycles[-1] + 2 * 1.2)] * POOLED_CONNECTIONS


def test_a_device_is_slower_by_its_shares_of_a_core() -> None:
    """Training at the training core's share, a message cycle's own work at the messaging cores'."""
    rpi4, laptop = device_profile("rpi4"), device_profile("laptop")
    shares = rpi4.shares()
    assert rpi4.step_s(0.01) == pytest.approx(0.01 / shares.train)
    assert laptop.step_s(0.01) == 0.01
    models = client_models([BUILTIN_LINKS["lan"]] * 2, [rpi4, laptop], 0.01)
    assert [m.step_s for m in models] == [rpi4.step_s(0.01), 0.01]
    assert [m.share for m in models] == [shares.message, 1.0]


def test_a_mixed_fleet_repeats_its_lists_over_the_clients() -> None:
    from netem.fleet import devices_for, links_for

    config = build_config(clients=5, profile="home-wifi,long-distance", device_profile="rpi3,rpi4,laptop")
    assert [link.name for link in links_for(config)] == ["home-wifi", "long-distance"] * 2 + ["home-wifi"]
    assert [d.name for d in devices_for(config)] == ["rpi3", "rpi4", "laptop", "rpi3", "rpi4"]
    with pytest.raises(ConfigError, match="3 device profiles for 2 clients"):
        devices_for(build_config(clients=2, device_profile="rpi3,rpi4,laptop"))


@pytest.mark.federation
@ONE_RAY
@pytest.mark.parametrize("strategy", ["fedavg", "fedprox:0.1", "scaffold"])
def test_a_simulation_and_a_deployment_train_the_same_global_model(
    tmp_path: Path, run_dir: Path, strategy: str, shared_federation, ray_head: str
) -> None:
    """Same seed, clients and sampling (3 clients, 2 a round): the deployment (SuperLink, SuperNodes, edge agents)
    and the simulation (Ray actors, sessions kept in Flower's node state) end on the same global model — and, for
    SCAFFOLD, on the same control variates, each client's sent with its global models both ways. The three
    deployed runs share one federation, as ``edgefl compare``'s do."""
    common = [*DIGITS, "--clients", "3", "--clients-per-round", "2", "--rounds", "3", "--strategy", strategy]
    settings = {"partition": "iid", "local_steps": 3, "clients_per_round": "2", "rounds": 3, "strategy": strategy}
    shared_federation(3).run(tmp_path / "deployed", **settings)  # DIGITS and common, as build_config's keywords
    simulated = edgefl("run", *common, "--federation", "simulation", "--ray-address", ray_head, "--out", str(run_dir))
    assert simulated.returncode == 0, simulated.stderr
    a, b = RunFolder(tmp_path / "deployed").read_checkpoint(), RunFolder(run_dir).read_checkpoint()
    assert a.round == b.round == 3
    np.testing.assert_array_equal(a.params, b.params)
    assert sorted(a.strategy) == sorted(b.strategy) == ([] if strategy != "scaffold" else ["c", "c/0", "c/1", "c/2"])
    for key in a.strategy:
        np.testing.assert_array_equal(a.strategy[key], b.strategy[key])
    sampler = Sampler(0, 3, 2)
    assert [r["clients"] for r in read_rounds(run_dir)] == [sorted(sampler.clients(t)) for t in (1, 2, 3)]
    assert json.loads((run_dir / "summary.json").read_text())["transport"] == "simulation"


@pytest.mark.federation
@ONE_RAY
def test_fedbuff_takes_updates_in_the_order_the_clock_gives_them_and_ctrl_c_stops_ray(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedBuff, one update a step, a laptop on a LAN beside a Raspberry Pi 3 on an IoT uplink, the clock's unit
    pinned: every message's modelled round trip is the clock's formula for its bytes and steps, and the fast
    client makes most steps. Ctrl-C then stops the simulation and every Ray process with it. The device's shares
    come from this host's speed, measured once into a cache of the test's own that the run and the test both read
    (a run measuring it again, the entry ten minutes old, gave an rpi3 share 1.5 % off the test's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    host_speeds(max_age_s=0)
    proc = start_edgefl("run", *DIGITS, "--clients", "2", "--rounds", "500", "--strategy", "fedbuff:1",
                        "--federation", "simulation", "--profile", "lan,iot-uplink", "--device-profile", "laptop,rpi3",
                        "--clock-step-s", "0.01", "--out", str(run_dir))  # fmt: skip
    wait_for_rows(run_dir, 8, proc=proc)
    running = processes_of(run_dir)
    assert any("raylet" in line for line in running), running  # Ray's processes carry the run's environment
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert not processes_of(run_dir)
    models = client_models(
        [BUILTIN_LINKS["lan"], BUILTIN_LINKS["iot-uplink"]], [device_profile("laptop"), device_profile("rpi3")], 0.01
    )
    trips = sorted((m for m in read_rounds(run_dir, "messages.jsonl") if m["rounds"]), key=lambda m: m["sent_at"])
    made = Counter()
    for trip in trips:
        index, made[trip["partition"]] = made[trip["partition"]], made[trip["partition"]] + 1
        steps = 3 * len(trip["rounds"])
        expected = models[trip["partition"]].cycle_s(trip["bytes_down"], steps, trip["bytes_up"], cycle_index=index)
        assert trip["round_trip_s"] == pytest.approx(expected, rel=1e-9)
    rows = read_rounds(run_dir)[:8]
    assert [r["round"] for r in rows] == list(range(1, 9))
    fast_steps = sum(r["clients"] == [0] for r in rows)
    assert fast_steps > 8 - fast_steps
    assert [r["wall_s"] for r in rows] == sorted(r["wall_s"] for r in rows)


@pytest.mark.federation
@ONE_RAY
def test_a_round_deadline_passes_at_its_modelled_time(run_dir: Path, ray_head: str) -> None:
    """A laptop on a LAN answers in about half a modelled second, a Pi 3 on an IoT uplink in several (the fixed cost,
    five 200 ms round trips, ~150 kB up at 0.25 Mbit/s, its own handling of both messages at its share of a core):
    with a 1 s deadline and a quorum of one, every round closes at its deadline, on the clock, with the laptop's
    update only — the Pi's arrives late and is refused."""
    done = edgefl("run", *DIGITS, "--clients", "2", "--rounds", "12", "--round-deadline-s", "1", "--quorum", "0.5",
                  "--federation", "simulation", "--ray-address", ray_head, "--profile", "lan,iot-uplink",
                  "--device-profile", "laptop,rpi3", "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = read_rounds(run_dir)
    assert [(r["clients"], r["closed_by"]) for r in rows] == [([0], "deadline")] * 12
    assert [r["wall_s"] for r in rows] == pytest.approx([float(i) for i in range(1, 13)])
    assert any("late" in rejection["reason"] for r in rows for rejection in r["rejected"])


def test_simulation_bad_input_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, edgefl_main) -> None:
    more = edgefl_main("run", *DIGITS, "--clients", "4", "--clients-per-round", "5", "--federation", "simulation")
    assert more.returncode == 2 and "more than the run's 4 clients" in more.stderr
    huge = edgefl_main("run", *DIGITS, "--clients", "5000", "--federation", "simulation")
    assert huge.returncode == 2 and "5000 partitions" in huge.stderr and len(huge.stderr.strip().splitlines()) == 1
    remote_only = edgefl_main("run", *DIGITS, "--federation", "simulation", "--insecure")
    assert remote_only.returncode == 2 and "for --federation remote" in remote_only.stderr
    simulation_only = edgefl_main("run", *DIGITS, "--clock-step-s", "0.01")
    assert simulation_only.returncode == 2 and "for --federation simulation" in simulation_only.stderr
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="needs Ray"):
        cli.preflight(build_config(dataset="digits", partition="iid", federation="simulation"))


def test_a_pipelined_client_trains_round_after_round_and_waits_only_at_the_staleness_bound() -> None:
    """The deployment's agent as the clock times it, one client on a lan (its way down and up half the fixed cost and
    the device's work each) with rounds of 1 s: D = 2 hides the path — a round every second — while D = 0 (FedAvg)
    waits the whole path for each global model."""
    model = ClientModel(BUILTIN_LINKS["lan"], step_s=0.1)
    down, up = model.down_s(0, 9), model.up_s(0, 9)
    for delay, expected_starts in [(2, [0.0, 1.0, 2.0, 3.0]), (0, None)]:
        timeline = ClientTimeline(model, steps=10, delay=delay)
        timeline.cycles = 9  # warm connections: no slow start
        timeline.arrivals.append((0.0, 0))
        starts = []
        for closed in range(1, 5):
            start = timeline.start_s()
            starts.append(start)
            arrival = timeline.train(start, 0)  # one client: its update closes the round on arrival
            timeline.global_sent(arrival, closed, 0)
        if expected_starts:
            assert starts == pytest.approx(expected_starts)  # hidden: up + down (< 1 s) ≤ D rounds
        else:
            assert starts == pytest.approx([i * (1.0 + up + down) for i in range(4)])  # lock-step
    assert timeline.newest_by(0.0) == 0 and timeline.newest_by(math.inf) == 4


@pytest.mark.federation
@ONE_RAY
def test_a_simulated_dga_runs_the_deployments_pipeline(run_dir: Path, ray_head: str) -> None:
    """DGA with every client in every round is timed as the agent's pipeline (``ClientTimeline``): each message
    asks for one round, held for and recorded as training exactly that round's modelled time on its device. With
    D as long as the run no round waits for a global model, and the laptop on a lan (no slow start there), whose
    rounds take longer than its messaging cores' work on a round's messages (the queue they are), trains its rounds
    back to back: one trainer, one round after the other."""
    done = edgefl("run", *DIGITS, "--clients", "2", "--rounds", "8", "--strategy", "dga:8",
                  "--federation", "simulation", "--ray-address", ray_head, "--profile", "lan,long-distance",
                  "--device-profile", "laptop,rpi4", "--clock-step-s", "0.2", "--out", str(run_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["clock"]["pipelined"] and summary["rounds"] == 8
    step_s = {0: 0.2, 1: device_profile("rpi4").step_s(0.2)}
    assert summary["round_train_s"] == pytest.approx(3 * (step_s[0] + step_s[1]) / 2)  # the median of 8 + 8 rounds
    trips = [m for m in read_rounds(run_dir, "messages.jsonl") if m["rounds"]]
    assert trips and all(len(m["rounds"]) == 1 for m in trips)
    for partition, step in step_s.items():
        mine = sorted((m for m in trips if m["partition"] == partition), key=lambda m: m["rounds"][0])
        assert [m["rounds"][0] for m in mine] == list(range(1, 9))
        assert [m["held_s"] for m in mine] == pytest.approx([3 * step] * len(mine))
        assert [m["train_s"] for m in mine] == pytest.approx([3 * step] * len(mine))  # the device's, not Ray's
    laptop = sorted((m for m in trips if m["partition"] == 0), key=lambda m: m["rounds"][0])
    ends = [m["sent_at"] + m["round_trip_s"] for m in laptop]  # arrival = start + training + the way up
    work = ClientModel(BUILTIN_LINKS["lan"], 0.2)
    assert work.device_s(laptop[-1]["bytes_down"]) + work.device_s(laptop[-1]["bytes_up"]) < 3 * 0.2  # < a round
    assert np.diff(ends) == pytest.approx([3 * 0.2] * (len(ends) - 1), abs=1e-6)  # back to back: nothing waited


def test_the_message_terms_are_recovered_from_the_cpu_and_path_of_two_message_sizes() -> None:
    """``bench/calibration.py --fit``'s arithmetic: a device's CPU a cycle and paths made from known terms give them
    back."""
    fixed, device_fixed, per_mb, share = 0.2, 0.05, 0.01, 0.36

    def path(megabytes: float) -> MessagePath:
        cpu = device_fixed + per_mb * megabytes
        return MessagePath(megabytes, fixed + cpu / share, cpu, share)

    assert fit_message_terms(path(0.85), path(6.6)) == pytest.approx((fixed, device_fixed, per_mb))


def test_a_model_coming_down_waits_for_the_messaging_cores_an_update_going_up_holds() -> None:
    """The device's messaging cores are one queue: a global model that lands while the last update's handling still
    holds them (DGA's pipeline: a model comes down as an update goes up) is the device's only once that is done."""
    model = ClientModel(BUILTIN_LINKS["lan"], step_s=0.1, share=0.01)  # a device this slow: its handling dominates
    handling = model.device_s(1_000_000)
    timeline = ClientTimeline(model, steps=10, delay=2)
    timeline.cycles = 9
    arrival = timeline.train(0.0, 1_000_000)  # trained by 1 s; its handling holds the cores from then
    assert arrival == pytest.approx(1.0 + handling + model.up_link_s(1_000_000, 9, 1.0))
    landed = 1.0 - model.down_link_s(1_000_000, 9)  # lands on the device as the update's handling starts
    timeline.global_sent(landed, 1, 1_000_000)
    assert timeline.arrivals[-1] == (pytest.approx(1.0 + 2 * handling), 1)  # after the update's handling, not at 1 s
    alone = ClientTimeline(model, steps=10, delay=2, cycles=9)
    alone.global_sent(landed, 1, 1_000_000)
    assert alone.arrivals[-1][0] == pytest.approx(1.0 + handling)


def test_a_model_pays_slow_start_again_once_its_connections_sat_idle() -> None:
    """Past a client's first three cycles a model's transfer is warm while a model went either way within the
    keep-alive (``KEEPALIVE_S``); after that the pooled connections are closed but the one the polls keep, so it pays
    (C − 1)/C of slow start in expectation."""
    assert [cold_share(i, 0.0) for i in range(4)] == [1.0, 1.0, 1.0, 0.0]
    assert cold_share(3, KEEPALIVE_S + 0.1) == pytest.approx(2 / 3)
    model = ClientModel(BUILTIN_LINKS["long-distance"], step_s=0.05)
    warm, idle = model.down_s(424_000, 5, idle_s=1.0), model.down_s(424_000, 5, idle_s=KEEPALIVE_S + 1)
    assert idle - warm == pytest.approx(2 / 3 * slow_start_s(424_000, math.inf, 0.3))


@pytest.mark.parametrize("round_s, update_cold", [(KEEPALIVE_S - 1, False), (KEEPALIVE_S + 1, True)])
def test_fedavgs_connections_stay_open_while_its_models_alternate_within_the_keep_alive(
    round_s: float, update_cold: bool
) -> None:
    """The pooled connections carry both ways' models: FedAvg's global model comes down right after the update went
    up, so it is warm however long the round; the update goes up a round's training after the model came down, so
    it pays (C − 1)/C of slow start only when the round trains past the keep-alive (as on the testbed, where a
    connection kept open keeps its window: ``bench/idle_transfer.py``)."""
    model = ClientModel(BUILTIN_LINKS["long-distance"], step_s=round_s / 10)
    timeline = ClientTimeline(model, steps=10, delay=0, cycles=POOLED_CONNECTIONS)
    size, handling = 3_300_000, model.device_s(3_300_000)
    timeline.global_sent(0.0, 0, size)
    start = timeline.start_s()
    assert start == pytest.approx(model.down_link_s(size, POOLED_CONNECTIONS) + handling)  # warm
    arrival = timeline.train(start, size)
    cold = 2 / 3 * slow_start_s(size, math.inf, 0.3) if update_cold else 0.0
    warm_up = model.up_link_s(size, POOLED_CONNECTIONS)
    assert arrival == pytest.approx(start + round_s + handling + warm_up + cold)
    timeline.global_sent(arrival + 0.1, 1, size)  # the next round's model, just after the server aggregated
    assert timeline.arrivals[-1][0] == pytest.approx(arrival + 0.1 + model.down_link_s(size, 4) + handling)
    cycle = model.cycle_s(size, 10, size, POOLED_CONNECTIONS, idle_s=0.1)  # the same without the pipeline
    assert cycle == pytest.approx(start + round_s + handling + warm_up + cold)
