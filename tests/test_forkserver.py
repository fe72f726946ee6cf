"""Processes forked from a fork server (``edgefl.forkserver``), as a ``ProcessGroup`` keeps them: each runs its
module's ``main()`` in a session of its own with its output in its log; its exit code comes back as ``Popen``'s
would; requests sent together are all served; a server killed takes its children with it; stopping the group
leaves nothing running. A command started by name through its shim (as SuperExec starts ``flwr-serverapp``) is
forked with the caller's arguments, streams, environment and folder, its exit status and signals passed through;
without a server the shim runs the command itself; another user is refused. A real fork server process, real
forks, sockets and signals; the modules are written here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl.forkserver import ServedCommand, write_shim
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
    if sys.argv[1] == "where":
        print(os.getcwd(), os.environ.get("DEMO"), file=sys.stderr, flush=True)
        return
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


def _listening(address: str) -> bool:
    """Whether a socket listens on the abstract Unix ``address`` (/proc/net/unix: flags __SO_ACCEPTCON; the
    connections it accepted are listed under its name too)."""
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return any(f[-1] == f"@{address}" and f[3] == "00010000" for f in (line.split() for line in lines) if len(f) > 7)


def _shim(group: ProcessGroup, tmp_path: Path, serve: bool = True) -> tuple[dict[str, str], ServedCommand]:
    """A fork server serving ``demo-cmd`` (``forked_demo``) when ``serve``, its shim on PATH; the environment."""
    command = ServedCommand("demo-cmd", "forked_demo", f"edgefl-test-{os.getpid()}-{tmp_path.name}")
    if serve:
        group.start_forkserver("forkserver", "forked_demo", command=command)
        group.wait_until("the fork server's socket", lambda: _listening(command.address), 60)
    fallback = tmp_path / "real-demo-cmd"
    fallback.write_text("#!/bin/sh\necho not forked: $@\nexit 4\n")
    fallback.chmod(0o755)
    shims = write_shim(tmp_path / "bin", command, fallback).parent
    return {**group.env, "PATH": f"{shims}{os.pathsep}{group.env['PATH']}", "DEMO": "carried"}, command


def test_a_command_started_by_name_is_forked_with_the_callers_streams_environment_and_folder(
    group: ProcessGroup, tmp_path: Path
) -> None:
    env, _ = _shim(group, tmp_path)
    (tmp_path / "work").mkdir()
    done = subprocess.run(["demo-cmd", "where"], env=env, cwd=tmp_path / "work", capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    preloaded, pid, _, args = done.stdout.split(" ", 3)
    assert (preloaded, args.strip()) == ("preloaded", "['where']")
    assert done.stderr.split() == [str(tmp_path / "work"), "carried"]
    assert int(pid) not in process_tree([os.getpid()])  # it has ended, reaped by the server
    failed = subprocess.run(["demo-cmd", "exit", "3"], env=env, capture_output=True, timeout=120)
    assert failed.returncode == 3


def test_a_signal_to_the_shim_or_its_parents_end_reaches_its_fork_and_a_shim_gone_takes_its_fork(
    group: ProcessGroup, tmp_path: Path
) -> None:
    env, _ = _shim(group, tmp_path)
    server = next(proc for name, proc in group.procs if name == "forkserver")
    for sig, expected in ((signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)):
        shim = subprocess.Popen(["demo-cmd", "wait"], env=env, stdout=subprocess.PIPE, text=True)
        assert shim.stdout is not None
        pid = int(shim.stdout.readline().split()[1])  # its fork is running
        assert pid in process_tree([server.pid]) and pid not in process_tree([shim.pid])  # the server's child
        shim.send_signal(sig)  # SIGTERM is passed on; SIGKILL hangs up, and the server sends the fork SIGTERM
        assert shim.wait(timeout=60) == expected
        group.wait_until(f"fork {pid} to end", lambda pid=pid: pid not in process_tree([server.pid]), 60)
        shim.stdout.close()
    # the shim's parent ends (as SuperExec does when its SuperLink goes): the fork is sent SIGINT, as Flower's
    # ServerApp stops when its parent is gone
    parent = subprocess.Popen(["sh", "-c", "demo-cmd wait; true"], env=env, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline().split()[1])
    parent.kill()
    assert parent.wait(timeout=60) == -signal.SIGKILL
    group.wait_until(f"fork {pid} to end", lambda: pid not in process_tree([server.pid]), 60)
    parent.stdout.close()


def test_without_its_fork_server_the_shim_runs_the_command_itself(group: ProcessGroup, tmp_path: Path) -> None:
    env, _ = _shim(group, tmp_path, serve=False)
    done = subprocess.run(["demo-cmd", "a", "b"], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (4, "not forked: a b\n")


def test_a_stopping_fork_server_answers_no_new_shim(group: ProcessGroup, tmp_path: Path) -> None:
    """Sent SIGTERM, a fork server waits for its children to end; meanwhile a new shim runs the command itself."""
    env, command = _shim(group, tmp_path)
    server = next(proc for name, proc in group.procs if name == "forkserver")
    shim = subprocess.Popen(["demo-cmd", "wait"], env=env, stdout=subprocess.PIPE, text=True)
    assert shim.stdout is not None
    shim.stdout.readline()  # its fork is running
    server.send_signal(signal.SIGTERM)
    group.wait_until("the socket to close", lambda: not _listening(command.address), 60)
    done = subprocess.run(["demo-cmd", "late"], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (4, "not forked: late\n")
    assert server.poll() is None  # still waiting for its child
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=60) == -signal.SIGTERM
    assert server.wait(timeout=60) == 0
    shim.stdout.close()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root")
def test_the_fork_server_refuses_another_users_request(group: ProcessGroup, tmp_path: Path) -> None:
    _, command = _shim(group, tmp_path)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # as nobody: ask for the command as a shim does
        os.close(reader)
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect("\0" + command.address)
                request = {"argv": ["exit", "0"], "env": {}, "cwd": "/"}
                with contextlib.suppress(BrokenPipeError):  # refused on connecting, before it reads the request
                    socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
                os.write(writer, sock.makefile("rb").readline())
                code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as answer:
        reply = answer.read()
    assert os.waitpid(child, 0)[1] == 0
    assert json.loads(reply) == {"error": f"this fork server serves user {os.getuid()} only"}
