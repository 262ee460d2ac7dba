"""Settings: argument > environment > default, validated with errors that name the setting."""

from __future__ import annotations

import pytest

from otel_gpu.agent.settings import Settings
from otel_gpu.core.errors import UsageError
from otel_gpu.core.otlp import check_endpoint

pytestmark = pytest.mark.unit


def test_defaults_without_environment() -> None:
    s = Settings.load(env={})
    assert s.interval_s == 5.0
    assert s.exporter == "otlp"
    assert s.simulate is None
    assert s.detect is True


def test_environment_overrides_default_and_argument_overrides_environment() -> None:
    env = {
        "OTEL_GPU_INTERVAL": "0.5",
        "OTEL_GPU_SIMULATE": "LEAK",
        "OTEL_METRIC_EXPORT_INTERVAL": "2500",
        "OTEL_GPU_DETECT": "off",
    }
    s = Settings.load(env=env)
    assert (s.interval_s, s.simulate, s.export_interval_s, s.detect) == (0.5, "leak", 2.5, False)
    s = Settings.load(env=env, interval_s=2.0, export_interval_s=1.0)
    assert s.interval_s == 2.0
    assert s.export_interval_s == 1.0  # arguments are seconds, the OTel variable milliseconds


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"OTEL_GPU_INTERVAL": "0.01"}, "0.1 s or more"),
        ({"OTEL_GPU_INTERVAL": "fast"}, "OTEL_GPU_INTERVAL='fast': use 0.1 s or more"),
        ({"OTEL_GPU_SIMULATE": "boom"}, "steady, leak, stall"),
        (
            {"OTEL_METRICS_EXPORTER": "kafka"},
            "otlp, console, prometheus (comma-separated), or none",
        ),
        (
            {"OTEL_GPU_SIMULATE_SPEED": "0.5"},
            "OTEL_GPU_SIMULATE_SPEED='0.5': use a speed from 1 to",
        ),
        ({"OTEL_GPU_DETECT": "maybe"}, "use true or false"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://host:notaport"}, "bad OTLP endpoint"),
        ({"OTEL_GPU_MAX_PROCESSES": "0"}, "OTEL_GPU_MAX_PROCESSES"),
        ({"OTEL_GPU_PROCESS_COMMAND": "full"}, "use one of redacted, executable, off"),
    ],
)
def test_bad_values_name_the_setting_and_the_fix(env: dict[str, str], needle: str) -> None:
    with pytest.raises(UsageError) as err:
        Settings.load(env=env)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "endpoint", ["http://localhost:4317", "https://collector.example:443", "localhost:4317"]
)
def test_good_endpoints(endpoint: str) -> None:
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("endpoint", ["ftp://x:1", "http://", "://nohost", "http://h:99999"])
def test_bad_endpoints(endpoint: str) -> None:
    with pytest.raises(UsageError):
        check_endpoint(endpoint)
