"""TLS of the rollout service: gRPC server and channel credentials from PEM files, checked before any socket opens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from cisjax import errors

LOCALHOST = {"127.0.0.1", "localhost", "::1", "[::1]"}  # addresses whose traffic never leaves the machine
_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY = b"PRIVATE KEY-----"  # "BEGIN PRIVATE KEY", "BEGIN RSA PRIVATE KEY", "BEGIN EC PRIVATE KEY", ...


def _read(path: str, what: str, marker: bytes) -> bytes:
    """The PEM file `path` (named `what` in errors); MissingInput if absent, UserError if it holds no `marker`."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise errors.MissingInput(f"{what} {path}: no such file")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise errors.UserError(f"{what} {path}: {err.strerror}") from None
    if marker not in data:
        kind = "certificate" if marker == _PEM_CERT else "private key"
        raise errors.UserError(f"{what} {path} holds no PEM {kind}")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """`cisjax serve --tls-cert/--tls-key [--tls-client-ca]`: the server's certificate chain and key; with a client
    CA, mutual TLS (a client must present a certificate that CA signed)."""

    cert: str
    key: str
    client_ca: str = ""

    def credentials(self) -> grpc.ServerCredentials:
        cert = _read(self.cert, "--tls-cert", _PEM_CERT)
        key = _read(self.key, "--tls-key", _PEM_KEY)
        ca = _read(self.client_ca, "--tls-client-ca", _PEM_CERT) if self.client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: the CA that signed the server's certificate; for mutual TLS, the client's certificate and key;
    `server_name`, the name the server's certificate must carry when it is not the host of the target (an address
    reached through a tunnel, or a certificate issued for a cluster-internal name)."""

    ca: str
    cert: str = ""
    key: str = ""
    server_name: str = ""

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise errors.UserError(
                "a TLS client certificate needs its key and the key its certificate (--tls-cert and --tls-key)"
            )

    @classmethod
    def of(cls, ca: str = "", cert: str = "", key: str = "", server_name: str = "") -> ClientTLS | None:
        """The settings as given by flags or a config ("" = unset): None without a CA (plain text), UserError for a
        client certificate or a server name without one."""
        if not ca:
            if cert or key or server_name:
                raise errors.UserError(
                    "a TLS client certificate or server name needs the CA (--tls-ca / rollout.tls_ca)"
                )
            return None
        return cls(ca, cert, key, server_name)

    def check(self, names: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key")) -> None:
        """Every file readable and PEM (what `credentials` would raise, early), named in errors as `names` (the
        flags, or the config fields that gave them)."""
        self.credentials(names)

    def credentials(self, names: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key")):
        """The gRPC channel credentials (grpc.ChannelCredentials)."""
        ca = _read(self.ca, names[0], _PEM_CERT)
        cert = _read(self.cert, names[1], _PEM_CERT) if self.cert else None
        key = _read(self.key, names[2], _PEM_KEY) if self.key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
