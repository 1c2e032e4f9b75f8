"""Rendering the chart with Helm's own engine (helm-python-sdk binds libhelm, Helm v4's Go SDK) and
reading what it rendered (``from tests.deploy.chart import ...``)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "kvroute"
RELEASE = "kvr"
NAMESPACE = "inference"
FULLNAME = "kvr-kvroute"


def render(values: dict[str, Any] | None = None, *, tests: bool = True) -> list[dict]:
    """Every manifest the chart renders for ``values`` (release ``kvr`` in namespace ``inference``),
    as dicts, NOTES.txt left out; ``tests=False`` leaves the ``helm test`` hooks out too.

    Raises:
        helm_python.HelmValuesError: the values break values.schema.json (the message names the key).
    """
    docs = []
    for name, text in sorted(_rendered(json.dumps(values or {}, sort_keys=True)).items()):
        if name.endswith("NOTES.txt") or (not tests and "/templates/tests/" in name):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@functools.lru_cache(maxsize=64)
def _rendered(values_json: str) -> dict[str, str]:
    """Template path -> rendered text (one render per distinct values within a test run; the
    generated Redis password is then the same for equal values)."""
    with helm.Chart.load(str(CHART_DIR)) as chart:
        return chart.render(values=json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)


def notes(values: dict[str, Any] | None = None) -> str:
    """The rendered NOTES.txt."""
    files = _rendered(json.dumps(values or {}, sort_keys=True))
    return next(text for name, text in files.items() if name.endswith("NOTES.txt"))


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one manifest of ``kind`` (and ``name``). Raises AssertionError when not exactly one."""
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{kind} {name or ''}: {len(hits)} rendered"
    return hits[0]


def kinds(docs: list[dict]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["metadata"]["name"]) for d in docs)


def pod_spec(workload: dict) -> dict:
    """The pod spec of a Deployment / StatefulSet, or of a Pod."""
    return workload["spec"]["template"]["spec"] if "template" in workload.get("spec", {}) else workload["spec"]


def container(workload: dict, name: str) -> dict:
    spec = pod_spec(workload)
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def env_of(c: dict) -> dict[str, Any]:
    """A container's env as name -> value (a string) or valueFrom (a dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def known_settings(component: str) -> set[str]:
    """The ``KVROUTE_*`` variables the router's, replica's or bridge's settings read."""
    if component == "router":
        from router.settings import RouterSettings as cls
    elif component == "bridge":
        from replica.bridge.settings import BridgeSettings as cls
    else:
        from replica.settings import ReplicaSettings as cls
    return {"KVROUTE_" + f.name.upper() for f in dataclasses.fields(cls)}


def unknown_kvroute_env(docs: list[dict]) -> list[str]:
    """``workload/container: KVROUTE_X`` for every KVROUTE_* variable that the program in that
    container does not read (settings ignore unknown variables, so the chart must not set one)."""
    bad = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in pod_spec(d)["containers"]:
            if c["name"] not in ("router", "replica", "bridge"):
                continue
            known = known_settings(c["name"])
            bad += [f"{d['metadata']['name']}/{c['name']}: {n}" for n in env_of(c)
                    if n.startswith("KVROUTE_") and n not in known]
    return bad
