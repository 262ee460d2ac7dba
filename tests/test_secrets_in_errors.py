"""Credentials in settings never reach error text (issue 18, item 18), through the real
command line and the real in-process pipeline: a malformed ``OTEL_EXPORTER_OTLP_HEADERS`` is
refused before anything starts (the SDK would print it in full and export without it), and
refused endpoints and URLs are echoed with their user-info and parameters masked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.otlp_sink import OtlpSink
from support.tiny_training import offline_env

pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "otel_gpu.cli"]
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")
SECRET = "Zk4-s3cr3t-9QwX"

# Header lists the OTLP exporter would half-drop, each with the credential in it.
MALFORMED = [
    (f"authorization:Bearer {SECRET}", "entry 1 ('authorization:***')"),  # ':' for '='
    (f'tenant=a,x-api-key="{SECRET}"', "entry 2 ('x-api-key=***')"),  # a quote, not encoded
    (SECRET, "entry 1 ('***')"),  # the token alone
]


@pytest.mark.parametrize(("headers", "named"), MALFORMED)
def test_run_refuses_malformed_headers_without_echoing_them(
    tmp_path: Path, headers: str, named: str
) -> None:
    marker = tmp_path / "job-ran"
    with OtlpSink() as sink:
        res = subprocess.run(
            [*CLI, "run", "--simulate", "steady", "--endpoint", sink.endpoint, "--",
             sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
            capture_output=True, text=True, timeout=60,
            env=offline_env(OTEL_EXPORTER_OTLP_HEADERS=headers, OTEL_GPU_LOCK_DIR=str(tmp_path)),
        )  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("otel-gpu: error: OTEL_EXPORTER_OTLP_HEADERS")
    assert named in lines[0] and "authorization=Bearer%20TOKEN" in lines[0]
    assert SECRET not in res.stderr + res.stdout
    assert not marker.exists()  # refused before the job started, never run unauthenticated


def test_instrumented_job_with_malformed_headers_runs_without_telemetry_or_the_secret(
    tmp_path: Path,
) -> None:
    job = tmp_path / "train.py"
    job.write_text("print('trained', flush=True)\n")
    with OtlpSink() as sink:
        res = subprocess.run(
            [INSTRUMENT, sys.executable, str(job)],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env=offline_env(
                OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
                OTEL_EXPORTER_OTLP_INSECURE="true",
                OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"authorization:Bearer {SECRET}",
                OTEL_GPU_SIMULATE="steady",
                OTEL_GPU_LOCK_DIR=str(tmp_path),
            ),
        )  # fmt: skip
        received = sink.spans() + sink.points()
    assert res.returncode == 0 and res.stdout.strip() == "trained", res.stderr
    assert SECRET not in res.stderr and "Header format invalid" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if "otel-gpu: error:" in line]
    assert len(errors) == 1 and "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in errors[0]
    assert "telemetry is off in this process" in errors[0]
    assert received == []  # nothing was exported without its authentication


@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://agent:{SECRET}@127.0.0.1:99999",  # port out of range
        f"http://agent:{SECRET}@127.0.0.1",  # no port
        f"http://127.0.0.1?token={SECRET}",  # no port, a token in the query
        f"ftp://agent:{SECRET}@127.0.0.1:4317",  # not http(s)
    ],
)
def test_bad_endpoint_is_echoed_masked(endpoint: str) -> None:
    res = subprocess.run(
        [*CLI, "run", "--endpoint", endpoint, "--", "true"],
        capture_output=True, text=True, timeout=60, env=offline_env(),
    )  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad OTLP endpoint '" in lines[0] and "***" in lines[0]
    assert SECRET not in res.stderr


def test_bad_server_metrics_url_is_echoed_masked() -> None:
    res = subprocess.run(
        [*CLI, "sidecar", "--server-metrics", f"ftp://u:{SECRET}@127.0.0.1/metrics?key={SECRET}"],
        capture_output=True, text=True, timeout=60, env=offline_env(),
    )  # fmt: skip
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "ftp://***@127.0.0.1" in res.stderr
    assert SECRET not in res.stderr


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        # the one SOURCE=value refusal of every setting: a secret-named setting shows nothing,
        # others their value redacted and URL-masked
        (["processor", "--listen", "127.0.0.1:0", "--stall-after", f"token={SECRET}"], {}),
        (["processor", "--listen", "127.0.0.1:0", "--forward", f"u:{SECRET}@127.0.0.1:0"], {}),
        (["run", "--", "true"], {"OTEL_GPU_INTERVAL": f"http://u:{SECRET}@h/?k={SECRET}"}),
    ],
)
def test_a_refused_setting_never_echoes_a_credential(argv: list[str], env: dict[str, str]) -> None:
    res = subprocess.run(
        [*CLI, *argv], capture_output=True, text=True, timeout=30, env=offline_env(**env)
    )
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "***" in res.stderr
    assert SECRET not in res.stderr


def test_a_secret_named_setting_is_refused_without_its_value() -> None:
    from otel_gpu.core.errors import UsageError
    from otel_gpu.core.settings import refuse

    with pytest.raises(UsageError) as e:
        refuse("OTEL_GPU_PROCESSOR_TOKEN", SECRET, "use a token")
    assert str(e.value) == "OTEL_GPU_PROCESSOR_TOKEN='***': use a token"


@pytest.mark.parametrize(
    "headers",
    [
        "authorization=Bearer%20abc,x-tenant=a",
        "authorization=Bearer abc",  # a space: the SDK takes it (liberal)
        " a = 1 , b=2 ",
        "authorization:Bearer abc",
        'x-api-key="abc"',
        "a=1;b=2",
        "abc",
        "a=caf\u00e9",
    ],
)
def test_the_check_refuses_exactly_what_the_sdk_would_drop(
    headers: str, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.util.re import parse_env_headers

    from otel_gpu.core.errors import UsageError
    from otel_gpu.core.otlp import check_headers

    with caplog.at_level("WARNING", logger="opentelemetry.util.re"):
        parse_env_headers(headers, liberal=True)  # what the gRPC exporter calls
    dropped = any("Header format invalid" in r.getMessage() for r in caplog.records)
    try:
        check_headers("OTEL_EXPORTER_OTLP_HEADERS", headers)
        refused = False
    except UsageError:
        refused = True
    assert refused == dropped
