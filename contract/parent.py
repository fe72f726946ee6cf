"""A process that ends with the process that started it: a launcher killed with SIGKILL (what an OOM kill does)
must not leave its agents, SuperNodes or ServerApp running. Two guards, Linux both: the launcher asks the kernel to
signal each process it forks when it ends (``signal_on_parent_death``, for ``subprocess.Popen``'s
``preexec_fn``), and the agent and the SuperNode also watch the PID they are given (``--parent-pid``,
``watch_parent``), through /proc, which a process in another network namespace (``ip netns exec``) shares."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

POLL_S = 1.0  # how often the watch looks whether the parent still lives
PR_SET_PDEATHSIG = 1  # prctl(2)
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: a forked child before exec may not load it


def started_at(pid: int) -> int | None:
    """The start time of the live process ``pid`` (clock ticks since boot, /proc/PID/stat), which tells it from a
    later process given the same PID; None once it is gone or a zombie (dead, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def signal_on_parent_death(parent: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child forked by ``parent`` (``subprocess.Popen(preexec_fn=...)`` from the launcher's main thread): have
    the kernel send it ``sig`` when the forking thread ends (prctl PR_SET_PDEATHSIG; it survives ``execve``,
    ``ip netns exec`` included); ``sig`` at once when ``parent`` has ended already."""
    _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def watch_parent(pid: int, sig: signal.Signals = signal.SIGTERM) -> threading.Thread:
    """Send this process ``sig`` (its clean stop: it stops what it started) once process ``pid`` is gone, looked
    at every POLL_S in a daemon thread; at once if it is gone already. Returns the thread."""
    born = started_at(pid)

    def watch() -> None:
        while born is not None and started_at(pid) == born:
            time.sleep(POLL_S)  # a watch: nothing to wait on for another process's end
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=watch, name=f"watch-parent-{pid}", daemon=True)
    thread.start()
    return thread
