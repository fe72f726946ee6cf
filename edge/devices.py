"""Device profiles: emulated Raspberry Pis on one machine, by capping CPU with cgroup quotas.

A profile is a whole device: ``cores`` cores, each ``cpu_fraction`` of ONE core of this machine. ``--device-profile
rpi4`` gives each client a cgroup tree of its own (``DeviceCaps``): the device (all its cores) and, inside it, one
device core each for the agent's training thread, the agent's other threads (taking and sending messages:
encoding, decoding, the Runtime API) and the device's SuperNode — on a Raspberry Pi 4 these run on different cores
of its four, so a message is encoded while the next round trains. The agent trains on one thread
(OMP_NUM_THREADS=1). ``laptop`` is no cap. Only the CPU is emulated, not the device's memory size, memory
bandwidth or thermal throttling. cgroup v1 (``cpu.cfs_quota_us``, a thread placed through ``tasks``) and cgroup v2
(``cpu.max``, the three roles as threaded cgroups) are supported; this project's machines run v1.

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
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from contract.errors import EdgeflError

MOUNTS = Path("/proc/self/mounts")
PERIOD_US = 100_000
DEVICE_SHARES, DEVICE_WEIGHT = 10 * 1024, 1000  # cgroup v1 cpu.shares, v2 cpu.weight: ten times a host process
REMOVE_ATTEMPTS = 5
HOST_PEAK_GFLOPS = 2.6 * 32  # one core of this machine: Zen 4 at 2.6 GHz, 32 fp32 FLOP/cycle
PI_CORES = 4  # every Raspberry Pi since the 2 B


class DeviceError(EdgeflError):
    """A device profile cannot be applied; str(e) is one clear line."""


@dataclass(frozen=True)
class DeviceProfile:
    """A device to emulate: its cores, each a share of one core of this machine, and where that share comes from."""

    name: str
    cpu_fraction: float | None  # each device core, of ONE core of this machine; None = no cap
    cores: int
    source: str


def _pi(name: str, core: str, ghz: float, flop_per_cycle: int) -> DeviceProfile:
    fraction = round(ghz * flop_per_cycle / HOST_PEAK_GFLOPS, 3)
    return DeviceProfile(name, fraction, PI_CORES, f"4 x {core} @{ghz} GHz, {flop_per_cycle} fp32 FLOP/cycle")


DEVICE_PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        _pi("rpi3", "Raspberry Pi 3 B+ Cortex-A53", 1.4, 4),
        _pi("rpi4", "Raspberry Pi 4 B Cortex-A72", 1.5, 8),
        _pi("rpi5", "Raspberry Pi 5 Cortex-A76", 2.4, 16),
        DeviceProfile("laptop", None, 0, "a laptop core is about as fast as this machine's"),
    )
}
ROLES = ("train", "agent", "supernode")  # one device core each (DeviceCaps)


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


@dataclass(frozen=True)
class AgentThreads:
    """What an emulated device's cgroups need to know of a started agent: its process and its training thread.
    The agent writes it to its ready file (``fl_client.node --ready-file``) once its data is loaded."""

    pid: int
    trainer_tid: int

    def save(self, path: Path) -> None:
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)  # whole or absent: the launcher polls for it

    @classmethod
    def load(cls, path: Path) -> AgentThreads:
        return cls(**json.loads(path.read_text()))

    def place(self, caps: DeviceCaps) -> None:
        """Put the agent on its device's ``agent`` core and its training thread on the ``train`` core."""
        caps.place("agent", self.pid)
        caps.place_thread("train", self.trainer_tid)


class DeviceCaps:
    """One emulated device's cgroups, created on entering the ``with`` and removed on leaving it (after moving any
    process still in them back to the root cgroup): ``edgefl-<tag>-<name>`` holds the whole device, ``cores`` x
    ``cpu_fraction`` of one core of this machine, and its children ``train``, ``agent`` and ``supernode``
    (``ROLES``) one device core each; a device takes precedence over the host's own processes up to its quota, as
    its cores are its own (the emulated links' forwarders run at real-time priority). Processes start uncapped and
    are placed once they have started (their imports and data loading are the emulation's start-up, not the
    device's work: a real device's agent starts once); the agent's training thread is placed apart from the rest
    of its process.

    For a profile without a cap (laptop) nothing is created and ``place`` / ``place_thread`` do nothing."""

    def __init__(self, profile: DeviceProfile, name: str, tag: str | None = None) -> None:
        self.profile = profile
        self.cgroup_name = f"edgefl-{os.getpid() if tag is None else tag}-{name}"
        self.path: Path | None = None  # the device's cgroup folder while it exists
        self._version, self._root = 1, Path()

    def __enter__(self) -> DeviceCaps:
        fraction = self.profile.cpu_fraction
        if fraction is None:
            return self
        self._version, self._root = cpu_hierarchy()
        path = self._root / self.cgroup_name
        try:
            if self._version == 2:
                _enable_cpu(self._root)
            path.mkdir(exist_ok=True)
            self.path = path
            self._set_quota(path, self.profile.cores * fraction)
            if self._version == 1:  # the device's cores are its own: up to its quota it runs before the host's
                (path / "cpu.shares").write_text(str(DEVICE_SHARES))  # processes (the server, the SuperLink)
            else:
                (path / "cpu.weight").write_text(str(DEVICE_WEIGHT))
            if self._version == 2:
                _enable_cpu(path)
            for role in ROLES:
                (path / role).mkdir(exist_ok=True)
                if self._version == 2:  # threads of one process in different cgroups: a threaded subtree
                    (path / role / "cgroup.type").write_text("threaded")
                self._set_quota(path / role, fraction)
        except OSError as err:
            self.remove()
            raise DeviceError(
                f"cannot set up cgroup {path} for device profile {self.profile.name}: {err.strerror} "
                "(device profiles need root and a writable cgroup cpu controller)"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _set_quota(self, path: Path, cores: float) -> None:
        quota_us = round(cores * PERIOD_US)
        if self._version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (path / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")

    def place(self, role: str | None, pid: int) -> None:
        """Move process ``pid`` (all its threads) onto ``role``'s device core, or onto the whole device for None;
        its future children and threads start there too."""
        self._write(role, "cgroup.procs", pid)

    def place_thread(self, role: str, tid: int) -> None:
        """Move the one thread ``tid`` onto ``role``'s device core (its process stays where it is)."""
        self._write(role, "tasks" if self._version == 1 else "cgroup.threads", tid)

    def _write(self, role: str | None, file: str, pid: int) -> None:
        if self.path is None:
            return
        folder = self.path if role is None else self.path / role
        try:
            (folder / file).write_text(str(pid))
        except OSError as err:
            raise DeviceError(f"cannot move {pid} into cgroup {folder}: {err.strerror}") from None

    def remove(self) -> None:
        """Move every process left in the device's cgroups to the root cgroup, then delete them."""
        if self.path is None:
            return
        for folder in [self.path / role for role in ROLES] + [self.path]:
            _remove(folder, self._root)
        self.path = None


def _enable_cpu(path: Path) -> None:
    """cgroup v2: let the children of ``path`` have the cpu controller."""
    if "cpu" not in _read(path / "cgroup.subtree_control").split():
        (path / "cgroup.subtree_control").write_text("+cpu")


def _remove(folder: Path, root: Path) -> None:
    """Move the processes in ``folder`` (all their threads) to the ``root`` cgroup, then delete ``folder``."""
    for _ in range(REMOVE_ATTEMPTS):  # a process may fork while we move its family out
        for pid in _read(folder / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                (root / "cgroup.procs").write_text(pid)
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno == errno.EBUSY:
                continue
            raise DeviceError(f"cannot remove cgroup {folder}: {err.strerror}") from None
        return
    raise DeviceError(f"cannot remove cgroup {folder}: processes keep appearing in it")
