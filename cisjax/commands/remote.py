"""The flags of the commands that call a running rollout server: its bearer token and TLS."""

from __future__ import annotations

import argparse
import logging
import os

from cisjax.rollout.tls import ClientTLS

log = logging.getLogger("cisjax")

TOKEN_ENV = "CISJAX_ROLLOUT_TOKEN"
TOKEN_ON_COMMAND_LINE = (
    "--token on the command line can be read by other users of this machine (ps, /proc/<pid>/cmdline); "
    f"set ${TOKEN_ENV} instead"
)


def add_token(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    p.add_argument(
        "--token",
        default=None,
        help=f"{what} (default ${TOKEN_ENV}, the safer way: a command line is visible to other local users)",
    )


def token(args: argparse.Namespace) -> str | None:
    """--token (with a warning: other local users can read a command line), else $CISJAX_ROLLOUT_TOKEN, else None."""
    if args.token is not None:
        log.warning(TOKEN_ON_COMMAND_LINE)
        return args.token or None
    return os.environ.get(TOKEN_ENV) or None


def add_client_tls(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--tls-ca",
        default="",
        help="connect with TLS, trusting the server's certificate if this CA (PEM) signed it (default: plain text)",
    )
    p.add_argument("--tls-cert", default="", help="with --tls-ca: this client's certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", default="", help="with --tls-cert: its private key (PEM)")
    p.add_argument(
        "--tls-server-name",
        default="",
        help="with --tls-ca: the name the server's certificate must carry, when not the host of the address",
    )


def client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """The TLS the flags ask for (None: plain text); UserError for a client certificate without a CA, or an unreadable
    or non-PEM file."""
    tls = ClientTLS.of(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    if tls is not None:
        tls.check()
    return tls
