"""TLS credentials from PEM files, for duo's gRPC servers and channels, checked at start-up with a clear message."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc


def read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from error


def check_pair(cert: str | None, key: str | None, flags: str) -> bool:
    """Whether a certificate and key were given; both or neither, and the key must match the certificate."""
    if (cert is None) != (key is None):
        raise ValueError(f"{flags}: give both the certificate and its key, or neither")
    if cert is None or key is None:
        return False
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"{flags} {cert} {key}: not a usable certificate and key ({error})") from error
    return True


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a gRPC server; with `client_ca`, clients must present a certificate it signed (mutual TLS)."""
    root = read_pem(client_ca, "--tls-ca") if client_ca else None
    return grpc.ssl_server_credentials([(read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))],
                                       root_certificates=root, require_client_auth=root is not None)


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None,
                        flags: str = "--tls") -> grpc.ChannelCredentials:
    """TLS for a gRPC channel: trust `ca` (default: the system's roots), present cert/key for mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, f"{flags}-ca") if ca else None,
        private_key=read_pem(key, f"{flags}-key") if key else None,
        certificate_chain=read_pem(cert, f"{flags}-cert") if cert else None)
