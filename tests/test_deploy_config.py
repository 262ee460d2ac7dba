"""The deployment files checked by the real tools that install here: promtool (Debian
``prometheus``) for the alert rules, their unit tests and the Prometheus config."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from opentelemetry.exporter.prometheus._mapping import sanitize_full_name
from prometheus_peer import ROOT, binary

from otel_gpu import metrics

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    promtool = binary("promtool", "prometheus")
    res = _run(promtool, "test", "rules", str(PROMETHEUS_DIR / "otel-gpu-rules.test.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_prometheus_config_and_rules_check_outside_the_container() -> None:
    promtool = binary("promtool", "prometheus")
    res = _run(promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 5 rules found" in res.stdout


# -- Grafana dashboards: structure, and names that hold behind the Collector too ---------------

DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))


def _dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        out += [(path.name, t["expr"]) for p in board["panels"] for t in p["targets"]]
    return out


def _unit_one_gauges() -> list[str]:
    """Prometheus names the Collector suffixes with `_ratio` (gauges of unit "1") but the
    OpenTelemetry Python exporter leaves bare: the agent's table plus the breaker state."""
    names = [i.name for i in metrics.INSTRUMENTS if i.kind == metrics.GAUGE and i.unit == "1"]
    names.append("otel_gpu.breaker.state")  # watchdog.register_instruments / processor outputs
    return [sanitize_full_name(n) for n in names]


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
