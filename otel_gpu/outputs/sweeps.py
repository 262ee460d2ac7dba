"""What the live view, the end-of-run summary and the recorder read after each sweep.

One :class:`Sweep` per sampler sweep, delivered on the sampler's thread (never the job's): the
snapshot, the points the detection engine judged (by subject), and the engine and breaker for
floor trends and states. Listeners must be quick and must not block: the view and the recorder
copy what they need and hand it to their own threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from otel_gpu.core.printable import printable
from otel_gpu.core.units import gpu_label
from otel_gpu.detect.breaker import Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import Point
from otel_gpu.sampling.snapshot import Snapshot

log = logging.getLogger("otel_gpu.sweeps")


class Sweep(NamedTuple):
    snapshot: Snapshot
    points: list[tuple[str, Point]]  # (subject, point) as the engine saw them
    engine: Engine | None  # None with --no-detect
    breaker: Breaker | None


SweepListener = Callable[[Sweep], None]


def on_sweeps(sampler: Any, watchdog: Any, listener: SweepListener) -> None:
    """Call ``listener`` after each sweep: after detection when ``watchdog`` runs (so the points
    are exactly the engine's and breaker states are current), else with the same points built
    from the snapshot. A failing listener is logged once and never breaks sampling."""
    failed: list[bool] = []

    def safe(sweep: Sweep) -> None:
        try:
            listener(sweep)
        except Exception:
            if not failed:
                failed.append(True)
                log.exception("sweep listener %r failed (logged once)", listener)

    if watchdog is not None:
        watchdog.sweep_listeners.append(
            lambda snap, points: safe(Sweep(snap, points, watchdog.engine, watchdog.breaker))
        )
        return
    from otel_gpu.agent.points import snapshot_points

    sampler.add_listener(
        lambda snap: safe(Sweep(snap, [(s, p) for s, p, _ in snapshot_points(snap)], None, None))
    )


def labels(snap: Snapshot) -> dict[str, str]:
    """A short human name per subject of ``snap``: ``GPU0 51a1a7ed H100 80GB``,
    ``python 4242 on GPU0``, ``python 4242 RSS``."""
    out: dict[str, str] = {}
    index = {g.uuid: g.index for g in snap.gpus}
    for g in snap.gpus:
        name = short_model(g.name)
        out[f"gpu:{g.uuid}"] = f"{gpu_label(g.index, g.uuid)}{' ' + name if name else ''}"
    names = {p.pid: printable(p.executable_name or "?") for p in snap.processes}
    for gp in snap.gpu_processes:
        local = snap.host_to_local.get(gp.pid, gp.pid)
        gpu = gpu_label(index.get(gp.gpu_uuid), gp.gpu_uuid).split()[0]
        out[f"process:{gp.pid}@{gp.gpu_uuid}"] = f"{names.get(local, '?')} {local} on {gpu}"
    for p in snap.processes:
        out[f"rss:{p.pid}"] = f"{names.get(p.pid, '?')} {p.pid} RSS"
    return out


def short_model(name: str | None) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100 80GB HBM3`` (the vendor is always NVIDIA here)."""
    if not name:
        return ""
    return printable(name.removeprefix("NVIDIA "))
