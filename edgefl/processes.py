"""Starting and stopping the processes of a run. Stopping takes each started process together with every
process it forked (Flower's SuperExec starts the ServerApp, in a session of its own), found by PID through /proc
(Linux) before any signal is sent: SIGTERM, a grace period, then SIGKILL — and SIGKILL to each started
process's group, for a child forked after the tree was read (e.g. an agent's partition worker).

A process started from the main thread is also sent SIGTERM by the kernel when this one ends, however it ends
(``contract.parent``): a launcher killed with SIGKILL leaves nothing running. Each stops what it started in turn
(the SuperLink its SuperExec, which its ServerApp; Flower's ``--parent-pid``)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from contract.errors import EdgeflError
from contract.parent import signal_on_parent_death
from edgefl.forkserver import ForkedProcess, ForkServer, ServedCommand

GRACE_S = 5.0  # between SIGTERM and SIGKILL while a run may still need what its processes hold
ENDED_GRACE_S = 1.0  # once its results are written: what a federation's processes hold is no longer needed, and
# a graceful exit takes seconds (Flower's SuperNode closes its Runtime API after the agent's connections, an
# agent's interpreter unloads torch)


def _raise_interrupt(*_: object) -> NoReturn:
    raise KeyboardInterrupt


def interrupt_on_signals() -> None:
    """Make SIGTERM unwind like Ctrl-C, so every ``with ProcessGroup``/``Testbed`` block stops what it started;
    SIGINT too even when started from a shell that ignores it (background jobs inherit SIG_IGN)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


class LaunchError(EdgeflError):
    """A process of the run could not be started or died; ``str()`` is one line for the user."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def tail_from(path: Path, offset: int) -> str:
    """The complete lines appended to a file since byte ``offset`` (a line still being written waits)."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            data = file.read()
    except OSError:
        return ""
    return data[: data.rfind(b"\n") + 1].decode(errors="replace")


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent PID, start time) of a live process, from /proc; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def process_tree(pids: list[int]) -> dict[int, int]:
    """``pids`` and all their descendants, as PID → start time (to never signal a recycled PID)."""
    stats = {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := _stat(int(e)))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, list(pids)
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree[pid] = stats[pid][1]
            todo.extend(children.get(pid, []))
    return tree


def _signal_all(tree: dict[int, int], sig: signal.Signals) -> None:
    for pid, started in tree.items():
        stat = _stat(pid)
        if stat and stat[1] == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _ends_with_this_process() -> Callable[[], None] | None:
    """A child's set-up that has the kernel send it SIGTERM when this process ends; only when forked from the main
    thread (the kernel's signal follows the forking thread: another thread's end would stop the child early)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(signal_on_parent_death, os.getpid())


class ProcessGroup:
    """The processes of one run; ``stop()`` (or leaving the ``with``) ends every one of them."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.procs: list[tuple[str, subprocess.Popen[bytes] | ForkedProcess]] = []
        self.grace_s = GRACE_S  # between SIGTERM and SIGKILL in ``stop``
        log_dir.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, name: str, argv: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=_ends_with_this_process(),
                    pass_fds=pass_fds,
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {name} ({argv[0]}): {exc.strerror}") from None
        self.procs.append((name, proc))
        return proc

    def start_forkserver(
        self, name: str, *preload: str, command: ServedCommand | None = None, prefix: tuple[str, ...] = ()
    ) -> ForkServer:
        """A fork server (``edgefl.forkserver``) in this group that preloads the modules ``preload``, serving
        ``command``'s shim if given; ``prefix``: its command line's (a network namespace's ``ip netns exec``)."""
        server = ForkServer()
        try:
            argv = [*prefix, *server.argv(*preload, command=command)]
            server.serve(self.start(name, argv, pass_fds=(server.child_fd,)))
        except LaunchError:
            server.close()
            raise
        return server

    def fork(self, server: ForkServer, name: str, module: str, args: list[str], netns: str | None,
             command: list[str]) -> ForkedProcess:  # fmt: skip
        """``python -m module *args`` forked by ``server`` (in network namespace ``netns``), kept as ``name``;
        ``command`` starts the same process without a fork server."""
        proc = server.fork(module, args, self.log_dir / f"{name}.log", netns, command)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise LaunchError(
                    f"{name} exited with code {proc.returncode}; last log lines:\n" + tail(self.log_dir / f"{name}.log")
                )

    def wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``ready`` (a real readiness check, e.g. a connect) until true; fail early if a process died."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise LaunchError(f"{what} was not ready within {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _pids(self) -> list[int]:
        """The PIDs of the started processes (a fork that failed has none)."""
        pids = []
        for _, proc in self.procs:
            with contextlib.suppress(OSError):
                pids.append(proc.pid)
        return pids

    def stop(self) -> None:
        tree = process_tree(self._pids())
        _signal_all(tree, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for _, proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _signal_all(tree, signal.SIGKILL)  # whatever ignored SIGTERM
        for pid in self._pids():  # and what was forked after the tree was read (each started process leads a
            with contextlib.suppress(ProcessLookupError, PermissionError):  # process group its children join)
                os.killpg(pid, signal.SIGKILL)
        for _, proc in self.procs:
            proc.wait()
        self.procs.clear()
