"""An ``OTEL_GPU_*`` variable that no setting reads (a typo such as ``OTEL_GPU_INTERVALL``)
is said once, with the closest known name, instead of being silently ignored.

The known names are every declared setting's variable (agent, tracing, detection, breaker,
actions, processor, inference readiness and serving) and the few that are read directly."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping

log = logging.getLogger("otel_gpu")

PREFIX = "OTEL_GPU_"
# Read directly, not through a declaration.
READ_DIRECTLY = frozenset(
    {
        "OTEL_GPU_ACTIONS_CONFIG",
        "OTEL_GPU_TRAIN_TRACEPARENT",
        "OTEL_GPU_RUNTIME_DIR",
        "OTEL_GPU_WATCHED_BY",  # set by otel-gpu run in its job (core/channel.py)
        "OTEL_GPU_GIT_DIR",
        "OTEL_GPU_ROLE",
        "OTEL_GPU_HEALTHCHECK_URL",  # the container image's health check (Dockerfile)
        "OTEL_GPU_PEERS_DIR",  # where the test suite's peers are installed
    }
)

_said = False


def known_variables() -> frozenset[str]:
    from otel_gpu.actions.settings import DECLARED as ACTIONS
    from otel_gpu.agent.settings import DECLARED as AGENT
    from otel_gpu.detect.breaker import DECLARED as BREAKER
    from otel_gpu.detect.settings import DECLARED as DETECT
    from otel_gpu.inference.readiness import DECLARED as READINESS
    from otel_gpu.inference.serving import DECLARED as SERVING
    from otel_gpu.processor.settings import DECLARED as PROCESSOR
    from otel_gpu.tracing.settings import DECLARED as TRACING

    groups: Iterable[Iterable[object]] = (
        AGENT, TRACING, DETECT, BREAKER, ACTIONS, PROCESSOR, READINESS, SERVING,
    )  # fmt: skip
    names = {getattr(s, "env", None) for group in groups for s in group}
    return frozenset(n for n in names if isinstance(n, str)) | READ_DIRECTLY


def unknown_lines(env: Mapping[str, str], known: frozenset[str] | None = None) -> list[str]:
    """One line per ``OTEL_GPU_*`` variable of ``env`` that nothing reads, naming the closest
    known one."""
    known = known_variables() if known is None else known
    lines = []
    for name in sorted(env):
        if not name.startswith(PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; see docs/settings.md"
        lines.append(f"otel-gpu: {name} is not a setting and is ignored{hint}")
    return lines


def warn_unknown(env: Mapping[str, str]) -> None:
    """Log :func:`unknown_lines` once per process; never raises."""
    global _said
    if _said:
        return
    _said = True
    try:
        for line in unknown_lines(env):
            log.warning("%s", line)
    except Exception:  # a broken declaration must not stop a command or a job
        log.debug("checking OTEL_GPU_* variables failed", exc_info=True)
