"""A real OTLP trace store for tests: Arize Phoenix (``phoenix serve``) on 127.0.0.1.

``tests/install-peers.sh`` installs it in its own virtualenv (about 850 MB, kept out of the
project's environment) under ``${OTEL_GPU_PEERS_DIR:-~/.cache/otel-gpu-peers}/phoenix``. Each
server gets free ports, its own working folder (SQLite database), telemetry off, and is stopped
(then killed) on exit. A missing install fails the test with the command to run; it is never
skipped.

Phoenix receives OTLP traces over gRPC (``PHOENIX_GRPC_PORT``) and answers REST queries on its
HTTP port (``PHOENIX_PORT``, bound to ``PHOENIX_HOST``). It keeps span names, ids, parents and
attributes; of the resource it keeps only ``openinference.project.name``, which names the
project the spans land in (``default`` without it). Its gRPC server binds every interface
(``[::]``, not configurable in 20.x); the tests send to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.peer_process import PeerProcess
from support.ports import free_port

VERSION = "20.26.1"  # as pinned in tests/install-peers.sh
HOME = Path(
    os.environ.get("OTEL_GPU_PEERS_DIR") or Path.home() / ".cache" / "otel-gpu-peers"
) / "phoenix"  # fmt: skip
STARTUP_S = 90  # about 11 s on an idle 2-core machine (database migrations, then the servers)


class Phoenix:
    """``with Phoenix(folder) as phoenix: phoenix.spans("default")``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.otlp_grpc = f"127.0.0.1:{self.grpc_port}"
        self._server = PeerProcess("phoenix", folder)

    def __enter__(self) -> Phoenix:
        binary = HOME / "bin" / "phoenix"
        if not binary.exists():
            pytest.fail(f"arize-phoenix is not installed in {HOME}: run tests/install-peers.sh")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update(
            PHOENIX_WORKING_DIR=str(self.folder / "work"),
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.http_port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_TELEMETRY_ENABLED="false",
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
        )
        self._server.start(
            [str(binary), "serve"], f"{self.url}/healthz", startup_s=STARTUP_S, poll_s=0.5, env=env
        )
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._server.stop()

    def log(self) -> str:
        return self._server.log()

    def get(self, path: str, **params: str) -> Any:
        """``GET /v1/<path>`` as JSON (an HTTP error is raised with its body)."""
        url = f"{self.url}/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: {exc.code} {exc.read().decode()}") from None

    def projects(self) -> set[str]:
        return {p["name"] for p in self.get("projects")["data"]}

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span of ``project`` (REST ``/v1/projects/{name}/spans``, all pages)."""
        if project not in self.projects():
            return []
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
            page = self.get(f"projects/{urllib.parse.quote(project)}/spans", **params)
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out
