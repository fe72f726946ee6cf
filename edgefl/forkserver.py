"""Agents and SuperNodes forked from a process that imported their code once.

Four agents that each import torch, and four SuperNodes that each import Flower's client, cost a run's start ~20
CPU seconds on a 2-core host before round 1 (``bench/startup.py``): the same modules, imported eight times. A
fork server is a process of the run that imports them once (``preload``: a module's ``preload()`` hook) and then
forks one child per request; each child runs its module's ``main()`` as ``python -m MODULE ARGS`` would, in a
session of its own, with its output in its log, in a network namespace if asked. Agents and SuperNodes each get a
server of their own, so that neither holds the other's modules in its memory (an agent's peak is measured).

A real device starts its agent and SuperNode once, with ``python -m``; this is the local testbed's way to start
many of them at once. The launcher side, ``ForkServer``, hands out ``ForkedProcess`` handles that a
``ProcessGroup`` keeps beside its ``subprocess.Popen`` ones.

A fork server may also serve a command that another program starts by name (``--command NAME MODULE ADDRESS``):
Flower's SuperExec starts ``flwr-serverapp`` from PATH for every run, a process that spends a second importing
Flower's server before it asks for its task. ``write_shim`` puts a script called NAME first on that program's PATH;
the script hands its arguments, environment, working folder and standard streams to the server over the abstract
Unix socket ADDRESS (answered only for this user), which forks MODULE's ``main()`` with them, and stays the
program's child until that fork ends: its exit status is the script's, a signal to it is passed on, and so is the
program's end, as SIGINT. Where no server answers, the script runs the command itself (``exec``), as if it were
not there.

    python -m edgefl.forkserver FD [--command NAME MODULE ADDRESS] MODULE [MODULE ...]
    (FD: the launcher's end of a socket pair)

Requests and replies are JSON lines on the socket: ``{"module", "args", "log", "netns", "name"}`` → ``{"pid"}`` or
``{"error"}``; a child's end → ``{"exited": PID, "code": CODE}`` (its wait status as ``Popen.returncode`` gives it).
A shim sends ``{"argv", "env", "cwd"}`` with its three standard streams (``SCM_RIGHTS``) and gets the same replies.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.parent import signal_on_parent_death, started_at

PR_SET_NAME = 15  # prctl(2)
_prctl = ctypes.CDLL(None, use_errno=True).prctl
POLL_S = 0.05  # how often a handle whose server is gone looks at /proc for its process
FORK_TIMEOUT_S = 300.0  # for a server's answer: its preload takes seconds, tens on a loaded 2-core host
SHIM_TIMEOUT_S = 5.0  # for a shim's request, once it has connected


class ForkedProcess:
    """A process a fork server forked, with the parts of ``subprocess.Popen``'s interface a ``ProcessGroup`` and
    its users use (``pid``, ``args``, ``poll``, ``wait``, ``send_signal``, ``returncode``). Its exit status comes
    from the server, which reaps it; once the server is gone, a process no longer in /proc counts as ended (-1)."""

    def __init__(self, args: list[str], log: Path, server: ForkServer) -> None:
        self.args = args  # the command line that starts it without a fork server (``python -m MODULE ...``)
        self.log = log
        self.returncode: int | None = None
        self._server = server
        self._pid: int | None = None
        self._error = ""
        self._known = threading.Event()  # the pid, or the server's refusal, has come
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        """The child's PID, once the server has forked it (waits for that); OSError if it was not forked."""
        if not self._known.wait(FORK_TIMEOUT_S):
            raise OSError(f"the fork server did not answer within {FORK_TIMEOUT_S:.0f} s")
        if self._pid is None:
            raise OSError(self._error)
        return self._pid

    def poll(self) -> int | None:
        gone = self._pid is None or started_at(self._pid) is None
        if self.returncode is None and self._server.gone() and self._known.is_set() and gone:
            self._set_ended(-1)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._ended.wait(POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic())))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def _forked(self, pid: int | None, error: str = "") -> None:
        self._pid, self._error = pid, error
        self._known.set()
        if pid is None:  # said where a failed start's reason is looked for: its log
            with contextlib.suppress(OSError), open(self.log, "a") as log:
                log.write(f"not started: {error}\n")
            self._set_ended(-1)

    def _set_ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()


class ForkServer:
    """The launcher's side of a fork server: ``process`` runs ``argv()`` with ``child_fd`` passed to it
    (``ProcessGroup.start_forkserver``); ``fork`` sends a request and returns its handle at once (the server answers
    once its preload is done)."""

    def __init__(self) -> None:
        self._sock, child = socket.socketpair()
        self.child_fd = child.detach()
        self.process: subprocess.Popen[bytes] | None = None  # set by ``serve``: the server's process
        self._lock = threading.Lock()
        self._asked: list[ForkedProcess] = []  # requests not answered yet, in order
        self._forked: dict[int, ForkedProcess] = {}
        self._gone = threading.Event()

    def argv(self, *preload: str, command: ServedCommand | None = None) -> list[str]:
        """The server's command line, preloading the modules ``preload`` (each module's ``preload()``) and serving
        ``command``'s shim if given."""
        served = ["--command", command.name, command.module, command.address] if command else []
        return [sys.executable, "-m", "edgefl.forkserver", str(self.child_fd), *served, *preload]

    def serve(self, process: subprocess.Popen[bytes]) -> None:
        """The server process has been started (its end of the socket passed to it): read its answers."""
        self.process = process
        os.close(self.child_fd)
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def fork(self, module: str, args: list[str], log: Path, netns: str | None, command: list[str]) -> ForkedProcess:
        """Ask for ``python -m module *args`` (in network namespace ``netns``, output appended to ``log``);
        ``command``: the same process's command line without a fork server, kept as the handle's ``args``."""
        handle = ForkedProcess(command, log, self)
        request = {"module": module, "args": args, "log": str(log), "netns": netns, "name": log.stem}
        with self._lock:
            if self._gone.is_set():
                handle._forked(None, "the fork server has ended")
                return handle
            self._asked.append(handle)
            with contextlib.suppress(OSError):
                self._sock.sendall(json.dumps(request).encode() + b"\n")
        return handle

    def gone(self) -> bool:
        return self._gone.is_set()

    def close(self) -> None:
        """Close both ends of a server that was never started."""
        with contextlib.suppress(OSError):
            os.close(self.child_fd)
        self._sock.close()
        self._gone.set()

    def _read(self) -> None:
        with self._sock.makefile("rb") as replies:
            for line in replies:
                with contextlib.suppress(ValueError):
                    self._answer(json.loads(line))
        with self._lock:
            self._gone.set()
            for handle in self._asked:
                handle._forked(None, "the fork server ended before it forked")
            self._asked.clear()
        self._sock.close()

    def _answer(self, reply: dict[str, Any]) -> None:
        with self._lock:
            if "exited" in reply:
                handle = self._forked.pop(int(reply["exited"]), None)
                if handle is not None:
                    handle._set_ended(int(reply["code"]))
                return
            handle = self._asked.pop(0)
            if "pid" in reply:
                self._forked[int(reply["pid"])] = handle
                handle._forked(int(reply["pid"]))
            else:
                handle._forked(None, str(reply.get("error", "refused")))


SHIM = """#!{python} -IS
# {name}, forked by edgefl's fork server on the abstract socket {address!r} (edgefl.forkserver); where none
# answers, {fallback} itself.
import ctypes, json, os, signal, socket, sys

PR_SET_PDEATHSIG = 1
parent = os.getppid()
try:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\\0" + {address!r})
    request = {{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}
    socket.send_fds(sock, [json.dumps(request).encode() + b"\\n"], [0, 1, 2])
    replies = sock.makefile("rb")
    pid = json.loads(replies.readline())["pid"]
except (OSError, ValueError, KeyError):
    os.execv({fallback!r}, [{fallback!r}, *sys.argv[1:]])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda sig, _: os.kill(pid, sig))
ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGINT)  # its parent's end, passed on as SIGINT
if os.getppid() != parent:  # it ended before
    os.kill(pid, signal.SIGINT)
for line in replies:
    code = json.loads(line).get("code")
    if code is not None and code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if code is not None:
        sys.exit(code)
sys.exit(1)  # the server ended first, and its child with it
"""


def write_shim(folder: Path, command: ServedCommand, fallback: Path) -> Path:
    """Write ``folder``/NAME, the script that asks the fork server serving ``command`` for its process, or runs
    ``fallback`` (the command itself) where no server answers; put ``folder`` first on PATH to use it."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / command.name
    text = SHIM.format(python=sys.executable, name=command.name, address=command.address, fallback=str(fallback))
    shim.write_text(text)
    shim.chmod(0o755)
    return shim


def _returncode(status: int) -> int:
    """A wait status as ``Popen.returncode`` gives it: the exit code, or minus the signal that ended it."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict[str, Any], server: int, closed: list[int]) -> int:
    """In the forked child: become ``python -m MODULE ARGS`` in a session of its own, its output appended to its
    log (a shim's request: on the shim's streams, in its environment and folder); returns its exit code."""
    os.setsid()
    for fd in closed:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal_on_parent_death(server)
    _prctl(PR_SET_NAME, request["name"].encode()[:15], 0, 0, 0)  # what ps -o comm and top show: agent-0, ...
    if "fds" in request:
        for target, fd in enumerate(request["fds"]):
            os.dup2(fd, target)
        for fd in set(request["fds"]) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
    else:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
    try:
        if request["netns"]:
            from pyroute2 import netns

            netns.setns(request["netns"], flags=0)  # 0: an existing one only
        module = importlib.import_module(request["module"])
        sys.argv = [module.__file__ or request["module"], *request["args"]]
        module.main()
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


@dataclass(frozen=True)
class ServedCommand:
    """A command a fork server forks for the shim that stands in for it (see the module's docstring)."""

    name: str  # what the program starts, e.g. flwr-serverapp
    module: str  # whose main() the fork runs
    address: str  # the abstract Unix socket the shim dials (no leading NUL)


class _Callers:
    """The shims connected to a fork server: each one's socket, by the PID of the child forked for it."""

    def __init__(self, command: ServedCommand) -> None:
        self.command = command
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + command.address)
        self.listener.listen(16)
        self.by_pid: dict[int, socket.socket] = {}

    def listening(self) -> bool:
        return self.listener.fileno() != -1

    def fds(self) -> list[int]:
        """What a forked child closes: the listener and every other shim's socket."""
        listener = [self.listener.fileno()] if self.listening() else []
        return [*listener, *(conn.fileno() for conn in self.by_pid.values())]

    def accept(self) -> tuple[socket.socket, dict[str, Any]] | None:
        """A shim's connection and its request (the child's to fork), or None when refused: another user's, or
        not a request (its reason said to it)."""
        conn, _ = self.listener.accept()
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():
            _say(conn, {"error": f"this fork server serves user {os.getuid()} only"})
            conn.close()
            return None
        conn.settimeout(SHIM_TIMEOUT_S)
        data, fds, refused = b"", [], ""
        try:
            while not data.endswith(b"\n"):
                part, new_fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                fds += new_fds
                if not part:
                    break
                data += part
            shim = json.loads(data)
            request = {"module": self.command.module, "args": [str(a) for a in shim["argv"]],
                       "env": {str(k): str(v) for k, v in shim["env"].items()}, "cwd": str(shim["cwd"]),
                       "fds": fds, "netns": None, "name": self.command.name}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            refused = f"not a request: {exc}"
        if not refused and len(fds) != 3:
            refused = f"not a request: {len(fds)} file descriptors passed, not 3"
        if refused:
            for fd in fds:
                os.close(fd)
            _say(conn, {"error": refused})
            conn.close()
            return None
        conn.settimeout(None)
        return conn, request


def serve(channel: socket.socket, preload: list[str], command: ServedCommand | None = None) -> None:
    """Preload ``preload``, then fork a child per request (the launcher's, and a ``command`` shim's) and report
    each child's end to whoever asked, until the launcher closes the channel (or SIGTERM comes) and every child
    has ended. A shim that hangs up before its child ends has the child sent SIGTERM. The shims' socket is bound
    before the preload: a shim that dials during it waits for its answer."""
    callers = _Callers(command) if command else None
    for name in preload:
        importlib.import_module(name).preload()
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd hears of each child's end
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    if callers:
        selector.register(callers.listener, selectors.EVENT_READ)
    pending = b""  # requests received, up to the last whole line
    open_channel = True
    while (open_channel and not stopping) or children:
        if callers and (stopping or not open_channel) and callers.listening():
            selector.unregister(callers.listener)
            callers.listener.close()  # no new shim is answered: it runs the command itself
        closed = [channel.fileno(), wakeup_r, wakeup_w, *(callers.fds() if callers else [])]
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is channel:
                data = channel.recv(65536)
                if not data:
                    open_channel = False
                    selector.unregister(channel)
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    _fork(json.loads(line), channel, children, closed)
            elif callers and key.fileobj is callers.listener:
                if (asked := callers.accept()) is not None:
                    conn, request = asked
                    pid = _fork(request, conn, children, [*closed, conn.fileno()])
                    for fd in request["fds"]:
                        os.close(fd)
                    if pid is None:
                        conn.close()
                    else:
                        callers.by_pid[pid] = conn
                        selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data is not None:  # a shim's socket readable: it hung up (it sends nothing more)
                with contextlib.suppress(OSError):
                    if not key.fileobj.recv(1):  # type: ignore[union-attr]
                        selector.unregister(key.fileobj)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(key.data, signal.SIGTERM)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup_r, 512)
        for pid, code in _reap(children):
            conn = callers.by_pid.pop(pid, None) if callers else None
            _say(conn or channel, {"exited": pid, "code": code})
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(conn)
                conn.close()


def _fork(request: dict[str, Any], channel: socket.socket, children: set[int], closed: list[int]) -> int | None:
    """Fork ``request``'s child and tell ``channel`` its PID (or why not); returns the PID."""
    server = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        _say(channel, {"error": f"fork: {exc.strerror}"})
        return None
    if pid == 0:
        code = 1
        try:
            code = _child(request, server, closed)
        finally:
            os._exit(code)
    children.add(pid)
    _say(channel, {"pid": pid})
    return pid


def _reap(children: set[int]) -> list[tuple[int, int]]:
    """The children that have ended, each with its exit code (``_returncode``); they leave ``children``."""
    ended = []
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            ended.append((pid, _returncode(status)))
        children.discard(pid)
    return ended


def _say(channel: socket.socket, reply: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        channel.sendall(json.dumps(reply).encode() + b"\n")


def main() -> None:
    fd, *preload = sys.argv[1:]
    command = None
    if preload[:1] == ["--command"]:
        command, preload = ServedCommand(*preload[1:4]), preload[4:]
    serve(socket.socket(fileno=int(fd)), preload, command)


if __name__ == "__main__":
    main()
