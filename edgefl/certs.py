"""TLS material for a lab federation, made with the ``cryptography`` package: a CA, a server certificate the
CA signs (its subject alternative names: the hosts devices dial, plus localhost and 127.0.0.1), and SuperNode
authentication keys in the OpenSSH EC format Flower's ``--auth-supernode-private-key`` and
``flwr supernode register`` read.

    edgefl certs --out certs --host 192.168.1.10 --host server.lan --node-keys 4

writes ``ca.pem`` (give it to every device), ``server.pem`` + ``server.key`` (stay on the server) and
``node-0.key`` + ``node-0.pub`` ... (a private key per device; the server registers the ``.pub`` files) and,
with ``--submitters N``, ``submitter-0.pem`` + ``submitter-0.key`` ... (client certificates the server's gateway
asks of whoever submits runs, ``edgefl.gateway``)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from contract.errors import EdgeflError
from contract.run_folder import ECHO_KEY

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
ALWAYS_HOSTS = ("localhost", "127.0.0.1")
VALID_DAYS = 825  # the longest validity clients accept for a server certificate


class CertError(EdgeflError, ValueError):
    """Certificates or keys that cannot be made or used; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class ServerCerts:
    """The PEM files a TLS SuperLink needs."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, folder: Path) -> ServerCerts:
        """The files ``make_server_certs`` wrote to ``folder``; raises CertError if one is missing."""
        certs = cls(folder / CA_CERT, folder / SERVER_CERT, folder / SERVER_KEY)
        for path in (certs.ca, certs.cert, certs.key):
            if not path.is_file():
                raise CertError(f"{path} does not exist: create the certificates with edgefl certs --out {folder}")
        return certs


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _subject_alt_names(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, *ALWAYS_HOSTS]):  # de-duplicated, in order
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() or c in "/:@" for c in host):
                raise CertError(f"{host!r} is neither an IP address nor a host name") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _certificate(
    subject: str, public_key: ec.EllipticCurvePublicKey, issuer: str, signer: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _key_usage(**allowed: bool) -> x509.KeyUsage:
    usages = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
              "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")  # fmt: skip
    return x509.KeyUsage(**{usage: allowed.get(usage, False) for usage in usages})


def make_server_certs(out: Path, hosts: list[str]) -> ServerCerts:
    """A new lab CA and a server certificate it signs for ``hosts`` + localhost + 127.0.0.1, as PEM in ``out``."""
    san = _subject_alt_names(hosts)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = "edgefl lab CA"
    ca_cert = (
        _certificate(ca_name, ca_key.public_key(), ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        _certificate(str(hosts[0] if hosts else "localhost"), server_key.public_key(), ca_name, ca_key)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    certs = ServerCerts(out / CA_CERT, out / SERVER_CERT, out / SERVER_KEY)
    certs.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out / CA_KEY, _pem_key(ca_key))
    certs.cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(certs.key, _pem_key(server_key))
    return certs


def make_submitter_certs(out: Path, count: int) -> list[Path]:
    """``count`` client certificates ``submitter-I.pem`` (+ ``.key``) signed by the CA in ``out``, for TLS client
    authentication only (the server's own certificate is for server use only, so it is not one), and the secret
    the server signs its runs' echoed results with (``ECHO_KEY``, made once), which each submitter keeps beside its
    certificate."""
    if count < 1:
        raise CertError(f"--submitters must be at least 1, got {count}")
    try:
        ca_key = serialization.load_pem_private_key((out / CA_KEY).read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((out / CA_CERT).read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"no usable CA in {out} ({exc}): make one with edgefl certs --out {out}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{out / CA_KEY} is not the elliptic-curve key edgefl certs makes")
    ca_name = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    certs = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _certificate(f"edgefl submitter {i}", key.public_key(), str(ca_name), ca_key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        path = out / f"submitter-{i}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(path.with_suffix(".key"), _pem_key(key))
        certs.append(path)
    if not (out / ECHO_KEY).exists():  # one for the server's submitters: given with their certificates
        _write_private(out / ECHO_KEY, secrets.token_hex(32).encode())
    return certs


def certificate_hosts(cert: Path) -> list[str]:
    """The host names and IP addresses a PEM server certificate is valid for (its subject alternative names)."""
    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
        names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except OSError as exc:
        raise CertError(f"cannot read certificate {cert}: {exc.strerror}") from None
    except (ValueError, x509.ExtensionNotFound):
        raise CertError(f"{cert} is not a PEM server certificate with host names") from None
    return [str(name) for name in names.get_values_for_type(x509.DNSName) + names.get_values_for_type(x509.IPAddress)]


def make_node_keys(out: Path, count: int) -> list[Path]:
    """``count`` SuperNode key pairs ``node-I.key`` (OpenSSH private) and ``node-I.pub`` (OpenSSH public) on the
    P-384 curve Flower's node authentication uses; returns the private key files."""
    if count < 1:
        raise CertError(f"--node-keys must be at least 1, got {count}")
    out.mkdir(parents=True, exist_ok=True)
    private_files = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP384R1())
        private = out / f"node-{i}.key"
        _write_private(
            private,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            ),
        )
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        private.with_suffix(".pub").write_bytes(public + f" edgefl-node-{i}\n".encode())
        private_files.append(private)
    return private_files


def check_node_public_key(path: Path) -> None:
    """Raise CertError unless ``path`` is an OpenSSH EC public key (what ``flwr supernode register`` takes)."""
    _check_node_key(path, "public", serialization.load_ssh_public_key, ec.EllipticCurvePublicKey)


def check_node_private_key(path: Path) -> None:
    """Raise CertError unless ``path`` is an OpenSSH EC private key (``flower-supernode`` would exit on it)."""
    _check_node_key(
        path,
        "private",
        lambda data: serialization.load_ssh_private_key(data, password=None),
        ec.EllipticCurvePrivateKey,
    )


def _check_node_key(path: Path, kind: str, load: Callable[[bytes], object], key_type: type) -> None:
    try:
        key = load(path.read_bytes())
    except OSError as exc:
        raise CertError(f"cannot read node {kind} key {path}: {exc.strerror}") from None
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise CertError(f"{path} is not an OpenSSH {kind} key (make one with edgefl certs --node-keys N)") from None
    if not isinstance(key, key_type):
        raise CertError(f"{path} is not an elliptic-curve key; Flower's node authentication needs one")
