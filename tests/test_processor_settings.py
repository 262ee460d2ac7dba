"""`otel-gpu processor` settings on the declarative layer: flag > variable > default, errors
that name the flag or variable used, --help from the declarations, direct construction held to
the same bounds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from otel_gpu.cli import build_parser
from otel_gpu.commands.processor import config_from_args
from otel_gpu.core.errors import UsageError
from otel_gpu.processor.settings import Downstream, ProcessorConfig

pytestmark = pytest.mark.unit

MIB = 1024 * 1024
PEM = str(Path(__file__).resolve())  # any readable file passes the readability check


def _subparser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["processor"]
    return parser


def _config(argv: list[str], env: dict[str, str] | None = None) -> ProcessorConfig:
    return config_from_args(_subparser().parse_args(argv), env or {})


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        # HOST:PORT, from the flag and from the variable.
        (["--listen", "nonsense"], {},
         "--listen='nonsense': use HOST:PORT with a port from 0 to 65535"),
        ([], {"OTEL_GPU_PROCESSOR_LISTEN": "nonsense"},
         "OTEL_GPU_PROCESSOR_LISTEN='nonsense': use HOST:PORT with a port from 0 to 65535"),
        (["--health", "x:y"], {}, "--health='x:y': use HOST:PORT"),
        ([], {"OTEL_GPU_PROCESSOR_HEALTH": "x:y"}, "OTEL_GPU_PROCESSOR_HEALTH='x:y': use HOST:PORT"),
        # A bad flag is named even when its variable is good, and the other way round.
        (["--health", "x:y"], {"OTEL_GPU_PROCESSOR_HEALTH": "127.0.0.1:0"}, "--health='x:y': "),
        (["--prometheus", "127.0.0.1:70000"], {}, "--prometheus='127.0.0.1:70000': use HOST"),
        ([], {"OTEL_GPU_PROCESSOR_PROMETHEUS": "9464"},
         "OTEL_GPU_PROCESSOR_PROMETHEUS='9464': use HOST:PORT"),
        # Downstreams: the bad one of a repeated flag, the bad one of a comma list; no port 0.
        (["--forward", "a:1", "--forward", "b"], {},
         "--forward='b': use HOST:PORT, http://HOST:PORT or https://HOST:PORT (TLS)"),
        ([], {"OTEL_GPU_PROCESSOR_FORWARD": "a:1, https://b"},
         "OTEL_GPU_PROCESSOR_FORWARD=' https://b': use HOST:PORT, http://HOST:PORT"),
        (["--forward", "a:0"], {}, "--forward='a:0': use HOST:PORT, http://HOST:PORT or https"),
        # A credential in the URL is not echoed (stderr is the pod's log).
        ([], {"OTEL_GPU_PROCESSOR_FORWARD": "http://user:s3cr3t@otelcol:4317"},
         "OTEL_GPU_PROCESSOR_FORWARD='http://***@otelcol:4317': use HOST:PORT, http://HOST:PORT"),
        (["--forward", ""], {}, "--forward='': use HOST:PORT, http://HOST:PORT or https"),
        ([], {"OTEL_GPU_PROCESSOR_FORWARD": ","},
         "OTEL_GPU_PROCESSOR_FORWARD=',': use HOST:PORT, http://HOST:PORT or https"),
        # Numbers and their bounds (flag-only settings).
        (["--export-interval", "0"], {}, "--export-interval='0': use a positive number of sec"),
        (["--stall-after", "inf"], {}, "--stall-after='inf': use a positive number of seconds"),
        # Bounded: past ~1e11 s a retry delay no longer fits a gRPC Duration (every push-back
        # failed) and a flush timeout no longer fits a thread wait.
        (["--retry-after", "1e308"], {},
         "--retry-after='1e308': use a positive number of seconds, at most 86400 (a day)"),
        (["--flush-timeout", "1e12"], {}, "--flush-timeout='1e12': use a positive number of sec"),
        (["--max-series", "2.5"], {}, "--max-series='2.5': use a whole number, 1 or more"),
        (["--max-inflight", "0"], {}, "--max-inflight='0': use a whole number, 1 or more"),
        (["--max-requests-per-s", "nan"], {},
         "--max-requests-per-s='nan': use a number of requests per second >= 0"),
        (["--telemetry-interval", "-1"], {},
         "--telemetry-interval='-1': use a number of seconds >= 0 (0 = never)"),
        (["--memory-limit-mib", "10"], {},
         "--memory-limit-mib='10': use 0 (off) or a whole number of MiB, 64 or more"),
        (["--queue-dir-mib", "0"], {}, "--queue-dir-mib='0': use a whole number of MiB, 1 or"),
        (["--max-recv-mib", "4096"], {}, "--max-recv-mib='4096': use a size in MiB from 0.001"),
        # Two of its servers on one port: refused before either binds, naming both.
        (["--listen", "127.0.0.1:9465", "--prometheus", "0.0.0.0:9465"], {},
         "--prometheus='0.0.0.0:9465': the port of --listen (127.0.0.1:9465); give each server"),
        (["--health", "[::1]:8080"], {"OTEL_GPU_PROCESSOR_PROMETHEUS": "[::1]:8080"},
         "OTEL_GPU_PROCESSOR_PROMETHEUS='[::1]:8080': the port of --health ([::1]:8080); give"),
        ([], {"OTEL_GPU_PROCESSOR_HEALTH": "127.0.0.1:4317"},
         "OTEL_GPU_PROCESSOR_HEALTH='127.0.0.1:4317': the port of --listen (127.0.0.1:4317)"),
        # Paths: empty, or a PEM file that cannot be read.
        (["--state", " "], {}, "--state=' ': give a value, or unset it"),
        (["--queue-dir", ""], {}, "--queue-dir='': give a value, or unset it"),
        (["--tls-cert", "/nonexistent.pem", "--tls-key", PEM], {},
         "--tls-cert='/nonexistent.pem': no such file; give the path of a readable PEM file"),
        ([], {"OTEL_GPU_PROCESSOR_TLS_KEY": "/nonexistent.pem", "OTEL_GPU_PROCESSOR_TLS_CERT": PEM},
         "OTEL_GPU_PROCESSOR_TLS_KEY='/nonexistent.pem': no such file"),
        # The certificate and key pair: the one given is named, by the source it came from.
        (["--tls-cert", PEM], {},
         f"--tls-cert={PEM!r}: a TLS certificate and its key go together: give --tls-key or "
         "OTEL_GPU_PROCESSOR_TLS_KEY too, or neither"),
        ([], {"OTEL_GPU_PROCESSOR_TLS_CERT": PEM},
         f"OTEL_GPU_PROCESSOR_TLS_CERT={PEM!r}: a TLS certificate and its key go together"),
        (["--tls-key", PEM], {},
         f"--tls-key={PEM!r}: a TLS certificate and its key go together: give --tls-cert or "
         "OTEL_GPU_PROCESSOR_TLS_CERT too, or neither"),
    ],
)  # fmt: skip
def test_errors_name_the_flag_or_variable_actually_used(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError) as err:
        _config(argv, env)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--token", "sekret token"], {}), ([], {"OTEL_GPU_PROCESSOR_TOKEN": "sekret\ttoken"})],
)
def test_a_bad_token_is_refused_without_echoing_it(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(UsageError) as err:
        _config(argv, env)
    source = "--token" if argv else "OTEL_GPU_PROCESSOR_TOKEN"
    assert str(err.value) == f"{source}: use a non-empty token without whitespace (value not shown)"
    assert "sekret" not in str(err.value)


ENV = {
    "OTEL_GPU_PROCESSOR_LISTEN": "0.0.0.0:14317",
    "OTEL_GPU_PROCESSOR_FORWARD": "a:1,https://b:2",
    "OTEL_GPU_PROCESSOR_STATE": "/var/lib/p.db",
    "OTEL_GPU_PROCESSOR_TOKEN": "from-env",
    "OTEL_GPU_PROCESSOR_HEALTH": "127.0.0.1:13133",
    "OTEL_GPU_PROCESSOR_PROMETHEUS": "127.0.0.1:9464",
    "OTEL_GPU_PROCESSOR_QUEUE_DIR": "/var/lib/q",
}


@pytest.mark.parametrize(
    ("argv", "env", "field", "value"),
    [
        # Default, then variable, then flag, for each setting that has a variable.
        ([], {}, "listen", "127.0.0.1:4317"),
        ([], ENV, "listen", "0.0.0.0:14317"),
        (["--listen", "[::1]:0"], ENV, "listen", "[::1]:0"),
        ([], {}, "forward", ()),
        ([], ENV, "forward", (Downstream("a:1"), Downstream("b:2", tls=True))),
        (["--forward", "c:3", "--forward", "d:4,e:5"], ENV, "forward",
         (Downstream("c:3"), Downstream("d:4"), Downstream("e:5"))),
        ([], {}, "state_path", None),
        ([], ENV, "state_path", "/var/lib/p.db"),
        (["--state", "here.db"], ENV, "state_path", "here.db"),
        ([], {}, "token", None),
        ([], ENV, "token", "from-env"),
        (["--token", "from-flag"], ENV, "token", "from-flag"),
        ([], {}, "health", None),
        ([], ENV, "health", "127.0.0.1:13133"),
        (["--health", "127.0.0.1:0"], ENV, "health", "127.0.0.1:0"),
        ([], {}, "prometheus", None),
        ([], ENV, "prometheus", "127.0.0.1:9464"),
        (["--prometheus", "0.0.0.0:9090"], ENV, "prometheus", "0.0.0.0:9090"),
        ([], {}, "queue_dir", None),
        ([], ENV, "queue_dir", "/var/lib/q"),
        (["--queue-dir", "q"], ENV, "queue_dir", "q"),
        # A blank variable is unset; a bad variable under a good flag is never read.
        ([], {"OTEL_GPU_PROCESSOR_LISTEN": "  "}, "listen", "127.0.0.1:4317"),
        (["--health", "127.0.0.1:1"], {"OTEL_GPU_PROCESSOR_HEALTH": "x:y"}, "health",
         "127.0.0.1:1"),
        # Flag-only settings: default, flag; sizes given in MiB are kept in bytes.
        ([], {}, "export_interval_s", 10.0),
        (["--export-interval", "0.2"], {}, "export_interval_s", 0.2),
        ([], {}, "queue_dir_bytes", 1024 * MIB),
        (["--queue-dir-mib", "2"], {}, "queue_dir_bytes", 2 * MIB),
        ([], {}, "max_recv_bytes", 4 * MIB),
        (["--max-recv-mib", "0.5"], {}, "max_recv_bytes", MIB // 2),
        (["--memory-limit-mib", "0"], {}, "memory_limit_mib", 0),
        (["--max-series", "7"], {}, "max_series", 7),
        (["--queue-size", "3"], {}, "queue_requests", 3),
    ],
)  # fmt: skip
def test_flag_beats_variable_beats_default(
    argv: list[str], env: dict[str, str], field: str, value: object
) -> None:
    assert getattr(_config(argv, env), field) == value


def test_help_shows_each_variable_and_default() -> None:
    text = " ".join(_subparser().format_help().split())
    for line in (
        "--health HOST:PORT serve HTTP `/healthz`, `/livez`, `/readyz` and `/stats` here (env "
        "OTEL_GPU_PROCESSOR_HEALTH, default off)",
        "--prometheus HOST:PORT serve the detector metrics and the processor's own metrics as "
        "Prometheus `/metrics` here (see Deploy) (env OTEL_GPU_PROCESSOR_PROMETHEUS, default off)",
        "(env OTEL_GPU_PROCESSOR_LISTEN, default 127.0.0.1:4317)",
        "--stall-after SECONDS `/healthz` fails when no request was accepted for this many "
        "seconds after the first one (default 300)",
        "above 80 % of it exports are refused",
    ):
        assert line in text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_series": 0}, "ProcessorConfig max_series=0: use a whole number, 1 or more"),
        ({"listen": "x"}, "ProcessorConfig listen='x': use HOST:PORT with a port from 0"),
        ({"prometheus": "x:y"}, "ProcessorConfig prometheus='x:y': use HOST:PORT"),
        ({"export_interval_s": -1.0}, "ProcessorConfig export_interval_s=-1.0: use a positive"),
        ({"queue_dir_bytes": 10}, "ProcessorConfig queue_dir_bytes=10: use a whole number of by"),
        ({"series_ttl_s": 0}, "ProcessorConfig series_ttl_s=0: use a positive number of sec"),
        ({"memory_limit_mib": 32}, "ProcessorConfig memory_limit_mib=32: use 0 (off) or a whole"),
        ({"tls_key": PEM}, f"ProcessorConfig tls_key={PEM!r}: a TLS certificate and its key go "
         "together: give tls_cert too, or neither"),
    ],
)  # fmt: skip
def test_direct_construction_is_held_to_the_same_bounds(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError) as err:
        ProcessorConfig(**fields)  # type: ignore[arg-type]
    assert str(err.value).startswith(message), str(err.value)
