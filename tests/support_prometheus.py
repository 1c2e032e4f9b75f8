"""A real Prometheus server for tests (``from tests.support_prometheus import ...``).

``prometheus_binary()`` finds one: ``KVROUTE_PROMETHEUS``, else what ``make prometheus`` unpacks
(``.prometheus/usr/bin/prometheus``, Debian trixie's 2.53), else
``prometheus`` on PATH. ``Prometheus`` runs it on a free loopback port, scraping static targets
every second, and queries it through its HTTP API
(https://prometheus.io/docs/prometheus/latest/querying/api/). Debian builds Prometheus without its
OTLP receiver (2.53 and 3.5 alike): OTLP metrics reach it through
tests.support_otlp_prometheus, as they would through a collector's ``prometheus`` exporter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from kvroute_tools.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def prometheus_binary() -> tuple[str, tuple[int, int]] | None:
    """(path, (major, minor)) of a Prometheus to run, or None when there is none."""
    for candidate in (os.environ.get("KVROUTE_PROMETHEUS", ""), str(ROOT / ".prometheus/usr/bin/prometheus"),
                      shutil.which("prometheus") or ""):
        if candidate and os.access(candidate, os.X_OK):
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=30).stdout
            m = re.search(r"version (\d+)\.(\d+)", out)
            if m:
                return candidate, (int(m.group(1)), int(m.group(2)))
    return None


class Prometheus:
    """A Prometheus on 127.0.0.1 with its TSDB in ``folder``.

    Args:
        binary: the prometheus executable.
        folder: its config, data and log.
        targets: ``host:port`` of /metrics endpoints scraped every second (job ``kvroute``).
        target_labels: labels added to every scraped series (what Kubernetes service discovery adds).
        honor_labels: keep the scraped ``job``, ``instance`` and other labels (as for a collector).

    Raises:
        RuntimeError: it did not become ready within 30 s (its log's tail says why).
    """

    def __init__(self, binary: str, folder: Path, *, targets: list[str] = (), target_labels: dict | None = None,
                 honor_labels: bool = False) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        folder.mkdir(parents=True, exist_ok=True)
        scrape = [{"job_name": "kvroute", "scrape_interval": "1s", "scrape_timeout": "1s", "honor_labels": honor_labels,
                   "static_configs": [{"targets": list(targets), "labels": dict(target_labels or {})}]}] if targets else []
        config = folder / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": scrape}))  # JSON is YAML
        argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}"]
        self.log = folder / "prometheus.log"
        self._proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"prometheus did not become ready:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def _get(self, path: str, params: dict[str, str]) -> list:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector of ``expr`` now (``/api/v1/query``): [{"metric": labels, "value": [t, "v"]}]."""
        data = self._get("/api/v1/query", {"query": expr})
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def label_values(self, label: str, selector: str) -> list[str]:
        """Values of ``label`` on the series ``selector`` matches (Grafana's ``label_values``)."""
        return self._get(f"/api/v1/label/{label}/values", {"match[]": selector})

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
