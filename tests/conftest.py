"""Shared helpers: run the real ``edgefl`` command (in a fresh interpreter, or in this one through
``edgefl.cli.main``), wait for a run's rows, and find processes a run left behind.

Tests that start a deployment, a simulation or a Flower process are marked ``federation``; the rest, the fast
tier, run with ``pytest -m "not federation"``. The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup``):
tests that share one deployment (``shared_federation``, a module's SuperNode or killed run) or start Ray are marked
with one ``xdist_group`` so that they run on one worker, one after another; every check for what a test left behind
counts only its own processes and namespaces."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from contract.run_folder import SUMMARY, read_rounds

REPO = Path(__file__).resolve().parents[1]


STRANGER_UID = 65534  # nobody


@contextlib.contextmanager
def stranger_listening(family: socket.AddressFamily, address: object) -> Iterator[tuple[int, int]]:
    """A socket of FAMILY bound to ADDRESS by a process of uid 65534 (root only: it forks and switches user); yields
    (the port it is bound to, 0 for a Unix socket; the read end of a pipe on which the process writes how many bytes
    it received on its first connection, once that connection is closed)."""
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the stranger
        try:
            os.setuid(STRANGER_UID)
            with socket.socket(family, socket.SOCK_STREAM) as listener:
                listener.bind(address)
                listener.listen()
                listener.settimeout(60)
                port = listener.getsockname()[1] if family == socket.AF_INET else 0
                os.write(ready_w, port.to_bytes(2, "big"))
                conn, _ = listener.accept()
                conn.settimeout(60)
                received = 0
                while chunk := conn.recv(65536):
                    received += len(chunk)
                os.write(got_w, received.to_bytes(8, "big"))
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(got_w)
    try:
        yield int.from_bytes(os.read(ready_r, 2), "big"), got_r
    finally:
        os.close(ready_r)
        os.close(got_r)
        os.waitpid(pid, 0)


def _cgroup_support() -> str:
    """Why the cgroup tests cannot run here, or "" if they can."""
    from edge.devices import DeviceError, cpu_hierarchy

    if os.geteuid() != 0:
        return "device profiles need root to create cgroups"
    try:
        cpu_hierarchy()
    except DeviceError as error:
        return str(error)
    return ""


needs_cgroups = pytest.mark.skipif(bool(_cgroup_support()), reason=_cgroup_support() or "supported")


def edgefl(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
    """``edgefl ARGS`` as a user types it, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "edgefl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kwargs,
    )


@pytest.fixture
def edgefl_main(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``edgefl ARGS`` in this process, through ``edgefl.cli.main(argv)``: what the command prints and returns, as
    ``edgefl`` gives it from a fresh interpreter (argparse's own errors exit 2 there too). For bad input, which
    fails before anything starts; one case per kind stays a subprocess, as a user types it (``edgefl``)."""
    from edgefl.cli import main

    monkeypatch.chdir(REPO)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main() installs its own

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["edgefl", *args], code, out, err)

    return run


def processes_of(run_dir: Path) -> list[str]:
    """Every live process that belongs to the run in ``run_dir``: Flower processes carry FLWR_HOME under it,
    agents carry their socket path in it on their command line."""
    marker = str(run_dir.resolve()).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if state != "Z" and int(pid) != os.getpid() and (marker in environ or marker in cmdline):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {command}")
    return found


@pytest.fixture
def flower_task() -> Iterator[None]:
    """Flower builds a Message only inside a task (its run, node and task ids): pretend to be one."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    yield path
    left = processes_of(path)
    for line in left:
        os.kill(int(line.split()[0]), 9)
    assert not left, f"processes left running: {left}"


class SharedFederation:
    """A local federation (SuperLink, agents, SuperNodes; over ``profile``'s testbed unless loopback) that
    consecutive tests submit their runs to, one after another, as ``edgefl compare`` does: for tests that assert on
    a run's own folder, not on the devices' processes or logs (which every run on it shares)."""

    def __init__(self, clients: int, profile: str, home: Path) -> None:
        from contract.settings import build_config
        from edgefl.launcher import local_federation

        self.home = home
        self.testbed_before = (namespaces_of(), host_testbed_links()) if profile != "loopback" else None
        self.stack = contextlib.ExitStack()
        config = build_config(dataset="digits", partition="iid", clients=clients, profile=profile, out=str(home))
        self.federation = self.stack.enter_context(local_federation(config, home, lambda line: None))

    def submit(self, run_dir: Path, **settings):
        """Submit the run ``settings`` (``build_config``'s keywords; digits, the federation's clients and links) to
        run in ``run_dir``, checked first as ``edgefl run`` does; returns its ``RunConfig``. ``follow`` waits for
        its end."""
        from contract.run_folder import CONFIG
        from contract.settings import build_config, save_config
        from edgefl.cli import preflight
        from edgefl.launcher import prepare_run_dir

        started = self.federation.config
        settings = {"dataset": "digits", "clients": started.clients, "profile": started.profile, **settings}
        config = build_config(**settings, out=str(run_dir))
        preflight(config)
        prepare_run_dir(config)
        config = dataclasses.replace(
            config, link_backend=started.link_backend, device_backend=started.device_backend
        )  # as ``edgefl.launcher.run_on`` records them
        save_config(config, run_dir / CONFIG)
        self.federation.submit(config, run_dir)
        self.federation.place_devices()
        return config

    def follow(self, config) -> Path:
        """Until the run of ``config`` ends; returns its folder."""
        from edgefl.launcher import follow

        follow(config, Path(config.out), self.federation.procs, lambda line: None)
        return Path(config.out)

    def run(self, run_dir: Path, **settings) -> Path:
        """``submit`` then ``follow``: the run, to its end."""
        return self.follow(self.submit(run_dir, **settings))

    def close(self) -> None:
        self.stack.close()
        left = processes_of(self.home)
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        assert not left, f"processes left running: {left}"
        if self.testbed_before is not None:
            left_behind = (namespaces_of(), host_testbed_links()) != self.testbed_before
            assert not left_behind, "namespaces or host devices left behind"


def namespaces_of(pid: int | None = None) -> set[str]:
    """The network namespaces of the testbeds that process ``pid`` (this one by default) started: the launcher tags
    them with its pid (``edgefl.launcher.placement_for``), so the testbed of a test running beside this one (the
    suite runs on pytest-xdist workers) is not counted."""
    from pyroute2 import netns

    tag = f"efl-{(os.getpid() if pid is None else pid) % 100000}-"
    return {name for name in netns.listnetns() if name.startswith(tag)}


def host_testbed_links() -> set[str]:
    """The testbeds' devices (veths, TUNs, ifbs, each with its qdiscs) that are in the host's namespace: none, while
    every testbed keeps its devices in its own namespaces."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        return {name for link in ip.get_links() if (name := link.get_attr("IFLA_IFNAME")).startswith("efl")}


_shared: dict[tuple[int, str], SharedFederation] = {}  # one at a time


def _close_shared() -> None:
    while _shared:
        _shared.popitem()[1].close()


@pytest.fixture
def shared_federation(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., SharedFederation]:
    """``shared_federation(clients, profile="loopback")``: a running ``SharedFederation``, started by the first
    test that asks for it and kept for the next test while that one asks for it too; stopped (and found to leave
    nothing running) after the last, or after a test that failed (one of its runs may still go on)."""

    def get(clients: int, profile: str = "loopback") -> SharedFederation:
        if (clients, profile) not in _shared:
            _close_shared()
            home = tmp_path_factory.mktemp(f"federation-{clients}-{profile}")
            _shared[clients, profile] = SharedFederation(clients, profile, home)
        return _shared[clients, profile]

    return get


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A shared federation lives only while consecutive tests use it (no idle processes beside other tests), and
    not past a failed test."""
    shared_next = nextitem is not None and "shared_federation" in getattr(nextitem, "fixturenames", ())
    if not shared_next or item.stash.get(_FAILED, False):
        _close_shared()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _close_shared()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest first: the ``xdist_group``s (each sent to one worker as a whole, ``--dist loadgroup``: a shared
    federation, a module's deployment, Ray), each group's tests one after another; then the other tests that start
    a deployment; then the rest, so that on pytest-xdist's workers the short ones fill the gaps at the end."""

    def key(item: pytest.Item) -> tuple[bool, bool, str]:
        group = item.get_closest_marker("xdist_group")
        return item.get_closest_marker("federation") is None, group is None, group.args[0] if group else ""

    items.sort(key=key)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a pytest-xdist worker under ``--dist loadgroup``: fail a test of an ``xdist_group`` that the scheduler
    was not told the group of. pytest-xdist tells it by a suffix of the test's node id, which pytest 9.2 no longer
    takes (pytest-dev/pytest-xdist#1386): the group's tests would run on both workers, side by side, each worker
    starting its own shared federation or Ray head. ``constraints.txt`` pins a pair that works."""
    if not item.config.getoption("loadgroup", False):
        return
    names = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
    if names and not item.nodeid.endswith("@" + "_".join(names)):
        pytest.fail(
            f"pytest {pytest.__version__} with this pytest-xdist does not keep xdist_group {names[0]!r} on one "
            "worker (pytest-dev/pytest-xdist#1386): install the versions in constraints.txt",
            pytrace=False,
        )


def start_edgefl(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "edgefl.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def rows_so_far(run_dir: Path) -> list[dict]:
    """rounds.jsonl as far as it is written (a row being appended is read on the next poll)."""
    with contextlib.suppress(json.JSONDecodeError):
        return read_rounds(run_dir)
    return []


def wait_for_rows(
    run_dir: Path,
    ready: int | Callable[[list[dict]], bool] = 1,
    what: str = "",
    timeout_s: float = 180,
    proc: subprocess.Popen[str] | None = None,
) -> list[dict]:
    """Until the run's rows (``rows_so_far``) hold ``ready`` rows, or satisfy ``ready``; returns them. Fails as
    soon as the run ended (its summary, or ``proc`` exited) or the time ran out, with the rows so far."""
    if isinstance(ready, int):
        count, what = ready, what or f"{ready} rows"
        ready = lambda rows: len(rows) >= count  # noqa: E731
    deadline = time.monotonic() + timeout_s
    while not ready(rows := rows_so_far(run_dir)):
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{what}: the run exited {proc.returncode} first; rows {rows}\n{out}{err}")
        assert not (run_dir / SUMMARY).exists(), f"{what}: the run ended first; rows {rows}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s; rows {rows}"
        time.sleep(0.1)
    return rows
