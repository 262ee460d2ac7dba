"""A real Prometheus 2.42 (Debian package ``prometheus``) on 127.0.0.1 for tests.

Each server gets a free port and its own data folder, and is stopped (then killed) on exit.
A missing binary fails the test with the package to install; it is never skipped.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.paths import ROOT
from support.peer_process import PeerProcess
from support.ports import free_port


def binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: apt-get install {package} (tests/install-peers.sh installs it)"
        )
    return path


RULES = ROOT / "deploy" / "prometheus" / "otel-gpu-rules.yml"

# Grafana's built-in interval variables, as a 5-minute dashboard range would fill them
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}


def fill_grafana_macros(expr: str) -> str:
    """A dashboard panel's PromQL with Grafana's built-in interval variables filled in."""
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return expr


def processor_scrape_config(target: str) -> str:
    """A Prometheus config that loads the project's alert rules and scrapes one processor
    ``--prometheus`` endpoint (``HOST:PORT``) every second."""
    return f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: otel-gpu-processor
    static_configs: [{{targets: ["{target}"]}}]
"""


class Prometheus:
    """``with Prometheus(tmp_path, config_yaml) as prom: prom.query("up")``."""

    def __init__(self, folder: Path, config: str) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = PeerProcess("prometheus", folder)
        (folder / "prometheus.yml").write_text(config)

    def __enter__(self) -> Prometheus:
        self._server.start(
            [
                binary("prometheus", "prometheus"),
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-remote-write-receiver",
            ],
            f"{self.url}/-/ready",
            startup_s=60,
            poll_s=0.2,
        )
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._server.stop()

    def log(self) -> str:
        return self._server.log()

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>``; the ``data`` of a success, else the error body raised."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a parse or evaluation error)."""
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, timeout_s: float) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns series; fail with the last answer after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(1.0)
