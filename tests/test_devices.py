"""Device profiles: a CPU cap slows a real torch training workload by the profile's factor, processes start
inside the cap through its argv prefix, and no cgroup is left behind. The cgroup tests need root and a cgroup
cpu controller (v1 or v2) and are skipped without them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.devices import DEVICE_PROFILES, CpuCap, DeviceError, cpu_hierarchy, device_profile

TAG = f"test{os.getpid()}"
NOBODY_UID = 65534
TOLERANCE = 0.15
TRAIN_STEPS = 100  # about 1 s of CPU time for edgefl's CNN on 28x28 images, on one core of this machine

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


def _cgroup_support() -> str:
    """Why the cgroup tests cannot run here, or "" if they can."""
    if os.geteuid() != 0:
        return "device profiles need root to create cgroups"
    try:
        cpu_hierarchy()
    except DeviceError as error:
        return str(error)
    return ""


needs_cgroups = pytest.mark.skipif(bool(_cgroup_support()), reason=_cgroup_support() or "supported")


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


def _cgroup_of(pid: int) -> str:
    """The cpu-controller cgroup path of ``pid`` ("/" is the root), from /proc/PID/cgroup."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and cpu_hierarchy()[0] == 2):
            return path
    raise AssertionError(f"no cpu cgroup line in /proc/{pid}/cgroup")


def _train(child: subprocess.Popen[str]) -> tuple[float, float]:
    child.stdin.write("go\n")
    child.stdin.flush()
    cpu_s, wall_s = map(float, child.stdout.readline().split())
    return cpu_s, wall_s


@pytest.mark.root
@needs_cgroups
def test_cap_slows_training_by_the_profile_factor() -> None:
    profile = DEVICE_PROFILES["rpi4"]
    with subprocess.Popen(
        [sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout.readline().strip() == "ready"
        uncapped_cpu_s, _ = _train(child)
        with CpuCap(profile, "train", tag=TAG) as cap:
            cap.add(child.pid)
            assert _cgroup_of(child.pid) == f"/{cap.cgroup_name}"
            capped_cpu_s, capped_wall_s = _train(child)
        assert _cgroup_of(child.pid) == "/"  # moved back to the root before the cgroup was removed
        child.stdin.close()
    assert child.returncode == 0
    # The cap's share of one core, CPU time over wall time while capped: training runs 1/fraction slower ...
    assert capped_cpu_s / capped_wall_s == pytest.approx(profile.cpu_fraction, rel=TOLERANCE)
    # ... which is at least that slowdown against the same work uncapped. Only a lower bound: the same work
    # can cost more CPU time when throttled (cold caches after each quota period), seen up to 1.25x here.
    assert capped_wall_s / uncapped_cpu_s >= (1 - TOLERANCE) / profile.cpu_fraction


@pytest.mark.root
@needs_cgroups
def test_argv_prefix_starts_a_command_inside_the_cap() -> None:
    with CpuCap(device_profile("rpi3"), "prefix", tag=TAG) as cap:
        done = subprocess.run([*cap.argv_prefix(), "cat", "/proc/self/cgroup"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert f"/{cap.cgroup_name}\n" in done.stdout
        assert cap.path is not None and cap.path.is_dir()


@pytest.mark.root
@needs_cgroups
def test_leaving_the_cap_moves_survivors_out_and_removes_it() -> None:
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as survivor:  # lives until its stdin closes
        with CpuCap(device_profile("rpi5"), "survivor", tag=TAG) as cap:
            cap.add(survivor.pid)
            path = cap.path
        assert path is not None and not path.exists()
        assert _cgroup_of(survivor.pid) == "/"
        assert survivor.poll() is None
        survivor.stdin.close()


@pytest.mark.root
@needs_cgroups
def test_without_root_a_cap_is_one_clear_line() -> None:
    os.seteuid(NOBODY_UID)
    try:
        with pytest.raises(DeviceError) as error, CpuCap(device_profile("rpi4"), "noroot", tag=TAG):
            pass
    finally:
        os.seteuid(0)
    message = str(error.value)
    assert "\n" not in message and "need root and a writable cgroup cpu controller" in message


def test_laptop_profile_is_no_cap() -> None:
    with CpuCap(device_profile("laptop"), "laptop", tag=TAG) as cap:
        cap.add(os.getpid())
        assert cap.path is None and cap.argv_prefix() == []


def test_unknown_profile_is_one_clear_line() -> None:
    with pytest.raises(DeviceError, match=r"^unknown device profile 'rpi9': known profiles are rpi3, rpi4, rpi5"):
        device_profile("rpi9")
