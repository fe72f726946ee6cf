"""The reference kernels a device's speed is stated in, and this host's speed on them.

An emulated device's cores are shares of this host's cores (``contract.devices``), one share per kind of work,
each set from a kernel that has published Raspberry Pi figures:

- ``dgemm``: single-thread float64 matrix multiply (n = ``DGEMM_N``) through numpy's BLAS, in GFLOP/s — the
  vectorised compute a training step is made of; the Pi figures are OpenBLAS's (HPL);
- ``nbody``: the Computer Language Benchmarks Game's n-body program in plain Python (five bodies, pairwise
  forces, ``dt = 0.01``), in seconds per step — interpreter work, which a device's messaging cores do (Flower's
  SuperNode, the Runtime API hand-over, the agent's message handling).

A share is this host's time on the kernel over the device's (``share = host / device``): a CPU quota of that
share of a host core then runs the kernel at the device's speed, on any host and whatever library or interpreter
this host has. The host is measured at run time, as the clock measures its unit: on the calling thread with one
BLAS thread, by its CPU time (``HOST``: the median of many short runs), so that other processes do not make it look
slow,
and kept for ``HOST_SPEED_MAX_AGE_S`` in ``$XDG_CACHE_HOME/edgefl/host-speed-*.json`` (one per machine, Python,
numpy and version of this file), so that the processes of one run (the launcher, a simulation's server) read the
same figures; a cloud host's core drifts by tens of percent over hours (seen here: 31.9 to 39.2 GFLOP/s), so an
older entry is measured again. ``measure(DEVICE)`` (wall time over a window) is what
``bench/device_calibration.py`` and ``edgefl edge bench --write-profile`` run under a device's caps or on a device.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

DGEMM_N = 512
NBODY_STEPS = 500
RUNS = 31  # on the host: many short runs by CPU time, their median (a few slowed by other processes do not count)
DEVICE_WINDOW_S = 2.0  # on a device: runs over this much wall time, averaged (a CPU quota is a rate over 100 ms
# periods: a short run that fits in one period's quota would see the uncapped core)
HOST_SPEED_MAX_AGE_S = 600.0
PROBE_RUNS = 5  # a probe of the host while devices run (edge.devices.HostFollower): few runs, ~60 ms in all here


@dataclass(frozen=True)
class KernelSpeeds:
    """A machine's speed on one core: ``dgemm_gflops`` (float64 GFLOP/s) and ``nbody_s_per_step`` (CPython)."""

    dgemm_gflops: float
    nbody_s_per_step: float


@dataclass(frozen=True)
class Timing:
    """How a kernel is timed: the median of ``runs`` runs by ``clock``, or, with ``window_s``, as many runs as fill
    that much of ``clock``'s time, averaged."""

    clock: Callable[[], float] = time.perf_counter
    runs: int = RUNS
    window_s: float | None = None

    def seconds_per_run(self, run: Callable[[], object]) -> float:
        run()  # warm-up
        if self.window_s is not None:
            runs, start = 0, self.clock()
            while (elapsed := self.clock() - start) < self.window_s:
                run()
                runs += 1
            return elapsed / runs
        times = []
        for _ in range(self.runs):
            start = self.clock()
            run()
            times.append(self.clock() - start)
        return sorted(times)[len(times) // 2]


PROBE = Timing(time.thread_time, runs=PROBE_RUNS)
HOST = Timing(time.thread_time)  # this thread's CPU time: other threads and processes do not make it look slow
DEVICE = Timing(time.perf_counter, window_s=DEVICE_WINDOW_S)  # wall time, under a device's caps or on a device


def dgemm_gflops(timing: Timing = DEVICE, n: int = DGEMM_N) -> float:
    """GFLOP/s of ``n`` x ``n`` float64 matrix products (2n³ FLOP each) on one BLAS thread."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a, b = rng.random((n, n)), rng.random((n, n))
    with threadpool_limits(1, user_api="blas"):  # on the calling thread only (a device's core)
        return 2 * n**3 / timing.seconds_per_run(lambda: a @ b) / 1e9


_SOLAR_MASS = 4 * 3.141592653589793**2
_DAYS = 365.24
_BODIES = (  # the Sun and the four giant planets: position (AU), velocity (AU/day), mass (solar masses)
    ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 1.0),
    ((4.84143144246472090e00, -1.16032004402742839e00, -1.03622044471123109e-01),
     (1.66007664274403694e-03, 7.69901118419740425e-03, -6.90460016972063023e-05), 9.54791938424326609e-04),
    ((8.34336671824457987e00, 4.12479856412430479e00, -4.03523417114321381e-01),
     (-2.76742510726862411e-03, 4.99852801234917238e-03, 2.30417297573763929e-05), 2.85885980666130812e-04),
    ((1.28943695621391310e01, -1.51111514016986312e01, -2.23307578892655734e-01),
     (2.96460137564761618e-03, 2.37847173959480950e-03, -2.96589568540237556e-05), 4.36624404335156298e-05),
    ((1.53796971148509165e01, -2.59193146099879641e01, 1.79258772950371181e-01),
     (2.68067772490389322e-03, 1.62824170038242295e-03, -9.51592254519715870e-05), 5.15138902046611451e-05),
)  # fmt: skip


def _advance(pairs: list, system: list, dt: float, steps: int) -> None:
    """The Benchmarks Game's n-body step, ``steps`` times: every pair's attraction, then every body's move."""
    for _ in range(steps):
        for (r1, v1, m1), (r2, v2, m2) in pairs:
            dx, dy, dz = r1[0] - r2[0], r1[1] - r2[1], r1[2] - r2[2]
            mag = dt * ((dx * dx + dy * dy + dz * dz) ** -1.5)
            b1m, b2m = m1 * mag, m2 * mag
            v1[0] -= dx * b2m
            v1[1] -= dy * b2m
            v1[2] -= dz * b2m
            v2[0] += dx * b1m
            v2[1] += dy * b1m
            v2[2] += dz * b1m
        for r, (vx, vy, vz), _m in system:
            r[0] += dt * vx
            r[1] += dt * vy
            r[2] += dt * vz


def nbody_s_per_step(timing: Timing = DEVICE, steps: int = NBODY_STEPS) -> float:
    """Seconds per n-body step (``_advance``), timed in runs of ``steps`` steps."""
    system = [([*r], [c * _DAYS for c in v], m * _SOLAR_MASS) for r, v, m in _BODIES]
    pairs = [(system[i], system[j]) for i in range(len(system)) for j in range(i + 1, len(system))]
    return timing.seconds_per_run(lambda: _advance(pairs, system, 0.01, steps)) / steps


def measure(timing: Timing = DEVICE) -> KernelSpeeds:
    """Both kernels in this process's calling thread (``DEVICE``: under a device's caps, or on a device)."""
    return KernelSpeeds(dgemm_gflops(timing), nbody_s_per_step(timing))


def probe_host_speeds() -> KernelSpeeds:
    """This host's speed now, from a short probe by CPU time (``PROBE``), not cached: what a device's quotas follow
    while it runs."""
    return measure(PROBE)


def host_speeds(max_age_s: float = HOST_SPEED_MAX_AGE_S) -> KernelSpeeds:
    """This host's speed on one core: measured on this thread (``HOST``: its CPU time, one BLAS thread), or read from
    an entry no older than ``max_age_s`` (0: measure now)."""
    path = _cache_path()
    try:
        entry = json.loads(path.read_text())
        if time.time() - entry["measured_at"] <= max_age_s:
            return KernelSpeeds(**entry["speeds"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    speeds = measure(HOST)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"measured_at": time.time(), "speeds": asdict(speeds)}))
        partial.replace(path)  # several processes may measure at once: whole or absent
    except OSError:
        pass  # a cache that cannot be written: measured again next time
    return speeds


def _cache_path() -> Path:
    """The host's entry, keyed by the CPU, Python, numpy and this file."""
    cpu = next((line for line in _cpuinfo().splitlines() if line.startswith("model name")), platform.processor())
    made_from = [platform.machine(), cpu, sys.version, version("numpy"), Path(__file__).read_bytes().hex()]
    key = hashlib.sha256(json.dumps(made_from).encode()).hexdigest()[:24]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgefl"
    return root / f"host-speed-{key}.json"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
