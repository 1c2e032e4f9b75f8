"""The Grafana dashboard's queries as Grafana sends them (``from tests.deploy.dashboard import ...``):
its panels, variables and PromQL expressions, and the interpolation of ``$variables``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/helm/kvroute/dashboards/kvroute.json"
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def label_values(dashboard: dict) -> list[tuple[str, str]]:
    """(selector, label) of each ``label_values(selector, label)`` variable query."""
    out = []
    for v in variables(dashboard).values():
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: expected label_values(selector, label), got {v['query']!r}"
            out.append((m.group(1), m.group(2)))
    return out


def interpolate(expr: str, variables: dict[str, dict], chosen: Mapping[str, str] | None = None) -> str:
    """What Grafana sends: builtins become durations, a variable its ``chosen`` value, else (at
    "All") its allValue."""

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in variables, f"${name} is not a variable of the dashboard ({expr})"
        return (chosen or {}).get(name, variables[name]["allValue"])

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)
