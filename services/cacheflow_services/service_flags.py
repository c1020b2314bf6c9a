"""The command-line options every service shares: TLS on the internal hops, and what its HTTP port holds
for a client (`http_server.ServerLimits`)."""

from __future__ import annotations

import argparse

from cacheflow_common.tls import TLSFiles
from cacheflow_services.http_server import ServerLimits

DEFAULTS = ServerLimits()


def add_service_flags(parser: argparse.ArgumentParser, *, tls_help: str) -> None:
    parser.add_argument("--tls-dir", default="", help=f"TLS: a directory with ca.crt, tls.crt, tls.key; {tls_help} "
                                                       "(default: plain)")
    parser.add_argument("--header-timeout-s", type=float, default=DEFAULTS.header_timeout_s,
                        help="close an HTTP connection whose request head is not complete this long after it began")
    parser.add_argument("--body-timeout-s", type=float, default=DEFAULTS.body_timeout_s,
                        help="close an HTTP connection whose request body pauses this long")
    parser.add_argument("--max-connections-per-client", type=int, default=DEFAULTS.max_connections_per_client,
                        help="open HTTP connections one client address may hold (more are closed at once)")


def tls_of(args: argparse.Namespace) -> TLSFiles | None:
    return TLSFiles.in_dir(args.tls_dir) if args.tls_dir else None


def limits_of(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                        max_connections_per_client=args.max_connections_per_client)
