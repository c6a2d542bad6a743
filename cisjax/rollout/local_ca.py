"""A throwaway certificate authority and the certificates it signs (TLS on localhost: `cisjax bench rollout --tls`, tests)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_DAY = datetime.timedelta(days=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def _write(path: Path, cert: x509.Certificate, key) -> tuple[str, str]:
    cert_path, key_path = path.with_suffix(".pem"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@dataclass(frozen=True)
class Issued:
    cert: str  # PEM certificate file
    key: str  # PEM private key file (mode 0600)


class LocalCA:
    """A CA (P-256 key, valid `days`) written to `out/<name>.pem` and `.key`; `issue` signs server or client
    certificates beside it."""

    def __init__(self, out, name: str = "ca", days: int = 7):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.days = days
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"cisjax {name}"))
            .issuer_name(_name(f"cisjax {name}"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + days * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # key_cert_sign, crl_sign
            .sign(self._key, hashes.SHA256())
        )
        self.cert, self._key_path = _write(self.out / name, self._cert, self._key)

    def issue(self, name: str, *, names=LOCAL_NAMES, client: bool = False) -> Issued:
        """A certificate for `names` (DNS names or IP addresses; a server's must include the host clients dial),
        for a server or, with `client`, for a client's mutual TLS."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + self.days * _DAY)
            .add_extension(_san(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        return Issued(*_write(self.out / name, cert, key))
