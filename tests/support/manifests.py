"""Kubernetes manifests as the tests read them: the kustomize overlays rendered by ``kubectl
kustomize``, every object validated by kubernetes-validate (strict), and small readers of
rendered objects (one object, a container, an argument's value)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
RULES = ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml"
# Prometheus Operator kinds: no schema in kubernetes-validate; the tests check them structurally.
OPERATOR_API = "monitoring.coreos.com/v1"
# The oldest Kubernetes the manifests promise to work on, and the newest the validator knows.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]

Object = dict[str, Any]


def render_kustomize(overlay: str) -> list[Object]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed to render the kustomize overlays (see docs/development.md)")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def validate_strictly(objects: list[Object], version: str) -> None:
    """Every object against the schemas of Kubernetes ``version``, unknown fields refused
    (raises on the first error); the Prometheus Operator kinds are left to the caller."""
    assert objects
    for obj in objects:
        if obj["apiVersion"] != OPERATOR_API:
            kubernetes_validate.validate(obj, version, strict=True)


def one(objects: list[Object], kind: str, name: str) -> Object:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def container(workload: Object, name: str) -> Object:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(name + "="))


def port(value: str) -> int:
    return int(value.rsplit(":", 1)[1].split("/", 1)[0])


def labels_select(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def otel_gpu_containers(objects: list[Object]) -> list[tuple[Object, Object]]:
    """(workload, container) of every container that runs the otel-gpu image."""
    return [
        (obj, c) for obj in objects if obj["kind"] in ("Deployment", "DaemonSet")
        for c in obj["spec"]["template"]["spec"]["containers"]
        if c["image"].split(":")[0].endswith("otel-gpu")
    ]  # fmt: skip


def check_operator_kinds(objects: list[Object]) -> None:
    """The ServiceMonitors and the PrometheusRule, which kubernetes-validate has no schema for:
    each monitor selects exactly one Service of its namespace, by a port it has, on /metrics;
    the rule's groups are those of deploy/prometheus/otel-gpu-rules.yml."""
    for monitor in [o for o in objects if o["kind"] == "ServiceMonitor"]:
        assert monitor["apiVersion"] == OPERATOR_API
        selected = [
            s for s in objects if s["kind"] == "Service"
            and labels_select(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]  # fmt: skip
        assert len(selected) == 1, monitor["metadata"]["name"]
        (service,) = selected
        assert service["metadata"]["namespace"] == monitor["metadata"]["namespace"]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    for rule in [o for o in objects if o["kind"] == "PrometheusRule"]:
        assert rule["apiVersion"] == OPERATOR_API
        assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
