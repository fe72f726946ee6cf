"""Device profiles: a device core slows a real torch training workload by its share, a device is its cores with
the agent's training thread on one of its own (the training share) and its other threads and SuperNode on
messaging cores (the messaging share), and no cgroup is left behind. The cgroup tests need
root and a cgroup cpu controller (v1 or v2) and are skipped without them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.kernels import KernelSpeeds
from edge.devices import (
    MESSAGING_ROLES,
    NO_CAP,
    ROLES,
    AgentThreads,
    DeviceCaps,
    DeviceError,
    DeviceShares,
    HostFollower,
    cpu_hierarchy,
    device_profile,
    mean_speeds,
)
from tests.conftest import needs_cgroups

TAG = f"test{os.getpid()}"
NOBODY_UID = 65534
TOLERANCE = 0.15
TRAIN_STEPS = 100  # about 1 s of CPU time for edgefl's CNN on 28x28 images, on one core of this machine
PI = DeviceShares(train=0.14, message=0.27, cores=4)  # about rpi4's on this host, fixed so the test is too

# A training workload in a child process: it imports torch and warms up first, so the timed part is training
# only; then for every "go" on stdin it trains TRAIN_STEPS steps on one thread and prints "cpu_s wall_s".
WORKLOAD = f"""
import sys, time
import numpy as np, torch
from ml.models import ImageCNN
from ml.trainer import LocalTrainer
torch.set_num_threads(1)
rng = np.random.default_rng(0)
x = rng.standard_normal((512, 1, 28, 28), dtype=np.float32)
trainer = LocalTrainer(ImageCNN(28, 28, 10), x, rng.integers(0, 10, 512), 32, 0.01, 0.9, seed=0)
trainer.train_steps(5)
print("ready", flush=True)
for _ in sys.stdin:
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.train_steps({TRAIN_STEPS})
    print(time.process_time() - cpu, time.perf_counter() - wall, flush=True)
"""


def _our_cgroups() -> list[Path]:
    try:
        _, root = cpu_hierarchy()
    except DeviceError:
        return []
    return sorted(root.glob(f"edgefl-{TAG}-*"))


@pytest.fixture(autouse=True)
def no_cgroup_left() -> Iterator[None]:
    yield
    assert not _our_cgroups(), f"cgroups left behind: {_our_cgroups()}"


def _cgroup_of(pid: int, tid: int | None = None) -> str:
    """The cpu-controller cgroup path of ``pid`` (or of its thread ``tid``; "/" is the root)."""
    task = f"/proc/{pid}" if tid is None else f"/proc/{pid}/task/{tid}"
    for line in Path(f"{task}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and cpu_hierarchy()[0] == 2):
            return path
    raise AssertionError(f"no cpu cgroup line in /proc/{pid}/cgroup")


def _quota(path: Path) -> float:
    """A cgroup's CPU quota in cores."""
    if (path / "cpu.max").exists():
        quota, period = (path / "cpu.max").read_text().split()
        return int(quota) / int(period)
    return int((path / "cpu.cfs_quota_us").read_text()) / int((path / "cpu.cfs_period_us").read_text())


# A process with a second thread, standing for the agent's trainer: prints its pid and the thread's id.
THREADS = """
import os, threading
started = threading.Event()
def train():
    print(os.getpid(), threading.get_native_id(), flush=True)
    started.set()
    threading.Event().wait()
threading.Thread(target=train, daemon=True).start()
started.wait()
threading.Event().wait()
"""


def _train(child: subprocess.Popen[str]) -> tuple[float, float]:
    child.stdin.write("go\n")
    child.stdin.flush()
    cpu_s, wall_s = map(float, child.stdout.readline().split())
    return cpu_s, wall_s


@pytest.mark.root
@needs_cgroups
def test_a_device_core_slows_training_by_its_share() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout.readline().strip() == "ready"
        uncapped_cpu_s, _ = _train(child)
        with DeviceCaps(PI, "train", tag=TAG) as caps:
            caps.place("train", child.pid)
            assert _cgroup_of(child.pid) == f"/{caps.cgroup_name}/train"
            capped_cpu_s, capped_wall_s = _train(child)
        assert _cgroup_of(child.pid) == "/"  # moved back to the root before the cgroups were removed
        child.stdin.close()
    assert child.returncode == 0
    # The core's share of one host core, CPU time over wall time while capped: training runs 1/share slower ...
    assert capped_cpu_s / capped_wall_s == pytest.approx(PI.train, rel=TOLERANCE)
    # ... which is at least that slowdown against the same work uncapped. Only a lower bound: the same work
    # can cost more CPU time when throttled (cold caches after each quota period), seen up to 1.25x here.
    assert capped_wall_s / uncapped_cpu_s >= (1 - TOLERANCE) / PI.train


@pytest.mark.root
@needs_cgroups
def test_a_device_is_its_cores_and_the_training_thread_has_one_of_its_own() -> None:
    """A Pi: the device holds one training core and three messaging cores and takes precedence over host
    processes; the agent's process goes on the agent core and its training thread alone on the train core
    (``AgentThreads``)."""
    with subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True) as child:
        pid, trainer = map(int, child.stdout.readline().split())
        with DeviceCaps(PI, "threads", tag=TAG) as caps:
            AgentThreads(pid, trainer).place(caps)
            assert caps.path is not None
            assert _cgroup_of(pid, trainer) == f"/{caps.cgroup_name}/train"
            others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != trainer]
            assert others and all(_cgroup_of(pid, t) == f"/{caps.cgroup_name}/agent" for t in others)
            quotas = {role: _quota(caps.path / role) for role in ROLES}
            assert quotas["train"] == pytest.approx(PI.train, abs=1e-5)
            assert [quotas[role] for role in MESSAGING_ROLES] == [pytest.approx(PI.message, abs=1e-5)] * 2
            assert _quota(caps.path) == pytest.approx(PI.train + 3 * PI.message, abs=1e-5)
            assert int((caps.path / "cpu.shares").read_text()) > 1024  # above a host process's weight
        child.kill()


@pytest.mark.root
@needs_cgroups
def test_leaving_the_caps_moves_survivors_out_and_removes_them() -> None:
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as survivor:  # lives until its stdin closes
        with DeviceCaps(PI, "survivor", tag=TAG) as caps:
            caps.place("supernode", survivor.pid)
            path = caps.path
        assert path is not None and not path.exists()
        assert _cgroup_of(survivor.pid) == "/"
        assert survivor.poll() is None
        survivor.stdin.close()


@pytest.mark.root
@needs_cgroups
def test_without_root_a_device_is_one_clear_line() -> None:
    os.seteuid(NOBODY_UID)
    try:
        with pytest.raises(DeviceError) as error, DeviceCaps(PI, "noroot", tag=TAG):
            pass
    finally:
        os.seteuid(0)
    message = str(error.value)
    assert "\n" not in message and "need root and a writable cgroup cpu controller" in message


def test_laptop_profile_is_no_cap(tmp_path: Path) -> None:
    assert device_profile("laptop").shares() == NO_CAP
    with DeviceCaps(NO_CAP, "laptop", tag=TAG) as caps:
        caps.place("agent", os.getpid())
        caps.place_thread("train", os.getpid())
        assert caps.path is None
    AgentThreads(123, 456).save(tmp_path / "ready")
    assert AgentThreads.load(tmp_path / "ready") == AgentThreads(123, 456)


def test_unknown_profile_is_one_clear_line() -> None:
    with pytest.raises(DeviceError, match=r"^unknown device profile 'rpi9': known profiles are rpi3, rpi4, rpi5"):
        device_profile("rpi9")


def test_a_machine_that_cannot_cap_a_cpu_runs_uncapped_and_says_so_once(monkeypatch) -> None:
    """The main job asks for Raspberry Pi 4s; where no writable cgroup cpu controller exists the launcher says so
    in one line, runs uncapped, and the run's config (and summary) records why."""
    import contextlib

    from contract.settings import build_config
    from edgefl import launcher

    def no_controller() -> tuple[int, Path]:
        raise DeviceError("no cgroup cpu controller is mounted")

    monkeypatch.setattr("edge.devices.cpu_hierarchy", no_controller)
    said: list[str] = []
    with contextlib.ExitStack() as stack:
        caps, backend = launcher.device_caps(build_config(clients=2, device_profile="rpi4"), stack, said.append)
    assert backend == "uncapped: no cgroup cpu controller is mounted"
    assert len(said) == 1 and "running uncapped" in said[0]
    assert all(cap.path is None for cap in caps) and len(caps) == 2
    with contextlib.ExitStack() as stack:
        _, backend = launcher.device_caps(build_config(clients=2), stack, said.append)
    assert backend == "none" and len(said) == 1  # laptops: nothing to cap, nothing said


FAST_HOST, SLOW_HOST = KernelSpeeds(96.0, 3e-6), KernelSpeeds(12.0, 20e-6)  # rpi4's shares: tiny, then large


def _quotas(caps: DeviceCaps) -> DeviceShares:
    assert caps.path is not None
    return DeviceShares(_quota(caps.path / "train"), _quota(caps.path / "agent"), caps.shares.cores)


@pytest.mark.root
@needs_cgroups
def test_a_devices_quotas_follow_this_hosts_speed_both_ways() -> None:
    """The follower sets a device's quotas from its profile at the mean of its CPUs' latest speeds; on a slow host
    the new messaging quota is above the device's old whole quota, which cgroup v1 refuses unless the device's
    own quota is raised first, and going back down writes the children first."""
    rpi4 = device_profile("rpi4")
    probes, cpus = iter([FAST_HOST, SLOW_HOST, FAST_HOST, FAST_HOST]), os.sched_getaffinity(0)
    first, second = sorted(cpus)[0], sorted(cpus)[-1]
    with DeviceCaps(rpi4.shares(FAST_HOST), "follow", tag=TAG) as caps:
        follower = HostFollower([(caps, rpi4)], probe=lambda: next(probes))
        fast = rpi4.shares(FAST_HOST)
        assert follower.follow_once(first) == FAST_HOST and _quotas(caps) == pytest.approx(fast, abs=1e-5)
        slow = rpi4.shares(SLOW_HOST)
        assert slow.message > fast.device  # the case cgroup v1 refuses in the wrong order
        both = follower.follow_once(second)  # the other CPU slow: the mean of the two
        assert both.dgemm_gflops == pytest.approx(54.0) and both.nbody_s_per_step == pytest.approx(
            1 / (1 / 3e-6 + 1 / 20e-6) * 2
        )
        follower.follow_once(second)
        follower.follow_once(first)
        assert caps.shares == fast and _quotas(caps) == pytest.approx(fast, abs=1e-5)
        caps.set_shares(slow)
        assert _quotas(caps) == pytest.approx(slow, abs=1e-5)
        assert _quota(caps.path) == pytest.approx(slow.device, abs=1e-5)
        assert list(follower.samples) == [FAST_HOST, both, FAST_HOST, FAST_HOST]


@pytest.mark.root
@needs_cgroups
def test_the_follower_runs_while_entered_and_says_in_one_line_when_it_cannot_go_on() -> None:
    """Its thread probes every CPU before the first wait and is gone once left; a device whose cgroups vanished
    under it stops it with one line, and the run goes on."""
    rpi4, said, probed = device_profile("rpi4"), [], threading.Event()

    def probe() -> KernelSpeeds:
        probed.set()
        return FAST_HOST

    with DeviceCaps(rpi4.shares(SLOW_HOST), "thread", tag=TAG) as caps:
        with HostFollower([(caps, rpi4)], every_s=3600, probe=probe, say=said.append) as follower:
            assert probed.wait(30)
        assert not any(t.name == "edgefl-host-follower" for t in threading.enumerate())
        assert len(follower.samples) == len(os.sched_getaffinity(0)) and caps.shares == rpi4.shares(FAST_HOST)
        path = caps.path
        caps.remove()
        caps.path = path  # as if removed under the follower
        with HostFollower([(caps, rpi4)], probe=lambda: SLOW_HOST, say=said.append):
            pass
        caps.path = None
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("device quotas no longer follow this host's speed: cannot set the quota of cgroup")


def test_a_thread_on_cpus_of_different_speeds_runs_at_the_mean_of_their_rates() -> None:
    mean = mean_speeds([KernelSpeeds(40.0, 4e-6), KernelSpeeds(60.0, 12e-6)])
    assert mean.dgemm_gflops == 50.0 and mean.nbody_s_per_step == pytest.approx(6e-6)
    assert HostFollower([(DeviceCaps(NO_CAP, "laptop"), device_profile("laptop"))]).devices == []
