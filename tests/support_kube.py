"""A fake Kubernetes API server on loopback for EndpointSlice list/watch (``from tests.support_kube import ...``).

It speaks the protocol the official kubernetes client uses: a list returns an EndpointSliceList with
a resourceVersion; a watch streams newline-delimited ADDED / MODIFIED / DELETED events (chunked)
after the requested resourceVersion, or one ERROR event with code 410 when that version was
compacted. Used by tests/router/test_discovery.py and by the chart test that runs the rendered
containers (tests/deploy/).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

NAMESPACE = "kvroute"
SERVICE = "kvroute-replicas"


def endpoint_slice(name: str, endpoints: list[tuple[str, bool | None | dict]], *, service: str = SERVICE,
                   ports: tuple[tuple[str, int], ...] = (("grpc", 50051), ("metrics", 9090)),
                   namespace: str = NAMESPACE) -> dict:
    """An EndpointSlice object. Per endpoint ``(ip, ready)``: ``ready`` None leaves the conditions
    unset; a dict is the whole ``conditions`` object (``ready`` / ``serving`` / ``terminating``)."""
    def conditions(ready: bool | None | dict) -> dict:
        if isinstance(ready, dict):
            return ready
        return {} if ready is None else {"ready": ready}

    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": conditions(ready)} for ip, ready in endpoints],
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
    }


class FakeKubeAPI:
    """EndpointSlices of one namespace with resourceVersions, an event log and watch compaction."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace
        self.cond = threading.Condition()
        self.slices: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, object)
        self.compacted = 0  # a watch from a resourceVersion below this gets 410 Gone
        self.generation = 0  # bumped to end every open watch
        self.closed = False
        self.requests: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices":
                    self.send_error(404)
                    return
                selector = q.get("labelSelector", "")
                if q.get("watch") == "true":
                    api.serve_watch(self, selector, int(q.get("resourceVersion", "0")),
                                    float(q.get("timeoutSeconds", "30")))
                else:
                    api.requests.append("list")
                    api.serve_list(self, selector)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    # -- state changes (the test's side) ---------------------------------------------------------------
    def put(self, obj: dict, *, record: bool = True) -> None:
        with self.cond:
            self.rv += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.slices[name] = obj
            if record:
                self.events.append((self.rv, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str) -> None:
        with self.cond:
            self.rv += 1
            obj = self.slices.pop(name)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.events.append((self.rv, "DELETED", obj))
            self.cond.notify_all()

    def put_while_compacting(self, obj: dict) -> None:
        """Apply ``obj`` as a change no watch will ever see (compacted away), and end open watches:
        the client's next watch is from a version that is gone, so it must relist."""
        with self.cond:
            self.put(obj, record=False)
            self.compacted = self.rv
            self.generation += 1
            self.cond.notify_all()

    def drop_watches(self) -> None:
        """End every open watch (an API server restart, a load balancer timeout)."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- requests (the server's side) ------------------------------------------------------------------
    @staticmethod
    def _selected(obj: dict, selector: str) -> bool:
        key, _, value = selector.partition("=")
        return not selector or obj["metadata"].get("labels", {}).get(key) == value

    def serve_list(self, h: BaseHTTPRequestHandler, selector: str) -> None:
        with self.cond:
            body = json.dumps({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": [o for o in self.slices.values() if self._selected(o, selector)],
            }).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def serve_watch(self, h: BaseHTTPRequestHandler, selector: str, since: int, timeout: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(event: dict) -> None:
            line = json.dumps(event).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        with self.cond:
            gone = since < self.compacted
            generation = self.generation
            # Recorded only once the watch is open (its generation taken), so a test that waits for
            # the request and then drops watches really ends this one.
            self.requests.append(f"watch {since}")
        try:
            if gone:
                chunk({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                    "message": f"too old resource version: {since} ({self.compacted})", "code": 410}})
            else:
                while True:
                    with self.cond:
                        new = [e for e in self.events if e[0] > since]
                        if not new and generation == self.generation and not self.closed:
                            self.cond.wait(0.1)
                            new = [e for e in self.events if e[0] > since]
                        dropped = generation != self.generation
                        if dropped:
                            # A dropped connection delivers nothing more: events put after (or
                            # racing with) the drop reach the client only through its next watch,
                            # resumed from the last resourceVersion it saw.
                            new = []
                        ended = dropped or self.closed or time.monotonic() > deadline
                    for rv, kind, obj in new:
                        since = rv
                        if self._selected(obj, selector):
                            chunk({"type": kind, "object": obj})
                    if ended:
                        break
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except OSError:  # the client went away
            h.close_connection = True
