"""The server's one door (``edgefl.gateway``): ``edgefl server`` in a testbed's server namespace, with real nginx
in front of Flower's SuperLink, and a stranger in a client namespace trying every API. Only the Fleet API is
served to it; the Control API only with a submitter certificate; the SuperLink's own port not at all."""

from __future__ import annotations

import http.client
import http.server
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from contract.uploads import ENV as UPLOADS_ENV
from contract.uploads import LIMIT_CONF, NO_RUN_LIMIT, limit_conf, posted
from edgefl.certs import ServerCerts, make_node_keys, make_server_certs, make_submitter_certs
from edgefl.gateway import CONNECTIONS_PER_ADDRESS, Gateway
from edgefl.launcher import FEDERATION, FLOWER_INTERNAL, flower_env, run_flwr, write_flwr_home
from edgefl.processes import LaunchError, ProcessGroup, free_port
from netem.profiles import BUILTIN_LINKS
from netem.testbed import SERVER_IP, Testbed
from tests.conftest import REPO, processes_of
from tests.test_remote import Command

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

# One HTTPS request from inside a namespace: prints the status (or the connection's error) and the body's first line.
PROBE = """
import http.client, socket, ssl, sys
host, port, path, ca, cert = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
context = ssl.create_default_context(cafile=ca) if ca else None
if context and cert:
    context.load_cert_chain(cert, cert[:-4] + ".key")
try:
    conn = (http.client.HTTPSConnection(host, port, context=context, timeout=10) if context
            else http.client.HTTPConnection(host, port, timeout=10))
    conn.request("POST", path, body=b"", headers={"Content-Type": "application/protobuf"})
    response = conn.getresponse()
    print(response.status, response.read().decode(errors="replace").strip().splitlines()[:1])
except (OSError, ssl.SSLError) as exc:
    print("error", type(exc).__name__, exc)
"""


def _probe(bed: Testbed, port: int, path: str, ca: Path | None, cert: Path | None = None) -> str:
    argv = [sys.executable, "-c", PROBE, SERVER_IP, str(port), path, str(ca or ""), str(cert or "")]
    done = subprocess.run(bed.netns_argv(bed.client_ns[0], argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.federation
@pytest.mark.root
@needs_root
def test_a_stranger_reaches_only_the_fleet_api_and_a_submitter_gets_in(tmp_path: Path) -> None:
    certs, port = tmp_path / "certs", free_port()
    make_server_certs(certs, [SERVER_IP])
    make_node_keys(certs, 2)
    make_submitter_certs(certs, 1)
    ca = certs / "ca.pem"
    with Testbed([BUILTIN_LINKS["lan"]], f"gw{os.getpid() % 10000}") as bed:
        server = Command("server", "--listen", f"{SERVER_IP}:{port}", "--certs", str(certs), "--auth-keys",
                         str(certs / "node-0.pub"), "--out", str(tmp_path / "server"),
                         prefix=bed.netns_argv(bed.server_ns, []))  # fmt: skip
        try:
            local_port = int(re.search(r"the SuperLink on 127\.0\.0\.1:(\d+)", server.wait_for("^gateway")).group(1))
            server.wait_for("Ctrl-C stops the server")

            # The Control and ServerAppIo APIs are refused with their reason, before they reach the SuperLink.
            control = _probe(bed, port, "/v1/control/list-runs", ca)
            assert control.startswith("403") and "submitter certificate" in control, control
            runtime = _probe(bed, port, "/v1/runtime/get-run", ca)
            assert runtime.startswith("403") and "only the Fleet API" in runtime, runtime
            # The server's own certificate is for server use only: not a way in.
            as_server = _probe(bed, port, "/v1/control/list-runs", ca, certs / "server.pem")
            assert as_server.startswith("400"), as_server  # nginx: "The SSL certificate error"
            # The SuperLink itself listens on the server's loopback only.
            direct = _probe(bed, local_port, "/v1/control/list-runs", None)
            assert direct.startswith("error ConnectionRefusedError"), direct
            # The Fleet API is served (Flower answers: an empty body is not a protobuf message).
            fleet = _probe(bed, port, "/v1/fleet/get-run", ca)
            assert fleet[:3] not in ("403", "404", "err"), fleet
            # A submitter's certificate lets the Control API through to the SuperLink.
            submitter = _probe(bed, port, "/v1/control/list-runs", ca, certs / "submitter-0.pem")
            assert not submitter.startswith(("403", "400", "error")), submitter

            # Flower's own CLI from the stranger's namespace cannot register a node key (node authentication
            # stays intact) nor list runs.
            env = flower_env(tmp_path / "stranger")
            write_flwr_home(Path(env["FLWR_HOME"]), f"{SERVER_IP}:{port}", ca)
            prefix = tuple(bed.netns_argv(bed.client_ns[0], []))
            with pytest.raises(LaunchError, match=r"(?s)flwr supernode failed.*\b403\b"):
                run_flwr(["supernode", "register", str(certs / "node-1.pub"), FEDERATION], env, prefix)
            with pytest.raises(LaunchError, match=r"(?s)flwr ls failed.*\b403\b"):
                run_flwr(["ls", FEDERATION], env, prefix)

            access = (tmp_path / "server" / "logs" / "gateway" / "access.log").read_text()
            refused = [line for line in access.splitlines() if "/v1/control/" in line and " 403 " in line]
            assert len(refused) == 3 and all("client-cert=NONE" in line for line in refused), access
            assert 'client-cert=SUCCESS "CN=edgefl submitter 0"' in access
            assert "No SuperNode found" not in (tmp_path / "server" / "logs" / "superlink.log").read_text()
        finally:
            assert server.interrupt() == 130
    assert not processes_of(tmp_path / "server")


def test_the_gateway_serves_from_a_relative_log_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``edgefl compare``'s federations keep their logs under a relative ``--out`` (``runs/compare/...``): nginx,
    which reads ``-c`` and ``-e`` relative to its prefix, must be given absolute paths (real nginx on loopback)."""
    monkeypatch.chdir(tmp_path)
    certs = make_server_certs(Path(".certs"), ["127.0.0.1"])
    port = free_port()
    with ProcessGroup(Path("runs/compare/home-wifi/logs"), dict(os.environ)) as procs:
        folder = Gateway("127.0.0.1", port, free_port(), certs).start(procs, ())
        assert folder.is_absolute() and (folder / "nginx.pid").exists()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass


class _Upstream(http.server.BaseHTTPRequestHandler):
    """Stands in for the SuperLink behind the gateway (what is tested is nginx's limits, not Flower): reads the
    body and answers 200."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _UpstreamServer(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # the held uploads' connections arrive at once (the default backlog is 5)


def _post(port: int, path: str, body: bytes, source: str = "127.0.0.1") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20, source_address=(source, 0))
    try:
        conn.request("POST", path, body=body)
        return conn.getresponse().status
    finally:
        conn.close()


def test_one_address_cannot_take_the_door_and_bodies_are_small_but_uploads(tmp_path: Path) -> None:
    """Real nginx on loopback: an address holding ``CONNECTIONS_PER_ADDRESS`` uploads open (headers sent, bodies
    trickling) is refused a further request with 429 while another address is served; a request body over
    ``SMALL_BODY`` is refused (413) everywhere but an object upload."""
    upstream = _UpstreamServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    held: list[socket.socket] = []
    try:
        with ProcessGroup(tmp_path / "logs", dict(os.environ)) as procs:
            Gateway("127.0.0.1", port, upstream.server_address[1], None).start(procs, ())
            big = b"x" * 100_000
            assert _post(port, "/v1/fleet/pull-messages", big) == 413
            assert _post(port, "/v1/fleet/push-object", big) == 200
            for _ in range(CONNECTIONS_PER_ADDRESS):
                stranger = socket.create_connection(("127.0.0.1", port), timeout=20, source_address=("127.0.0.2", 0))
                stranger.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nx")
                held.append(stranger)
            assert _post(port, "/v1/fleet/pull-messages", b"", source="127.0.0.2") == 429
            assert _post(port, "/v1/fleet/pull-messages", b"") == 200
    finally:
        for stranger in held:
            stranger.close()
        upstream.shutdown()


def _revoke_command(certs: Path, cert: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "edgefl.cli", "certs", "--out", str(certs), "--revoke", str(cert)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_revoked_submitter_is_refused_at_the_control_api_at_once(tmp_path: Path) -> None:
    """Real nginx on loopback with TLS (the SuperLink stood in for): ``edgefl certs --revoke`` (the command) reloads
    the gateway serving with those certificates, so the revoked certificate is refused from the command's return on
    (nginx's 400, the reason in its log) before the Control API; another submitter's still gets through. A gateway
    that stopped is forgotten: the next revocation says none is serving."""
    upstream = _UpstreamServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    make_server_certs(tmp_path, ["127.0.0.1"])
    lost, kept = make_submitter_certs(tmp_path, 2)
    port = free_port()

    def control(cert: Path) -> tuple[int, str]:
        context = ssl.create_default_context(cafile=tmp_path / "ca.pem")
        context.load_cert_chain(cert, cert.with_suffix(".key"))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=20)
        try:
            conn.request("POST", "/v1/control/list-runs", body=b"")
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    try:
        with ProcessGroup(tmp_path / "logs", dict(os.environ)) as procs:
            gateway = Gateway("127.0.0.1", port, upstream.server_address[1], ServerCerts.in_dir(tmp_path))
            folder = gateway.start(procs, ())
            assert control(lost)[0] == 200
            said = _revoke_command(tmp_path, lost)
            assert f"the gateway of {folder} (pid " in said and "): reloaded" in said, said
            status, body = control(lost)
            assert status == 400 and "SSL certificate error" in body, body  # nginx's own refusal of a bad one
            assert control(kept)[0] == 200
        access = (tmp_path / "logs" / "gateway" / "access.log").read_text()
        assert "client-cert=FAILED:certificate revoked" in access, access
        assert "no gateway is serving with these certificates" in _revoke_command(tmp_path, kept)
    finally:
        upstream.shutdown()


def test_a_run_bounds_object_uploads_while_it_runs(tmp_path: Path) -> None:
    """Real nginx on loopback: while a run's bound is posted (``contract.uploads.posted``, as its ServerApp does) an
    object upload over it is refused with 413 before the SuperLink (stood in for) reads it, one within it passes, and
    other requests keep their own limits; once the run ends the limit is back to ``NO_RUN_LIMIT``."""
    upstream = _UpstreamServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    try:
        with ProcessGroup(tmp_path / "logs", dict(os.environ)) as procs:
            folder = Gateway("127.0.0.1", port, upstream.server_address[1], None).start(procs, ())
            assert _post(port, "/v1/fleet/push-object", b"x" * 300_000) == 200
            with posted(200_000, str(folder)):
                assert (folder / LIMIT_CONF).read_text() == limit_conf(200_000)
                assert _post(port, "/v1/fleet/push-object", b"x" * 300_000) == 413
                assert _post(port, "/v1/fleet/push-object", b"x" * 150_000) == 200
                assert _post(port, "/v1/control/list-runs", b"") == 403
            assert (folder / LIMIT_CONF).read_text() == limit_conf(NO_RUN_LIMIT)
            assert _post(port, "/v1/fleet/push-object", b"x" * 300_000) == 200
    finally:
        upstream.shutdown()


def test_flower_processes_get_none_of_flowers_internal_switches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FLWR_INTERNAL_GRPC_*=1`` in the server's environment would make the SuperLink open its legacy gRPC Control
    and Fleet APIs, unauthenticated, on every address: ``flower_env`` drops every ``FLWR_INTERNAL_*`` (and a gateway
    folder it did not set). Fails if Flower renames its switches out of that prefix."""
    from flwr.common import constant

    switches = [getattr(constant, name) for name in dir(constant) if "INTERNAL" in name and name.startswith("FLWR")]
    assert switches and all(switch.startswith(FLOWER_INTERNAL) for switch in switches)
    for switch in switches:
        monkeypatch.setenv(switch, "1")
    monkeypatch.setenv(UPLOADS_ENV, str(tmp_path / "another-gateway"))
    env = flower_env(tmp_path)
    assert not [name for name in env if name.startswith(FLOWER_INTERNAL)] and UPLOADS_ENV not in env
