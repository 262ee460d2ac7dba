"""The declarative settings layer: one precedence, errors naming the source the user used, one
true/false word list, options and --help built from the declarations, settings tables (README and
docs/) that match.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from support.docs import reference_lines

from otel_gpu.agent import settings as config
from otel_gpu.cli import build_parser
from otel_gpu.commands.common import add_agent_options, settings_from_args
from otel_gpu.commands.demo import DEMO_OPTIONS
from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import FALSE_WORDS, TRUE_WORDS, Setting, boolean, number, resolve
from otel_gpu.tracing import settings as tracing_settings

pytestmark = pytest.mark.unit

PERIOD = Setting("period_s", "X_PERIOD", number(1, 60, accepted="use 1 to 60"), "a period", "5")


@pytest.mark.parametrize(
    ("args", "env", "file", "value", "origin"),
    [
        ({}, {}, None, None, None),  # nowhere: left to the dataclass default
        ({}, {}, {"period_s": 7}, 7.0, "period_s in f.toml"),
        ({}, {"X_PERIOD": "8"}, {"period_s": 7}, 8.0, "X_PERIOD"),
        ({"period_s": "9"}, {"X_PERIOD": "8"}, {"period_s": 7}, 9.0, "period_s"),
        ({"period_s": None}, {"X_PERIOD": " "}, {"period_s": 7}, 7.0, "period_s in f.toml"),
    ],
)
def test_argument_beats_environment_beats_file_beats_default(
    args: dict[str, Any], env: dict[str, str], file: dict[str, Any] | None, value: Any, origin: Any
) -> None:
    values, origins = resolve((PERIOD,), env=env, args=args, file=file, file_name="f.toml")
    assert values.get("period_s") == value
    assert origins.get("period_s") == origin


def _agent(argv: list[str], env: dict[str, str]) -> config.Settings:
    parser = argparse.ArgumentParser()
    add_agent_options(parser)
    return settings_from_args(parser.parse_args(argv), env)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        # The flag the user typed, not the variable it stands in for, and the other way round.
        (
            ["--export-interval", "0"],
            {},
            "--export-interval='0': use a positive number of seconds, at most 3600",
        ),
        (
            [],
            {"OTEL_METRIC_EXPORT_INTERVAL": "0"},
            "OTEL_METRIC_EXPORT_INTERVAL='0': use a positive number of milliseconds, at most "
            "3600000",
        ),
        (["--interval", "fast"], {}, "--interval='fast': use 0.1 s or more (at most 3600 s)"),
        ([], {"OTEL_GPU_INTERVAL": "1e9"}, "OTEL_GPU_INTERVAL='1e9': use 0.1 s or more"),
        ([], {"OTEL_GPU_MAX_PROCESSES": "2.5"}, "OTEL_GPU_MAX_PROCESSES='2.5': use a whole"),
        ([], {"OTEL_GPU_SAMPLER": "fork"}, "OTEL_GPU_SAMPLER='fork': use one of process, thread"),
        (["--health", "x"], {"OTEL_GPU_HEALTH": "127.0.0.1:1"}, "--health='x': use HOST:PORT"),
        ([], {"OTEL_GPU_HEALTH": "x"}, "OTEL_GPU_HEALTH='x': use HOST:PORT"),
        ([], {"OTEL_GPU_DETECT": "maybe"}, "OTEL_GPU_DETECT='maybe': use true or false"),
        ([], {"OTEL_GPU_SHUTDOWN_TIMEOUT": "inf"}, "OTEL_GPU_SHUTDOWN_TIMEOUT='inf': use a pos"),
    ],
)
def test_errors_name_the_source_actually_used(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError) as err:
        _agent(argv, env)
    assert str(err.value).startswith(message)


def test_flags_and_environment_reach_the_settings() -> None:
    env = {"OTEL_GPU_INTERVAL": "3", "OTEL_METRIC_EXPORT_INTERVAL": "2500"}
    s = _agent(["--exporter", "none", "--no-detect"], env)
    assert (s.interval_s, s.export_interval_s, s.exporter, s.detect) == (3.0, 2.5, "none", False)
    s = _agent(["--interval", "0.5", "--export-interval", "4"], env)
    assert (s.interval_s, s.export_interval_s, s.detect) == (0.5, 4.0, True)


def _booleans(word: str) -> list[bool]:
    """The same word given to a boolean setting of each settings layer."""
    from otel_gpu.actions.settings import ActionsConfig
    from otel_gpu.detect.settings import DetectConfig

    return [
        boolean(word, "X"),
        config.Settings.load({"OTEL_GPU_DETECT": word, "OTEL_METRICS_EXPORTER": "none"}).detect,
        tracing_settings.TracingSettings.load({"OTEL_GPU_STOP": word}).stop_enabled,
        ActionsConfig.from_env({"OTEL_GPU_SPAN_EVENTS": word}).span_events,
        DetectConfig.from_env({"OTEL_GPU_DETECT_LEAK_ENABLED": word}).leak_enabled,
    ]


@pytest.mark.parametrize(
    ("word", "value"),
    [(w, True) for w in TRUE_WORDS]
    + [(w, False) for w in FALSE_WORDS]
    + [("TRUE", True), (" Off ", False)],
)
def test_every_layer_reads_the_same_true_false_words(word: str, value: bool) -> None:
    assert _booleans(word) == [value] * 5


def _help_line(s: Setting) -> str:
    """A setting's help as argparse prints it (``%%`` is argparse's escape of ``%``)."""
    return " ".join(s.help().replace("%%", "%").split())


def test_help_of_each_command_comes_from_the_declarations() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("run", "watch", "sidecar"):
        text = " ".join(sub.choices[command].format_help().split())
        for s in config.AGENT_OPTIONS:
            assert s.flag is not None
            assert f"{s.flag}" in text
            assert _help_line(s) in text, (command, s.name)
    from otel_gpu.processor.settings import DECLARED as PROCESSOR

    for command, declared in (
        ("sidecar", config.SIDECAR_OPTIONS),
        ("demo", DEMO_OPTIONS),
        ("processor", PROCESSOR),
    ):
        text = " ".join(sub.choices[command].format_help().split())
        for s in declared:
            assert _help_line(s) in text, (command, s.name)


def _settings_rows() -> list[dict[str, str]]:
    """Rows of the settings tables of the README and docs/ (those with "default" and "meaning"
    columns), as header -> cell."""
    rows: list[dict[str, str]] = []
    header: list[str] = []
    for line in reference_lines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = cells
        elif not line.startswith("|---") and {"default", "meaning"} <= set(header):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def _declared() -> list[Setting]:
    from otel_gpu.detect.breaker import DECLARED as BREAKER
    from otel_gpu.detect.settings import DECLARED as DETECT
    from otel_gpu.diagnose.memory_settings import DECLARED as MEMORY
    from otel_gpu.inference.readiness import DECLARED as READINESS
    from otel_gpu.inference.serving import DECLARED as SERVING
    from otel_gpu.processor.settings import DECLARED as PROCESSOR

    return [
        *config.DECLARED, *tracing_settings.DECLARED, *BREAKER, *DETECT, *READINESS, *SERVING,
        *PROCESSOR, *MEMORY,
    ]  # fmt: skip


def _rows_of(setting: Setting) -> list[dict[str, str]]:
    """The table rows of a setting: those naming its variable alone in a cell (`VAR`,
    `VAR=false`, `VAR` (ms)), not one of a list; for a flag-only setting, those naming its
    flag with no variable."""
    if setting.env:
        variable = re.compile(rf"^`{setting.env}(=[^`]*)?`( \(.*\))?$")
        return [r for r in _settings_rows() if any(variable.match(c) for c in r.values())]
    flag = re.compile(rf"^`{setting.flag}( |`)")
    return [
        r
        for r in _settings_rows()
        if flag.match(r.get("option", "")) and not (r.get("environment") or r.get("variable"))
    ]


@pytest.mark.parametrize("setting", _declared(), ids=lambda s: s.name)
def test_docs_tables_match_the_declarations(setting: Setting) -> None:
    """Each declared setting has a table row with its variable (or its flag, when it has no
    variable), flag, default and doc; every row that names it shows the same default."""
    rows = _rows_of(setting)
    assert rows, f"no table row in README.md or docs/ for {setting.env or setting.flag}"
    for row in rows:
        default = row["default"].replace("`", "")
        assert default == setting.default.replace("`", ""), (setting.env, row)
    assert any(row["meaning"] == setting.doc for row in rows), (setting.env, setting.doc)
    if setting.flag:
        flag = re.compile(rf"^`{setting.flag}( |`)")
        assert any(flag.match(row.get("option", "")) for row in rows), setting.flag


# Named in the tables but not settings of a declaration here: trace context the launcher sets,
# the path of the actions' config file (read before the settings it holds), and the runtime
# directory every process resolves for itself (otel_gpu/core/runtime_dir.py).
NOT_DECLARED = {"OTEL_GPU_TRAIN_TRACEPARENT", "OTEL_GPU_ACTIONS_CONFIG", "OTEL_GPU_RUNTIME_DIR"}


def test_every_variable_in_the_docs_tables_is_declared() -> None:
    from otel_gpu.actions.settings import DECLARED as ACTIONS

    declared = {s.env for s in [*_declared(), *ACTIONS]} | NOT_DECLARED
    named = {
        v
        for row in _settings_rows()
        for cell in (row.get("variable", ""), row.get("environment", ""))
        for v in re.findall(r"`(OTEL_GPU_[A-Z_]+)", cell)
    }
    assert named, "no variables found in the settings tables"
    assert named - declared == set()


def _with_objects() -> list[tuple[Setting, object]]:
    from otel_gpu.detect.breaker import DECLARED as BREAKER
    from otel_gpu.detect.breaker import BreakerConfig
    from otel_gpu.detect.settings import DECLARED as DETECT
    from otel_gpu.detect.settings import DetectConfig
    from otel_gpu.diagnose.memory_settings import DECLARED as MEMORY
    from otel_gpu.diagnose.memory_settings import MemorySettings
    from otel_gpu.inference.readiness import DECLARED as READINESS
    from otel_gpu.inference.readiness import ReadinessConfig
    from otel_gpu.inference.serving import DECLARED as SERVING
    from otel_gpu.inference.serving import ServingConfig
    from otel_gpu.processor.settings import DECLARED as PROCESSOR
    from otel_gpu.processor.settings import ProcessorConfig

    return [
        *((s, config.Settings()) for s in config.DECLARED),
        *((s, tracing_settings.TracingSettings()) for s in tracing_settings.DECLARED),
        *((s, BreakerConfig()) for s in BREAKER),
        *((s, DetectConfig()) for s in DETECT),
        *((s, ReadinessConfig()) for s in READINESS),
        *((s, ServingConfig()) for s in SERVING),
        *((s, ProcessorConfig()) for s in PROCESSOR),
        *((s, MemorySettings()) for s in MEMORY),
    ]


# Defaults shown in words, not as a value the setting accepts.
SHOWN_IN_WORDS = {
    "—",
    "off",
    "none",
    "in memory",
    "SDK default",
    "10 s",
    "the runtime directory (`OTEL_GPU_RUNTIME_DIR`)",
}


@pytest.mark.parametrize(
    ("setting", "defaults"),
    [(s, o) for s, o in _with_objects() if s.default not in SHOWN_IN_WORDS],
    ids=lambda v: getattr(v, "name", ""),
)
def test_the_shown_default_is_the_objects_default(setting: Setting, defaults: object) -> None:
    shown = setting.parse(setting.default.strip("`"), "docs")
    assert shown == getattr(defaults, setting.name)


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("absent.json", None, "cannot read (No such file or directory); point it at a JSON or TOML"),
        ("bad.json", '{"a": ', "not valid JSON (line 1: Expecting value); use a .toml name"),
        ("list.json", "[1, 2]", "expected an object of detection settings"),
        ("bad.toml", "a = ", "not valid TOML"),
    ],
)  # fmt: skip
def test_a_settings_file_problem_is_one_line_naming_the_setting_and_file(
    tmp_path: Path, name: str, text: str | None, problem: str
) -> None:
    from otel_gpu.core.settings import read_settings_file

    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    if name.endswith(".toml") and sys.version_info < (3, 11):
        problem = "TOML needs Python >= 3.11; use JSON"
    with pytest.raises(UsageError) as e:
        read_settings_file(str(path), "--config", "detection settings")
    assert str(e.value).startswith(f"--config={str(path)!r}: {problem}")
    assert "\n" not in str(e.value)


def test_a_settings_file_holds_an_object_in_json_or_toml(tmp_path: Path) -> None:
    from otel_gpu.core.settings import read_settings_file

    (tmp_path / "a.json").write_text('{"stall_window_s": 1200}')
    assert read_settings_file(str(tmp_path / "a.json"), "--config", "x") == {"stall_window_s": 1200}
    if sys.version_info >= (3, 11):
        (tmp_path / "a.toml").write_text("[detect]\nstall_window_s = 1200\n")
        got = read_settings_file(str(tmp_path / "a.toml"), "--config", "x")
        assert got == {"detect": {"stall_window_s": 1200}}


def test_a_flag_that_turns_a_setting_off_says_so_in_its_help() -> None:
    # Issue 19.8: `--no-detect  leak / stall detection in the agent` read as its opposite.
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["run"].format_help().split())
    assert "--no-detect turn off leak / stall detection" in text
    assert "--no-instrument do not load the in-process part" in text
    assert "OTEL_GPU_DETECT=false; on by default" in text
