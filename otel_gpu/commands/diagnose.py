"""``otel-gpu diagnose``: where and why, on demand. ``stall``: where a job is stuck."""

from __future__ import annotations

import argparse
import json
import sys

from otel_gpu.core.errors import UsageError
from otel_gpu.core.printable import printable
from otel_gpu.core.redact import redact_text, redact_value
from otel_gpu.diagnose import hang, stacks


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "diagnose",
        help="where a job is stuck (stall)",
        description="Look inside a running job.",
    )
    kinds = parser.add_subparsers(dest="diagnose_kind", metavar="KIND")
    stall = kinds.add_parser(
        "stall",
        help="every process's Python stacks, grouped, and the collective a rank has not joined",
        description="The Python stacks of every thread of every process of the job PID belongs "
        "to (the launcher — torchrun, the wrapper's job — or any rank), grouped: ranks whose "
        "top frames agree form one group, the odd ones out first. Stacks come from py-spy dump "
        "--nonblocking where ptrace is permitted, else from the in-process part (its 'stacks' "
        "channel operation, or its faulthandler dump). With the in-process part, each rank's "
        "flight recorder also says which collective a rank has not joined. Same user only; "
        "exit 2 with one line when nothing can be seen.",
    )
    stall.add_argument("--pid", type=int, required=True, metavar="PID", help="a process of the job")
    stall.add_argument("--json", action="store_true", help="one JSON object on stdout")
    stall.add_argument("--frames", action="store_true", help="also each group's innermost frames")
    stall.add_argument(
        "--via",
        metavar="WAYS",
        default=",".join(stacks.WAYS),
        help="the ways to get stacks, tried in this order (default: %(default)s)",
    )
    stall.set_defaults(func=diagnose_stall)
    parser.set_defaults(func=_kind_missing)


def _kind_missing(args: argparse.Namespace) -> int:
    raise UsageError("diagnose needs a kind: 'otel-gpu diagnose stall --pid PID'")


def diagnose_stall(args: argparse.Namespace) -> int:
    if args.pid <= 0:
        raise UsageError(f"--pid {args.pid}: expected the PID of a process of the job")
    ways = tuple(w.strip() for w in args.via.split(",") if w.strip())
    unknown = [w for w in ways if w not in stacks.WAYS]
    if unknown or not ways:
        raise UsageError(
            f"--via {args.via!r}: expected a comma-separated list of {', '.join(stacks.WAYS)}"
        )
    try:
        report = hang.look(args.pid, pyspy=stacks.find_pyspy(), only=ways)
    except hang.CannotLook as exc:
        raise UsageError(
            f"cannot look into the job of --pid {args.pid}: {exc} (py-spy needs ptrace "
            "permission — same user, ptrace_scope 0 or CAP_SYS_PTRACE — otherwise start the job "
            "with the in-process part: opentelemetry-instrument or otel-gpu run)"
        ) from None
    if args.json:
        print(json.dumps(redact_value(report.to_json())))
        return 0
    lines = report.lines() + (report.details() if args.frames else [])
    for line in lines:
        print(printable(redact_text(line)))
    print(f"(looked at {len(report.stacks)} processes in {report.took_s:.1f} s)", file=sys.stderr)
    return 0
