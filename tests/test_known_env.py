"""An ``OTEL_GPU_*`` typo is said once with the closest known name (issue 19.8)."""

from __future__ import annotations

import pytest
from support.cli import clean_env, otel_gpu

from otel_gpu.commands.known_env import known_variables, unknown_lines


@pytest.mark.unit
def test_an_unknown_variable_is_named_with_the_closest_known_one() -> None:
    known = known_variables()
    assert {"OTEL_GPU_INTERVAL", "OTEL_GPU_STOP", "OTEL_GPU_DETECT_LEAK_MIN_WINDOW_S"} <= known
    lines = unknown_lines({"OTEL_GPU_INTERVALL": "2", "OTEL_GPU_INTERVAL": "2", "PATH": "/"})
    assert lines == [
        "otel-gpu: OTEL_GPU_INTERVALL is not a setting and is ignored; "
        "did you mean OTEL_GPU_INTERVAL?"
    ]
    assert "; see docs/settings.md" in unknown_lines({"OTEL_GPU_ZZZZZZZZ": "1"})[0]
    assert unknown_lines({name: "x" for name in known}) == []


@pytest.mark.process
def test_a_command_warns_once_and_runs_on() -> None:
    res = otel_gpu(
        "run", "--exporter", "none", "--simulate", "steady", "--quiet", "--", "true",
        env=clean_env(OTEL_GPU_INTERVALL="2"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    said = [line for line in res.stderr.splitlines() if "OTEL_GPU_INTERVALL" in line]
    assert said == [
        "otel-gpu: OTEL_GPU_INTERVALL is not a setting and is ignored; "
        "did you mean OTEL_GPU_INTERVAL?"
    ]
