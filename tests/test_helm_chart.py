"""deploy/helm/otel-gpu: rendered and linted by a real Helm engine (helm-python-sdk: Helm's own
Go SDK, v4, loaded in-process; no helm binary, no cluster), every rendered object validated with
kubernetes-validate (strict), each value shown to change what it says, and the default render
held equal to the kustomize overlays so the two cannot drift.

The engine is a shared library called through ctypes: it starts Go threads, but no process and
no socket (checked once under strace), so its tests are unit; the kustomize comparison runs
kubectl (peers)."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from support.manifests import (
    OPERATOR_API,
    ROOT,
    VERSIONS,
    Object,
    check_operator_kinds,
    container,
    flag,
    labels_select,
    one,
    otel_gpu_containers,
    render_kustomize,
    validate_strictly,
)

from otel_gpu import __version__
from otel_gpu.cli import build_parser

CHART = ROOT / "deploy" / "helm" / "otel-gpu"
MICROK8S = "/var/snap/microk8s/common/var/lib/kubelet"
K0S = "/var/lib/k0s/kubelet"
# What overlays/operator adds to overlays/cluster, as values.
OPERATOR = {
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "runtimeClassName": "nvidia",
}
SCHEDULING = {
    "nodeSelector": {"node-role.example/gpu": "yes"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    "priorityClassName": "gpu-telemetry",
    "imagePullSecrets": [{"name": "registry-login"}],
}  # fmt: skip
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "operator": OPERATOR,
    "microk8s": {"kubeletPath": MICROK8S},
    "k0s": {"kubeletPath": K0S + "/"},
    "scheduling": SCHEDULING,
    "no-processor": {"processor": {"enabled": False}, **OPERATOR},
    "own-collector": {"processor": {"enabled": False}, "otlpEndpoint": "http://otelcol.obs:4317"},
    "processor-options": {
        "processor": {"forward": "otelcol.obs:4317", "prometheus": False, "replicas": 0,
                      "persistence": {"size": "5Gi", "storageClassName": "fast-ssd"}},
        "serviceMonitor": {"enabled": True, "interval": "30s", "labels": {"prometheus": "main"}},
    },
    "image": {
        "image": {"repository": "registry.example/ml/otel-gpu", "tag": "0.1.0-rc1",
                  "pullPolicy": "Always"},
        "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"memory": "1Gi"}},
        "processor": {"resources": {"limits": {"memory": "2Gi"}}},
    },
}  # fmt: skip


def _render_files(
    values: dict[str, Any] | None = None, *, name: str = "otel-gpu", namespace: str = "otel-gpu"
) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=name, namespace=namespace, is_install=True)


def render(values: dict[str, Any] | None = None, **release: str) -> list[Object]:
    files = _render_files(values, **release)
    return [
        doc for path, text in sorted(files.items()) if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text) if doc
    ]  # fmt: skip


def _pod(objects: list[Object], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, kind, name)["spec"]["template"]["spec"]
    return spec


def _agent(objects: list[Object]) -> Object:
    return container(one(objects, "DaemonSet", "otel-gpu-node"), "otel-gpu")


def _kinds(objects: list[Object]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


# --- the engine: lint, schemas, command lines ----------------------------------------------


@pytest.mark.unit
def test_the_chart_is_versioned_as_the_package() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert meta["version"] == meta["appVersion"] == __version__
    with helm.Chart.load(CHART) as chart:  # as the engine reads it
        assert chart.version == chart.metadata["appVersion"] == __version__
    images = {c["image"] for _, c in otel_gpu_containers(render())}
    assert images == {f"otel-gpu:{__version__}"}  # the image tag follows appVersion


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_helm_lint_finds_no_error_and_no_warning(values: dict[str, Any], version: str) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{version}")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 1 is information (only "icon is recommended"); 2 and 3 are warning and error.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.unit
def test_helm_lint_is_a_real_linter(tmp_path: Path) -> None:
    """The lint above could pass by finding nothing at all: a template with one `end` too few
    is an error to it."""
    broken = tmp_path / "otel-gpu"
    shutil.copytree(CHART, broken)
    template = broken / "templates" / "servicemonitors.yaml"
    template.write_text(template.read_text().rsplit("{{- end }}", 1)[0])
    report = helm.lint(broken, strict=True)
    assert any("servicemonitors.yaml" in e for e in report["errors"]), report


@pytest.mark.unit
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_validates_strictly(values: dict[str, Any], version: str) -> None:
    objects = render(values)
    validate_strictly(objects, version)  # raises on any error
    check_operator_kinds(objects)  # the ServiceMonitors and the PrometheusRule, structurally
    assert not [o for o in objects if o["kind"] in ("Namespace", "Role", "ClusterRole")]


@pytest.mark.unit
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_the_otel_gpu_arguments_are_ones_the_command_line_accepts(values: dict[str, Any]) -> None:
    parser = build_parser()
    found = otel_gpu_containers(render(values))
    wanted = {"DaemonSet"} | (
        {"Deployment"} if values.get("processor", {}).get("enabled", 1) else set()
    )
    assert {obj["kind"] for obj, _ in found} == wanted
    for obj, c in found:
        args = parser.parse_args(c["args"])
        assert args.func is not None, (obj["metadata"]["name"], c["args"])


# --- the same objects as the kustomize overlays ---------------------------------------------


def _comparable(obj: Object) -> Object:
    """An object less what a Helm release labels differently from kustomize (its labels, the
    selectors made of them) and Helm's explicit imagePullPolicy: the rest must be equal."""
    obj = copy.deepcopy(obj)
    obj["metadata"] = {k: v for k, v in obj["metadata"].items() if k != "labels"}
    spec = obj.get("spec", {})
    if obj["kind"] in ("DaemonSet", "Deployment", "Service", "ServiceMonitor"):
        spec.pop("selector")
    if obj["kind"] in ("DaemonSet", "Deployment"):
        spec["template"].pop("metadata")
        for c in spec["template"]["spec"]["containers"]:
            c.pop("imagePullPolicy", None)  # only Helm sets it
    return obj


def _label_sets(obj: Object) -> dict[str, dict[str, str]]:
    spec = obj.get("spec", {})
    sets = {"labels": obj["metadata"].get("labels", {})}
    if obj["kind"] in ("DaemonSet", "Deployment"):
        sets["selector"] = spec["selector"]["matchLabels"]
        sets["pod"] = spec["template"]["metadata"]["labels"]
    if obj["kind"] == "Service":
        sets["selector"] = spec["selector"]
    if obj["kind"] == "ServiceMonitor":
        sets["selector"] = spec["selector"]["matchLabels"]
    return sets


@pytest.mark.peers  # kubectl kustomize
@pytest.mark.parametrize(
    ("overlay", "values"), [("overlays/cluster", {}), ("overlays/operator", OPERATOR)]
)
def test_the_default_render_is_the_kustomize_overlay(overlay: str, values: dict[str, Any]) -> None:
    """`helm install otel-gpu` with default values makes overlays/cluster's objects (less its
    Namespace: Helm's --create-namespace makes that), field for field: names, container args
    and env, ports, probes, resources, volumes and mounts, security contexts, hostPID,
    scheduling, Services, the claim; with OPERATOR's values, overlays/operator's. Labels and
    selectors may add Helm's (the release's instance) but keep every kustomize one."""
    kustomized = [o for o in render_kustomize(overlay) if o["kind"] != "Namespace"]
    charted = render(values)
    assert _kinds(charted) == _kinds(kustomized)
    by_kind = {(o["kind"], o["metadata"]["name"]): o for o in charted}
    for want in kustomized:
        got = by_kind[want["kind"], want["metadata"]["name"]]
        assert _comparable(got) == _comparable(want), want["metadata"]["name"]
        got_labels = _label_sets(got)
        for part, labels in _label_sets(want).items():
            assert labels.items() <= got_labels[part].items(), (want["metadata"]["name"], part)


# --- each value does what it says -----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("path", [MICROK8S, K0S, K0S + "/"])
def test_kubelet_path_moves_the_host_side_of_the_pod_resources_mount(path: str) -> None:
    objects = render({"kubeletPath": path})
    pod = _pod(objects, "DaemonSet", "otel-gpu-node")
    volume = next(v for v in pod["volumes"] if v["name"] == "pod-resources")
    assert volume["hostPath"] == {"path": path.rstrip("/") + "/pod-resources", "type": "Directory"}
    agent = _agent(objects)  # the container's side stays where the agent's argument points
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "pod-resources")
    assert flag(agent["args"], "--pod-resources") == mount["mountPath"] + "/kubelet.sock"
    default = _pod(render(), "DaemonSet", "otel-gpu-node")
    volume = next(v for v in default["volumes"] if v["name"] == "pod-resources")
    assert volume["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"


@pytest.mark.unit
def test_scheduling_values_reach_the_node_agent() -> None:
    objects = render(SCHEDULING)
    pod = _pod(objects, "DaemonSet", "otel-gpu-node")
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        assert pod[key] == SCHEDULING[key], key
    assert "runtimeClassName" not in pod
    assert _pod(objects, "Deployment", "otel-gpu-processor")["imagePullSecrets"] == [
        {"name": "registry-login"}
    ]
    assert _pod(render({"runtimeClassName": "nvidia"}), "DaemonSet", "otel-gpu-node")[
        "runtimeClassName"
    ] == "nvidia"  # fmt: skip
    # Defaults: evicted last, GPU-tainted nodes tolerated, nothing that needs GFD.
    default = _pod(render(), "DaemonSet", "otel-gpu-node")
    assert default["priorityClassName"] == "system-node-critical"
    assert default["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert not {"nodeSelector", "affinity", "runtimeClassName", "imagePullSecrets"} & set(default)
    # An empty priorityClassName leaves the field out (a class that does not exist fails pods).
    assert "priorityClassName" not in _pod(render({"priorityClassName": ""}), "DaemonSet",
                                           "otel-gpu-node")  # fmt: skip


@pytest.mark.unit
def test_image_and_resources_values_reach_both_containers() -> None:
    values = VALUE_SETS["image"]
    objects = render(values)
    for _, c in otel_gpu_containers(objects):
        assert c["image"] == "registry.example/ml/otel-gpu:0.1.0-rc1"
        assert c["imagePullPolicy"] == "Always"
    assert _agent(objects)["resources"] == values["resources"]
    processor = container(one(objects, "Deployment", "otel-gpu-processor"), "processor")
    # Merged with the chart's defaults, as Helm merges maps: the requests stay.
    merged = {"limits": {"memory": "2Gi"}, "requests": {"cpu": "100m", "memory": "128Mi"}}
    assert processor["resources"] == merged
    assert {c["imagePullPolicy"] for _, c in otel_gpu_containers(render())} == {"IfNotPresent"}


@pytest.mark.unit
def test_service_monitors_only_when_enabled_with_their_labels_and_interval() -> None:
    assert not [o for o in render() if o["apiVersion"] == OPERATOR_API]
    objects = render(VALUE_SETS["processor-options"])  # the processor serves no /metrics
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["name"] == "otel-gpu-node"
    assert monitor["metadata"]["labels"]["prometheus"] == "main"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # Helm merges
    # A null removes the default (as --set serviceMonitor.labels.release=null does).
    values = {"serviceMonitor": {"enabled": True, "labels": {"release": None, "team": "ml"}}}
    for m in [o for o in render(values) if o["kind"] == "ServiceMonitor"]:
        assert "release" not in m["metadata"]["labels"] and m["metadata"]["labels"]["team"] == "ml"
    assert [e["interval"] for e in monitor["spec"]["endpoints"]] == ["30s"]
    objects = render({"serviceMonitor": {"enabled": True}})
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"otel-gpu-node", "otel-gpu-processor"}
    for m in monitors.values():
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert [e["interval"] for e in m["spec"]["endpoints"]] == ["15s"]
    assert not [o for o in objects if o["kind"] == "PrometheusRule"]


@pytest.mark.unit
def test_the_prometheus_rule_ships_the_rules_file_untemplated() -> None:
    (rule,) = [
        o for o in render({"prometheusRule": {"enabled": True}}) if o["kind"] == "PrometheusRule"
    ]
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]
    assert "{{ $labels.hw_id }}" in str(rule["spec"]["groups"])  # reached Prometheus as written
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (CHART / "files" / "otel-gpu-rules.yml").read_text() == (
        ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml"
    ).read_text()  # the chart's copy (a chart reads no file outside itself)


@pytest.mark.unit
def test_without_the_processor_the_agents_serve_prometheus_only_or_send_otlp_elsewhere() -> None:
    objects = render({"processor": {"enabled": False}, "serviceMonitor": {"enabled": True}})
    assert _kinds(objects) == {("DaemonSet", "otel-gpu-node"), ("Service", "otel-gpu-node"),
                               ("ServiceAccount", "otel-gpu-node"),
                               ("ServiceMonitor", "otel-gpu-node")}  # fmt: skip
    args = _agent(objects)["args"]
    assert flag(args, "--exporter") == "prometheus"
    assert not [a for a in args if a.startswith("--endpoint")]  # no OTLP to nowhere
    args = _agent(render(VALUE_SETS["own-collector"]))["args"]
    assert flag(args, "--exporter") == "otlp,prometheus"
    assert flag(args, "--endpoint") == "http://otelcol.obs:4317"
    # otlpEndpoint wins over the chart's processor too.
    args = _agent(render({"otlpEndpoint": "http://otelcol.obs:4317"}))["args"]
    assert flag(args, "--endpoint") == "http://otelcol.obs:4317"
    assert flag(_agent(render())["args"], "--endpoint") == "http://otel-gpu-processor:4317"


@pytest.mark.unit
def test_processor_values_forward_replicas_prometheus_and_persistence() -> None:
    objects = render(VALUE_SETS["processor-options"])
    deploy = one(objects, "Deployment", "otel-gpu-processor")
    assert deploy["spec"]["replicas"] == 0
    processor = container(deploy, "processor")
    env = {e["name"]: e["value"] for e in processor["env"]}
    assert env["OTEL_GPU_PROCESSOR_FORWARD"] == "otelcol.obs:4317"
    assert not [a for a in processor["args"] if a.startswith("--prometheus")]
    assert "metrics" not in {p["name"] for p in processor["ports"]}
    service = one(objects, "Service", "otel-gpu-processor")
    assert [p["name"] for p in service["spec"]["ports"]] == ["otlp-grpc"]
    assert "annotations" not in service["metadata"]  # nothing to scrape
    claim = one(objects, "PersistentVolumeClaim", "otel-gpu-processor-state")
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    default = one(render(), "PersistentVolumeClaim", "otel-gpu-processor-state")
    assert "storageClassName" not in default["spec"]  # the cluster's default class
    processor = container(one(render(), "Deployment", "otel-gpu-processor"), "processor")
    assert flag(processor["args"], "--prometheus") == "0.0.0.0:9465"
    assert {e["name"]: e["value"] for e in processor["env"]}["OTEL_GPU_PROCESSOR_FORWARD"] == ""


@pytest.mark.unit
def test_more_than_one_processor_replica_is_refused() -> None:
    with pytest.raises(helm.HelmRenderError, match="processor.replicas: 0 or 1"):
        render({"processor": {"replicas": 2}})


@pytest.mark.unit
def test_objects_go_in_the_release_namespace_with_the_standard_labels() -> None:
    objects = render(OPERATOR, namespace="monitoring")
    for obj in objects:
        assert obj["metadata"]["namespace"] == "monitoring", obj["metadata"]["name"]
        labels = obj["metadata"]["labels"]
        assert labels["helm.sh/chart"] == f"otel-gpu-{__version__}"
        assert labels["app.kubernetes.io/name"] == "otel-gpu"
        assert labels["app.kubernetes.io/instance"] == "otel-gpu"
        assert labels["app.kubernetes.io/version"] == __version__
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
    notes = _render_files(namespace="monitoring")["otel-gpu/templates/NOTES.txt"]
    assert (
        "kubectl label namespace monitoring pod-security.kubernetes.io/enforce=privileged" in notes
    )


@pytest.mark.unit
def test_a_second_release_names_and_selects_its_own_objects() -> None:
    ours, theirs = render(OPERATOR), render(OPERATOR, name="lab")
    assert {name for _, name in _kinds(theirs)} == {
        "lab-otel-gpu", "lab-otel-gpu-node", "lab-otel-gpu-processor",
        "lab-otel-gpu-processor-state"}  # fmt: skip
    agent = container(one(theirs, "DaemonSet", "lab-otel-gpu-node"), "otel-gpu")
    assert flag(agent["args"], "--endpoint") == "http://lab-otel-gpu-processor:4317"
    pods = [(o, o["spec"]["template"]["metadata"]["labels"]) for o in ours + theirs
            if o["kind"] in ("DaemonSet", "Deployment")]  # fmt: skip
    for service in [o for o in ours + theirs if o["kind"] == "Service"]:
        selected = [w for w, labels in pods if labels_select(service["spec"]["selector"], labels)]
        assert [w["metadata"]["name"] for w in selected] == [
            service["metadata"]["name"]
        ]  # its own release's, never the other's
    override = render({"fullnameOverride": "gpu"})
    assert ("DaemonSet", "gpu-node") in _kinds(override)
    assert flag(container(one(override, "DaemonSet", "gpu-node"), "otel-gpu")["args"],
                "--endpoint") == "http://gpu-processor:4317"  # fmt: skip
