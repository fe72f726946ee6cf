"""Processes forked from a fork server (``edgefl.forkserver``), as a ``ProcessGroup`` keeps them: each runs its
module's ``main()`` in a session of its own with its output in its log; its exit code comes back as ``Popen``'s
would; requests sent together are all served; a server killed takes its children with it; stopping the group
leaves nothing running. A real fork server process, real forks and signals; the modules are written here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl.processes import ProcessGroup, process_tree, tail

REPO = Path(__file__).resolve().parents[1]
MODULE = """
import os, sys, time

PRELOADED = False


def preload():
    global PRELOADED
    PRELOADED = True


def main():
    print("preloaded" if PRELOADED else "not preloaded", os.getpid(), os.getpgid(0), sys.argv[1:], flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    if sys.argv[1] == "raise":
        raise RuntimeError("a bad start")
    time.sleep(600)
"""


@pytest.fixture
def group(tmp_path: Path):
    (tmp_path / "forked_demo.py").write_text(MODULE)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    with ProcessGroup(tmp_path / "logs", env) as procs:
        yield procs


def _log(procs: ProcessGroup, name: str) -> str:
    return tail(procs.log_dir / f"{name}.log", 100)  # "" until the child has opened it


def test_a_forked_process_runs_its_module_preloaded_in_a_session_of_its_own(group: ProcessGroup) -> None:
    server = group.start_forkserver("forkserver", "forked_demo")
    proc = group.fork(server, "demo", "forked_demo", ["exit", "3"], None, [sys.executable, "-m", "forked_demo"])
    assert proc.wait(timeout=60) == 3
    preloaded, pid, pgid, args = _log(group, "demo").split(" ", 3)
    assert (preloaded, int(pid), int(pgid)) == ("preloaded", proc.pid, proc.pid)
    assert args.strip() == "['exit', '3']"
    assert proc.args == [sys.executable, "-m", "forked_demo"]


def test_requests_sent_together_are_all_served_and_errors_come_back_as_exit_codes(group: ProcessGroup) -> None:
    server = group.start_forkserver("forkserver", "forked_demo")
    procs = [group.fork(server, f"demo-{i}", "forked_demo", ["exit", str(i)], None, []) for i in range(4)]
    failing = group.fork(server, "failing", "forked_demo", ["raise"], None, [])
    missing = group.fork(server, "missing", "no_such_module_here", [], None, [])
    assert [proc.wait(timeout=60) for proc in procs] == [0, 1, 2, 3]
    assert failing.wait(timeout=60) == 1
    assert "RuntimeError: a bad start" in _log(group, "failing")
    assert missing.wait(timeout=60) == 1
    assert "ModuleNotFoundError" in _log(group, "missing")


def test_a_killed_child_reports_its_signal_and_a_killed_server_takes_its_children(group: ProcessGroup) -> None:
    server = group.start_forkserver("forkserver", "forked_demo")
    killed, orphaned = (group.fork(server, name, "forked_demo", ["wait"], None, []) for name in ("killed", "orphan"))
    group.wait_until("both forks", lambda: all(_log(group, n) for n in ("killed", "orphan")), 60)
    assert Path(f"/proc/{killed.pid}/comm").read_text().strip() == "killed"  # named as its log, in ps and top
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    server.process.kill()  # the server gone, its child is signalled by the kernel (PR_SET_PDEATHSIG)
    assert orphaned.wait(timeout=60) is not None
    assert server.gone()
    late = group.fork(server, "late", "forked_demo", ["exit", "0"], None, [])
    with pytest.raises(OSError, match="fork server"):
        _ = late.pid
    assert "not started: the fork server" in _log(group, "late")


def test_stopping_the_group_leaves_nothing_running(group: ProcessGroup) -> None:
    server = group.start_forkserver("forkserver", "forked_demo")
    forked = [group.fork(server, f"demo-{i}", "forked_demo", ["wait"], None, []) for i in range(3)]
    group.wait_until("the forks", lambda: all(_log(group, f"demo-{i}") for i in range(3)), 60)
    assert server.process is not None
    pids = [server.process.pid, *(proc.pid for proc in forked)]
    assert set(pids) <= set(process_tree([os.getpid()]))
    group.stop()
    assert not set(pids) & set(process_tree([os.getpid()]))
    assert all(proc.returncode is not None for proc in forked)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_process_forked_into_a_network_namespace_lives_there(group: ProcessGroup) -> None:
    name = f"efl-fork-{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        server = group.start_forkserver("forkserver", "forked_demo")
        proc = group.fork(server, "namespaced", "forked_demo", ["wait"], name, [])
        group.wait_until("the fork", lambda: _log(group, "namespaced"), 60)
        inside = os.readlink(f"/proc/{proc.pid}/ns/net")
        assert inside == f"net:[{os.stat(f'/run/netns/{name}').st_ino}]" != os.readlink("/proc/self/ns/net")
    finally:
        group.stop()
        subprocess.run(["ip", "netns", "delete", name], check=True)
