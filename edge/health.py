"""What a device reports about itself with each reply: peak memory, CPU temperature and throttling where the
device exposes them (Linux thermal zones; Raspberry Pi firmware through ``vcgencmd get_throttled``)."""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
from pathlib import Path

THERMAL_ZONE = Path("/sys/class/thermal/thermal_zone0/temp")
STATUS = Path("/proc/self/status")


def cpu_temperature_c() -> float | None:
    try:
        return int(THERMAL_ZONE.read_text().strip()) / 1000.0
    except (OSError, ValueError):
        return None


def throttled_flags() -> int | None:
    """Raspberry Pi throttling bits (0 = never throttled); None where there is no vcgencmd."""
    if shutil.which("vcgencmd") is None:
        return None
    try:
        out = subprocess.run(["vcgencmd", "get_throttled"], capture_output=True, text=True, timeout=2).stdout
        return int(out.strip().split("=")[1], 16)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def peak_rss_mb() -> float:
    """Peak resident set size of this process: Linux's VmHWM (ru_maxrss would also count the memory of the process
    that started this one, as it was when it forked), elsewhere ru_maxrss (KiB)."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        found = None
    return int(found.group(1)) / 1024.0 if found else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def health_snapshot() -> dict[str, float | int | None]:
    return {
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "cpu_temp_c": cpu_temperature_c(),
        "throttled": throttled_flags(),
    }
