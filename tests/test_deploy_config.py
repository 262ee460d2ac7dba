"""The deployment files checked by the real tools that install here: promtool (Debian
``prometheus``) for the alert rules, their unit tests and the Prometheus config."""

from __future__ import annotations

import subprocess

from prometheus_peer import ROOT, binary

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
