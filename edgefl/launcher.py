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
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from contract.errors import EdgeflError
from contract.flower import FLOWER_CONFIG_FILE, flwr_run, serverapp_command
from contract.run_folder import (
    CHECKPOINT,
    CONFIG,
    ECHO_KEY,
    GLOBAL_ONNX,
    MESSAGES,
    REMOTE_RUN,
    ROUNDS,
    SERVER_ERROR,
    SERVER_LOG,
    SUMMARY,
    Mirror,
    read_echo_key,
    read_rounds,
    remote_folder_name,
)
from contract.settings import ConfigError, RunConfig, parse_address, save_config
from contract.uploads import ENV as UPLOADS_ENV
from edge.devices import NO_CAP, AgentThreads, DeviceCaps, DeviceError, HostFollower, cpu_hierarchy
from edgefl.certs import ServerCerts, make_node_keys, make_server_certs
from edgefl.forkserver import ForkServer, ServedCommand, write_shim
from edgefl.gateway import Gateway, Submitter, gateway_folder, open_submit_tunnel
from edgefl.processes import (
    ENDED_GRACE_S,
    GRACE_S,
    LaunchError,
    ProcessGroup,
    free_port,
    port_in_use,
    tail,
    tail_from,
)
from netem.fleet import devices_for, links_for
from netem.testbed import Testbed
from strategies.registry import app_of

FEDERATION = "edgefl"
STARTUP_TIMEOUT_S = 90.0
SUBMIT_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 30.0  # how long a remote SuperLink may stay unreachable before a command gives up
CLIENT_PROCESSES = ("agent-", "supernode-")  # ProcessGroup names of a client's processes
FORKSERVER = "forkserver-"  # ProcessGroup names of the fork servers of the clients' processes (not a client's own)
RUN_LOG = "run-log"  # a remote run's streamed ServerApp log (flwr log --stream)
LAST_WORD_WAIT_S = 30.0  # how long a stopped remote run's checkpoint and error may take to come back
RUNTIME_HOST = "127.0.0.1"  # a SuperNode's Runtime API, where its agent claims tasks: the device's loopback only
JOINED = "SuperNode ID:"  # flower-supernode logs this once the SuperLink has accepted the node
SHIMS = ".bin"  # in a run's (or server's) folder, first on its processes' PATH: the warm ServerApp's shim
WARM_SERVERAPP = "forkserver-serverapp"  # ProcessGroup name of the fork server of the ServerApps (fl_server.warm)

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
    testbed: Testbed | None = None  # the namespaced testbed, for fault injection (set_link_up, loss_burst, stall)


@contextlib.contextmanager
def placement_for(config: RunConfig) -> Iterator[Placement]:
    if config.federation == "remote":
        yield Placement(parse_address(config.server)[0], (), (), "remote")
        return
    links = links_for(config)
    if links is None:
        yield Placement("127.0.0.1", (), ((),) * config.clients, "loopback")
        return
    with Testbed(links, tag=f"{os.getpid() % 100000}") as bed:
        prefixes = tuple(tuple(bed.netns_argv(ns, [])) for ns in bed.client_ns)
        yield Placement(bed.server_ip, tuple(bed.netns_argv(bed.server_ns, [])), prefixes, bed.backend, bed)


def prepare_run_dir(config: RunConfig, resume: bool = False) -> Path:
    """A fresh run starts from an empty folder; a resumed one needs its checkpoint (the server continues from it;
    a remote server from its own copy, in the folder ``REMOTE_RUN`` names)."""
    run_dir = Path(config.out).resolve()
    if resume:
        if not (run_dir / CHECKPOINT).exists():
            raise LaunchError(f"nothing to resume: {run_dir} has no {CHECKPOINT} (no round was finished)")
        if (run_dir / SUMMARY).exists():
            raise LaunchError(f"nothing to resume: the run in {run_dir} has finished")
        if config.federation == "remote" and not (run_dir / REMOTE_RUN).exists():
            raise LaunchError(f"nothing to resume: {run_dir} does not name the server's folder of the run")
        (run_dir / SERVER_ERROR).unlink(missing_ok=True)
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (ROUNDS, MESSAGES, SUMMARY, SERVER_ERROR, CHECKPOINT, GLOBAL_ONNX, REMOTE_RUN):
        (run_dir / name).unlink(missing_ok=True)
    return run_dir


FLOWER_INTERNAL = "FLWR_INTERNAL_"  # flwr.common.constant's FLWR_INTERNAL_GRPC_CONTROL_API, ..._FLEET_API


def flower_env(run_dir: Path) -> dict[str, str]:
    """The environment of every Flower process, without Flower's ``FLWR_INTERNAL_*`` switches. This Python's scripts
    come first on PATH, after the folder of the warm ServerApp's shim (``start_superlink``): the SuperLink and
    SuperNode start ``flower-superexec`` and the ``flwr-*`` apps by name, also when the venv is not activated."""
    env = {  # Flower's FLWR_INTERNAL_* switches open its legacy gRPC APIs unauthenticated on every address
        name: value for name, value in os.environ.items() if not name.startswith(FLOWER_INTERNAL)
    }
    env.pop(UPLOADS_ENV, None)  # only a gateway started beside the SuperLink sets it
    env.update(
        PATH=os.pathsep.join([str(run_dir / SHIMS), str(Path(sys.executable).parent), env.get("PATH", "")]),
        FLWR_HOME=str(run_dir / ".flwr"),
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        RAY_USAGE_STATS_ENABLED="0",  # a simulation's Ray: no usage report sent anywhere
    )
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # Flower's processes send no usage events unless the user asks
    return env


def app_for(config: RunConfig) -> str:
    """The key in APPS of the apps that run ``config``."""
    return app_of(config.strategy_spec)


def superlink_argv(host: str, port: int, certs: ServerCerts | None, node_auth: bool = False) -> list[str]:
    """Flower's SuperLink serving every API on HOST:PORT: TLS with ``certs``, plain text without; with
    ``node_auth`` only SuperNodes whose public keys were registered (``flwr supernode register``) may join."""
    tls = ["--insecure"]
    if certs:
        tls = ["--ssl-ca-certfile", str(certs.ca), "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)]
    auth = ["--enable-supernode-auth"] if node_auth else []
    return ["flower-superlink", *tls, *auth,
            "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]  # fmt: skip


def supernode_argv(
    address: str,
    root_cert: Path | None,
    node_config: str,
    auth_key: Path | None = None,
    serve: NodeRuntime | None = None,
) -> list[str]:
    """A SuperNode for the SuperLink at ``address``, verifying its certificate with ``root_cert`` (plain text
    without), authenticated with the private key ``auth_key`` if given. With ``serve`` it is edgefl's tuned
    SuperNode whose tasks an edge agent serves (``--isolation process``); without, Flower's stock one, which starts
    a ClientApp process per message. It retries a lost SuperLink without limit (no --max-retries). edgefl's ends
    when this process does (``--parent-pid``; Flower's, started by a ProcessGroup, is signalled by the kernel)."""
    tls = ["--root-certificates", str(root_cert)] if root_cert else ["--insecure"]
    auth = ["--auth-supernode-private-key", str(auth_key)] if auth_key else []
    if serve is None:
        runtime = ["flower-supernode", "--port", str(free_port())]
    else:
        runtime = [sys.executable, "-m", "fl_client.supernode", "--parent-pid", str(os.getpid()),
                   "--isolation", "process", "--host", RUNTIME_HOST, "--port", str(serve.port),
                   "--superexec-auth-secret-file", str(serve.secret_file)]  # fmt: skip
    return [*runtime, *tls, *auth, "--superlink", address, "--node-config", node_config]


@dataclass(frozen=True)
class NodeRuntime:
    """Where a SuperNode's agent claims its tasks: the Runtime API port on the device's loopback, and the
    SuperExec secret that signs each claim (so no other process on the device can take them)."""

    port: int
    secret_file: Path
    ready_file: Path  # the agent writes it once its data is loaded: AgentReady
    held_dir: Path  # the tasks the agent is serving (fl_client.tasks.HeldTask), for the agent that restarts

    @classmethod
    def create(cls, folder: Path, name: str) -> NodeRuntime:
        secret_file, ready_file, held_dir = (folder / f".{name}.{kind}" for kind in ("secret", "ready", "tasks"))
        secret_file.unlink(missing_ok=True)
        secret_file.touch(mode=0o600)
        secret_file.write_bytes(secrets.token_bytes(32))
        ready_file.unlink(missing_ok=True)
        shutil.rmtree(held_dir, ignore_errors=True)  # held for a SuperNode that is gone
        return cls(free_port(RUNTIME_HOST), secret_file, ready_file, held_dir)

    def agent_argv(self, *extra: str) -> list[str]:
        """The agent's command line; it ends when this process does (``--parent-pid``)."""
        return [sys.executable, "-m", "fl_client.node", "--runtime-api", f"{RUNTIME_HOST}:{self.port}",
                "--secret-file", str(self.secret_file), "--ready-file", str(self.ready_file),
                "--held-tasks", str(self.held_dir), "--parent-pid", str(os.getpid()), *extra]  # fmt: skip


def start_superlink(procs: ProcessGroup, argv: list[str], prefix: tuple[str, ...] = (), warm: bool = True) -> None:
    """Start the SuperLink (``prefix``: where, e.g. ``ip netns exec NS``) and return once it serves: its log says so
    after this start (a resumed run's log holds the killed SuperLink's lines too). With ``warm``, each run's
    ServerApp is forked from a process that imported it once (``fl_server.warm``) where Flower's SuperExec is the
    code ``contract.flower.LAUNCH_SOURCE`` was checked against; Flower starts its own otherwise."""
    log = procs.log_dir / "superlink.log"
    offset = log.stat().st_size if log.exists() else 0
    shims = Path(procs.env["FLWR_HOME"]).parent / SHIMS
    shutil.rmtree(shims, ignore_errors=True)  # an earlier server's, in this folder
    procs.start("superlink", [*prefix, *argv])
    if warm:
        start_warm_serverapp(procs, prefix, shims)
    procs.wait_until("the SuperLink", lambda: "Uvicorn running on" in tail_from(log, offset), STARTUP_TIMEOUT_S)


def start_warm_serverapp(procs: ProcessGroup, prefix: tuple[str, ...], shims: Path) -> None:
    """The fork server of the runs' ServerApps and, in ``shims`` (first on the SuperLink's PATH: ``flower_env``),
    the shim SuperExec starts by the ServerApp's command name (``edgefl.forkserver``); nothing where the installed
    flwr starts its ServerApp otherwise (``contract.flower.serverapp_command``)."""
    name = serverapp_command()
    if name is None:
        return
    command = ServedCommand(name, "fl_server.warm", f"edgefl-serverapp-{os.getpid()}-{secrets.token_hex(6)}")
    procs.start_forkserver(WARM_SERVERAPP, "fl_server.warm", command=command, prefix=prefix)
    fallback = Path(sys.executable).parent / name
    write_shim(shims, command, fallback)


def reach_superlink(address: str, root_cert: Path | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Return once a TCP connection to the SuperLink opens (retried for ``timeout_s``) and, with ``root_cert``,
    its TLS certificate verifies against that CA for the host dialled; else raise LaunchError with the reason."""
    host, port = parse_address(address)
    context = None
    if root_cert:
        try:
            context = ssl.create_default_context(cafile=str(root_cert))
        except (OSError, ssl.SSLError) as exc:
            raise LaunchError(f"cannot use {root_cert} as root certificate: {exc.strerror or exc}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=5.0) as sock:
                if context:
                    context.wrap_socket(sock, server_hostname=host).close()
            return
        except ssl.SSLCertVerificationError as exc:
            raise LaunchError(
                f"the SuperLink at {address} presents a certificate that {root_cert} does not verify "
                f"({exc.verify_message}): wrong --root-cert, or a host name the certificate does not list"
            ) from None
        except ssl.SSLError as exc:
            raise LaunchError(f"no TLS with {address} ({exc.reason}): if it runs --insecure, use --insecure") from None
        except socket.gaierror:
            raise LaunchError(f"cannot resolve the host name {host!r} of the SuperLink") from None
        except OSError as exc:
            if time.monotonic() > deadline:
                reason = exc.strerror or str(exc) or type(exc).__name__
                raise LaunchError(f"cannot reach the SuperLink at {address} in {timeout_s:.0f} s ({reason})") from None
            time.sleep(1.0)


def write_flwr_home(flwr_home: Path, address: str, root_cert: Path | None) -> None:
    """``$FLWR_HOME/config.toml`` naming the SuperLink at ``address`` as federation FEDERATION for ``flwr``."""
    tls: dict[str, str | bool] = {"root-certificates": str(root_cert.resolve())} if root_cert else {"insecure": True}
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / FLOWER_CONFIG_FILE).write_text(tomli_w.dumps({"superlink": {FEDERATION: {"address": address, **tls}}}))


def run_flwr(args: list[str], env: dict[str, str], prefix: tuple[str, ...] = ()) -> dict:
    """``flwr ARGS --format json`` against federation FEDERATION of ``env``'s FLWR_HOME; its JSON answer."""
    try:
        done = subprocess.run(
            [*prefix, "flwr", *args, "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=SUBMIT_TIMEOUT_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        raise LaunchError(f"flwr {args[0]} did not return within {SUBMIT_TIMEOUT_S:.0f} s") from None
    try:
        result = json.loads(done.stdout)
    except json.JSONDecodeError:
        result = {}
    if done.returncode != 0 or not result.get("success"):
        detail = result.get("error-message") or (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise LaunchError(f"flwr {args[0]} failed: {detail}")
    return result


def app_project(app: str, config: RunConfig, run_dir: Path | None, resume_folder: str = "") -> dict:
    """The pyproject of the app ``flwr run`` packages: the components of ``app`` (a key of APPS) and, as its run
    config, the run's settings and the folder to write (None: the server picks one and echoes it back; or goes on
    in ``resume_folder``, its folder of the run resumed)."""
    serverapp, clientapp = APPS[app]
    return {
        "build-system": {"requires": ["setuptools>=68"], "build-backend": "setuptools.build_meta"},
        "project": {"name": "edgefl-app", "version": "0.1.0", "license": "Apache-2.0", "dependencies": [],
                    "description": "edgefl run: the ServerApp and ClientApp live in the installed edgefl package"},
        "tool": {"flwr": {"app": {
            "publisher": "edgefl",
            "components": {"serverapp": serverapp, "clientapp": clientapp},
            "config": {"run-dir": str(run_dir or ""), "resume-folder": resume_folder, **config.to_run_config()},
        }}},
    }  # fmt: skip


def submit(
    config: RunConfig,
    run_dir: Path,
    address: str,
    root_cert: Path | None,
    env: dict[str, str],
    prefix: tuple[str, ...] = (),
    shared: bool = True,
) -> str:
    """``flwr run`` of ``config`` on the SuperLink at ``address``; ``shared``: the server writes ``run_dir``
    itself (same machine), else it names its own folder of the run in ``run_dir``'s REMOTE_RUN — and a run whose
    folder holds a checkpoint is a resumed one (``prepare_run_dir`` leaves one only then). Returns Flower's run
    id."""
    app_dir = run_dir / ".app"
    app_dir.mkdir(exist_ok=True)
    remote_run = run_dir / REMOTE_RUN
    resumed = not shared and (run_dir / CHECKPOINT).exists() and remote_run.exists()
    resume_folder = remote_run.read_text().strip() if resumed else ""
    project = app_project(app_for(config), config, run_dir if shared else None, resume_folder)
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(project))
    write_flwr_home(Path(env["FLWR_HOME"]), address, root_cert)
    run_id = None
    if not prefix:  # Flower's CLI called here, where its code is what contract.flower checked
        try:
            run_id = flwr_run(app_dir, FEDERATION, Path(env["FLWR_HOME"]))
        except EdgeflError as exc:
            raise LaunchError(f"flwr run failed: {exc}") from None
    if run_id is None:  # from the server's network namespace, or another flwr: its command
        run_id = str(run_flwr(["run", str(app_dir), FEDERATION], env, prefix)["run-id"])
    if not shared and not resumed:
        remote_run.write_text(remote_folder_name(config.name, run_id) + "\n")
    return run_id


def device_caps(
    config: RunConfig, stack: contextlib.ExitStack, progress: Callable[[str], None]
) -> tuple[list[DeviceCaps], str]:
    """Each client's emulated device (``edge.devices.DeviceCaps``, entered on ``stack`` with a ``HostFollower``
    that sets their quotas again as this host's speed moves), and how they are emulated, for the run's record:
    "none" (no profile caps anything), "cgroup-v1" / "cgroup-v2", or "uncapped: REASON" when this machine cannot
    cap a CPU (said in one line; the run goes on uncapped)."""
    devices = devices_for(config) if app_for(config) == "edgefl" else []  # Flower's own clients stay uncapped
    uncapped = [DeviceCaps(NO_CAP, "none")] * config.clients
    if all(device.speeds is None for device in devices):
        return uncapped, "none"
    tag = str(os.getpid())
    with contextlib.ExitStack() as trial:
        try:
            shares = {device: device.shares() for device in set(devices)}
            caps = [trial.enter_context(DeviceCaps(shares[d], f"device-{i}", tag=tag)) for i, d in enumerate(devices)]
        except DeviceError as exc:
            progress(f"device profiles not applied, running uncapped: {exc}")
            return uncapped, f"uncapped: {exc}"
        stack.enter_context(trial.pop_all())
    stack.enter_context(HostFollower(list(zip(caps, devices, strict=True)), say=progress))
    return caps, f"cgroup-v{cpu_hierarchy()[0]}"


class LocalFederation:
    """SuperLink, agents and SuperNodes inside ``procs``, started for runs like ``config`` (its app, links, devices
    and clients), with their secrets, certificates and the agents' first job in ``home``; ``caps``: each client's
    emulated device. Runs are submitted to it one after another (``run_on``)."""

    def __init__(
        self, config: RunConfig, home: Path, place: Placement, procs: ProcessGroup, caps: list[DeviceCaps]
    ) -> None:
        self.config = config
        self.run_dir = home
        self.place = place
        self.procs = procs
        self.caps = caps
        self.app = app_for(config)
        self.certs: ServerCerts | None = None  # TLS on a non-loopback SuperLink address
        self.node_keys: list[Path] = []  # each device's SuperNode key there (node authentication)
        self.runtimes: list[NodeRuntime | None] = []
        self.address = ""  # where runs are submitted
        self.device_address = ""  # where devices dial: the gateway, or the SuperLink itself on loopback
        self.placed = False

    def superlink_port(self) -> int:
        if self.config.port:
            if self.place.backend == "loopback" and port_in_use("127.0.0.1", self.config.port):
                raise ConfigError(f"port {self.config.port} is in use on 127.0.0.1; pick another with --port")
            return self.config.port
        return free_port()

    def start(self) -> str:
        """Start every process; returns the address devices dial. The SuperLink first, alone (a run's submission
        waits for it); then agents and SuperNodes, forked from two fork servers (``edgefl.forkserver``: their
        modules imported once, not once each) that import while the run is submitted; agents load their data while
        the SuperNodes join (an agent serves its SuperNode once it is ready). Forks are asked for, not waited for."""
        port = self.superlink_port()
        address = self.device_address = f"{self.place.server_host}:{port}"
        if self.place.backend == "loopback":
            self.address = address
            start_superlink(self.procs, superlink_argv("127.0.0.1", port, None), warm=self.app == "edgefl")
        else:  # devices in other namespaces reach the SuperLink as over a network: through the gateway, with TLS and
            # node authentication, as edgefl server runs it
            self.certs = make_server_certs(self.run_dir / ".certs", [self.place.server_host])
            self.node_keys = make_node_keys(self.run_dir / ".certs", self.config.clients)
            local_port = free_port()
            self.address = f"127.0.0.1:{local_port}"  # the server's own loopback, where runs are submitted
            argv = superlink_argv("127.0.0.1", local_port, self.certs, node_auth=True)
            self.procs.env[UPLOADS_ENV] = str(gateway_folder(self.procs.log_dir))  # where its runs bound uploads
            start_superlink(self.procs, argv, self.place.server_prefix, warm=self.app == "edgefl")
            gateway = Gateway(self.place.server_host, port, local_port, self.certs, superlink_tls=True)
            gateway.start(self.procs, self.place.server_prefix)
            self._register_nodes()
        agents = nodes = None
        if self.app == "edgefl":
            agents = self.procs.start_forkserver(f"{FORKSERVER}agents", "fl_client.node")
            nodes = self.procs.start_forkserver(f"{FORKSERVER}supernodes", "fl_client.supernode")
        self.runtimes = self._start_agents(agents) if agents else [None] * self.config.clients
        for i, runtime in enumerate(self.runtimes):
            node_config = f"partition-id={i} num-partitions={self.config.clients}"
            key = self.node_keys[i] if self.node_keys else None
            supernode = supernode_argv(address, self.certs.ca if self.certs else None, node_config, key, runtime)
            self._start_client_process(nodes if runtime else None, f"supernode-{i}", i, supernode)
        return address

    def _register_nodes(self) -> None:
        """Register each device's public key with the SuperLink (``flwr supernode register``, side by side, from the
        server's namespace): only those SuperNodes may join."""
        assert self.certs is not None
        write_flwr_home(Path(self.procs.env["FLWR_HOME"]), self.address, self.certs.ca)
        with ThreadPoolExecutor(max_workers=len(self.node_keys)) as pool:
            register = [["supernode", "register", str(key.with_suffix(".pub")), FEDERATION] for key in self.node_keys]
            calls = [pool.submit(run_flwr, args, self.procs.env, self.place.server_prefix) for args in register]
            for call in calls:
                call.result()

    def _start_client_process(self, server: ForkServer | None, name: str, client: int, argv: list[str]) -> None:
        """Client ``client``'s process ``argv`` in its place: forked by ``server`` when given (``argv`` is then a
        ``python -m MODULE ...``), started as a command otherwise."""
        command = [*self.place.client_prefixes[client], *argv]
        if server is None:
            self.procs.start(name, command)
            return
        netns = self.place.testbed.client_ns[client] if self.place.testbed else None
        self.procs.fork(server, name, argv[2], argv[3:], netns, command)

    def place_devices(self) -> None:
        """Put each agent on its device's cores once it is ready and each SuperNode once it has joined the
        SuperLink (their start-up stays off the device: a real device's agent and SuperNode start once, not per
        run; the first round starts only after every agent has answered who it is). Once per federation."""
        if self.placed:
            return
        self.placed = True
        for i, (cap, runtime) in enumerate(zip(self.caps, self.runtimes, strict=True)):
            if runtime is None:
                continue
            self.procs.wait_until(f"edge agent {i}", runtime.ready_file.exists, STARTUP_TIMEOUT_S)
            if cap.path is None:
                continue
            AgentThreads.load(runtime.ready_file).place(cap)
            name = f"supernode-{i}"
            log = self.procs.log_dir / f"{name}.log"
            self.procs.wait_until(f"SuperNode {i} to join", lambda log=log: JOINED in tail(log, 200), STARTUP_TIMEOUT_S)
            cap.place("supernode", dict(self.procs.procs)[name].pid)

    def _start_agents(self, server: ForkServer) -> list[NodeRuntime]:
        """One agent per client, forked by ``server``, uncapped; ``place_devices`` puts it on its device's cores once
        it is ready."""
        job = self.run_dir / ".job.json"
        job.write_text(self.config.client_job().to_json())
        runtimes = []
        for i in range(self.config.clients):
            runtime = NodeRuntime.create(self.run_dir, f"node-{i}")
            argv = runtime.agent_argv("--job", str(job), "--partition-id", str(i),
                                      "--num-partitions", str(self.config.clients))  # fmt: skip
            self._start_client_process(server, f"agent-{i}", i, argv)
            runtimes.append(runtime)
        return runtimes

    def submit(self, config: RunConfig, run_dir: Path) -> str:
        """``flwr run`` of ``config`` against our SuperLink (from the server's namespace, on its loopback); returns
        Flower's run id."""
        root_cert = self.certs.ca if self.certs else None
        return submit(config, run_dir, self.address, root_cert, self.procs.env, self.place.server_prefix)


def echo_key(config: RunConfig) -> bytes | None:
    """The echo secret beside the submitter's certificate (``contract.run_folder.ECHO_KEY``); None without TLS."""
    if not config.submitter_cert:
        return None
    path = Path(config.submitter_cert).resolve().parent / ECHO_KEY
    try:
        return read_echo_key(path)
    except (OSError, ValueError):
        raise ConfigError(
            f"no echo secret at {path}: the server signs a run's results with the {ECHO_KEY} edgefl certs "
            "--submitters wrote beside the submitter certificates; copy it there"
        ) from None


def submit_remote(config: RunConfig, run_dir: Path, procs: ProcessGroup) -> tuple[str, Path]:
    """Submit ``config`` to the running server at ``config.server`` once it is reachable with the configured TLS
    (its ServerApp waits for ``config.clients`` SuperNodes to join) and stream the run's log here: returns
    Flower's run id and the log file, whose echoed results ``follow`` mirrors into ``run_dir``. Over TLS both go
    through a tunnel that presents the submitter's certificate to the server's gateway (``edgefl.gateway``)."""
    root_cert = Path(config.root_cert).resolve() if config.root_cert else None
    reach_superlink(config.server, root_cert, config.connect_timeout_s)
    address = config.server
    if root_cert:
        submitter = Submitter.from_cert(Path(config.submitter_cert))
        address = open_submit_tunnel(procs, config.server, root_cert, submitter)
    run_id = submit(config, run_dir, address, None, procs.env, shared=False)
    procs.start(RUN_LOG, ["flwr", "log", run_id, FEDERATION, "--stream"])
    return run_id, procs.log_dir / f"{RUN_LOG}.log"


def _fmt(value: float | None) -> str:
    return "  —   " if value is None else f"{value:.4f}"


def _progress_line(row: dict, rounds: int) -> str:
    return (
        f"round {row['round']:>3}/{rounds}  acc {_fmt(row['test_accuracy'])}  loss {_fmt(row['test_loss'])}  "
        f"wall {row['wall_s']:7.1f} s  up {row['bytes_up'] / 1e6:7.2f} MB  down {row['bytes_down'] / 1e6:7.2f} MB"
        + (f"  refused {len(row['rejected'])}" if row["rejected"] else "")
    )


def _check_server_alive(procs: ProcessGroup, run_dir: Path) -> None:
    """A client's agent or SuperNode may die (and come back): the run goes on with the others. The SuperLink (or
    a simulation) may not, unless it ended after writing the run's summary."""
    for name, proc in procs.procs:
        if not name.startswith((*CLIENT_PROCESSES, RUN_LOG)) and proc.poll() is not None:
            if (run_dir / SUMMARY).exists():
                return
            raise LaunchError(f"{name} exited with code {proc.returncode}; see {procs.log_dir / name}.log")


class EchoStream:
    """A remote run's streamed log (``procs``'s process RUN_LOG, writing ``log``), mirrored into ``run_dir`` as it
    grows (``contract.run_folder.Mirror``); what the mirror refuses is said with ``progress``."""

    def __init__(
        self, log: Path, run_dir: Path, procs: ProcessGroup, progress: Callable[[str], None], key: bytes | None = None
    ) -> None:
        """``key``: the server's echo secret (``echo_key``): every echoed line must be signed with it."""
        self.log = log
        self.run_dir = run_dir
        self.stream = dict(procs.procs)[RUN_LOG]
        self.progress = progress
        self.mirror = Mirror(run_dir, key)
        self.offset = 0

    def pull(self) -> bool:
        """Mirror what the log gained; returns whether the stream has ended (and all it said is mirrored)."""
        ended = self.stream.poll() is not None
        text = tail_from(self.log, self.offset)
        self.offset += len(text.encode())
        for reason in self.mirror.feed(text) + (self.mirror.close() if ended else []):
            self.progress(f"not mirrored: {reason}")
        return ended

    def await_last_word(self, timeout_s: float = LAST_WORD_WAIT_S) -> None:
        """After a stop: mirror until the run's last word (its error or summary, the checkpoint before it) has come,
        the stream has ended, or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        said = False
        while not self.pull() and not any((self.run_dir / name).exists() for name in (SUMMARY, SERVER_ERROR)):
            if not said:
                self.progress(f"waiting up to {timeout_s:.0f} s for the stopped run's checkpoint")
                said = True
            if time.monotonic() > deadline:
                self.progress(f"the stopped run's checkpoint did not come within {timeout_s:.0f} s; see {self.log}")
                return
            time.sleep(0.2)


def follow(
    config: RunConfig,
    run_dir: Path,
    procs: ProcessGroup,
    progress: Callable[[str], None],
    echo: EchoStream | None = None,
) -> None:
    """Stream rounds.jsonl until summary.json appears; fail on a server error, a dead SuperLink or a stall. With
    ``echo`` (a remote run's streamed log), the run's files are first mirrored from it into ``run_dir``."""
    stall_s = max(600.0, 3 * config.round_deadline_s)
    shown, last_change = 0, time.monotonic()
    while not (run_dir / SUMMARY).exists():
        if echo is not None:
            ended = echo.pull()
            if ended and not (run_dir / SUMMARY).exists() and not (run_dir / SERVER_ERROR).exists():
                raise LaunchError(f"the run's log stream ended before its results; see {echo.log}")
        if (run_dir / SERVER_ERROR).exists():
            raise LaunchError(f"the server failed: {(run_dir / SERVER_ERROR).read_text().strip()}")
        rows = read_rounds(run_dir)
        for row in rows[shown:]:
            progress(_progress_line(row, config.rounds))
            last_change = time.monotonic()
        shown = len(rows)
        _check_server_alive(procs, run_dir)
        if time.monotonic() - last_change > stall_s:
            raise LaunchError(f"no round finished for {stall_s:.0f} s; see {run_dir / SERVER_LOG}")
        time.sleep(0.2)
    for row in read_rounds(run_dir)[shown:]:
        progress(_progress_line(row, config.rounds))


def run_simulated(config: RunConfig, run_dir: Path, logs: Path, progress: Callable[[str], None]) -> None:
    """The run on Flower's Simulation Engine, in a process of its own (``edgefl.simulation``), followed as a
    deployment's server is; stopping it stops Ray's processes too (they are its descendants)."""
    save_config(config, run_dir / CONFIG)
    with ProcessGroup(logs, flower_env(run_dir)) as procs:
        procs.start("simulation", [sys.executable, "-m", "edgefl.simulation", str(run_dir)])
        progress(
            f"simulation: {config.strategy} on {config.dataset} ({config.partition}), {config.clients} virtual "
            f"clients, {config.per_round} a round; links {config.profile}, devices {config.device_profile}"
        )
        follow(config, run_dir, procs, progress)


@contextlib.contextmanager
def local_federation(
    config: RunConfig,
    home: Path,
    progress: Callable[[str], None] = print,
    processes: Callable[[Path, dict[str, str]], ProcessGroup] = ProcessGroup,
) -> Iterator[LocalFederation]:
    """A local federation for runs like ``config`` (``LocalFederation``), its processes' logs in ``home``/logs; its
    ``config`` records how its links and devices are emulated. ``processes`` makes the group its processes start
    in (from the logs folder and the environment). Everything stops on leaving the ``with``."""
    with placement_for(config) as place, contextlib.ExitStack() as stack:
        caps, devices = device_caps(config, stack, progress)
        config = dataclasses.replace(config, link_backend=place.backend, device_backend=devices)
        with processes(home / "logs", flower_env(home)) as procs:
            federation = LocalFederation(config, home, place, procs, caps)
            federation.start()
            yield federation


def run_on(
    federation: LocalFederation, config: RunConfig, progress: Callable[[str], None] = print, resume: bool = False
) -> Path:
    """Run ``config`` on a running local federation (it must share its app, links, devices and clients); returns the
    run folder."""
    run_dir = prepare_run_dir(config, resume)
    started = federation.config
    config = dataclasses.replace(config, link_backend=started.link_backend, device_backend=started.device_backend)
    save_config(config, run_dir / CONFIG)
    run_id = federation.submit(config, run_dir)
    federation.place_devices()
    progress(
        f"run {run_id}: {config.strategy} on {config.dataset} ({config.partition}), {config.clients} clients, link "
        f"{config.profile} [{config.link_backend}], devices {config.device_profile} [{config.device_backend}]"
    )
    federation.procs.grace_s = GRACE_S  # while a run goes on, its processes may stop gracefully
    follow(config, run_dir, federation.procs, progress)
    federation.procs.grace_s = ENDED_GRACE_S  # its results are written
    return run_dir


def run(config: RunConfig, progress: Callable[[str], None] = print, resume: bool = False) -> Path:
    """Run one configuration end to end (``resume``: on from the run folder's checkpoint); returns the folder."""
    run_dir = prepare_run_dir(config, resume)
    logs = run_dir / "logs"
    if not resume:
        shutil.rmtree(logs, ignore_errors=True)
    if config.federation == "simulation":
        run_simulated(config, run_dir, logs, progress)
        return run_dir
    if config.federation == "local":
        with local_federation(config, run_dir, progress) as federation:
            return run_on(federation, config, progress, resume)
    with placement_for(config) as place:
        config = dataclasses.replace(config, link_backend=place.backend)
        save_config(config, run_dir / CONFIG)
        key = echo_key(config)  # before anything starts on the server
        with ProcessGroup(logs, flower_env(run_dir)) as procs:
            run_id, echo = submit_remote(config, run_dir, procs)
            progress(
                f"run {run_id}: {config.strategy} on {config.dataset} ({config.partition}), "
                f"{config.clients} clients, the SuperLink at {config.server}"
            )
            stream = EchoStream(echo, run_dir, procs, progress, key)
            try:
                follow(config, run_dir, procs, progress, stream)
            except BaseException:  # that SuperLink outlives us: end the run there too, and keep its checkpoint
                with contextlib.suppress(LaunchError):
                    run_flwr(["stop", run_id, FEDERATION], procs.env)
                stream.await_last_word()
                raise
    return run_dir
