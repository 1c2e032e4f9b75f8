"""TLS credentials, built in one place for the router, the replica and the tools (docs/security.md):
gRPC's, and the certificate files of the HTTP API and the metrics port.

    server side (router and replica ports):  tls_cert_file + tls_key_file [+ tls_client_ca_file = mTLS]
        ──server_credentials──▶ grpc.ServerCredentials ──bind──▶ add_secure_port (else add_insecure_port)
    client side (router -> replica, kvroute generate): ca_file [+ cert_file + key_file]
        ──channel_credentials──▶ grpc.ChannelCredentials ──secure / insecure channel
    HTTP API and metrics port (http_tls / metrics_tls switches): the server's files again
        ──server_tls_files──▶ ServerTlsFiles ──▶ uvicorn's / prometheus_client's ssl options

Files are PEM. A certificate without its key (or the reverse) is refused, and so is a client CA
without a server certificate: a half-set TLS configuration never falls back to plaintext. With
``tls_client_ca_file`` set the server requires a client certificate signed by that CA (gRPC's
``require_client_auth``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import grpc


def _read(setting: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{setting}: cannot read {path} ({e.strerror})") from e


def _pair(cert_setting: str, cert_file: str, key_setting: str, key_file: str) -> tuple[bytes, bytes] | None:
    if bool(cert_file) != bool(key_file):
        raise ValueError(f"{cert_setting}, {key_setting}: set both or neither")
    if not cert_file:
        return None
    return _read(key_setting, key_file), _read(cert_setting, cert_file)


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials of a gRPC server, or None for plaintext (no certificate set).

    Args:
        cert_file: the server's certificate chain (PEM path; setting ``tls_cert_file``).
        key_file: its private key (PEM path; ``tls_key_file``).
        client_ca_file: CA bundle of accepted client certificates (``tls_client_ca_file``); set =
            every client must present one (mutual TLS).

    Raises:
        ValueError: a certificate without a key or the reverse, a client CA without a server
            certificate, or an unreadable file (the message names the setting).
    """
    if client_ca_file and not (cert_file or key_file):
        raise ValueError("tls_client_ca_file: needs tls_cert_file and tls_key_file")
    pair = _pair("tls_cert_file", cert_file, "tls_key_file", key_file)
    if pair is None:
        return None
    if client_ca_file:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=_read("tls_client_ca_file", client_ca_file), require_client_auth=True
        )
    return grpc.ssl_server_credentials([pair])


class ServerTlsFiles(NamedTuple):
    """The PEM files an HTTP server serves TLS with; ``client_ca_file`` "" = no client certificate asked."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""


def server_tls_files(switch: str, cert_file: str, key_file: str, client_ca_file: str = "") -> ServerTlsFiles:
    """The gRPC server's certificate files, checked for an HTTP server that the setting ``switch``
    (``http_tls``, ``metrics_tls``) turns TLS on for: the same certificate, key and client CA.

    Raises:
        ValueError: no certificate and key set, or as :func:`server_credentials` (the message
            names the settings).
    """
    if not (cert_file or key_file):
        raise ValueError(f"{switch}: needs tls_cert_file and tls_key_file")
    server_credentials(cert_file, key_file, client_ca_file)  # the same checks, files read once
    return ServerTlsFiles(cert_file, key_file, client_ca_file)


def bind(server: Any, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``server`` (grpc or grpc.aio) to ``address`` ("host:port"), with TLS when
    ``credentials`` is set; returns the bound port (0 when it could not bind)."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "", *,
                        prefix: str = "tls_") -> grpc.ChannelCredentials | None:
    """TLS credentials of a gRPC client, or None for plaintext (no CA set).

    Args:
        ca_file: CA bundle (PEM path) that verifies the server; "" = plaintext.
        cert_file, key_file: the client's certificate chain and key, for servers that require
            mutual TLS ("" = none).
        prefix: how the settings are named in errors (``replica_tls_`` for the router's side,
            ``tls_`` for the CLI's flags).

    Raises:
        ValueError: a certificate without a key or the reverse, a client certificate without a
            CA, or an unreadable file (the message names the setting).
    """
    if not ca_file:
        if cert_file or key_file:
            raise ValueError(f"{prefix}cert_file, {prefix}key_file: need {prefix}ca_file")
        return None
    pair = _pair(f"{prefix}cert_file", cert_file, f"{prefix}key_file", key_file)
    key, chain = pair if pair is not None else (None, None)
    return grpc.ssl_channel_credentials(_read(f"{prefix}ca_file", ca_file), key, chain)


def open_channel(target: str, credentials: grpc.ChannelCredentials | None, *, aio: bool = False,
                 options: Any = None, server_name: str = "") -> Any:
    """A (``grpc.aio`` when ``aio``) channel to ``target``: TLS with ``credentials``, else plaintext.

    ``server_name``: over TLS, the name the server's certificate is checked against instead of the
    ``target`` host (``grpc.ssl_target_name_override``; e.g. a Service name while dialing a
    port-forward at 127.0.0.1); ignored on plaintext."""
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(target, options=options)
    if server_name:
        options = [*(options or ()), ("grpc.ssl_target_name_override", server_name)]
    return module.secure_channel(target, credentials, options=options)


__all__ = ["ServerTlsFiles", "bind", "channel_credentials", "open_channel", "server_credentials", "server_tls_files"]
