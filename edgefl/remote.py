"""A federation across machines: ``edgefl certs`` makes the TLS material, ``edgefl server`` runs Flower's
SuperLink on the server machine, ``edgefl client`` joins from each device (edge agent + Flower's SuperNode),
and ``edgefl run --federation remote`` submits runs to that SuperLink.

    edgefl certs --out certs --host 192.168.1.10 --node-keys 4 --submitters 1
    edgefl server --listen 0.0.0.0:9092 --certs certs --auth-keys certs/node-*.pub
    edgefl client --server 192.168.1.10:9092 --root-cert ca.pem --partition-id 0 --num-partitions 4 \\
        --auth-key node-0.key

A script waits for ``--ready-file PATH`` (:class:`ReadyFile`), not for words the commands print: the server writes
it once it serves, the client once its device joined.

A client keeps its device in the federation: Flower's SuperNode retries a lost SuperLink without limit, and
when the SuperNode gives up (the SuperLink restarted and forgot the node) the client starts it again."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from contract.run_folder import ECHO_KEY
from contract.settings import ConfigError, RunConfig, parse_address
from contract.uploads import ENV as UPLOADS_ENV
from edge.devices import AgentThreads, DeviceCaps, HostFollower, device_profile
from edgefl.certs import (
    REVOKED,
    CertError,
    ServerCerts,
    certificate_hosts,
    check_node_private_key,
    check_node_public_key,
    make_node_keys,
    make_server_certs,
    make_submitter_certs,
    revoke,
)
from edgefl.gateway import Gateway, gateway_folder, reload_gateways
from edgefl.launcher import (
    CONNECT_TIMEOUT_S,
    FEDERATION,
    JOINED,
    STARTUP_TIMEOUT_S,
    NodeRuntime,
    flower_env,
    reach_superlink,
    run_flwr,
    start_superlink,
    superlink_argv,
    supernode_argv,
    write_flwr_home,
)
from edgefl.processes import LaunchError, ProcessGroup, free_port, port_in_use, tail_from

POLL_S = 0.5
RESTART_DELAY_S = 3.0
CONNECT_FAILED = "Failed to initialize the connection to the SuperLink."  # flower-supernode, then the reason
NODE_ACTIVATED = "[Fleet.ActivateNode] Activated node_id="  # flower-superlink
NODE_REFUSED = ("[/v1/fleet/activate-node][ApiError:", "[/v1/fleet/register-node][ApiError:")  # flower-superlink
WILDCARD_HOSTS = ("0.0.0.0", "::")
LOCAL_HOSTS = ("localhost", "127.0.0.1")
READY_FILE_HELP = "write this file (atomically) once {when}, for scripts to wait for; removed when it stops"


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


@dataclass(frozen=True)
class ReadyFile:
    """``--ready-file PATH`` of ``edgefl server`` and ``edgefl client``: written atomically the moment the command
    is ready (the server serves, the device joined), with the lines it prints then; removed on entering and on
    leaving the ``with`` around the command, so that it is never an earlier run's."""

    path: Path | None  # None: no --ready-file

    def __enter__(self) -> ReadyFile:
        self.clear()  # an earlier run's
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def clear(self) -> None:
        if self.path:
            self.path.unlink(missing_ok=True)

    def write(self, lines: list[str]) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.partial")
            partial.write_text("".join(f"{line}\n" for line in lines))
            os.replace(partial, self.path)


# ----- edgefl server ------------------------------------------------------------------------------------------
def _advertised_host(listen_host: str, certs: ServerCerts | None) -> str:
    """The host devices dial: the listen address, or for a wildcard the certificate's first non-local name."""
    if listen_host not in WILDCARD_HOSTS:
        return listen_host
    names = [host for host in certificate_hosts(certs.cert) if host not in LOCAL_HOSTS] if certs else []
    return names[0] if names else socket.gethostname()


def join_instructions(listen: str, certs: ServerCerts | None, auth_keys: list[Path], local: str) -> list[str]:
    """What ``edgefl server`` prints: what faces the network, the command each device runs to join, and how to
    submit runs (``local``: the SuperLink's own address on this machine's loopback)."""
    host, port = parse_address(listen)
    tls = f"--root-cert {certs.ca.resolve()}" if certs else "--insecure"
    auth = f" --auth-key {auth_keys[0].parent.resolve()}/node-I.key" if auth_keys else ""
    server = f"{_advertised_host(host, certs)}:{port}"
    copy = f" (copy {certs.ca.name}{' and its node-I.key' if auth_keys else ''} to each device)" if certs else ""
    if certs:
        submit = [
            "submit runs from any machine with a submitter certificate (edgefl certs --submitters N):",
            f"  edgefl run --federation remote --server {server} {tls} "
            f"--submitter-cert {certs.ca.parent.resolve()}/submitter-I.pem --clients N ...",
        ]
    else:
        submit = ["submit runs on this machine only, with:",
                  f"  edgefl run --federation remote --server {local} --insecure --clients N ..."]  # fmt: skip
    return [
        f"gateway (nginx) on {listen}, {'TLS' if certs else 'plain text (--insecure)'}: devices' Fleet API only, "
        + ("runs from submitter certificates" if certs else "no run submission")
        + f"; the SuperLink on {local}",
        "node authentication: "
        + (f"{len(auth_keys)} registered keys" if auth_keys else "off (--allow-any-device), any SuperNode may join"),
        f"each device joins with, for I = 0 .. N-1{copy}:",
        f"  edgefl client --server {server} {tls} --partition-id I --num-partitions N{auth}",
        *submit,
    ]


def _server_events(text: str) -> list[str]:
    """Joins and refusals in new SuperLink log text, as lines for the operator."""
    events = []
    for line in text.splitlines():
        if NODE_ACTIVATED in line:
            events.append(f"SuperNode {line.split(NODE_ACTIVATED)[1].strip()} joined")
        elif any(marker in line for marker in NODE_REFUSED):
            reason = line.rsplit("exception:", 1)[-1].strip() if "exception:" in line else line.strip()
            events.append(f"refused a SuperNode: {reason}")
    return events


def serve(
    listen: str,
    certs: ServerCerts | None,
    auth_keys: list[Path],
    out: Path,
    progress: Callable[[str], None],
    ready: ReadyFile | None = None,
) -> None:
    """Run Flower's SuperLink on this machine's loopback and the gateway (``edgefl.gateway``) on ``listen`` until
    interrupted, registering the SuperNode keys ``auth_keys`` (node authentication is on when there are any);
    writes ``ready`` as it prints how to join, then reports joins and refusals. Stops what it started on the way
    out."""
    host, port = parse_address(listen)
    if auth_keys and certs is None:
        raise ConfigError("node authentication needs TLS: give --certs DIR instead of --insecure")
    for key in auth_keys:
        check_node_public_key(key)
    if certs and host not in WILDCARD_HOSTS and host not in (names := certificate_hosts(certs.cert)):
        raise CertError(
            f"{certs.cert} is for {', '.join(names)}, not {host}: recreate it with edgefl certs --host {host}"
        )
    if port_in_use(host, port):
        raise ConfigError(f"cannot listen on {listen}: the port is in use or the address is not this machine's")
    out = out.resolve()
    logs = out / "logs"
    env = {**flower_env(out), UPLOADS_ENV: str(gateway_folder(logs))}  # its ServerApps bound object uploads there
    if certs and (key := certs.ca.parent / ECHO_KEY).is_file():  # the ServerApp signs its runs' echoes with it
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(key, out / ECHO_KEY)
        (out / ECHO_KEY).chmod(0o600)
    with ProcessGroup(logs, env) as procs:
        local_port = free_port()
        local = f"127.0.0.1:{local_port}"
        start_superlink(procs, superlink_argv("127.0.0.1", local_port, certs, node_auth=bool(auth_keys)))
        gateway = Gateway(host, port, local_port, certs, superlink_tls=True).start(procs)
        write_flwr_home(Path(env["FLWR_HOME"]), local, certs.ca.resolve() if certs else None)
        for key in auth_keys:
            run_flwr(["supernode", "register", str(key.resolve()), FEDERATION], env)
        lines = join_instructions(listen, certs, auth_keys, local)
        lines.append(f"logs: {logs / 'superlink.log'}, {gateway / 'access.log'}; Ctrl-C stops the server")
        if ready:
            ready.write(lines)
        for line in lines:
            progress(line)
        offset = 0
        while True:
            procs.check_alive()
            text = tail_from(logs / "superlink.log", offset)
            offset += len(text.encode())
            for event in _server_events(text):
                progress(event)
            time.sleep(POLL_S)


# ----- edgefl client ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientSpec:
    """One device's membership in a remote federation: everything ``edgefl client`` was given."""

    server: str
    partition_id: int
    num_partitions: int
    root_cert: Path | None  # None: plain text (--insecure)
    auth_key: Path | None = None
    dataset: str = RunConfig.dataset
    data_dir: str = ""
    device_profile: str = "laptop"
    out: Path | None = None  # default runs/client-I
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    startup_timeout_s: float = STARTUP_TIMEOUT_S  # for the edge agent to start (minutes under emulation)

    @property
    def folder(self) -> Path:
        return (self.out or Path(f"runs/client-{self.partition_id}")).resolve()

    def argv(self) -> list[str]:
        """The ``edgefl client`` command line for this spec, with absolute paths (for a service manager)."""
        argv = [sys.executable, "-m", "edgefl.cli", "client", "--server", self.server,
                "--partition-id", str(self.partition_id), "--num-partitions", str(self.num_partitions)]  # fmt: skip
        argv += ["--root-cert", str(self.root_cert.resolve())] if self.root_cert else ["--insecure"]
        if self.auth_key:
            argv += ["--auth-key", str(self.auth_key.resolve())]
        argv += ["--dataset", self.dataset]
        if self.data_dir:
            argv += ["--data-dir", str(Path(self.data_dir).resolve())]
        argv += ["--device-profile", self.device_profile, "--out", str(self.folder)]
        argv += ["--connect-timeout", f"{self.connect_timeout_s:g}"]
        return [*argv, "--startup-timeout", f"{self.startup_timeout_s:g}"]

    def check(self) -> None:
        """Raise the module's own error (one line) for input that cannot work, before anything starts."""
        from ml.data import load_dataset

        parse_address(self.server)
        if self.num_partitions < 1:
            raise ConfigError(f"--num-partitions must be at least 1, got {self.num_partitions}")
        if not 0 <= self.partition_id < self.num_partitions:
            raise ConfigError(f"--partition-id must be in 0..{self.num_partitions - 1}, got {self.partition_id}")
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"--connect-timeout must be positive, got {self.connect_timeout_s:g}")
        if self.startup_timeout_s <= 0:
            raise ConfigError(f"--startup-timeout must be positive, got {self.startup_timeout_s:g}")
        if self.auth_key:
            if self.root_cert is None:
                raise ConfigError("node authentication needs TLS: give --root-cert FILE instead of --insecure")
            check_node_private_key(self.auth_key)
        load_dataset(self.dataset, self.data_dir or None)  # DataError if this device lacks the data


def unit_user(spec: ClientSpec, run_as: str | None) -> str:
    """The user a device's systemd unit runs ``edgefl client`` as: ``run_as``, else the user who ran ``sudo``, else
    the owner of the working directory; root only when asked for by name (``--run-as root``), as an emulated device
    profile needs (its cgroups). Raises ConfigError (one line) for an unknown user, a device profile without root,
    root not asked for, or a key or folder the user could not read or write."""
    import pwd

    owner = Path.cwd().stat().st_uid
    try:
        name = run_as or os.environ.get("SUDO_USER") or pwd.getpwuid(owner).pw_name
        user = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"--run-as {run_as or owner}: no such user on this device") from None
    capped = device_profile(spec.device_profile).speeds is not None
    if user.pw_uid == 0 and run_as != "root":
        raise ConfigError(
            "the unit would run the device as root: run --install-systemd with sudo from the user the device runs "
            "as, or name one with --run-as USER (--run-as root only for an emulated --device-profile)"
        )
    if user.pw_uid != 0 and capped:
        raise ConfigError(f"--device-profile {spec.device_profile} emulates a device with cgroups, which needs root: "
                          "--run-as root, or no --device-profile on a real device")  # fmt: skip
    for path in (spec.auth_key, spec.folder if spec.folder.exists() else None):
        if path is not None and user.pw_uid != 0 and path.stat().st_uid != user.pw_uid:
            raise ConfigError(f"{path} belongs to another user than {name}, who runs the device: chown {name} {path}")
    return name


def systemd_unit(spec: ClientSpec, user: str) -> str:
    """A systemd service that keeps this device in the federation across failures and reboots, as ``user``, with
    no way to gain privileges and the operating system read-only to it."""
    return f"""\
[Unit]
Description=edgefl client {spec.partition_id} of {spec.num_partitions} (SuperLink {spec.server})
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User={user}
ExecStart={shlex.join(spec.argv())}
WorkingDirectory={Path.cwd()}
Environment=PYTHONUNBUFFERED=1
Restart=on-failure
RestartSec=10
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=full

[Install]
WantedBy=multi-user.target
"""


def _refusal(text: str, spec: ClientSpec) -> str:
    """Why a SuperNode that never joined exited, from its log."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if CONNECT_FAILED in line:
            reason = lines[i + 1].strip() if i + 1 < len(lines) else "no reason given"
            hint = (
                "is this device's public key registered (edgefl server --auth-keys)?"
                if spec.auth_key
                else "if the server authenticates nodes, give --auth-key"
            )
            return f"the SuperLink at {spec.server} refused this SuperNode ({reason}): {hint}"
    return f"the SuperNode stopped before it joined {spec.server}; see {spec.folder / 'logs' / 'supernode.log'}"


def _run_supernode(
    spec: ClientSpec,
    argv: list[str],
    agent: ProcessGroup,
    first: bool,
    progress: Callable[[str], None],
    cap: DeviceCaps,
    tend_agent: Callable[[], None],
    ready: ReadyFile | None,
) -> bool:
    """Run one SuperNode process until it exits (on the emulated device's ``supernode`` core once it has joined,
    when it writes ``ready``), calling ``tend_agent`` meanwhile; returns whether it joined. The ``first`` one must
    join within the connect timeout, or this raises LaunchError with the reason."""
    log = agent.log_dir / "supernode.log"
    offset = _size(log)
    deadline = time.monotonic() + spec.connect_timeout_s
    joined = False
    with ProcessGroup(agent.log_dir, agent.env) as node:
        proc = node.start("supernode", argv)
        while proc.poll() is None:
            tend_agent()
            if not joined and JOINED in tail_from(log, offset):
                joined = True
                cap.place("supernode", proc.pid)
                line = f"partition {spec.partition_id}/{spec.num_partitions} joined {spec.server}"
                if ready:
                    ready.write([line])
                progress(line)
            if first and not joined and time.monotonic() > deadline:
                raise LaunchError(f"the SuperNode did not join {spec.server} within {spec.connect_timeout_s:.0f} s")
            time.sleep(POLL_S)
    text = tail_from(log, offset)
    if first and JOINED not in text:
        raise LaunchError(_refusal(text, spec))
    return JOINED in text


def join(spec: ClientSpec, progress: Callable[[str], None], ready: ReadyFile | None = None) -> None:
    """Keep this device in the federation until interrupted: the edge agent, started again beside the running
    SuperNode whenever it dies, and Flower's SuperNode restarted whenever it exits; ``ready`` is written each time
    the SuperNode joins. Fails with one line if the server cannot be reached or refuses the node the first time,
    or if the agent does not start."""
    spec.check()
    with contextlib.ExitStack() as stack:
        profile = device_profile(spec.device_profile)
        cap = stack.enter_context(DeviceCaps(profile.shares(), f"client-{spec.partition_id}"))
        stack.enter_context(HostFollower([(cap, profile)], say=progress))
        reach_superlink(spec.server, spec.root_cert, spec.connect_timeout_s)
        logs = spec.folder / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        env = flower_env(spec.folder)
        agent = stack.enter_context(ProcessGroup(logs, env))
        runtime = NodeRuntime.create(spec.folder, "node")
        agent_args = ["--data-dir", str(Path(spec.data_dir).resolve())] if spec.data_dir else []
        agent_args += ["--own-dataset", spec.dataset]  # the server's word does not reach this device's files

        def start_agent() -> None:
            runtime.ready_file.unlink(missing_ok=True)
            agent.start("agent", runtime.agent_argv(*agent_args))
            agent.wait_until("the edge agent", runtime.ready_file.exists, spec.startup_timeout_s)
            AgentThreads.load(runtime.ready_file).place(cap)

        def tend_agent() -> None:
            """An agent that died (killed, out of memory) is started again with the same Runtime API, secret and
            held-tasks folder: it answers the tasks it held at once (``fl_client.tasks``), and the SuperNode, its
            node id and its place in the run stay."""
            ((_, proc),) = agent.procs
            if proc.poll() is None:
                return
            progress(f"the edge agent exited with code {proc.returncode}; starting it again")
            agent.stop()  # and whatever it had forked
            start_agent()
            progress("edge agent ready again")

        start_agent()
        node_config = f"partition-id={spec.partition_id} num-partitions={spec.num_partitions}"
        progress(f"edge agent ready; logs: {logs}")
        first = True
        while True:
            argv = supernode_argv(spec.server, spec.root_cert, node_config, spec.auth_key, serve=runtime)
            joined = _run_supernode(spec, argv, agent, first, progress, cap, tend_agent, ready)
            first = False
            progress(
                f"the SuperNode {'left' if joined else 'could not rejoin'}; restarting it in {RESTART_DELAY_S:g} s"
            )
            time.sleep(RESTART_DELAY_S)


# ----- the commands -------------------------------------------------------------------------------------------
def cmd_certs(args: argparse.Namespace) -> int:
    if args.revoke:
        if args.host or args.node_keys or args.submitters:
            raise ConfigError("--revoke changes only the revocation list: give it with --out alone")
        serial = revoke(args.out, args.revoke)
        print(f"revoked {args.revoke} (serial {serial:x}) in {args.out / REVOKED}")
        reloaded = reload_gateways(args.out)
        for line in reloaded:
            print(line)
        if not reloaded:
            print("no gateway is serving with these certificates: edgefl server refuses it from its next start")
        return 0
    certs = make_server_certs(args.out, args.host)
    print(f"CA certificate (give it to every device): {certs.ca}")
    print(f"server certificate for {', '.join(certificate_hosts(certs.cert))}: {certs.cert} (key {certs.key})")
    if args.node_keys:
        keys = make_node_keys(args.out, args.node_keys)
        print(f"SuperNode keys: {keys[0].parent}/node-I.key to device I, node-I.pub to edgefl server --auth-keys")
    if args.submitters:
        submitters = make_submitter_certs(args.out, args.submitters)
        print(
            f"submitter certificates: {submitters[0].parent}/submitter-I.pem (+ .key, and {ECHO_KEY} beside them) "
            "to whoever submits runs"
        )
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    if (args.certs is None) == (not args.insecure):
        raise ConfigError("give --certs DIR (TLS) or --insecure (plain text, trusted networks only)")
    if not args.auth_keys and not args.allow_any_device:
        raise ConfigError(
            "refusing to serve without device authentication: anyone who reaches the port could join, learn each "
            "run's data, seed and split, take a partition and send updates; give --auth-keys node-*.pub (from "
            "edgefl certs --node-keys N, with --certs) or --allow-any-device on a network you trust"
        )
    certs = ServerCerts.in_dir(args.certs) if args.certs else None
    with ReadyFile(args.ready_file) as ready:
        serve(args.listen, certs, args.auth_keys or [], args.out, lambda line: print(line, flush=True), ready)
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    if (args.root_cert is None) == (not args.insecure):
        raise ConfigError("give --root-cert FILE (the server's CA certificate) or --insecure, not both or neither")
    spec = ClientSpec(
        args.server, args.partition_id, args.num_partitions, args.root_cert, args.auth_key, args.dataset,
        args.data_dir or "", args.device_profile, args.out, args.connect_timeout, args.startup_timeout,
    )  # fmt: skip
    if args.run_as and args.install_systemd is None:
        raise ConfigError("--run-as names the user of the unit --install-systemd writes; give both or neither")
    if args.install_systemd is not None:
        spec.check()
        user = unit_user(spec, args.run_as)
        path = Path(args.install_systemd or f"/etc/systemd/system/edgefl-client-{spec.partition_id}.service")
        path.write_text(systemd_unit(spec, user))
        print(f"wrote {path}; enable it with: sudo systemctl daemon-reload && sudo systemctl enable --now {path.name}")
        return 0
    with ReadyFile(args.ready_file) as ready:
        join(spec, lambda line: print(line, flush=True), ready)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certs", help="a lab CA, a server certificate and SuperNode keys for edgefl server/client")
    p.add_argument("--out", type=Path, required=True, help="folder for the PEM files and keys")
    p.add_argument("--host", action="append", default=[], help="host name or IP devices dial (repeatable)")
    p.add_argument("--node-keys", type=int, default=0, metavar="N", help="also N SuperNode key pairs node-I.key/.pub")
    p.add_argument("--submitters", type=int, default=0, metavar="N",
                   help="also N submitter certificates submitter-I.pem/.key (edgefl run --submitter-cert)")  # fmt: skip
    p.add_argument("--revoke", type=Path, metavar="PEM", help="revoke this submitter certificate of the CA in --out "
                   "(nothing else is made); a running edgefl server's gateway refuses it at once")  # fmt: skip
    p.set_defaults(func=cmd_certs)

    p = sub.add_parser("server", help="run the SuperLink devices join (TLS); prints the edgefl client line")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="e.g. 0.0.0.0:9092")
    p.add_argument("--certs", type=Path, help="folder made by edgefl certs (TLS)")
    p.add_argument("--insecure", action="store_true", help="plain text instead of TLS (trusted networks only)")
    p.add_argument("--auth-keys", type=Path, nargs="+", metavar="PUB",
                   help="SuperNode public keys (node-I.pub) to admit; other nodes are refused")  # fmt: skip
    p.add_argument(
        "--allow-any-device",
        action="store_true",
        help="serve without --auth-keys: any SuperNode that reaches the port may join (trusted networks)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/server"), help="folder for logs (default runs/server)")
    p.add_argument("--ready-file", type=Path, metavar="PATH", help=READY_FILE_HELP.format(when="it serves"))
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("client", help="join this device to an edgefl server (edge agent + SuperNode)")
    p.add_argument("--server", required=True, metavar="HOST:PORT")
    p.add_argument("--partition-id", type=int, required=True, help="this device's data partition, 0..N-1")
    p.add_argument("--num-partitions", type=int, required=True, help="N, the number of devices")
    p.add_argument("--root-cert", type=Path, help="the server's CA certificate (ca.pem from edgefl certs)")
    p.add_argument("--insecure", action="store_true", help="plain text, for a server started with --insecure")
    p.add_argument("--auth-key", type=Path, help="this device's SuperNode private key (node-I.key)")
    p.add_argument("--dataset", default=RunConfig.dataset, help=f"data set to check before joining "
                   f"(default {RunConfig.dataset})")  # fmt: skip
    p.add_argument("--data-dir", help="folder with the data set's files (mnist, or a local fashion-mnist)")
    p.add_argument("--device-profile", default="laptop", help="emulated device CPU: laptop, rpi3, rpi4, rpi5")
    p.add_argument("--out", type=Path, help="folder for logs and the node's secret (default runs/client-I)")
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the server at start (default {CONNECT_TIMEOUT_S:g})")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the edge agent to start (default {STARTUP_TIMEOUT_S:g})")  # fmt: skip
    p.add_argument("--ready-file", type=Path, metavar="PATH", help=READY_FILE_HELP.format(when="this device joined"))
    p.add_argument("--install-systemd", nargs="?", const="", default=None, metavar="UNIT_FILE",
                   help="write a systemd unit running this command instead of running it "
                   "(default /etc/systemd/system/edgefl-client-I.service)")  # fmt: skip
    p.add_argument("--run-as", metavar="USER", help="the user the unit runs the device as (default: who ran sudo, "
                   "else the working directory's owner; root only by name, for --device-profile)")  # fmt: skip
    p.set_defaults(func=cmd_client)
