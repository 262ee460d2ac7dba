"""deploy/kubernetes: each overlay renders with ``kubectl kustomize``, every object validates
against the Kubernetes schemas (kubernetes-validate, strict), the otel-gpu arguments parse with
the real command line, and the probes, ports, sockets and volumes are wired to each other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from otel_gpu.cli import build_parser

pytestmark = pytest.mark.peers

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
OVERLAYS = ["overlays/cluster", "overlays/vllm", "overlays/operator"]
# Prometheus Operator kinds: no schema in kubernetes-validate; checked structurally below.
OPERATOR_API = "monitoring.coreos.com/v1"
RULES = DEPLOY.parent / "prometheus" / "otel-gpu-rules.yml"
# The oldest Kubernetes the manifests promise to work on, and the newest the validator knows.
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed to render the kustomize overlays (see docs/development.md)")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _flag(args: list[str], flag: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(flag + "="))


def _port(value: str) -> int:
    return int(value.rsplit(":", 1)[1].split("/", 1)[0])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    objects = _render(overlay)
    assert objects
    for obj in objects:
        if obj["apiVersion"] == OPERATOR_API:
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises on any error


def test_the_otel_gpu_arguments_are_ones_the_command_line_accepts() -> None:
    parser = build_parser()
    for overlay in OVERLAYS:
        checked = []
        for obj in _render(overlay):
            if obj["kind"] not in ("Deployment", "DaemonSet"):
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if c["image"].split(":")[0].endswith("otel-gpu"):
                    args = parser.parse_args(c["args"])
                    assert args.func is not None, c["args"]
                    checked.append(f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}")
        # Every overlay runs otel-gpu somewhere: none found means the image was renamed and
        # nothing was checked, not that the arguments are right.
        assert checked, f"{overlay}: no container image ends in otel-gpu; nothing was checked"


def test_the_sidecar_gates_readiness_and_the_server_its_liveness() -> None:
    objects = _render("overlays/vllm")
    deploy = _one(objects, "Deployment", "vllm")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    server, sidecar = _container(deploy, "vllm"), _container(deploy, "otel-gpu")
    health_port = _port(_flag(sidecar["args"], "--health"))
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": health_port}
    server_port = next(p["containerPort"] for p in server["ports"] if p["name"] == "http")
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["livenessProbe"]["httpGet"]["port"] == "http"
    assert _port(_flag(sidecar["args"], "--server-metrics")) == server_port
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["containerPort"] for p in sidecar["ports"]} == {health_port}
    env = {e["name"]: e for e in sidecar["env"]}
    for var, field in (("K8S_POD_NAME", "metadata.name"), ("K8S_POD_UID", "metadata.uid"),
                       ("K8S_NAMESPACE_NAME", "metadata.namespace")):  # fmt: skip
        assert env[var]["valueFrom"]["fieldRef"]["fieldPath"] == field
    assert env["K8S_CONTAINER_NAME"]["value"] == server["name"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_daemonset_mounts_what_it_reads_and_exports_to_the_processor() -> None:
    objects = _render("overlays/cluster")
    ds = _one(objects, "DaemonSet", "otel-gpu-node")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    agent = _container(ds, "otel-gpu")
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket = _flag(agent["args"], "--pod-resources")
    pr = mounts["pod-resources"]
    assert socket.startswith(pr["mountPath"] + "/") and pr["readOnly"] is True
    assert volumes["pod-resources"]["hostPath"]["path"] == pr["mountPath"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    proc = mounts["host-proc"]
    assert env["OTEL_GPU_PROC_ROOT"] == proc["mountPath"] and proc["readOnly"] is True
    assert volumes["host-proc"]["hostPath"]["path"] == "/proc"
    logs = mounts["pod-logs"]
    assert _flag(agent["args"], "--pod-logs") == logs["mountPath"] and logs["readOnly"] is True
    assert volumes["pod-logs"]["hostPath"]["path"] == "/var/log/pods"
    assert env["CUDA_VISIBLE_DEVICES"] == "all"
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    account = _one(objects, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole")]  # no API access

    service = _one(objects, "Service", "otel-gpu-processor")
    endpoint = _flag(agent["args"], "--endpoint").removeprefix("http://")
    host, port = endpoint.rsplit(":", 1)
    assert host == service["metadata"]["name"]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_the_processor_keeps_its_state_on_the_claim() -> None:
    objects = _render("overlays/cluster")
    deploy = _one(objects, "Deployment", "otel-gpu-processor")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    processor = _container(deploy, "processor")
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    claim = _one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mount = next(m for m in processor["volumeMounts"] if m["name"] == "state")
    assert _flag(processor["args"], "--state").startswith(mount["mountPath"] + "/")
    names = {p["name"]: p["containerPort"] for p in processor["ports"]}
    assert _port(_flag(processor["args"], "--listen")) == names["otlp-grpc"]
    assert processor["readinessProbe"]["httpGet"]["port"] == "health"
    assert _port(_flag(processor["args"], "--health")) == names["health"]
    service = _one(objects, "Service", "otel-gpu-processor")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(names)


# What each otel-gpu command's probes may use (otel_gpu/agent/health.py,
# otel_gpu/processor/health.py): liveness on the agent's own work or the processor's serving,
# never on a telemetry backend (the agents' /exportz, the processor's stall in /healthz).
AGENT_PROBES = {"livenessProbe": "/healthz", "readinessProbe": "/healthz"}
PROCESSOR_PROBES = {"livenessProbe": "/livez", "readinessProbe": "/readyz"}


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_no_probe_restarts_or_unreadies_for_a_telemetry_backend() -> None:
    checked = []
    for overlay in OVERLAYS:
        for obj in _render(overlay):
            if obj["kind"] not in ("Deployment", "DaemonSet"):
                continue
            containers = obj["spec"]["template"]["spec"]["containers"]
            for c in containers:
                for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                    if kind in c:  # on any container, the inference server's too
                        assert c[kind]["httpGet"]["path"] != "/exportz", (obj["kind"], c["name"])
                if not c["image"].split(":")[0].endswith("otel-gpu"):
                    continue
                command = c["args"][0]
                wanted = PROCESSOR_PROBES if command == "processor" else AGENT_PROBES
                health = _port(_flag(c["args"], "--health"))
                assert "livenessProbe" in c, (obj["kind"], c["name"])
                for kind, path in wanted.items():
                    if kind in c:
                        assert c[kind]["httpGet"]["path"] == path, (obj["kind"], c["name"], kind)
                        assert _probe_port(c, c[kind]) == health, (obj["kind"], c["name"], kind)
                checked.append(f"{overlay}:{obj['kind']}/{c['name']}")
    assert {"overlays/cluster:DaemonSet/otel-gpu", "overlays/cluster:Deployment/processor",
            "overlays/vllm:Deployment/otel-gpu"} <= set(checked), checked  # fmt: skip


def _labels_select(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_the_default_overlay_delivers_metrics_to_prometheus_and_the_processor() -> None:
    """As shipped, something scrapes or receives every series: each node agent serves
    /metrics behind a headless Service and sends OTLP to the processor, and the processor
    serves its detector metrics behind its Service."""
    objects = _render("overlays/cluster")
    ds = _one(objects, "DaemonSet", "otel-gpu-node")
    agent = _container(ds, "otel-gpu")
    assert set(_flag(agent["args"], "--exporter").split(",")) == {"otlp", "prometheus"}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["OTEL_EXPORTER_PROMETHEUS_HOST"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports["metrics"] == int(env["OTEL_EXPORTER_PROMETHEUS_PORT"])
    node = _one(objects, "Service", "otel-gpu-node")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert node["spec"]["clusterIP"] == "None"  # one target per node
    assert _labels_select(node["spec"]["selector"], pod_labels)
    assert {(p["name"], p["targetPort"]) for p in node["spec"]["ports"]} == {("metrics", "metrics")}
    assert node["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])

    deploy = _one(objects, "Deployment", "otel-gpu-processor")
    processor = _container(deploy, "processor")
    names = {p["name"]: p["containerPort"] for p in processor["ports"]}
    assert _port(_flag(processor["args"], "--prometheus")) == names["metrics"]
    service = _one(objects, "Service", "otel-gpu-processor")
    assert "metrics" in {p["targetPort"] for p in service["spec"]["ports"]}
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(names["metrics"])


def test_the_node_agent_schedules_on_any_cluster_and_is_evicted_last() -> None:
    objects = _render("overlays/cluster")
    pod = _one(objects, "DaemonSet", "otel-gpu-node")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    # Neither needs the gpu-operator or GPU feature discovery by default...
    assert "runtimeClassName" not in pod and "nodeSelector" not in pod
    # ...and overlays/operator, for clusters that have them, adds both.
    operator = _render("overlays/operator")
    pod = _one(operator, "DaemonSet", "otel-gpu-node")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_images_are_pinned_to_this_release_and_namespaces_allow_what_pods_need() -> None:
    from otel_gpu import __version__

    for overlay in OVERLAYS:
        objects = _render(overlay)
        for obj in objects:
            if obj["kind"] not in ("Deployment", "DaemonSet"):
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if c["image"].split(":")[0].endswith("otel-gpu"):
                    assert c["image"].rsplit(":", 1)[1] == __version__, (overlay, c["image"])
        namespaces = [o for o in objects if o["kind"] == "Namespace"]
        for ns in namespaces:  # hostPID (node agent) and SYS_PTRACE (both) need "privileged"
            labels = ns["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/enforce"] == "privileged", overlay
        assert namespaces or overlay == "overlays/operator"  # (it adds to overlays/cluster's)


def test_the_operator_overlay_monitors_both_services_and_ships_the_rules() -> None:
    objects = _render("overlays/operator")
    for monitor in [o for o in objects if o["kind"] == "ServiceMonitor"]:
        assert monitor["apiVersion"] == OPERATOR_API
        selected = [
            s for s in objects if s["kind"] == "Service"
            and _labels_select(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]  # fmt: skip
        assert len(selected) == 1, monitor["metadata"]["name"]
        (service,) = selected
        assert service["metadata"]["namespace"] == monitor["metadata"]["namespace"]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    monitored = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceMonitor"}
    assert monitored == {"otel-gpu-node", "otel-gpu-processor"}
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == OPERATOR_API
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
