"""deploy/kubernetes: each overlay renders with ``kubectl kustomize``, every object validates
against the Kubernetes schemas (kubernetes-validate, strict), the otel-gpu arguments parse with
the real command line, and the probes, ports, sockets and volumes are wired to each other."""

from __future__ import annotations

from typing import Any

import pytest
from support.manifests import (
    VERSIONS,
    check_operator_kinds,
    container,
    flag,
    labels_select,
    one,
    otel_gpu_containers,
    port,
    render_kustomize,
    validate_strictly,
)

from otel_gpu.cli import build_parser

pytestmark = pytest.mark.peers

OVERLAYS = ["overlays/cluster", "overlays/vllm", "overlays/operator"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    validate_strictly(render_kustomize(overlay), version)  # raises on any error


def test_the_otel_gpu_arguments_are_ones_the_command_line_accepts() -> None:
    parser = build_parser()
    for overlay in OVERLAYS:
        found = otel_gpu_containers(render_kustomize(overlay))
        # Every overlay runs otel-gpu somewhere: none found means the image was renamed and
        # nothing was checked, not that the arguments are right.
        assert found, f"{overlay}: no container image ends in otel-gpu; nothing was checked"
        for obj, c in found:
            args = parser.parse_args(c["args"])
            assert args.func is not None, (obj["metadata"]["name"], c["args"])


def test_the_sidecar_gates_readiness_and_the_server_its_liveness() -> None:
    objects = render_kustomize("overlays/vllm")
    deploy = one(objects, "Deployment", "vllm")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    server, sidecar = container(deploy, "vllm"), container(deploy, "otel-gpu")
    health_port = port(flag(sidecar["args"], "--health"))
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": health_port}
    server_port = next(p["containerPort"] for p in server["ports"] if p["name"] == "http")
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["livenessProbe"]["httpGet"]["port"] == "http"
    assert port(flag(sidecar["args"], "--server-metrics")) == server_port
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["containerPort"] for p in sidecar["ports"]} == {health_port}
    env = {e["name"]: e for e in sidecar["env"]}
    for var, field in (("K8S_POD_NAME", "metadata.name"), ("K8S_POD_UID", "metadata.uid"),
                       ("K8S_NAMESPACE_NAME", "metadata.namespace")):  # fmt: skip
        assert env[var]["valueFrom"]["fieldRef"]["fieldPath"] == field
    assert env["K8S_CONTAINER_NAME"]["value"] == server["name"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_daemonset_mounts_what_it_reads_and_exports_to_the_processor() -> None:
    objects = render_kustomize("overlays/cluster")
    ds = one(objects, "DaemonSet", "otel-gpu-node")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    agent = container(ds, "otel-gpu")
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket = flag(agent["args"], "--pod-resources")
    pr = mounts["pod-resources"]
    assert socket.startswith(pr["mountPath"] + "/") and pr["readOnly"] is True
    assert volumes["pod-resources"]["hostPath"]["path"] == pr["mountPath"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    proc = mounts["host-proc"]
    assert env["OTEL_GPU_PROC_ROOT"] == proc["mountPath"] and proc["readOnly"] is True
    assert volumes["host-proc"]["hostPath"]["path"] == "/proc"
    logs = mounts["pod-logs"]
    assert flag(agent["args"], "--pod-logs") == logs["mountPath"] and logs["readOnly"] is True
    assert volumes["pod-logs"]["hostPath"]["path"] == "/var/log/pods"
    assert env["CUDA_VISIBLE_DEVICES"] == "all"
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    account = one(objects, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole")]  # no API access

    service = one(objects, "Service", "otel-gpu-processor")
    endpoint = flag(agent["args"], "--endpoint").removeprefix("http://")
    host, number = endpoint.rsplit(":", 1)
    assert host == service["metadata"]["name"]
    assert int(number) in {p["port"] for p in service["spec"]["ports"]}


def test_the_processor_keeps_its_state_on_the_claim() -> None:
    objects = render_kustomize("overlays/cluster")
    deploy = one(objects, "Deployment", "otel-gpu-processor")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    processor = container(deploy, "processor")
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    claim = one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mount = next(m for m in processor["volumeMounts"] if m["name"] == "state")
    assert flag(processor["args"], "--state").startswith(mount["mountPath"] + "/")
    names = {p["name"]: p["containerPort"] for p in processor["ports"]}
    assert port(flag(processor["args"], "--listen")) == names["otlp-grpc"]
    assert processor["readinessProbe"]["httpGet"]["port"] == "health"
    assert port(flag(processor["args"], "--health")) == names["health"]
    service = one(objects, "Service", "otel-gpu-processor")
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
        for obj in render_kustomize(overlay):
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
                health = port(flag(c["args"], "--health"))
                assert "livenessProbe" in c, (obj["kind"], c["name"])
                for kind, path in wanted.items():
                    if kind in c:
                        assert c[kind]["httpGet"]["path"] == path, (obj["kind"], c["name"], kind)
                        assert _probe_port(c, c[kind]) == health, (obj["kind"], c["name"], kind)
                checked.append(f"{overlay}:{obj['kind']}/{c['name']}")
    assert {"overlays/cluster:DaemonSet/otel-gpu", "overlays/cluster:Deployment/processor",
            "overlays/vllm:Deployment/otel-gpu"} <= set(checked), checked  # fmt: skip


def test_the_default_overlay_delivers_metrics_to_prometheus_and_the_processor() -> None:
    """As shipped, something scrapes or receives every series: each node agent serves
    /metrics behind a headless Service and sends OTLP to the processor, and the processor
    serves its detector metrics behind its Service."""
    objects = render_kustomize("overlays/cluster")
    ds = one(objects, "DaemonSet", "otel-gpu-node")
    agent = container(ds, "otel-gpu")
    assert set(flag(agent["args"], "--exporter").split(",")) == {"otlp", "prometheus"}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["OTEL_EXPORTER_PROMETHEUS_HOST"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports["metrics"] == int(env["OTEL_EXPORTER_PROMETHEUS_PORT"])
    node = one(objects, "Service", "otel-gpu-node")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert node["spec"]["clusterIP"] == "None"  # one target per node
    assert labels_select(node["spec"]["selector"], pod_labels)
    assert {(p["name"], p["targetPort"]) for p in node["spec"]["ports"]} == {("metrics", "metrics")}
    assert node["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])

    deploy = one(objects, "Deployment", "otel-gpu-processor")
    processor = container(deploy, "processor")
    names = {p["name"]: p["containerPort"] for p in processor["ports"]}
    assert port(flag(processor["args"], "--prometheus")) == names["metrics"]
    service = one(objects, "Service", "otel-gpu-processor")
    assert "metrics" in {p["targetPort"] for p in service["spec"]["ports"]}
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(names["metrics"])


def test_the_node_agent_schedules_on_any_cluster_and_is_evicted_last() -> None:
    objects = render_kustomize("overlays/cluster")
    pod = one(objects, "DaemonSet", "otel-gpu-node")["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    # Neither needs the gpu-operator or GPU feature discovery by default...
    assert "runtimeClassName" not in pod and "nodeSelector" not in pod
    # ...and overlays/operator, for clusters that have them, adds both.
    operator = render_kustomize("overlays/operator")
    pod = one(operator, "DaemonSet", "otel-gpu-node")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


def test_images_are_pinned_to_this_release_and_namespaces_allow_what_pods_need() -> None:
    from otel_gpu import __version__

    for overlay in OVERLAYS:
        objects = render_kustomize(overlay)
        for _, c in otel_gpu_containers(objects):
            assert c["image"].rsplit(":", 1)[1] == __version__, (overlay, c["image"])
        namespaces = [o for o in objects if o["kind"] == "Namespace"]
        for ns in namespaces:  # hostPID (node agent) and SYS_PTRACE (both) need "privileged"
            labels = ns["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/enforce"] == "privileged", overlay
        assert namespaces or overlay == "overlays/operator"  # (it adds to overlays/cluster's)


def test_the_operator_overlay_monitors_both_services_and_ships_the_rules() -> None:
    objects = render_kustomize("overlays/operator")
    check_operator_kinds(objects)
    monitored = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceMonitor"}
    assert monitored == {"otel-gpu-node", "otel-gpu-processor"}
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "PrometheusRule"] == ["otel-gpu"]
