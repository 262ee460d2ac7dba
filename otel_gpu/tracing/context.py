"""Process roles and the run's trace context.

Kept free of the OpenTelemetry SDK so a launcher process, which only needs these, stays cheap.

Under ``opentelemetry-instrument`` every Python process of a job loads the SDK: the ``swift``
launcher, torchrun's agent, each rank, spawned workers (docs/background.md §1, §4). :func:`decide_role`
sorts them from the command line and the environment alone (pure, table-tested).

One trace per run: the first instrumented process of a job (usually the launcher) picks the
trace id and the span id of the ``train`` root and puts them in ``OTEL_GPU_TRAIN_TRACEPARENT``
for its children. Global rank 0 (or the single training process) then creates the ``train``
span with exactly those ids (:class:`~otel_gpu.tracing.ids.PresetIdGenerator`); every other
rank parents its spans on that same id. So all ranks share one trace under one ``train`` root,
and a launcher never has to create, hold or export a span.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from otel_gpu.core.commandline import python_target
from otel_gpu.tracing.environment_variables import OTEL_GPU_TRAIN_TRACEPARENT

LAUNCHER = "launcher"  # passes trace context to its children; exports nothing
TRAINER = "trainer"  # spans and in-process metrics
NODE = "node"  # trainer plus the node's GPU / process sampler (one per node)
OFF = "off"  # nothing at all (spawned helper processes)

# Console scripts and modules that only start other Python processes.
LAUNCHER_SCRIPTS = frozenset({"swift", "torchrun", "accelerate", "deepspeed"})
LAUNCHER_MODULES = frozenset(
    {
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "deepspeed.launcher.runner",
    }
)
# Helper interpreters that must add nothing: multiprocessing's spawn/forkserver children
# (DataLoader workers under the spawn start method) and torch.compile's worker pool.
OFF_MARKERS = (
    "multiprocessing.spawn",
    "multiprocessing.forkserver",
    "multiprocessing.resource_tracker",
)
OFF_MODULES = frozenset({"torch._inductor.compile_worker"})


def program(argv: Sequence[str]) -> tuple[str, str]:
    """``("script", basename)``, ``("module", name)`` or ``("code", text)`` of an ``orig_argv``."""
    if "--multiprocessing-fork" in argv[1:]:
        return "code", "multiprocessing.spawn"  # a spawn child, whatever else its line says
    kind, value, _ = python_target(argv[1:])
    if kind == "script":
        return "script", os.path.basename(value)
    return ("module", value) if kind == "module" else ("code", value)


def decide_role(argv: Sequence[str], env: Mapping[str, str], requested: str = "auto") -> str:
    """The role of a process started with ``argv`` (``sys.orig_argv``) in environment ``env``.

    Rules: an explicit role wins; helper interpreters are ``off``; known launchers are
    ``launcher``; a rank with ``LOCAL_RANK`` other than 0 is ``trainer``; the rest (local rank
    0, or a single process) is ``node``, which still samples only if it wins the node lock.
    """
    if requested != "auto":
        return requested
    kind, name = program(argv)
    if kind == "code" and any(m in name for m in OFF_MARKERS):
        return OFF
    if kind == "module" and name in OFF_MODULES:
        return OFF
    if (kind == "module" and name in LAUNCHER_MODULES) or (
        kind == "script" and name in LAUNCHER_SCRIPTS
    ):
        return LAUNCHER
    local_rank = env.get("LOCAL_RANK", "").strip()
    if local_rank not in ("", "0"):
        return TRAINER
    return NODE


# Scripts known to train from their first line (ms-swift's training entry points), so their
# start-up counts as the ``load`` phase before any Trainer exists.
TRAINING_SCRIPTS = ("swift/cli/sft.py", "swift/cli/pt.py", "swift/cli/rlhf.py")


def is_training_command(argv: Sequence[str]) -> bool:
    """True for commands that certainly train (ms-swift ``sft``, ``pt``, ``rlhf`` workers)."""
    return any(arg.replace(os.sep, "/").endswith(TRAINING_SCRIPTS) for arg in argv[1:3])


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in a distributed job (torchrun's variables)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankInfo:
        env = os.environ if env is None else env

        def number(name: str, default: int) -> int:
            try:
                return int(env.get(name, "").strip() or default)
            except ValueError:
                return default

        return cls(number("RANK", 0), number("LOCAL_RANK", 0), number("WORLD_SIZE", 1))

    def attributes(self) -> dict[str, int]:
        """Span attributes; the same names the job resource detector uses."""
        return {
            "otel_gpu.job.rank": self.rank,
            "otel_gpu.job.local_rank": self.local_rank,
            "otel_gpu.job.world_size": self.world_size,
        }


# -- trace context -----------------------------------------------------------------------------


def parse_traceparent(value: str | None) -> SpanContext | None:
    """A valid remote SpanContext from a W3C ``traceparent`` string, else None."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1))
    return ctx if ctx.is_valid else None


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def ensure_run_context(env: MutableMapping[str, str]) -> SpanContext:
    """The ``train`` root's ids for this job, chosen here if no ancestor chose them.

    The trace id is the one of an outer ``TRACEPARENT`` (a CI job, a workflow engine) when
    present, so the run joins that trace.
    """
    existing = parse_traceparent(env.get(OTEL_GPU_TRAIN_TRACEPARENT))
    if existing is not None:
        return existing
    outer = parse_traceparent(env.get("TRACEPARENT"))
    trace_id = outer.trace_id if outer is not None else _nonzero_bits(128)
    ctx = SpanContext(trace_id, _nonzero_bits(64), is_remote=True, trace_flags=TraceFlags(1))
    env[OTEL_GPU_TRAIN_TRACEPARENT] = format_traceparent(ctx.trace_id, ctx.span_id)
    return ctx


def _nonzero_bits(bits: int) -> int:
    # The OS's randomness: training scripts seed ``random`` (see ids.SystemRandomIdGenerator).
    value = 0
    while value == 0:
        value = _random.getrandbits(bits)
    return value


_random = random.SystemRandom()


def outer_context(env: Mapping[str, str] | None = None) -> Context | None:
    """The context of an outer ``TRACEPARENT`` (the ``train`` root's parent), if any."""
    env = os.environ if env is None else env
    outer = parse_traceparent(env.get("TRACEPARENT"))
    return trace.set_span_in_context(NonRecordingSpan(outer)) if outer is not None else None


def run_root_context(env: Mapping[str, str] | None = None) -> Context | None:
    """The ``train`` root as a remote parent, for ranks other than the one that creates it."""
    env = os.environ if env is None else env
    root = parse_traceparent(env.get(OTEL_GPU_TRAIN_TRACEPARENT))
    return trace.set_span_in_context(NonRecordingSpan(root)) if root is not None else None


# -- this process's role (set by the configurator) -----------------------------------------------

_role: str | None = None  # None: not started by our configurator (manual use: everything on)


def set_role(role: str | None) -> None:
    global _role
    _role = role


_turned_off = False  # a bad setting (or a failed start) turned telemetry off in this process


def turn_off(line: str | None) -> None:
    """Telemetry is off in this process for good: a bad ``OTEL_GPU_*`` value or a failed
    start, found by the configurator or by the first API call that reads the settings. Says
    ``line`` on stderr once per process (None: said elsewhere); never raises into the job."""
    global _turned_off
    set_role(OFF)
    first, _turned_off = not _turned_off, True
    if first and line:
        with contextlib.suppress(Exception):  # stderr closed: nowhere to say it
            print(line, file=sys.stderr, flush=True)


def turned_off() -> bool:
    """Whether :func:`turn_off` ran here: phases, steps and callbacks record nothing."""
    return _turned_off


def traces_enabled() -> bool:
    """False in launchers and helper processes, where instrumentors must add nothing."""
    return _role not in (LAUNCHER, OFF)
