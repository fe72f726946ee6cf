"""Device profiles: emulated Raspberry Pis on one machine, by capping a process's CPU with a cgroup quota.

``--device-profile rpi4`` runs a client's process in a cgroup of its own whose CPU bandwidth is
``cpu_fraction`` of ONE core of this machine (cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, or
cgroup v2 ``cpu.max``), so a mixed fleet can be rehearsed here. The agent trains on one thread
(OMP_NUM_THREADS=1), so the cap emulates one device core; ``laptop`` is no cap. Only the CPU is emulated, not
the device's memory size, memory bandwidth or thermal throttling.

Calibration (our own reasoning, not a measurement on a Pi): the training step of edgefl's models is
dominated by convolution and matrix-multiply kernels, whose speed per core is set by the peak float32
fused-multiply-add rate = clock x FLOP per cycle:

- this machine: AMD EPYC, Zen 4 (family 25, model 17) at 2.6 GHz, AVX-512 executed as two 256-bit FMA
  per cycle = 32 FLOP/cycle = 83.2 GFLOP/s (torch reaches 49 GFLOP/s on one core here in a 512x512 sgemm);
- Raspberry Pi 3 B+: Cortex-A53 at 1.4 GHz, 64-bit NEON datapath, one 128-bit FMA per 2 cycles
  = 4 FLOP/cycle = 5.6 GFLOP/s -> 0.067;
- Raspberry Pi 4 B: Cortex-A72 at 1.5 GHz, one 128-bit NEON FMA per cycle = 8 FLOP/cycle
  = 12 GFLOP/s -> 0.144;
- Raspberry Pi 5: Cortex-A76 at 2.4 GHz, two 128-bit NEON FMA per cycle = 16 FLOP/cycle
  = 38.4 GFLOP/s -> 0.462.

The ratios between the Pis (Pi 4 = 2.1x Pi 3 B+, Pi 5 = 3.2x Pi 4) agree with published single-core
comparisons (Roy Longbottom's benchmarks: Pi 4 about 2x Pi 3 B+; Raspberry Pi Ltd: Pi 5 2-3x Pi 4). Small
batches also spend time in framework overhead, scalar code where a Pi core is relatively less slow (about a
quarter of this core for a Pi 4), so the profiles err on the slow side. On another host the fractions still
mean "of one core of that host"; they are calibrated for this one.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from contract.errors import EdgeflError

MOUNTS = Path("/proc/self/mounts")
PERIOD_US = 100_000
REMOVE_ATTEMPTS = 5
HOST_PEAK_GFLOPS = 2.6 * 32  # one core of this machine: Zen 4 at 2.6 GHz, 32 fp32 FLOP/cycle


class DeviceError(EdgeflError):
    """A device profile cannot be applied; str(e) is one clear line."""


@dataclass(frozen=True)
class DeviceProfile:
    """A device to emulate: its CPU as a share of one core of this machine, and where that share comes from."""

    name: str
    cpu_fraction: float | None  # of ONE core of this machine; None = no cap
    source: str


def _pi(name: str, core: str, ghz: float, flop_per_cycle: int) -> DeviceProfile:
    fraction = round(ghz * flop_per_cycle / HOST_PEAK_GFLOPS, 3)
    return DeviceProfile(name, fraction, f"{core} @{ghz} GHz, {flop_per_cycle} fp32 FLOP/cycle")


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        _pi("rpi3", "Raspberry Pi 3 B+ Cortex-A53", 1.4, 4),
        _pi("rpi4", "Raspberry Pi 4 B Cortex-A72", 1.5, 8),
        _pi("rpi5", "Raspberry Pi 5 Cortex-A76", 2.4, 16),
        DeviceProfile("laptop", None, "a laptop core is about as fast as this machine's"),
    )
}


def device_profile(name: str) -> DeviceProfile:
    """The profile called ``name``."""
    try:
        return DEVICE_PROFILES[name]
    except KeyError:
        raise DeviceError(f"unknown device profile {name!r}: known profiles are {', '.join(DEVICE_PROFILES)}") from None


def cpu_hierarchy() -> tuple[int, Path]:
    """(cgroup version, mount point) of the hierarchy that has the ``cpu`` controller."""
    for line in MOUNTS.read_text().splitlines():
        _, mount_point, fstype, options = line.split()[:4]
        if fstype == "cgroup" and "cpu" in options.split(","):
            return 1, Path(mount_point)
        if fstype == "cgroup2" and "cpu" in _read(Path(mount_point) / "cgroup.controllers").split():
            return 2, Path(mount_point)
    raise DeviceError(
        "no cgroup cpu controller is mounted (neither cgroup v1 'cpu' nor cgroup v2 with 'cpu'): "
        "device profiles need one"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class CpuCap:
    """A cgroup ``edgefl-<tag>-<name>`` that holds processes to ``profile.cpu_fraction`` of one core; removed on
    leaving the ``with``, after moving any process still in it back to the root cgroup.

    For a profile without a cap (laptop) nothing is created and ``add`` / ``argv_prefix`` do nothing.
    """

    def __init__(self, profile: DeviceProfile, name: str, tag: str | None = None) -> None:
        self.profile = profile
        self.cgroup_name = f"edgefl-{os.getpid() if tag is None else tag}-{name}"
        self.path: Path | None = None  # the cgroup's folder while it exists
        self._root = Path()

    def __enter__(self) -> CpuCap:
        fraction = self.profile.cpu_fraction
        if fraction is None:
            return self
        version, self._root = cpu_hierarchy()
        path = self._root / self.cgroup_name
        quota_us = round(fraction * PERIOD_US)
        try:
            if version == 2 and "cpu" not in _read(self._root / "cgroup.subtree_control").split():
                (self._root / "cgroup.subtree_control").write_text("+cpu")
            path.mkdir(exist_ok=True)
            self.path = path
            if version == 1:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota_us))
            else:
                (path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        except OSError as err:
            self.remove()
            raise DeviceError(
                f"cannot set up cgroup {path} for device profile {self.profile.name}: {err.strerror} "
                "(device profiles need root and a writable cgroup cpu controller)"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup; its future children start in it too."""
        if self.path is None:
            return
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError as err:
            raise DeviceError(f"cannot move process {pid} into cgroup {self.path}: {err.strerror}") from None

    def argv_prefix(self) -> list[str]:
        """An argv prefix that starts a command inside the cgroup: a shell that moves itself in, then execs the
        command (same PID). Put it before an ``ip netns exec`` prefix, which hides /sys/fs/cgroup."""
        if self.path is None:
            return []
        return ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(self.path / "cgroup.procs")]

    def remove(self) -> None:
        """Move every process left in the cgroup to the root cgroup, then delete the cgroup."""
        if self.path is None:
            return
        for _ in range(REMOVE_ATTEMPTS):  # a process may fork while we move its family out
            for pid in _read(self.path / "cgroup.procs").split():
                with contextlib.suppress(ProcessLookupError):
                    (self._root / "cgroup.procs").write_text(pid)
            try:
                self.path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno == errno.EBUSY:
                    continue
                raise DeviceError(f"cannot remove cgroup {self.path}: {err.strerror}") from None
            self.path = None
            return
        raise DeviceError(f"cannot remove cgroup {self.path}: processes keep appearing in it")
