"""Device profiles: the devices a run may emulate (``--device-profile``), each a number of cores and its speed on
the reference kernels (``contract.kernels``), from which each kind of work gets its own share of a core of this
host. The cgroups that cap a device's CPU are ``edge.devices``'s; the fleet and a simulation's clock (``netem``)
read the same shares.

A Raspberry Pi's cores and this host's differ by kind of work: a Cortex-A72 is about a seventh of a Zen 4 core in
vectorised float64 compute but about a quarter in CPython. So a device has two shares (``DeviceShares``): its
training core's, set from single-thread DGEMM, and its messaging cores' (the agent's other threads, the
SuperNode), set from the Benchmarks Game's n-body in CPython. Each share is this host's time on the kernel over
the device's, measured on this host at run time (``contract.kernels.host_speeds``), so an emulated Pi runs the two
kernels at a Pi's speed on any host; ``bench/device_calibration.py`` checks them under the caps.

The Pis' figures, all published (``PUBLISHED``, each with its source):

- Raspberry Pi 4 B (Cortex-A72 at 1.5 GHz): DGEMM 4.8 GFLOP/s (HPL with OpenBLAS 0.3.5, one thread: OpenBLAS
  issue #2230); n-body 158.26 s for 5,000,000 steps in CPython 3.7 (Pi 4 B rev 1.1, performance governor, no
  throttling: chaitanyamehta.github.io, "Performance Analysis of Languages on Raspberry Pi", 2020), which CPython
  3.11 runs ``CPYTHON_311_OVER_37`` times as fast (this program on one host, pyenv's 3.7.16 and 3.11.7);
- Raspberry Pi 3 B+ (Cortex-A53 at 1.4 GHz): the Pi 4's, scaled by ncnn's ResNet-18 on one thread (Pi 3 B+ 379.6
  ms; Pi 4 191.1 ms at 1.8 GHz, 229.3 ms at 1.5: Tencent/ncnn benchmark/README.md) for DGEMM, and by sysbench
  1.0.20's single-core CPU score (Pi 3+ 687.45, Pi 4 1477.83 events/s: leoncode.co.uk, "Raspberry Pi CPU
  Benchmarks") for n-body;
- Raspberry Pi 5 (Cortex-A76 at 2.4 GHz): the Pi 4's, scaled by HPL on four threads (Pi 5 30.2 GFLOP/s, Pi 4 11.9
  at 1.8 GHz: geerlingguy/top500-benchmark) and by the same sysbench score (2737.49 events/s).

What a quota cannot give: the Pi's memory bandwidth against its compute (a quota slices a host core's time, so its
cache and memory stay the host's), its thermal throttling, and its torch kernels' efficiency on ARM, which for
small matrices may be lower than x86's (``bench/device_calibration.py`` prints how far each is off).

A device measured by the user (``edgefl edge bench --write-profile FILE`` on the device) is a JSON file of the same
figures, given as ``--device-profile FILE`` (``load_profile_file``); with the training step it measured for a
model, the clock takes that step time for runs of that model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from contract.errors import EdgeflError
from contract.kernels import KernelSpeeds, host_speeds

PI_CORES = 4  # every Raspberry Pi since the 2 B
CPYTHON_311_OVER_37 = 8.633 / 6.343  # n-body µs a step in CPython 3.7.16 and 3.11.7 on one host (min of 5 x 50k)
PROFILE_FORMAT = 1  # the "edgefl-device-profile" field of a profile file
PI4_DGEMM_GFLOPS = 4.8
PI4_NBODY_S_PER_STEP = 158.263 / 5_000_000 / CPYTHON_311_OVER_37  # on CPython 3.11
PI4_RESNET18_MS_AT_1500 = 191.1 * 1.8 / 1.5
PI3_RESNET18_MS = 379.6
SYSBENCH_EVENTS_S = {"rpi3": 687.45, "rpi4": 1477.83, "rpi5": 2737.49}
PI5_OVER_PI4_HPL = 30.2 / (11.9 * 1.5 / 1.8)


class DeviceError(EdgeflError):
    """A device profile cannot be applied; str(e) is one clear line."""


@dataclass(frozen=True)
class TrainStep:
    """Seconds a local step of ``model`` on ``dataset`` at ``batch_size`` took on the device (one thread)."""

    model: str
    dataset: str
    batch_size: int
    seconds: float


@dataclass(frozen=True)
class DeviceShares:
    """What a device's cgroups give (``edge.devices.DeviceCaps``) and the clock models: each training core and each
    messaging core as a share of one core of this host (None: no cap), and how many cores the device has."""

    train: float | None
    message: float | None
    cores: int

    @property
    def device(self) -> float | None:
        """The whole device's quota, in cores of this host: one training core, the rest messaging cores."""
        if self.train is None or self.message is None:
            return None
        return self.train + max(self.cores - 1, 2) * self.message


NO_CAP = DeviceShares(None, None, 0)


@dataclass(frozen=True)
class DeviceProfile:
    """A device to emulate: its cores, its speed on one core on the reference kernels (None: as fast as this host's)
    and where those figures come from; a measured training step, where its file gave one."""

    name: str
    cores: int
    speeds: KernelSpeeds | None
    source: str
    train_step: TrainStep | None = None

    def shares(self, host: KernelSpeeds | None = None) -> DeviceShares:
        """Each kind of core's share of one of this host's (``host``: this host's speeds, measured when None)."""
        if self.speeds is None:
            return NO_CAP
        host = host or host_speeds()
        train = self.speeds.dgemm_gflops / host.dgemm_gflops
        message = host.nbody_s_per_step / self.speeds.nbody_s_per_step
        return DeviceShares(round(min(train, 1.0), 4), round(min(message, 1.0), 4), self.cores)

    def step_s(self, host_step_s: float, run: tuple[str, str, int] | None = None) -> float:
        """Seconds a local step takes on the device: its measured step where ``run`` (model, data set, batch size)
        is what it measured, else this host's one-core step at the training core's share."""
        step = self.train_step
        if step is not None and (step.model, step.dataset, step.batch_size) == run:
            return step.seconds
        return host_step_s / (self.shares().train or 1.0)


def _pi(name: str, board: str, dgemm_gflops: float, nbody_s: float, how: str) -> DeviceProfile:
    return DeviceProfile(name, PI_CORES, KernelSpeeds(dgemm_gflops, nbody_s), f"4 x {board}: {how}")


PUBLISHED_SOURCES = {
    "dgemm": "HPL, OpenBLAS 0.3.5, 1 thread, Pi 4 B at 1.5 GHz: OpenMathLib/OpenBLAS issue #2230",
    "nbody": "Benchmarks Game n-body in CPython 3.7, Pi 4 B rev 1.1 at 1.5 GHz: chaitanyamehta.github.io (2020)",
    "resnet18": "ncnn ResNet-18 224x224, 1 thread: Tencent/ncnn benchmark/README.md",
    "sysbench": "sysbench 1.0.20 cpu, 1 thread: leoncode.co.uk, Raspberry Pi CPU Benchmarks",
    "hpl4": "HPL, 4 threads, Pi 5 / Pi 4 at 1.8 GHz: geerlingguy/top500-benchmark",
}
_RPI3_COMPUTE = PI4_RESNET18_MS_AT_1500 / PI3_RESNET18_MS
_RPI3_PYTHON = SYSBENCH_EVENTS_S["rpi3"] / SYSBENCH_EVENTS_S["rpi4"]
_RPI5_PYTHON = SYSBENCH_EVENTS_S["rpi5"] / SYSBENCH_EVENTS_S["rpi4"]

DEVICE_PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        _pi("rpi3", "Raspberry Pi 3 B+ Cortex-A53 @1.4 GHz", PI4_DGEMM_GFLOPS * _RPI3_COMPUTE,
            PI4_NBODY_S_PER_STEP / _RPI3_PYTHON, "the Pi 4's figures scaled by ncnn ResNet-18 and sysbench cpu"),
        _pi("rpi4", "Raspberry Pi 4 B Cortex-A72 @1.5 GHz", PI4_DGEMM_GFLOPS, PI4_NBODY_S_PER_STEP,
            "DGEMM 4.8 GFLOP/s (OpenBLAS HPL), n-body in CPython"),
        _pi("rpi5", "Raspberry Pi 5 Cortex-A76 @2.4 GHz", PI4_DGEMM_GFLOPS * PI5_OVER_PI4_HPL,
            PI4_NBODY_S_PER_STEP / _RPI5_PYTHON, "the Pi 4's figures scaled by HPL and sysbench cpu"),
        DeviceProfile("laptop", 0, None, "a laptop core is about as fast as this machine's"),
    )
}  # fmt: skip


def device_profile(name: str) -> DeviceProfile:
    """The profile called ``name``, or the profile file at ``name`` (a path ending in ``.json``)."""
    if name.endswith(".json"):
        return load_profile_file(Path(name))
    try:
        return DEVICE_PROFILES[name]
    except KeyError:
        raise DeviceError(
            f"unknown device profile {name!r}: known profiles are {', '.join(DEVICE_PROFILES)}, or a FILE.json "
            "that edgefl edge bench --write-profile wrote"
        ) from None


def profile_record(name: str, speeds: KernelSpeeds, train_step: TrainStep | None, cores: int) -> dict:
    """What ``edgefl edge bench --write-profile`` writes: a device's own figures, read back by ``load_profile_file``."""
    record: dict = {"edgefl-device-profile": PROFILE_FORMAT, "name": name, "cores": cores,
                    "dgemm_gflops": speeds.dgemm_gflops, "nbody_s_per_step": speeds.nbody_s_per_step}  # fmt: skip
    if train_step is not None:
        record["train_step"] = {"model": train_step.model, "dataset": train_step.dataset,
                                "batch_size": train_step.batch_size, "seconds": train_step.seconds}  # fmt: skip
    return record


def load_profile_file(path: Path) -> DeviceProfile:
    """The device profile a device wrote (``profile_record``); raises DeviceError naming the file and what is wrong."""
    try:
        record = json.loads(path.read_text())
    except OSError as err:
        raise DeviceError(f"cannot read device profile {path}: {err.strerror}") from None
    except ValueError as err:
        raise DeviceError(f"device profile {path} is not JSON: {err}") from None
    if not isinstance(record, dict) or record.get("edgefl-device-profile") != PROFILE_FORMAT:
        raise DeviceError(f"{path} is not an edgefl device profile (edgefl-device-profile: {PROFILE_FORMAT} missing)")

    def positive(where: dict, key: str, kind: type = float) -> float:
        if key not in where:
            raise DeviceError(f"device profile {path} lacks {key}")
        value = where[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise DeviceError(f"device profile {path}: {key} must be a positive number, got {value!r}")
        if kind is int and value != int(value):
            raise DeviceError(f"device profile {path}: {key} must be a whole number, got {value!r}")
        return kind(value)

    name = record.get("name")
    if not isinstance(name, str) or not name.strip():
        raise DeviceError(f"device profile {path}: name must be a non-empty string")
    speeds = KernelSpeeds(positive(record, "dgemm_gflops"), positive(record, "nbody_s_per_step"))
    step = record.get("train_step")
    train_step = None
    if step is not None:
        if not isinstance(step, dict) or not all(isinstance(step.get(k), str) for k in ("model", "dataset")):
            raise DeviceError(f"device profile {path}: train_step needs model, dataset, batch_size and seconds")
        train_step = TrainStep(step["model"], step["dataset"], positive(step, "batch_size", int),
                               positive(step, "seconds"))  # fmt: skip
    cores = positive(record, "cores", int)
    return DeviceProfile(name.strip(), cores, speeds, f"measured on the device ({path})", train_step)
