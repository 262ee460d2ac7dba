"""The ``otel-gpu`` command line.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``; the parser it adds
sets ``func`` (called with the parsed namespace, returns the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from otel_gpu import __version__
from otel_gpu.commands.common import quiet_grpc
from otel_gpu.core.errors import UsageError

# Order is the order of `otel-gpu --help`.
COMMAND_MODULES = (
    "otel_gpu.commands.demo",
    "otel_gpu.commands.run",
    "otel_gpu.commands.watch",
    "otel_gpu.commands.sidecar",
    "otel_gpu.commands.doctor",
    "otel_gpu.commands.analyze",
    "otel_gpu.commands.diagnose",
    "otel_gpu.commands.report",
    "otel_gpu.commands.processor",
)


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as one line, exit code 2, no usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="otel-gpu",
        description="OpenTelemetry agent for GPU jobs: NVML and per-process metrics, "
        "training spans, git provenance, leak and stall detection.",
    )
    parser.add_argument("--version", action="version", version=f"otel-gpu {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    quiet_grpc()
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(args_list)
        if args.subcommand:
            from otel_gpu.commands.known_env import warn_unknown

            warn_unknown(os.environ)
        if extra:
            # Point at the subcommand's own help: the top-level help does not list its options.
            prog = f"otel-gpu {args.subcommand}" if args.subcommand else "otel-gpu"
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{prog} --help')")
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"otel-gpu: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
