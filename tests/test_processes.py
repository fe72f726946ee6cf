"""Stopping a run's processes (``edgefl.processes.ProcessGroup.stop``): SIGTERM first, SIGKILL after the group's
grace — ``GRACE_S`` while a run may need what its processes hold, ``ENDED_GRACE_S`` once its results are written."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from edgefl.processes import ENDED_GRACE_S, GRACE_S, ProcessGroup

IGNORES_SIGTERM = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)\n"
)

WAITS = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path, {"PATH": os.environ["PATH"]}) as procs:
        stubborn = procs.start("stubborn", [sys.executable, "-c", IGNORES_SIGTERM])
        polite = procs.start("polite", [sys.executable, "-c", WAITS])
        for name in ("stubborn", "polite"):
            procs.wait_until(name, lambda name=name: "ready" in (tmp_path / f"{name}.log").read_text(), 60)
        assert procs.grace_s == GRACE_S
        procs.grace_s = ENDED_GRACE_S
        started = time.monotonic()
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode == -signal.SIGTERM
    assert time.monotonic() - started < GRACE_S  # the shorter grace was the one waited
