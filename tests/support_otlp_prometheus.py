"""OTLP metrics as Prometheus sees them after the OpenTelemetry-to-Prometheus translation, for tests
(``from tests.support_otlp_prometheus import TranslatedMetrics``).

The rules are the OpenTelemetry specification's "Prometheus and OpenMetrics Compatibility"
(https://opentelemetry.io/docs/specs/otel/compatibility/prometheus_and_openmetrics/), as the
Collector's ``prometheus`` exporter and Prometheus's own OTLP receiver (prometheus/otlptranslator)
apply them with metric suffixes on:

- the name: every character outside ``[a-zA-Z0-9]`` splits it into tokens joined by ``_``; the
  unit's suffix is appended unless a token already is it (``s`` -> ``seconds``, ``ms`` ->
  ``milliseconds``, ``By`` -> ``bytes``, ``x/y`` -> ``x_per_y``; an annotation ``{...}`` adds
  nothing); a gauge of unit ``1`` gets ``ratio``; a monotonic cumulative sum ends in ``total``;
- the labels: each point attribute, its key with every character outside ``[a-zA-Z0-9_]`` as ``_``;
  ``job`` from ``service.namespace``/``service.name``, ``instance`` from ``service.instance.id``;
  the scope's name and version dropped (Prometheus's receiver keeps none; older collectors neither);
- a histogram: ``_bucket{le}`` (cumulative counts, ``+Inf`` = count), ``_sum``, ``_count``.

On top, the one collector setting docs/metrics.md names for the dashboard's namespace filter:
a transform processor copying the resource's ``k8s.namespace.name`` to a ``namespace`` label.

``TranslatedMetrics(receiver)`` serves the latest value of every series a real
tests.support_otlp.OtlpReceiver got, so translated, on a loopback /metrics for a real Prometheus
to scrape (with ``honor_labels``, as one scrapes a collector).
"""

from __future__ import annotations

import math
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

UNIT_SUFFIXES = {"d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
                 "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes",
                 "GiBy": "gibibytes", "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "m": "meters",
                 "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams", "Cel": "celsius",
                 "Hz": "hertz", "%": "percent"}
PER_UNIT_SUFFIXES = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}


def metric_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus name of an OTLP metric; ``kind``: ``gauge``, ``counter`` (a monotonic
    cumulative sum) or ``histogram``."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9]+", name) if t]
    unit = re.sub(r"\{[^}]*\}", "", unit).strip()
    main, _, per = unit.partition("/")
    main_suffix = UNIT_SUFFIXES.get(main) or (main if main.isalnum() and main != "1" else "")
    if main_suffix and main_suffix not in tokens:
        tokens.append(main_suffix)
    if per:
        per_suffix = PER_UNIT_SUFFIXES.get(per, per)
        if per_suffix not in tokens:
            tokens += ["per", per_suffix]
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if kind == "gauge" and unit == "1" and "ratio" not in tokens:
        tokens.append("ratio")
    out = "_".join(tokens)
    return f"_{out}" if out[:1].isdigit() else out


def label_name(key: str) -> str:
    out = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return f"key_{out}" if out[:1].isdigit() else out


def _value(v) -> str:
    return {math.inf: "+Inf", -math.inf: "-Inf"}.get(v, repr(float(v)))


def _any(value) -> str:
    kind = value.WhichOneof("value")
    return str(getattr(value, kind)) if kind else ""


def _labels(labels: dict[str, str]) -> str:
    body = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in sorted(labels.items()))
    return "{" + body + "}"


def translate(resource_metrics: list) -> str:
    """The Prometheus text exposition of ``resource_metrics`` (``ResourceMetrics`` protos, oldest
    first: cumulative points, so each series' latest wins)."""
    families: dict[str, tuple[str, dict[tuple[str, tuple], str]]] = {}  # name -> (type, {(sample, labels): value})
    for rm in resource_metrics:
        res = {a.key: _any(a.value) for a in rm.resource.attributes}
        base = {"job": "/".join(x for x in (res.get("service.namespace"), res.get("service.name")) if x)}
        if "service.instance.id" in res:
            base["instance"] = res["service.instance.id"]
        if "k8s.namespace.name" in res:  # the collector's transform processor (docs/metrics.md)
            base["namespace"] = res["k8s.namespace.name"]
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                data = m.WhichOneof("data")
                if data == "sum":
                    kind = "counter" if m.sum.is_monotonic and m.sum.aggregation_temporality == 2 else "gauge"
                    points = m.sum.data_points
                elif data == "gauge":
                    kind, points = "gauge", m.gauge.data_points
                elif data == "histogram":
                    kind, points = "histogram", m.histogram.data_points
                else:
                    continue
                name = metric_name(m.name, m.unit, kind)
                series = families.setdefault(name, (kind, {}))[1]
                for p in points:
                    labels = {**base, **{label_name(a.key): _any(a.value) for a in p.attributes}}
                    if kind == "histogram":
                        running = 0
                        for bound, count in zip([*p.explicit_bounds, math.inf], p.bucket_counts, strict=True):
                            running += count
                            key = {**labels, "le": _value(bound)}
                            series[(f"{name}_bucket", tuple(sorted(key.items())))] = _value(running)
                        series[(f"{name}_sum", tuple(sorted(labels.items())))] = _value(p.sum)
                        series[(f"{name}_count", tuple(sorted(labels.items())))] = _value(p.count)
                    else:
                        v = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                        series[(name, tuple(sorted(labels.items())))] = _value(v)
    lines = []
    for family, (kind, series) in sorted(families.items()):
        lines.append(f"# TYPE {family} {kind}")
        lines += [f"{sample}{_labels(dict(labels))} {value}" for (sample, labels), value in sorted(series.items())]
    return "\n".join(lines) + "\n"


class TranslatedMetrics:
    """``receiver``'s metrics (one transport's, ``http/protobuf`` by default), translated, on
    ``http://127.0.0.1:<port>/metrics`` (``target`` is ``127.0.0.1:<port>``)."""

    def __init__(self, receiver, transport: str = "http/protobuf") -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                with receiver._lock:
                    got = list(receiver.resource_metrics[transport])
                body = translate(got).encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
