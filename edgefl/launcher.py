"""``edgefl run``: a real Flower deployment on this machine — Flower's own SuperLink and one SuperNode per
client as separate processes, an edge agent beside each SuperNode, the app submitted with ``flwr run`` — then
follow the run's progress and stop everything that was started, on success, error or Ctrl-C.

With a link profile the processes are placed in network namespaces of a ``netem.testbed.Testbed`` (server in
one, each client with its agent in its own), joined by shaped links; without one they share loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from edge.devices import CpuCap, DeviceProfile, device_profile
from edge.protocol import call_agent
from edgefl.config import ConfigError, RunConfig, client_job, save_config
from edgefl.processes import LaunchError, ProcessGroup, free_port, port_in_use, tail
from fl_server.results import CHECKPOINT, GLOBAL_ONNX, ROUNDS, SERVER_ERROR, SUMMARY, read_rounds
from netem.profiles import Link, load_links, resolve_links
from netem.testbed import Testbed

FEDERATION = "edgefl"
STARTUP_TIMEOUT_S = 90.0
SUBMIT_TIMEOUT_S = 120.0

APP_TOML = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "edgefl-app"
version = "0.1.0"
description = "edgefl run: the ServerApp and ClientApp live in the installed edgefl package"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "edgefl"

[tool.flwr.app.components]
serverapp = "{serverapp}"
clientapp = "{clientapp}"

[tool.flwr.app.config]
run-dir = ""
"""

APPS = {
    "edgefl": ("fl_server.app:app", "fl_client.app:app"),
    "flower": ("fl_server.baseline:app", "fl_client.baseline:app"),
}


@dataclass(frozen=True)
class Placement:
    """Where the run's processes live: argv prefixes per host and the address the SuperLink binds."""

    server_host: str
    server_prefix: tuple[str, ...]
    client_prefixes: tuple[tuple[str, ...], ...]
    backend: str


def links_for(config: RunConfig) -> list[Link] | None:
    """The clients' links, or None for plain loopback; raises LinkError for unknown or invalid profiles."""
    if config.profile == "loopback":
        return None
    extra = load_links(config.profiles_file) if config.profiles_file else None
    return resolve_links(config.profile, config.clients, extra)


def devices_for(config: RunConfig) -> list[DeviceProfile]:
    """One emulated device per client from ``rpi4`` (all) or ``rpi4,rpi4,laptop`` (one per client)."""
    names = [name.strip() for name in config.device_profile.split(",")]
    if len(names) not in (1, config.clients):
        raise ConfigError(f"{len(names)} device profiles for {config.clients} clients; give one or one per client")
    profiles = [device_profile(name) for name in names]
    return profiles * config.clients if len(profiles) == 1 else profiles


@contextlib.contextmanager
def placement_for(config: RunConfig) -> Iterator[Placement]:
    links = links_for(config)
    if links is None:
        yield Placement("127.0.0.1", (), ((),) * config.clients, "loopback")
        return
    with Testbed(links, tag=f"{os.getpid() % 100000}") as bed:
        prefixes = tuple(tuple(bed.netns_argv(ns, [])) for ns in bed.client_ns)
        yield Placement(bed.server_ip, tuple(bed.netns_argv(bed.server_ns, [])), prefixes, bed.backend)


def prepare_run_dir(config: RunConfig) -> Path:
    run_dir = Path(config.out).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (ROUNDS, SUMMARY, SERVER_ERROR, CHECKPOINT, GLOBAL_ONNX):
        (run_dir / name).unlink(missing_ok=True)
    return run_dir


def _flower_env(run_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(run_dir / ".flwr"),
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _bin(name: str) -> str:
    """A console script of this Python environment (flower-superlink, flwr, ...)."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else name


class LocalFederation:
    """SuperLink, agents and SuperNodes for one run, inside ``procs``."""

    def __init__(
        self, config: RunConfig, run_dir: Path, place: Placement, procs: ProcessGroup, caps: contextlib.ExitStack
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.place = place
        self.procs = procs
        self.caps = caps
        self.app = "flower" if config.strategy == "flower-fedavg" else "edgefl"

    def superlink_port(self) -> int:
        if self.config.port:
            if self.place.backend == "loopback" and port_in_use("127.0.0.1", self.config.port):
                raise ConfigError(f"port {self.config.port} is in use on 127.0.0.1; pick another with --port")
            return self.config.port
        return free_port()

    def start(self) -> str:
        """Start every process; returns the SuperLink address. Agents import torch while the SuperLink starts."""
        port = self.superlink_port()
        address = f"{self.place.server_host}:{port}"
        sockets = self._start_agents() if self.app == "edgefl" else [""] * self.config.clients
        superlink = [
            _bin("flower-superlink"), "--insecure", "--host", self.place.server_host, "--port", str(port),
            "--disable-runtime-dependency-installation",
        ]  # fmt: skip
        self.procs.start("superlink", [*self.place.server_prefix, *superlink])
        log = self.procs.log_dir / "superlink.log"
        self.procs.wait_until("the SuperLink", lambda: "Uvicorn running on" in tail(log, 50), STARTUP_TIMEOUT_S)
        for sock in sockets:
            if sock:
                self.procs.wait_until(f"edge agent {sock}", lambda s=sock: _agent_ready(s), STARTUP_TIMEOUT_S)
        for i, (prefix, sock) in enumerate(zip(self.place.client_prefixes, sockets, strict=True)):
            node_config = f"partition-id={i} num-partitions={self.config.clients}"
            if sock:
                node_config += f' agent="{sock}"'
            supernode = [
                _bin("flower-supernode"), "--insecure", "--superlink", address,
                "--port", str(free_port()), "--node-config", node_config,
            ]  # fmt: skip
            self.procs.start(f"supernode-{i}", [*prefix, *supernode])
        return address

    def _start_agents(self) -> list[str]:
        """One agent per client, each inside its emulated device's CPU cap (the cap's prefix goes first:
        ``ip netns exec`` hides /sys/fs/cgroup)."""
        sockets = [str(self.run_dir / f".agent-{i}.sock") for i in range(self.config.clients)]
        job = self.run_dir / ".job.json"
        job.write_text(json.dumps(client_job(self.config)))
        tag = str(os.getpid())
        for i, (prefix, sock, device) in enumerate(
            zip(self.place.client_prefixes, sockets, devices_for(self.config), strict=True)
        ):
            cap = self.caps.enter_context(CpuCap(device, f"agent-{i}", tag=tag))
            argv = [sys.executable, "-m", "edge.agent", "--socket", sock, "--job", str(job),
                    "--partition-id", str(i), "--num-partitions", str(self.config.clients)]  # fmt: skip
            self.procs.start(f"agent-{i}", [*cap.argv_prefix(), *prefix, *argv])
        return sockets

    def submit(self, address: str) -> str:
        """``flwr run`` against our SuperLink; returns Flower's run id."""
        app_dir = self.run_dir / ".app"
        app_dir.mkdir(exist_ok=True)
        serverapp, clientapp = APPS[self.app]
        (app_dir / "pyproject.toml").write_text(APP_TOML.format(serverapp=serverapp, clientapp=clientapp))
        flwr_home = self.run_dir / ".flwr"
        flwr_home.mkdir(exist_ok=True)
        (flwr_home / "config.toml").write_text(f'[superlink.{FEDERATION}]\naddress = "{address}"\ninsecure = true\n')
        argv = [
            *self.place.server_prefix,
            _bin("flwr"),
            "run",
            str(app_dir),
            FEDERATION,
            "--format",
            "json",
            "--run-config",
            f"run-dir='{self.run_dir}'",
        ]
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=self.procs.env,
                timeout=SUBMIT_TIMEOUT_S,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            raise LaunchError(f"flwr run did not return within {SUBMIT_TIMEOUT_S:.0f} s") from None
        try:
            result = json.loads(done.stdout)
        except json.JSONDecodeError:
            result = {}
        if done.returncode != 0 or not result.get("success"):
            detail = result.get("error-message") or (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise LaunchError(f"flwr run failed: {detail}")
        return str(result["run-id"])


def _agent_ready(sock: str) -> bool:
    try:
        return "pong" in call_agent(sock, {"op": "ping"}, b"", timeout_s=2.0)[0]
    except OSError:
        return False


def _progress_line(row: dict, rounds: int) -> str:
    return (
        f"round {row['round']:>3}/{rounds}  acc {row['test_accuracy']:.4f}  loss {row['test_loss']:.4f}  "
        f"wall {row['wall_s']:7.1f} s  up {row['bytes_up'] / 1e6:7.2f} MB  down {row['bytes_down'] / 1e6:7.2f} MB"
        + (f"  refused {len(row['rejected'])}" if row["rejected"] else "")
    )


def follow(config: RunConfig, run_dir: Path, procs: ProcessGroup, progress: Callable[[str], None]) -> None:
    """Stream rounds.jsonl until summary.json appears; fail on a server error, a dead process or a stall."""
    stall_s = max(600.0, 3 * config.round_deadline_s)
    shown, last_change = 0, time.monotonic()
    while not (run_dir / SUMMARY).exists():
        if (run_dir / SERVER_ERROR).exists():
            raise LaunchError(f"the server failed: {(run_dir / SERVER_ERROR).read_text().strip()}")
        rows = read_rounds(run_dir)
        for row in rows[shown:]:
            progress(_progress_line(row, config.rounds))
            last_change = time.monotonic()
        shown = len(rows)
        procs.check_alive()
        if time.monotonic() - last_change > stall_s:
            raise LaunchError(f"no round finished for {stall_s:.0f} s; see {run_dir / 'server.log'}")
        time.sleep(0.2)
    for row in read_rounds(run_dir)[shown:]:
        progress(_progress_line(row, config.rounds))


def run(config: RunConfig, progress: Callable[[str], None] = print) -> Path:
    """Run one configuration end to end; returns the run folder."""
    run_dir = prepare_run_dir(config)
    logs = run_dir / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    with placement_for(config) as place:
        config = dataclasses.replace(config, link_backend=place.backend)
        save_config(config, run_dir / "config.toml")
        with contextlib.ExitStack() as caps, ProcessGroup(logs, _flower_env(run_dir)) as procs:
            federation = LocalFederation(config, run_dir, place, procs, caps)
            address = federation.start()
            run_id = federation.submit(address)
            progress(
                f"run {run_id}: {config.strategy} on {config.dataset} ({config.partition}), "
                f"{config.clients} clients, link {config.profile} [{place.backend}]"
            )
            follow(config, run_dir, procs, progress)
    return run_dir
