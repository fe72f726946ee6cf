"""Device profiles: emulated Raspberry Pis on one machine, by capping CPU with cgroup quotas.

A profile is a whole device: ``cores`` cores, each kind of core a share of ONE core of this machine
(``contract.devices.DeviceShares``: the training core's from DGEMM, the messaging cores' from CPython's n-body).
``--device-profile rpi4`` gives each client a cgroup tree of its own (``DeviceCaps``): the device (all its cores)
and, inside it, one device core each for the agent's training thread (the training share), the agent's other
threads (taking and sending messages: encoding, decoding, the Runtime API) and the device's SuperNode (the
messaging share each) — on a Raspberry Pi 4 these run on different cores of its four, so a message is encoded
while the next round trains. The agent trains on one thread
(OMP_NUM_THREADS=1). ``laptop`` is no cap. Only the CPU is emulated, not the device's memory size, memory
bandwidth or thermal throttling. cgroup v1 (``cpu.cfs_quota_us``, a thread placed through ``tasks``) and cgroup v2
(``cpu.max``, the three roles as threaded cgroups) are supported; this project's machines run v1.

A quota is a share of whatever speed the host's core has that moment; ``HostFollower`` keeps the shares following
this host's speed while the devices run.

The profiles themselves (``DEVICE_PROFILES``, ``device_profile``) and their calibration are
``contract.devices``'s, one table that the fleet and a simulation's clock (``netem``) read too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from contract.devices import (  # noqa: F401 (re-exported)
    DEVICE_PROFILES,
    NO_CAP,
    DeviceError,
    DeviceProfile,
    DeviceShares,
    device_profile,
)
from contract.kernels import KernelSpeeds, probe_host_speeds

MOUNTS = Path("/proc/self/mounts")
PERIOD_US = 100_000
DEVICE_SHARES, DEVICE_WEIGHT = 10 * 1024, 1000  # cgroup v1 cpu.shares, v2 cpu.weight: ten times a host process
REMOVE_TIMEOUT_S = 10.0  # for a device's cgroup to empty: a killed process leaves it once it has exited
REMOVE_POLL_S = 0.02
ROLES = ("train", "agent", "supernode")  # one device core each (DeviceCaps)
MESSAGING_ROLES = ("agent", "supernode")  # at the messaging share; "train" at the training share
FOLLOW_EVERY_S = 2.0  # how often a device's quotas are set again from this host's speed (HostFollower)
FOLLOW_SAMPLES = 3600  # the speeds it keeps: two hours of them, and a device joined for days holds no more


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
    process still in them back to the root cgroup): ``edgefl-<tag>-<name>`` holds the whole device
    (``DeviceShares.device`` cores of this machine), and its children ``train``, ``agent`` and ``supernode``
    (``ROLES``) one device core each, ``train`` at the training share and the other two at the messaging share; a
    device takes precedence over the host's own processes up to its quota, as its cores are its own (the emulated
    links' forwarders run at real-time priority). Processes start uncapped and
    are placed once they have started (their imports and data loading are the emulation's start-up, not the
    device's work: a real device's agent starts once); the agent's training thread is placed apart from the rest
    of its process.

    For shares without a cap (a laptop) nothing is created and ``place`` / ``place_thread`` do nothing."""

    def __init__(self, shares: DeviceShares, name: str, tag: str | None = None) -> None:
        self.shares = shares
        self.cgroup_name = f"edgefl-{os.getpid() if tag is None else tag}-{name}"
        self.path: Path | None = None  # the device's cgroup folder while it exists
        self._version, self._root = 1, Path()

    def __enter__(self) -> DeviceCaps:
        device = self.shares.device
        if device is None:
            return self
        self._version, self._root = cpu_hierarchy()
        path = self._root / self.cgroup_name
        try:
            if self._version == 2:
                _enable_cpu(self._root)
            path.mkdir(exist_ok=True)
            self.path = path
            self._set_quota(path, device)
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
                self._set_quota(path / role, self.shares.message if role in MESSAGING_ROLES else self.shares.train)
        except OSError as err:
            self.remove()
            raise DeviceError(
                f"cannot set up cgroup {path} for an emulated device: {err.strerror} "
                "(device profiles need root and a writable cgroup cpu controller)"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def set_shares(self, shares: DeviceShares) -> None:
        """Set the device's quotas again (``HostFollower``: this host's core changed speed); a lower quota is
        written child first and a higher one parent first, as cgroup v1 refuses a child above its parent."""
        if self.path is None or shares.device is None:
            return
        path = self.path
        parent_first = shares.device > (self.shares.device or 0.0)
        writes = [(path / role, shares.message if role in MESSAGING_ROLES else shares.train) for role in ROLES]
        writes = [(path, shares.device), *writes] if parent_first else [*writes, (path, shares.device)]
        try:
            for folder, cores in writes:
                self._set_quota(folder, cores)
        except OSError as err:
            raise DeviceError(f"cannot set the quota of cgroup {path} again: {err.strerror}") from None
        self.shares = shares

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
    """Move the processes in ``folder`` (all their threads) to the ``root`` cgroup, then delete ``folder``: once
    it is empty, which a process still exiting (killed, its memory being freed) or forking while its family is
    moved out delays, for up to REMOVE_TIMEOUT_S."""
    deadline = time.monotonic() + REMOVE_TIMEOUT_S
    while time.monotonic() < deadline:
        for pid in _read(folder / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                (root / "cgroup.procs").write_text(pid)
        try:
            folder.rmdir()
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno == errno.EBUSY:
                time.sleep(REMOVE_POLL_S)  # polled until the cgroup empties
                continue
            raise DeviceError(f"cannot remove cgroup {folder}: {err.strerror}") from None
        return
    left = _read(folder / "cgroup.procs").split()
    raise DeviceError(
        f"cannot remove cgroup {folder}: processes {', '.join(left)} stayed in it for {REMOVE_TIMEOUT_S:.0f} s"
    )


class HostFollower:
    """Keeps emulated devices at their profiles' speed while this host's cores change speed: a quota is a share of
    whatever speed the core has, and a cloud host's one-core DGEMM moved 29.6-68.5 GFLOP/s within minutes here,
    its CPUs not always together. On a thread of its own, every ``every_s`` one of this process's CPUs in turn is
    probed (``contract.kernels.probe_host_speeds``, the thread pinned to it: by CPU time, a few short runs of each
    reference kernel), and each device's quotas
    set again from its profile (share = host / device, ``DeviceProfile.shares``) at the mean of the CPUs' latest
    speeds (``mean_speeds``: a device's threads run on any of them). Entered after the devices' caps, so that it
    stops before they are removed; a device whose quota cannot be set again stops it, said in one line to ``say``.

    ``samples`` holds the speeds it set the quotas from, in order (the last ``FOLLOW_SAMPLES``)."""

    def __init__(
        self,
        devices: Sequence[tuple[DeviceCaps, DeviceProfile]],
        every_s: float = FOLLOW_EVERY_S,
        probe: Callable[[], KernelSpeeds] = probe_host_speeds,
        say: Callable[[str], None] = print,
    ) -> None:
        self.devices = [(caps, profile) for caps, profile in devices if caps.path is not None]
        self.every_s = every_s
        self.probe = probe
        self.say = say
        self.samples: deque[KernelSpeeds] = deque(maxlen=FOLLOW_SAMPLES)
        self._cpus = sorted(os.sched_getaffinity(0))
        self._latest: dict[int, KernelSpeeds] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HostFollower:
        if self.devices:
            self._thread = threading.Thread(target=self._follow, name="edgefl-host-follower", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def follow_once(self, cpu: int) -> KernelSpeeds:
        """Probe ``cpu`` (the calling thread pinned to it meanwhile), set every device's quotas from the mean of
        every CPU's latest speeds; returns that mean."""
        allowed = os.sched_getaffinity(0)  # 0: the calling thread only
        os.sched_setaffinity(0, {cpu})
        try:
            self._latest[cpu] = self.probe()
        finally:
            os.sched_setaffinity(0, allowed)
        host = mean_speeds(list(self._latest.values()))
        for caps, profile in self.devices:
            caps.set_shares(profile.shares(host))
        self.samples.append(host)
        return host

    def _follow(self) -> None:
        for cpu in self._cpus:  # every CPU once before the first wait: the quotas start from all of them
            if not self._follow_or_stop(cpu):
                return
        turn = 0
        while not self._stop.wait(self.every_s):
            if not self._follow_or_stop(self._cpus[turn % len(self._cpus)]):
                return
            turn += 1

    def _follow_or_stop(self, cpu: int) -> bool:
        try:
            self.follow_once(cpu)
        except DeviceError as exc:
            self.say(f"device quotas no longer follow this host's speed: {exc}")
            return False
        return True


def mean_speeds(speeds: Sequence[KernelSpeeds]) -> KernelSpeeds:
    """The speed of a thread that spends equal time on CPUs of these speeds: the mean of each kernel's rate."""
    dgemm = sum(s.dgemm_gflops for s in speeds) / len(speeds)
    nbody_rate = sum(1 / s.nbody_s_per_step for s in speeds) / len(speeds)
    return KernelSpeeds(dgemm, 1 / nbody_rate)
