"""``otel-gpu diagnose``: ask a running process where and why (docs/inprocess.md).

A group of subcommands, one per question: ``memory`` (which tensors grow, held by what; issue
20 §3). Each asks the process's in-process part over its control channel
(:mod:`otel_gpu.core.channel`); a process without one gets one line saying why and what to
do, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from otel_gpu.core.channel import ChannelError, process_socket, request
from otel_gpu.core.errors import UsageError

DEFAULT_OVER_S = 5.0
NO_PART = (
    "pid {pid}: {why}; run it with the in-process part (`otel-gpu run -- python ...`, "
    "`opentelemetry-instrument python ...` or `import otel_gpu` in the script), as the same user"
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="ask a running process where and why: `diagnose memory` (what holds growing memory)",
        description="Ask a process running otel-gpu's in-process part where and why, over its "
        "private control channel (same user only).",
    )
    sub = p.add_subparsers(dest="diagnosis", metavar="WHAT", parser_class=type(p))
    add_memory_parser(sub)
    p.set_defaults(func=lambda _args: _missing(p))


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def add_memory_parser(sub: Any) -> None:
    m = sub.add_parser(
        "memory",
        help="the live tensors of a process by holder, and which holders grow",
        description="Live tensors of a process grouped by the code path that holds them "
        "(module global, attribute chain, frame local, closure), and their growth over an "
        "interval. Tensor values are never read.",
    )
    m.add_argument("--pid", type=int, required=True, metavar="PID", help="the process to ask")
    m.add_argument(
        "--over",
        type=float,
        default=DEFAULT_OVER_S,
        metavar="SECONDS",
        help=f"measure growth over this many seconds (default {DEFAULT_OVER_S:g})",
    )
    m.add_argument("--top", type=int, default=10, metavar="N", help="holders shown (default 10)")
    m.add_argument("--json", action="store_true", help="one JSON object on standard output")
    m.set_defaults(func=run_memory)


def ask_memory(pid: int, over_s: float, top: int = 20) -> dict[str, Any]:
    """The process's census growth over ``over_s``; UsageError (one line) when it cannot."""
    path = process_socket(pid)
    try:
        # The census bounds are the trainer's (5 s a census by default, three of them).
        return request(path, "memory.census", timeout_s=over_s + 30.0, over_s=over_s, top=top)
    except ChannelError as exc:
        if not os.path.exists(f"/proc/{pid}"):
            raise UsageError(f"pid {pid}: no such process") from None
        raise UsageError(NO_PART.format(pid=pid, why=str(exc))) from None


def run_memory(args: argparse.Namespace) -> int:
    if args.pid <= 0:
        raise UsageError(f"--pid={args.pid}: not a process id; give the trainer's pid")
    if not 0 <= args.over <= 3600:
        raise UsageError(f"--over={args.over:g}: use seconds between 0 and 3600")
    if args.top < 1:
        raise UsageError(f"--top={args.top}: use 1 or more")
    reply = ask_memory(args.pid, args.over, max(args.top, 20))
    holders = reply.get("holders", [])
    if args.json:
        json.dump(
            {
                "pid": reply.get("pid", args.pid),
                "over_s": reply.get("over_s"),
                "censuses": reply.get("censuses", []),
                "holders": holders[: args.top],
                "growing": [h["path"] for h in holders if h.get("growing")],
            },
            sys.stdout,
        )
        sys.stdout.write("\n")
        return 0
    print(table(reply, args.top))
    return 0


def table(reply: dict[str, Any], top: int) -> str:
    from otel_gpu.diagnose.memory import size

    holders = reply.get("holders", [])[:top]
    censuses = reply.get("censuses", [])
    last = censuses[-1] if censuses else {}
    head = (
        f"pid {reply.get('pid')}: {last.get('tensors', 0)} live tensors, "
        f"{size(last.get('bytes', 0))}, over {reply.get('over_s', 0):.1f} s"
    )
    stopped = [c["truncated"] for c in censuses if c.get("truncated")]
    if stopped:
        head += f" (a census stopped early: {stopped[0]})"
    rows = [head, ""]
    rows.append(f"{'+bytes':>10} {'+tensors':>8} {'tensors':>8} {'bytes':>10}  holder  [where]")
    for h in holders:
        mark = "GROWING " if h.get("growing") else ""
        rows.append(
            f"{size(h['growth_bytes']):>10} {h['growth_count']:>+8d} {h['count']:>8} "
            f"{size(h['bytes']):>10}  {mark}{h['path']}  [{h.get('root')} in {h.get('site')}]"
        )
    if not any(h.get("growing") for h in holders):
        rows.append("")
        rows.append("no holder grew in every interval")
    return "\n".join(rows)
