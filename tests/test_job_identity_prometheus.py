"""Two ranks of one job in a real Prometheus (issue 22.1): each instrumented rank serves its
``training_step`` on its own endpoint; Prometheus scrapes both. Their ``target_info`` carry two
``service.instance.id`` and one ``otel_gpu.job.id``, and their ``training_step`` series stay
apart (before, every rank reported the job's one instance id)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import clean_env
from support.paths import ROOT
from support.ports import free_port
from support.prometheus_peer import Prometheus

from otel_gpu.core.job_identity import ensure_job_id

INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
RANK = """
import os, time
import otel_gpu
rank = int(os.environ["RANK"])
for n in range(1, 400):
    otel_gpu.step(10_000 * (rank + 1) + n)  # apart whatever the pace: 10001.. and 20001..
    time.sleep(0.05)
"""


@pytest.mark.peers
def test_two_ranks_series_stay_apart_with_one_job_key(tmp_path: Path) -> None:
    job_env: dict[str, str] = {"OTEL_RESOURCE_ATTRIBUTES": "team=ml"}
    job = ensure_job_id(job_env)
    ports = [free_port(), free_port()]
    ranks = []
    for rank, port in enumerate(ports):
        env = clean_env(
            PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE="2", OTEL_SERVICE_NAME="train",
            OTEL_METRICS_EXPORTER="prometheus", OTEL_TRACES_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none", OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(port), OTEL_GPU_LOCK_DIR=str(tmp_path),
            OTEL_GPU_SIMULATE="steady", **job_env,
        )  # fmt: skip
        ranks.append(
            subprocess.Popen([INSTRUMENT, sys.executable, "-c", RANK], env=env, cwd=tmp_path)
        )
    targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
    config = (
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: ranks\n    static_configs: [{{targets: [{targets}]}}]\n"
    )
    try:
        with Prometheus(tmp_path / "prom", config) as prom:
            infos = prom.wait_for('count(target_info{job="ranks"}) == 2', timeout_s=60)
            assert infos, prom.log()
            info = prom.query('target_info{job="ranks"}')
            ids = {s["metric"]["service_instance_id"] for s in info}
            assert len(ids) == 2  # one instance per rank
            assert {s["metric"]["otel_gpu_job_id"] for s in info} == {job}  # one job key
            steps = prom.wait_for('count(training_step{job="ranks"}) == 2', timeout_s=30)
            assert steps, prom.log()
            series = prom.query('training_step{job="ranks"} > 10000')
            assert len(series) == 2 and len({s["metric"]["instance"] for s in series}) == 2
            values = sorted(float(s["value"][1]) for s in series)
            assert values[0] < 20_000 < values[1]  # rank 0's steps and rank 1's, not mixed
    finally:
        for p in ranks:
            p.kill()
            p.wait(10)
