"""The server's one door to the network, and the submitter's key to it.

Flower's SuperLink (1.41, 1.42) serves its Fleet API (devices), its Control API (``flwr run``, ``flwr supernode
register``) and its ServerAppIo API (the ServerApp) on one port, and the Control API authenticates nobody
unless Flower's enterprise user authentication is set up: whoever reaches the port can register a node key
and run code on the server. So the SuperLink listens on the server's loopback only and nginx faces the network
(:class:`Gateway`):

- ``/v1/fleet/*`` is passed on: devices join with Flower's TLS (and node authentication) as before;
- ``/v1/control/*`` only over TLS with a client certificate the server's CA signed for a submitter
  (``edgefl certs --submitters N``; the server's own certificate is not one: it is for server use only);
- everything else, the ServerAppIo API ``/v1/runtime/*`` included, is refused with 403 and its reason.

Flower's CLI presents no client certificate, so ``edgefl run --federation remote`` opens a local stunnel on
the submitting machine (:func:`open_submit_tunnel`) that presents the submitter's certificate, verifies the
server's, and carries ``flwr run`` and ``flwr log --stream`` alike."""

from __future__ import annotations

import logging
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from contract.settings import ConfigError, parse_address
from contract.transport import KEEPALIVE_S
from contract.uploads import LIMIT_CONF, NO_RUN_LIMIT, PID_FILE, POSTED, alive, limit_conf, reload
from edgefl.certs import ServerCerts
from edgefl.processes import LaunchError, ProcessGroup, free_port, tail

log = logging.getLogger("edgefl.gateway")

STARTUP_TIMEOUT_S = 30.0
RUNNING = "gateways"  # in a certificates folder: a file per gateway serving with them (its nginx pid: its folder)
CONTROL_REFUSED = "the Control API takes a submitter certificate signed by this server's CA"
OTHER_REFUSED = "only the Fleet API (/v1/fleet/) is served to the network"
# One HTTP request carries one object of a message. An object upload (a device's reply: one object holding its
# updates, contract.wire) is bounded by the runs under way (contract.uploads: each run's ServerApp posts what its
# model and D allow, and nginx is reloaded), 16 MB while none is; a submitted run's app by MAX_BODY.
MAX_BODY = "16m"
SMALL_BODY = "64k"  # every request but an object upload and a submitted run's app: a message's envelope, a pull,
# a heartbeat are a few kB
# Limits per address, far above what devices need (a device keeps up to ~10 connections open and sends a few dozen
# requests a second while it transfers; behind one NAT, or on loopback, devices share an address: ~25 fit) and far
# below what locks the door: one address cannot take all the connections, nor queue requests without bound.
CONNECTIONS_PER_ADDRESS = 256
REQUESTS_PER_S, REQUEST_BURST = 1000, 2000
WORKER_CONNECTIONS = 4096  # the gateway's connections, a device's and its upstream one each
HEADER_TIMEOUT_S = 10  # a request's headers must come within this; a body must not stall longer than BODY_TIMEOUT_S
BODY_TIMEOUT_S = 30


def _binary(*names: str) -> str:
    """The first of ``names`` on PATH or in /usr/sbin (not on a normal user's PATH)."""
    for name in names:
        found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        if found:
            return found
    raise LaunchError(f"{names[0]} is not installed: run ./install.sh (it installs nginx-light and stunnel4)")


@dataclass(frozen=True)
class Gateway:
    """nginx on ``listen_host:listen_port`` passing only the Fleet API (and, with a submitter certificate, the
    Control API) to the SuperLink on this host's ``127.0.0.1:superlink_port``; TLS with ``certs``."""

    listen_host: str
    listen_port: int
    superlink_port: int
    certs: ServerCerts | None  # None: plain text, Fleet API only (the Control API is never served then)
    superlink_tls: bool = False  # the SuperLink serves TLS with ``certs`` too (Flower's node authentication needs it)

    def config(self, folder: Path) -> str:
        """nginx's configuration, with every file it writes inside ``folder``."""
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        upstream, upstream_tls = "http://superlink", ""
        if self.superlink_tls and self.certs:  # its certificate names localhost (edgefl.certs.ALWAYS_HOSTS)
            upstream = "https://superlink"
            upstream_tls = f"""
    proxy_ssl_trusted_certificate {self.certs.ca.resolve()};
    proxy_ssl_verify on;
    proxy_ssl_name localhost;
    proxy_ssl_session_reuse on;"""
        if self.certs:
            revoked = self.certs.revoked  # a revoked submitter's certificate: 400, FAILED:certificate revoked
            crl = f"\n        ssl_crl {revoked.resolve()};" if revoked else ""
            listen = f"listen {host}:{self.listen_port} ssl;"
            tls = f"""
        ssl_certificate {self.certs.cert.resolve()};
        ssl_certificate_key {self.certs.key.resolve()};
        ssl_client_certificate {self.certs.ca.resolve()};
        ssl_verify_client optional_no_ca;  # another CA's: $ssl_client_verify FAILED, 403 below; a bad one: 400
        ssl_verify_depth 1;{crl}"""
            control = f"""
        location /v1/control/ {{
            if ($ssl_client_verify != SUCCESS) {{ return 403 "{CONTROL_REFUSED} ($ssl_client_verify)\\n"; }}
            client_max_body_size {MAX_BODY};  # a run's app (flwr run)
            proxy_pass {upstream};
        }}"""
        else:
            listen, tls = f"listen {host}:{self.listen_port};", ""
            control = f"""
        location /v1/control/ {{ return 403 "{CONTROL_REFUSED}; this server runs without TLS\\n"; }}"""
        return f"""\
daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log notice;
worker_rlimit_nofile {2 * WORKER_CONNECTIONS};
events {{ worker_connections {WORKER_CONNECTIONS}; }}
http {{
    log_format door '$time_iso8601 $remote_addr conn=$connection/$connection_requests "$request" $status '
                    '$body_bytes_sent client-cert=$ssl_client_verify "$ssl_client_s_dn" '
                    'at=$msec took=$request_time upstream=$upstream_response_time in=$request_length';
    access_log {folder}/access.log door;
    client_body_temp_path {folder}/tmp/body;
    proxy_temp_path {folder}/tmp/proxy;
    fastcgi_temp_path {folder}/tmp/fastcgi;
    uwsgi_temp_path {folder}/tmp/uwsgi;
    scgi_temp_path {folder}/tmp/scgi;
    client_max_body_size {SMALL_BODY};
    client_body_buffer_size {SMALL_BODY};
    client_header_timeout {HEADER_TIMEOUT_S}s;
    client_body_timeout {BODY_TIMEOUT_S}s;
    send_timeout {BODY_TIMEOUT_S}s;
    limit_conn_zone $binary_remote_addr zone=per_address:1m;
    limit_conn per_address {CONNECTIONS_PER_ADDRESS};
    limit_req_zone $binary_remote_addr zone=requests:1m rate={REQUESTS_PER_S}r/s;
    limit_req zone=requests burst={REQUEST_BURST} nodelay;
    limit_conn_status 429;
    limit_req_status 429;
    proxy_request_buffering off;
    proxy_buffering off;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    keepalive_timeout {KEEPALIVE_S + 15:.0f}s;  # longer than a device's SuperNode keeps an idle connection
    proxy_read_timeout 1h;
    proxy_send_timeout 1h;{upstream_tls}
    default_type text/plain;
    server_tokens off;
    upstream superlink {{ server 127.0.0.1:{self.superlink_port}; keepalive 16; }}
    server {{
        {listen}{tls}
        location /v1/fleet/ {{ proxy_pass {upstream}; }}
        location = /v1/fleet/push-object {{ include {folder}/{LIMIT_CONF}; proxy_pass {upstream}; }}{control}
        location / {{ return 403 "{OTHER_REFUSED}\\n"; }}
    }}
}}
"""

    def start(self, procs: ProcessGroup, prefix: tuple[str, ...] = ()) -> Path:
        """Start nginx in ``procs`` (inside ``prefix``, e.g. a network namespace) and return once it listens;
        returns its folder (``access.log``: every request, with its connection's number and its requests so far,
        its status and client certificate)."""
        nginx = _binary("nginx")
        folder = gateway_folder(procs.log_dir)
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        (folder / PID_FILE).unlink(missing_ok=True)
        shutil.rmtree(folder / POSTED, ignore_errors=True)  # an earlier server's runs'
        (folder / LIMIT_CONF).write_text(limit_conf(NO_RUN_LIMIT))
        conf = folder / "nginx.conf"
        conf.write_text(self.config(folder))
        argv = [nginx, "-p", str(folder), "-e", str(folder / "error.log"), "-c", str(conf)]
        procs.start("gateway", [*prefix, *argv])
        # nginx writes its pid file once its listening sockets are open (a failed bind ends the process first).
        try:
            procs.wait_until("the gateway (nginx)", (folder / PID_FILE).exists, STARTUP_TIMEOUT_S)
        except LaunchError:
            raise LaunchError(
                f"nginx could not serve {self.listen_host}:{self.listen_port}: {tail(folder / 'error.log', 1)}"
            ) from None
        if self.certs:
            _register(self.certs.ca.parent, folder)
        return folder


def _register(certs_dir: Path, folder: Path) -> None:
    """Note the gateway of ``folder`` in ``certs_dir``: ``edgefl certs --revoke`` reloads it (``reload_gateways``)."""
    try:
        (certs_dir / RUNNING).mkdir(exist_ok=True)
        (certs_dir / RUNNING / (folder / PID_FILE).read_text().strip()).write_text(str(folder))
    except OSError as exc:  # e.g. a certificates folder this user may only read: the gateway serves all the same
        log.warning("edgefl: %s; edgefl certs --revoke will not reload this gateway (restart it after one)", exc)


def reload_gateways(certs_dir: Path) -> list[str]:
    """Have every gateway still serving with the certificates of ``certs_dir`` read them again (a revocation applies
    at once); a line for each: reloaded, or why not."""
    said = []
    for entry in sorted((certs_dir / RUNNING).glob("*")):
        try:
            folder = Path(entry.read_text())
            serving = (folder / PID_FILE).read_text().strip() == entry.name and alive(int(entry.name))
        except (OSError, ValueError):
            serving = False
        if not serving:  # stopped (nginx removes its pid file; a killed one leaves it), or the folder another's
            entry.unlink(missing_ok=True)
            continue
        failed = reload(folder)
        said.append(f"the gateway of {folder} (pid {entry.name}): " + (failed or "reloaded"))
    return said


def gateway_folder(log_dir: Path) -> Path:
    """Where the gateway of a process group logging to ``log_dir`` keeps its files (absolute: nginx reads -c and -e
    relative to its prefix -p); the SuperLink beside it is told (``contract.uploads.ENV``) before either starts."""
    return (log_dir / "gateway").resolve()


@dataclass(frozen=True)
class Submitter:
    """A submitter's certificate and key (``submitter-I.pem`` / ``.key`` from ``edgefl certs --submitters``)."""

    cert: Path
    key: Path

    @classmethod
    def from_cert(cls, cert: Path) -> Submitter:
        """The certificate and the key beside it (same name, ``.key``); ConfigError when either is missing."""
        submitter = cls(cert.resolve(), cert.resolve().with_suffix(".key"))
        for path in (submitter.cert, submitter.key):
            if not path.is_file():
                raise ConfigError(
                    f"{path} does not exist: make submitter certificates with edgefl certs --submitters N"
                )
        return submitter


def _tunnel_config(server: str, ca: Path, submitter: Submitter, local_port: int) -> str:
    host, port = parse_address(server)
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        check = f"checkIP = {host}"
    except OSError:
        check = f"checkHost = {host}"
    return f"""\
foreground = yes
pid =
debug = notice
[edgefl-control]
client = yes
accept = 127.0.0.1:{local_port}
connect = {f"[{host}]" if ":" in host else host}:{port}
cert = {submitter.cert}
key = {submitter.key}
CAfile = {ca.resolve()}
verifyChain = yes
{check}
"""


def _control_status(local: str) -> tuple[int, str]:
    """The HTTP status and first body line of a Control API call through the tunnel (an empty ListRuns)."""
    host, port = parse_address(local)
    request = (
        f"POST /v1/control/list-runs HTTP/1.1\r\nHost: {local}\r\nContent-Type: application/protobuf\r\n"
        "Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((host, port), timeout=10.0) as sock:
        sock.sendall(request.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, body.decode(errors="replace").strip().splitlines()[0] if body.strip() else ""


def open_submit_tunnel(procs: ProcessGroup, server: str, ca: Path, submitter: Submitter) -> str:
    """Start stunnel in ``procs``: a plain-text port on this machine's loopback that reaches ``server``'s Control
    API over TLS with ``submitter``'s certificate, verifying the server's against ``ca``. Returns its local
    address once a Control API call through it is let in; LaunchError with the server's reason otherwise."""
    stunnel = _binary("stunnel4", "stunnel")
    local_port = free_port()
    conf = procs.log_dir / "tunnel.conf"
    conf.write_text(_tunnel_config(server, ca, submitter, local_port))
    procs.start("tunnel", [stunnel, str(conf)])
    local = f"127.0.0.1:{local_port}"

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", local_port), timeout=1.0).close()
        except OSError:
            return False
        return True

    procs.wait_until("the submitter's tunnel (stunnel)", listening, STARTUP_TIMEOUT_S)
    try:
        status, reason = _control_status(local)
    except (OSError, ValueError, IndexError):
        status, reason = 0, ""
    if status in (400, 403):
        raise LaunchError(f"the server at {server} refused {submitter.cert.name}: {reason or status}")
    if status == 0:
        log = tail(procs.log_dir / "tunnel.log", 3).replace("\n", " | ")
        raise LaunchError(f"no authenticated channel to {server} (stunnel: {log})")
    return local
