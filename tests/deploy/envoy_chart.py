"""The chart's Envoy bootstraps (``deploy/helm/kvroute/files/envoy-bootstrap.json``, and
``envoy-bootstrap-tls.json`` for ``tls.enabled``) are ``kvroute_tools.envoy.bootstrap``'s output,
written by this module; the chart's ConfigMap template only puts the release's addresses and names
into them (and adds the kubelet's ready listener, and the listener's client CA under
``tls.mutual``). The tests in test_chart_gateway.py hold the files and the rendered ConfigMap to
the generator.

Regenerate after changing the generator::

    PYTHONPATH=. python -m tests.deploy.envoy_chart
"""

from __future__ import annotations

import json
from typing import Any

from kvroute_tools.envoy import EnvoyTls, bootstrap
from tests.deploy.chart import CHART_DIR

BOOTSTRAP_FILE = CHART_DIR / "files" / "envoy-bootstrap.json"
TLS_BOOTSTRAP_FILE = CHART_DIR / "files" / "envoy-bootstrap-tls.json"
TLS_DIR = "/etc/kvroute/tls"  # where the chart mounts tls.existingSecret (kvroute.tlsDir)
# Placeholder addresses: the template replaces all four from the values.
PLACEHOLDERS = {"listen_host": "0.0.0.0", "listen_port": 8080, "router_host": "kvroute-router",
                "router_port": 50050, "picker_host": "kvroute-router", "picker_port": 9002,
                "admin_host": "127.0.0.1", "admin_port": 9901}




def chart_tls(replica_server_name: str = "kvroute-replica", router_server_name: str = "kvroute-router",
              client_ca: bool = False) -> EnvoyTls:
    """The TLS of the chart's Envoy: the mounted Secret's files on the listener and as the
    upstreams' CA and client certificate; the server names are placeholders the template replaces
    (and ``client_ca``, ``tls.mutual``, it adds)."""
    return EnvoyTls(cert_file=f"{TLS_DIR}/tls.crt", key_file=f"{TLS_DIR}/tls.key",
                    client_ca_file=f"{TLS_DIR}/ca.crt" if client_ca else "", upstream_ca_file=f"{TLS_DIR}/ca.crt",
                    upstream_cert_file=f"{TLS_DIR}/tls.crt", upstream_key_file=f"{TLS_DIR}/tls.key",
                    replica_server_name=replica_server_name, router_server_name=router_server_name)


def chart_bootstrap(tls: bool = False) -> dict[str, Any]:
    """A bootstrap the chart ships: the generator's, with the placeholder addresses."""
    return bootstrap(**PLACEHOLDERS, tls=chart_tls() if tls else None)


def file_text(tls: bool = False) -> str:
    return json.dumps(chart_bootstrap(tls), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    for path, tls in ((BOOTSTRAP_FILE, False), (TLS_BOOTSTRAP_FILE, True)):
        path.write_text(file_text(tls))
        print(f"wrote {path}")
