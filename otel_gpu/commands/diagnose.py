"""``otel-gpu diagnose``: ask a running job where and why (docs/inprocess.md).

A group of subcommands, one per question: ``memory`` (which tensors grow, held by what; issue
20 §3) and ``stall`` (where a job is stuck: every rank's stacks and the collective a rank has
not joined; issue 21 §4). Each asks over the same user's private channels (or py-spy); a
process it cannot see gets one line saying why and what to do, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from otel_gpu.core.channel import ChannelError, process_socket, request
from otel_gpu.core.errors import UsageError
from otel_gpu.core.printable import printable
from otel_gpu.core.redact import redact_text, redact_value
from otel_gpu.diagnose import hang, stacks

DEFAULT_OVER_S = 5.0
NO_PART = (
    "pid {pid}: {why}; run it with the in-process part (`otel-gpu run -- python ...`, "
    "`opentelemetry-instrument python ...` or `import otel_gpu` in the script), as the same user"
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="ask a running job where and why: `diagnose memory` (what holds growing memory), "
        "`diagnose stall` (where it is stuck)",
        description="Ask a running job where and why, over its private control channels (same "
        "user only) or py-spy.",
    )
    sub = p.add_subparsers(dest="diagnosis", metavar="WHAT", parser_class=type(p))
    add_memory_parser(sub)
    add_stall_parser(sub)
    p.set_defaults(func=_kind_missing)


def add_stall_parser(sub: Any) -> None:
    stall = sub.add_parser(
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


def _kind_missing(_args: argparse.Namespace) -> int:
    raise UsageError(
        "diagnose needs what to look at: 'otel-gpu diagnose memory --pid PID' or "
        "'otel-gpu diagnose stall --pid PID'"
    )


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
                # where CUDA is in use: the allocation sites that grew over the interval
                **{k: reply[k][: args.top] for k in ("sites", "site_lines") if k in reply},
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
    sites = reply.get("site_lines") or []
    if sites:
        rows.append("")
        rows.extend(sites[:top])
    return "\n".join(rows)


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
