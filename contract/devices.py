"""Device profiles: the devices a run may emulate (``--device-profile``), one table, each a number of cores and
each core's share of one core of this machine. The cgroups that cap a device's CPU are ``edge.devices``'s; the
fleet and a simulation's clock (``netem``) read the same shares.

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

from dataclasses import dataclass

from contract.errors import EdgeflError

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


def device_profile(name: str) -> DeviceProfile:
    """The profile called ``name``."""
    try:
        return DEVICE_PROFILES[name]
    except KeyError:
        raise DeviceError(f"unknown device profile {name!r}: known profiles are {', '.join(DEVICE_PROFILES)}") from None
