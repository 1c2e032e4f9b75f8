"""The chart's Envoy bootstrap (``deploy/helm/kvroute/files/envoy-bootstrap.json``) is
``kvroute_tools.envoy.bootstrap``'s output, written by this module; the chart's ConfigMap template
only puts the release's addresses into it (and adds the kubelet's ready listener). The tests in
test_chart_gateway.py hold the file and the rendered ConfigMap to the generator.

Regenerate after changing the generator::

    PYTHONPATH=. python -m tests.deploy.envoy_chart
"""

from __future__ import annotations

import json
from typing import Any

from kvroute_tools.envoy import bootstrap
from tests.deploy.chart import CHART_DIR

BOOTSTRAP_FILE = CHART_DIR / "files" / "envoy-bootstrap.json"
# Placeholder addresses: the template replaces all four from the values.
PLACEHOLDERS = {"listen_host": "0.0.0.0", "listen_port": 8080, "router_host": "kvroute-router",
                "router_port": 50050, "picker_host": "kvroute-router", "picker_port": 9002,
                "admin_host": "127.0.0.1", "admin_port": 9901}


def chart_bootstrap() -> dict[str, Any]:
    """The bootstrap the chart ships: the generator's, with the placeholder addresses."""
    return bootstrap(**PLACEHOLDERS)


def file_text() -> str:
    return json.dumps(chart_bootstrap(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    BOOTSTRAP_FILE.write_text(file_text())
    print(f"wrote {BOOTSTRAP_FILE}")
