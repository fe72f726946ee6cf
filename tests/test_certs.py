"""Lab certificates and SuperNode keys (edgefl.certs), and the TLS check commands run before they connect
(edgefl.launcher.reach_superlink), against a real TLS listener on loopback."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from contract.run_folder import ECHO_KEY, read_echo_key
from contract.settings import ConfigError, build_config
from edgefl.certs import (
    CA_KEY,
    PRIVATE,
    REVOKED,
    SUBMITTER_DAYS,
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
from edgefl.launcher import echo_key, reach_superlink
from edgefl.processes import LaunchError, free_port


def test_server_certificate_is_signed_by_the_ca_for_the_given_hosts(tmp_path: Path) -> None:
    certs = make_server_certs(tmp_path, ["192.168.1.10", "server.lan"])
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    server = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert set(certificate_hosts(certs.cert)) == {"192.168.1.10", "server.lan", "localhost", "127.0.0.1"}
    assert certs.key.stat().st_mode & 0o077 == 0
    assert ServerCerts.in_dir(tmp_path) == certs


def test_bad_host_and_missing_files_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(CertError, match="neither an IP address nor a host name"):
        make_server_certs(tmp_path, ["http://x"])
    with pytest.raises(CertError, match="edgefl certs --out"):
        ServerCerts.in_dir(tmp_path / "nothing")


def test_node_keys_are_openssh_ec_pairs(tmp_path: Path) -> None:
    keys = make_node_keys(tmp_path, 2)
    assert [k.name for k in keys] == ["node-0.key", "node-1.key"]
    for key in keys:
        check_node_private_key(key)
        check_node_public_key(key.with_suffix(".pub"))
        private = serialization.load_ssh_private_key(key.read_bytes(), password=None)
        public = serialization.load_ssh_public_key(key.with_suffix(".pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.public_key().public_numbers() == public.public_numbers()
    assert keys[0].read_bytes() != keys[1].read_bytes()
    with pytest.raises(CertError, match="not an OpenSSH public key"):
        check_node_public_key(keys[0])
    with pytest.raises(CertError, match="at least 1"):
        make_node_keys(tmp_path, 0)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, ServerCerts]]:
    """A TLS listener on loopback with a lab certificate, completing handshakes until the test ends."""
    certs = make_server_certs(tmp_path / "lab", [])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", certs
    stop.set()
    listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() it waits in (close() alone does not, on Linux)
    listener.close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_reach_superlink_verifies_the_server_certificate(tls_server: tuple[str, ServerCerts], tmp_path: Path) -> None:
    address, certs = tls_server
    reach_superlink(address, certs.ca, timeout_s=5)
    other = make_server_certs(tmp_path / "other", [])
    with pytest.raises(LaunchError, match="does not verify"):
        reach_superlink(address, other.ca, timeout_s=5)
    with pytest.raises(LaunchError, match="cannot use"):
        reach_superlink(address, tmp_path / "missing.pem", timeout_s=5)


def test_reach_superlink_gives_up_after_the_bounded_wait() -> None:
    with pytest.raises(LaunchError, match=r"cannot reach the SuperLink .* in 1 s"):
        reach_superlink(f"127.0.0.1:{free_port()}", None, timeout_s=1)


def test_submitters_get_one_echo_secret_kept_private_and_made_once(tmp_path: Path) -> None:
    make_server_certs(tmp_path, ["127.0.0.1"])
    make_submitter_certs(tmp_path, 2)
    key = tmp_path / ECHO_KEY
    first = read_echo_key(key)
    assert len(first) == 32 and key.stat().st_mode & 0o077 == 0
    make_submitter_certs(tmp_path, 1)  # more submitters later: the server's secret stays
    assert read_echo_key(key) == first


def test_a_submitter_without_the_echo_secret_is_one_line(tmp_path: Path) -> None:
    config = build_config(federation="remote", server="127.0.0.1:9", root_cert="ca.pem",
                          submitter_cert=str(tmp_path / "submitter-0.pem"))  # fmt: skip
    with pytest.raises(ConfigError, match=f"no echo secret at {tmp_path / ECHO_KEY}"):
        echo_key(config)


def test_the_cas_key_is_kept_apart_and_a_submitter_can_be_revoked(tmp_path: Path) -> None:
    """The CA's key sits in a folder only its owner opens, not among the files handed out; a CA made where edgefl
    kept its key before still signs; a revoked submitter's serial is on the CA's signed list (once, however often
    it is revoked), a certificate of another CA is refused in one line, and submitters' certificates expire."""
    make_server_certs(tmp_path, ["127.0.0.1"])
    assert not (tmp_path / CA_KEY).exists() and (tmp_path / PRIVATE).stat().st_mode & 0o077 == 0
    first, second = make_submitter_certs(tmp_path, 2)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert = x509.load_pem_x509_certificate(first.read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert abs(lifetime.days - SUBMITTER_DAYS) <= 1

    def revoked() -> list[int]:
        crl = x509.load_pem_x509_crl((tmp_path / REVOKED).read_bytes())
        assert crl.is_signature_valid(ca.public_key())
        return [entry.serial_number for entry in crl]

    assert revoked() == []
    assert revoke(tmp_path, first) == cert.serial_number
    revoke(tmp_path, first)
    assert revoked() == [cert.serial_number]
    other = make_server_certs(tmp_path / "other", [])
    with pytest.raises(CertError, match="not a certificate of the CA"):
        revoke(tmp_path, other.cert)
    with pytest.raises(CertError, match="not a certificate of the CA"):
        revoke(tmp_path, tmp_path / "missing.pem")
    (tmp_path / PRIVATE / CA_KEY).rename(tmp_path / CA_KEY)  # a folder from before the key moved
    assert make_submitter_certs(tmp_path, 1) and revoke(tmp_path, second) > 0
