"""``otel-gpu report FILE... -o report.html``: plots of recorded runs in one offline HTML page."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from otel_gpu.commands.common import add_command
from otel_gpu.core.errors import UsageError


def add_parser(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "report",
        "an HTML report with plots of recorded runs (--record FILE)",
        """Replay recordings (otel-gpu run/watch --record FILE) through the detection
        engine and write one self-contained HTML page: GPU memory per process with
        the engine's floor and fitted leak rate, utilization and power, phases,
        alerts and breaker transitions, and the run summary. Needs matplotlib (from a
        clone: pip install '.[report]').""",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="recordings (CSV)")
    p.add_argument(
        "-o", "--output", metavar="FILE.html", default="report.html", help="default report.html"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="detection settings file, as for 'otel-gpu analyze --config' (use the settings "
        "the run had to see its alerts)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "otel-gpu report needs matplotlib: pip install '.[report]' from a clone "
            "(or pip install matplotlib)"
        ) from None
    from otel_gpu.commands.analyze import load_config
    from otel_gpu.core.private_files import open_private
    from otel_gpu.detect.breaker import BreakerConfig
    from otel_gpu.detect.trace import read_rows
    from otel_gpu.outputs.report.page import page
    from otel_gpu.outputs.report.replay import replay_recording

    detect = load_config(args.config)
    breaker = BreakerConfig.from_env()
    from otel_gpu.outputs.record import read_comments

    runs = []
    for name in args.files:
        context, diagnoses = read_comments(name)
        run = replay_recording(name, read_rows(name), detect, breaker, context)
        run.diagnoses = diagnoses
        runs.append(run)
    try:
        with open_private(args.output, "w", encoding="utf-8") as fh:  # created 0600
            fh.write(page(runs))
    except OSError as exc:
        raise UsageError(
            f"--output {args.output}: cannot write ({exc.strerror or exc}); give a writable path"
        ) from None
    print(f"otel-gpu: wrote {args.output} ({len(runs)} recording(s))", file=sys.stderr)
    return 0
