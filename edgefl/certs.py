"""TLS material for a lab federation, made with the ``cryptography`` package: a CA, a server certificate the
CA signs (its subject alternative names: the hosts devices dial, plus localhost and 127.0.0.1), and SuperNode
authentication keys in the OpenSSH EC format Flower's ``--auth-supernode-private-key`` and
``flwr supernode register`` read.

    edgefl certs --out certs --host 192.168.1.10 --host server.lan --node-keys 4

writes ``ca.pem`` (give it to every device), ``server.pem`` + ``server.key`` (stay on the server), the CA's key in
``private/`` (a folder only its owner opens: nothing in it is handed out), ``revoked.pem`` (the CA's list of revoked
certificates, which the gateway checks) and ``node-0.key`` + ``node-0.pub`` ... (a private key per device; the
server registers the ``.pub`` files) and, with ``--submitters N``, ``submitter-0.pem`` + ``submitter-0.key`` ...
(client certificates the server's gateway asks of whoever submits runs, ``edgefl.gateway``, valid
``SUBMITTER_DAYS``). ``edgefl certs --out certs --revoke certs/submitter-1.pem`` revokes one."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from contract.errors import EdgeflError
from contract.run_folder import ECHO_KEY

CA_CERT = "ca.pem"
PRIVATE = "private"  # the CA's key: made 0700, beside the files handed out but not among them
CA_KEY = "ca.key"
REVOKED = "revoked.pem"  # the CA's certificate revocation list (nginx's ssl_crl)
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
ALWAYS_HOSTS = ("localhost", "127.0.0.1")
VALID_DAYS = 825  # the longest validity clients accept for a server certificate
SUBMITTER_DAYS = 365  # a submitter's certificate: a lost one is revoked (--revoke), a forgotten one expires


class CertError(EdgeflError, ValueError):
    """Certificates or keys that cannot be made or used; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class ServerCerts:
    """The PEM files a TLS SuperLink needs."""

    ca: Path
    cert: Path
    key: Path
    revoked: Path | None = None  # the CA's revocation list; None in folders made before edgefl wrote one

    @classmethod
    def in_dir(cls, folder: Path) -> ServerCerts:
        """The files ``make_server_certs`` wrote to ``folder``; raises CertError if one is missing."""
        revoked = folder / REVOKED
        certs = cls(folder / CA_CERT, folder / SERVER_CERT, folder / SERVER_KEY, revoked if revoked.is_file() else None)
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
    subject: str, public_key: ec.EllipticCurvePublicKey, issuer: str, days: int = VALID_DAYS
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
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
        _certificate(ca_name, ca_key.public_key(), ca_name)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        _certificate(str(hosts[0] if hosts else "localhost"), server_key.public_key(), ca_name)
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    certs = ServerCerts(out / CA_CERT, out / SERVER_CERT, out / SERVER_KEY, out / REVOKED)
    certs.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (out / PRIVATE).mkdir(mode=0o700, exist_ok=True)
    (out / PRIVATE).chmod(0o700)
    (out / CA_KEY).unlink(missing_ok=True)  # an earlier CA's key where edgefl once kept it
    _write_private(out / PRIVATE / CA_KEY, _pem_key(ca_key))
    _write_revoked(out, ca_cert, ca_key, [])
    certs.cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(certs.key, _pem_key(server_key))
    return certs


def _load_ca(out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in ``out`` (its key in ``private/``, or beside ``ca.pem`` where edgefl kept it before); CertError when
    there is none."""
    key_file = out / PRIVATE / CA_KEY
    key_file = key_file if key_file.exists() else out / CA_KEY
    try:
        ca_key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((out / CA_CERT).read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"no usable CA in {out} ({exc}): make one with edgefl certs --out {out}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{key_file} is not the elliptic-curve key edgefl certs makes")
    return ca_cert, ca_key


def _write_revoked(
    out: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, serials: list[int]
) -> None:
    """The CA's revocation list of ``serials``, valid as long as any certificate it signs (an expired list would
    fail every client certificate the gateway checks against it)."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=VALID_DAYS))
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    (out / REVOKED).write_bytes(crl.public_bytes(serialization.Encoding.PEM))


def revoke(out: Path, cert_file: Path) -> int:
    """Add the certificate ``cert_file`` (one the CA in ``out`` signed: a submitter's) to the CA's revocation list;
    returns its serial. A gateway reads the list when it starts and when it reloads (``edgefl certs --revoke``
    reloads those serving: ``edgefl.gateway.reload_gateways``). CertError (one line) for a file that is not a
    certificate of this CA."""
    ca_cert, ca_key = _load_ca(out)
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        cert.verify_directly_issued_by(ca_cert)
    except (OSError, ValueError, TypeError, InvalidSignature) as exc:
        raise CertError(f"{cert_file} is not a certificate of the CA in {out}: {exc or type(exc).__name__}") from None
    serials = []
    if (out / REVOKED).is_file():
        serials = [entry.serial_number for entry in x509.load_pem_x509_crl((out / REVOKED).read_bytes())]
    if cert.serial_number not in serials:
        _write_revoked(out, ca_cert, ca_key, [*serials, cert.serial_number])
    return cert.serial_number


def make_submitter_certs(out: Path, count: int) -> list[Path]:
    """``count`` client certificates ``submitter-I.pem`` (+ ``.key``) signed by the CA in ``out``, for TLS client
    authentication only (the server's own certificate is for server use only, so it is not one), and the secret
    the server signs its runs' echoed results with (``ECHO_KEY``, made once), which each submitter keeps beside its
    certificate."""
    if count < 1:
        raise CertError(f"--submitters must be at least 1, got {count}")
    ca_cert, ca_key = _load_ca(out)
    ca_name = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    certs = []
    for i in range(count):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _certificate(f"edgefl submitter {i}", key.public_key(), str(ca_name), SUBMITTER_DAYS)
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
