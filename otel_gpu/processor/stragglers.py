"""Stragglers judged in the processor: the one place that sees every rank of a job (a fleet
gateway routes a job's series to one replica by ``otel_gpu.job.id``).

Fed by the decoder, through the assembler:

- each rank's ``training.step.work`` (the gauge of its last step, one point per export; the
  rank is the resource's ``otel_gpu.job.rank``, the job its ``otel_gpu.job.id``) goes to its
  job's :class:`~otel_gpu.detect.straggler.StragglerJudge` (windows, per-rank medians, MAD
  scores, k of n naming, the job-wide slowdown). A point equal to the rank's previous one is
  the same step read again (no step ended between two exports) and is skipped;
- the GPU a rank computes on: the ``hw.id`` of its own ``torch.cuda.memory.*`` series;
- what a node agent's series say of each GPU: the engine's GPU points (temperature, power and
  its limit) and the SM clock, throttle reasons and PCIe throughput.

A named rank's alert quotes its GPU (or says "GPU metrics not seen" when no agent's series for
it reach this processor, "GPU not known" when the rank names none). Alerts take the engine's
path (processor/pipeline.py: breaker, store, notifications, log records, detector metrics) on
the subjects ``<job> rank <r>`` (a straggler) and ``<job>`` (a job-wide slowdown), whose
condition holds while the rank stays named or the job slow: the breaker is advanced at each
window the judge closes.

Bounded: at most ``max_ranks`` ranks over all jobs, and ``per_peer`` of them from one peer
address (what a client cannot choose); at most ``max_gpus`` GPUs and reporter GPUs; at most
:data:`MAX_SAMPLES` points per rank per window. Jobs and GPUs silent for ``ttl_s`` are
forgotten.
"""

from __future__ import annotations

import math
from dataclasses import replace

from otel_gpu.core.signals import (
    CLOCK_DOMAIN,
    IO_DIRECTION,
    JOB,
    SUBJECT_KIND,
    SUBJECT_NAME,
    THROTTLE_REASON,
)
from otel_gpu.detect.model import Alert, Diagnosis, Point
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.straggler import (
    JOB_SLOWDOWN,
    STRAGGLER,
    RankInfo,
    StragglerConfig,
    StragglerJudge,
)
from otel_gpu.detect.subject import GPU_INDEX_PREFIX
from otel_gpu.processor.assemble import Subject
from otel_gpu.processor.decode import JOB_RANK_KEY, ResourceInfo

RANK = "rank"  # subject kind of a straggler alert: one rank of a job
MAX_SAMPLES = 64  # per rank per window: one per export, so a window of 64 exports
_MAX_FACTS = 64  # facts kept per GPU (throttle reasons, clock, PCIe directions)
_HELD = frozenset({STRAGGLER})
_NONE: frozenset[str] = frozenset()


def straggler_config(d: DetectConfig) -> StragglerConfig:
    """The judge's settings from the detection settings (``OTEL_GPU_DETECT_STRAGGLER_*``)."""
    return StragglerConfig(
        window_s=d.straggler_window_s,
        k=d.straggler_k,
        n=d.straggler_n,
        z=d.straggler_z,
        min_ratio=d.straggler_min_ratio,
        job_ratio=d.straggler_job_ratio,
        min_ranks=d.straggler_min_ranks,
        max_samples=MAX_SAMPLES,
    )


class _Rank:
    __slots__ = ("res", "peer", "last", "info")

    def __init__(self, res: ResourceInfo, peer: str) -> None:
        self.res = res
        self.peer = peer
        self.last = math.nan  # the last work value (the same again: the same step)
        self.info = RankInfo()


class _Job:
    __slots__ = ("judge", "ranks", "seen", "subjects")

    def __init__(self, judge: StragglerJudge) -> None:
        self.judge = judge
        self.ranks: dict[int, _Rank] = {}
        self.seen = 0.0  # monotonic time of its last point
        self.subjects: dict[str, Subject] = {}  # those that alerted: advanced per window


class _Gpu:
    __slots__ = ("point", "facts", "seen")

    def __init__(self) -> None:
        self.point: Point | None = None  # the engine's last point of it
        self.facts: dict[tuple[str, str], tuple[float, float]] = {}  # -> (data time, value)
        self.seen = 0.0


class Stragglers:
    """Every job's straggler judge, and what alerts quote. Not thread-safe (the pipeline's
    lock holds it)."""

    def __init__(
        self,
        config: StragglerConfig,
        max_ranks: int,
        per_peer: int,
        max_gpus: int,
        ttl_s: float,
    ) -> None:
        self.config = config
        self._max_ranks = max_ranks
        self._per_peer = per_peer
        self._max_gpus = max_gpus
        self._ttl = ttl_s
        self._jobs: dict[str, _Job] = {}
        self._ranks = 0
        self._by_peer: dict[str, int] = {}
        self._gpus: dict[str, _Gpu] = {}
        self._devices: dict[str, tuple[str, float]] = {}  # reporter label -> (GPU, seen)
        self._subjects: dict[str, tuple[str, int | None]] = {}  # name -> (job, rank)
        self.refused = 0  # ranks refused by the bounds
        self.skipped = 0  # points of a step already judged
        self._alerts: list[tuple[Subject, Alert]] = []
        self._advances: list[tuple[Subject, float]] = []

    @property
    def pending(self) -> bool:
        return bool(self._alerts or self._advances)

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    @property
    def ranks(self) -> int:
        return self._ranks

    # -- input -------------------------------------------------------------------------------

    def work(self, res: ResourceInfo, time_ns: int, value: float, peer: str, now: float) -> None:
        """``training.step.work`` of the rank ``res`` names, at data time ``time_ns``."""
        rank = res.rank
        if rank is None or not value >= 0 or not math.isfinite(value):
            return
        job = self._jobs.get(res.job)
        if job is None:
            if len(self._jobs) >= self._max_ranks:
                self.refused += 1
                return
            job = self._jobs[res.job] = _Job(StragglerJudge(res.job, self.config))
        r = job.ranks.get(rank)
        if r is None:
            held = self._by_peer.get(peer, 0)
            if self._ranks >= self._max_ranks or held >= self._per_peer:
                self.refused += 1
                if not job.ranks:
                    del self._jobs[res.job]
                return
            r = job.ranks[rank] = _Rank(res, peer)
            self._ranks += 1
            self._by_peer[peer] = held + 1
        job.seen = now
        if value == r.last:
            self.skipped += 1
            return
        r.last = value
        info = None
        gpu = self._devices.get(res.label, ("", 0.0))[0]
        if r.res is not res or gpu != r.info.gpu or not r.info.host:
            r.res = res
            r.info = info = RankInfo(host=str(dict(res.attrs).get("host.name", "")), gpu=gpu)
        judge = job.judge
        windows = judge.windows
        alerts = judge.add(time_ns / 1e9, rank, value, info)
        for a in alerts:
            self._raise(job, a)
        if judge.windows != windows and judge.closed_at is not None:
            self._advances.extend((s, judge.closed_at) for s in job.subjects.values())

    def device(self, label: str, hw_id: str, now: float) -> None:
        """The reporter ``label`` has torch series on GPU ``hw_id``: the GPU it computes on."""
        if hw_id.startswith(GPU_INDEX_PREFIX):
            return  # an index only: no UUID to find the agent's series by
        if label in self._devices or len(self._devices) < self._max_gpus:
            self._devices[label] = (hw_id, now)

    def fact(
        self, hw_id: str, key: str, selector: str, time_ns: int, value: float, now: float
    ) -> None:
        """One GPU fact: its SM clock (``key`` the clock domain), a throttle reason, a PCIe
        direction's throughput."""
        g = self._gpu(hw_id, now)
        if g is None:
            return
        item = (key, selector)
        last = g.facts.get(item)
        if last is None and len(g.facts) >= _MAX_FACTS:
            return
        if last is None or time_ns / 1e9 >= last[0]:
            g.facts[item] = (time_ns / 1e9, value)

    def gpu_point(self, hw_id: str, point: Point, now: float) -> None:
        """The engine's point of GPU ``hw_id`` (its temperature and power)."""
        g = self._gpu(hw_id, now)
        if g is not None:
            g.point = point

    def _gpu(self, hw_id: str, now: float) -> _Gpu | None:
        g = self._gpus.get(hw_id)
        if g is None:
            if len(self._gpus) >= self._max_gpus:
                return None
            g = self._gpus[hw_id] = _Gpu()
        g.seen = now
        return g

    # -- output ------------------------------------------------------------------------------

    def take(self) -> tuple[list[tuple[Subject, Alert]], list[tuple[Subject, float]]]:
        """The alerts raised, and the (subject, data time) to advance breakers to, since the
        last call."""
        alerts, self._alerts = self._alerts, []
        advances, self._advances = self._advances, []
        return alerts, advances

    def active(self, name: str) -> frozenset[str]:
        """The alert kinds whose condition holds for a subject (the breaker's question)."""
        found = self._subjects.get(name)
        job = None if found is None else self._jobs.get(found[0])
        if job is None or found is None:
            return _NONE
        rank = found[1]
        held = job.judge.job_slowed if rank is None else job.judge.is_named(rank)
        return _HELD if held else _NONE

    def evict(self, now: float) -> None:
        """Forget jobs, GPUs and reporter GPUs silent for ``ttl_s`` (monotonic ``now``)."""
        cutoff = now - self._ttl
        for key in [k for k, j in self._jobs.items() if j.seen < cutoff]:
            job = self._jobs.pop(key)
            for r in job.ranks.values():
                self._ranks -= 1
                self._by_peer[r.peer] -= 1
                if not self._by_peer[r.peer]:
                    del self._by_peer[r.peer]
            for name in job.subjects:
                self._subjects.pop(name, None)
        for hw_id in [h for h, g in self._gpus.items() if g.seen < cutoff]:
            del self._gpus[hw_id]
        for label in [lb for lb, (_g, t) in self._devices.items() if t < cutoff]:
            del self._devices[label]

    def _raise(self, job: _Job, alert: Alert) -> None:
        key = job.judge.job
        if alert.evidence.get("rule") == JOB_SLOWDOWN:
            first = job.ranks[min(job.ranks)]
            res = ResourceInfo(key, first.res.attrs, key)
            subject = Subject(key, JOB, res, ((SUBJECT_KIND, JOB), (SUBJECT_NAME, "job")))
            self._keep(job, subject, None)
            self._alerts.append((subject, replace(alert, subject=key)))
            return
        rank = int(alert.evidence["rank"])
        r = job.ranks[rank]
        name = f"{key} rank {rank}"
        attrs = ((SUBJECT_KIND, RANK), (JOB_RANK_KEY, rank), (SUBJECT_NAME, f"rank:{rank}"))
        subject = Subject(name, RANK, r.res, attrs, r.info.gpu or None, None, r.peer)
        self._keep(job, subject, rank)
        lines, facts = self._gpu_facts(r.info, alert.time)
        diagnosis = Diagnosis(STRAGGLER, lines, dict(facts))
        evidence = {**alert.evidence, **facts}
        self._alerts.append(
            (subject, replace(alert, subject=name, evidence=evidence, diagnosis=diagnosis))
        )

    def _keep(self, job: _Job, subject: Subject, rank: int | None) -> None:
        job.subjects[subject.name] = subject
        self._subjects[subject.name] = (job.judge.job, rank)

    def _gpu_facts(
        self, info: RankInfo, at: float
    ) -> tuple[tuple[str, ...], dict[str, float | str]]:
        """What the processor knows of a rank's GPU: (diagnosis lines, evidence)."""
        where = f" on host {info.host}" if info.host else ""
        if not info.gpu:
            return (
                f"GPU not known{where}: the rank reports no torch.cuda.memory series naming its "
                "GPU (hw.id); GPU metrics not seen",
            ), {"gpu_metrics": "not seen"}
        g = self._gpus.get(info.gpu)
        if g is None:
            return (
                f"GPU {info.gpu}{where}: GPU metrics not seen (no node agent's series for this "
                "GPU reach this processor)",
            ), {"gpu_metrics": "not seen"}
        parts: list[str] = []
        facts: dict[str, float | str] = {"gpu_metrics": "seen"}
        times: list[float] = []
        clock = g.facts.get((CLOCK_DOMAIN, "sm"))
        if clock is not None:
            parts.append(f"SM clock {clock[1] / 1e6:.0f} MHz")
            facts["sm_clock_hz"] = clock[1]
            times.append(clock[0])
        reasons = {s: v for (k, s), v in g.facts.items() if k == THROTTLE_REASON}
        if reasons:
            on = sorted(s for s, (_t, v) in reasons.items() if v > 0)
            parts.append(f"throttled: {', '.join(on)}" if on else "not throttled")
            facts["throttle"] = ",".join(on) or "none"
            times.append(max(t for t, _v in reasons.values()))
        p = g.point
        if p is not None:
            if p.temperature_c is not None:
                parts.append(f"{p.temperature_c:.0f} °C")
                facts["temperature_c"] = p.temperature_c
            if p.power_w is not None:
                limit = f" of {p.power_limit_w:.0f} W" if p.power_limit_w else ""
                parts.append(f"{p.power_w:.0f} W{limit}")
                facts["power_w"] = p.power_w
            times.append(p.time)
        pcie = []
        for direction, short in (("receive", "rx"), ("transmit", "tx")):
            found = g.facts.get((IO_DIRECTION, direction))
            if found is not None:
                pcie.append(f"{short} {_rate(found[1])}")
                facts[f"pcie_{short}_bytes_per_s"] = found[1]
                times.append(found[0])
        if pcie:
            parts.append("PCIe " + ", ".join(pcie))
        age = f" (the node agent's data {max(0.0, at - max(times)):.0f} s before)" if times else ""
        shown = "; ".join(parts) or "no SM clock, throttle, temperature, power or PCIe series"
        return (f"GPU {info.gpu}{where}: {shown}{age}",), facts


def _rate(bytes_per_s: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
