"""A device's processes end with their launcher (``contract.parent``): a process a ProcessGroup started is sent
SIGTERM by the kernel when the launcher is killed with SIGKILL, and the agent and the SuperNode, given
``--parent-pid``, stop cleanly once that process is gone (also when it is not their parent, as across ``ip netns
exec`` or a wrapper)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contract.parent import POLL_S, started_at
from edgefl.launcher import NodeRuntime, flower_env, supernode_argv
from edgefl.processes import free_port
from tests.conftest import REPO

BOUND_S = 10 * POLL_S  # how soon a process must end after its parent did (one poll, on a loaded host)


def _gone_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (not our child: nothing to wait on) has ended within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while started_at(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def parent() -> subprocess.Popen[bytes]:
    """A stand-in launcher, killed by the test (not reaped at once: a zombie is gone too)."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_watched_process_stops_cleanly_once_the_pid_is_gone(parent: subprocess.Popen[bytes]) -> None:
    code = (
        "import signal, sys, threading\n"
        "from contract.parent import watch_parent\n"
        "stop = threading.Event()\n"
        "signal.signal(signal.SIGTERM, lambda *_: stop.set())\n"
        f"watch_parent({parent.pid})\n"
        "print('watching', flush=True)\n"
        "stop.wait()\n"
        "print('stopped cleanly', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "watching\n"
        assert child.poll() is None  # the parent lives: the child goes on
        parent.send_signal(signal.SIGKILL)  # and is left a zombie until the fixture reaps it
        out, _ = child.communicate(timeout=BOUND_S)
    finally:
        child.kill()
    assert child.returncode == 0 and out == "stopped cleanly\n"


def test_a_process_a_group_started_is_signalled_when_its_launcher_is_killed(tmp_path: Path) -> None:
    launcher_code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from edgefl.processes import ProcessGroup\n"
        f"procs = ProcessGroup(Path({str(tmp_path)!r}), {{'PATH': '/usr/bin:/bin'}})\n"
        "print(procs.start('sleeper', ['sleep', '600']).pid, flush=True)\n"
        "sys.stdin.read()\n"  # until the test kills it
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        sleeper = int(launcher.stdout.readline())
        assert started_at(sleeper) is not None
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone_within(sleeper, BOUND_S), "the launcher's child outlived it"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("process", ["agent", pytest.param("supernode", marks=pytest.mark.federation)])
def test_the_agent_and_the_supernode_stop_once_their_launcher_is_gone(
    process: str, tmp_path: Path, parent: subprocess.Popen[bytes]
) -> None:
    """The real command lines (``NodeRuntime.agent_argv``, ``supernode_argv``) with the launcher's PID swapped for a
    stand-in's; the SuperLink they would serve does not exist (they wait for it as they would on a device)."""
    runtime = NodeRuntime.create(tmp_path, "node-0")
    if process == "agent":
        argv = runtime.agent_argv()
    else:
        argv = supernode_argv(f"127.0.0.1:{free_port()}", None, "partition-id=0 num-partitions=1", serve=runtime)
    at = argv.index("--parent-pid") + 1
    argv[at] = str(parent.pid)
    log = tmp_path / f"{process}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=flower_env(tmp_path))
    try:
        ready = "Connection attempt failed" if process == "supernode" else "no SuperNode at"
        deadline = time.monotonic() + 120
        while ready not in log.read_text(errors="replace"):  # up (its signal handlers set) before its parent dies
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.1)
        parent.send_signal(signal.SIGKILL)
        proc.wait(timeout=BOUND_S + 10)  # its clean stop: Flower's graceful exit, the agent's stop()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")
