"""Stragglers: one rank slower than the rest of its job, told apart from the whole job slowing
down. Pure, causal, driven by the data's own time.

Fed each rank's per-step *work* time (a step's time minus the time it waited in blocking
collectives: the waiting is where the fast ranks sit while a slow one computes), it closes a
window every ``window_s`` and, per window:

* each rank's work is the median of its steps in the window; the job's is the median over
  ranks, its spread the MAD over ranks (floored at ``mad_floor`` of the median, so a perfectly
  balanced job does not turn rounding into outliers);
* a rank is *slow in the window* when its robust score ``(work - median) / (1.4826 MAD)``
  exceeds ``z`` and its work is at least ``min_ratio`` × the median (NVIDIA's resiliency
  extension scores ranks relative to the median the same way);
* a rank is **named** once it was slow in ``k`` of the last ``n`` windows (rare slow steps do
  not make a straggler: a window's median ignores them);
* the **job slowed down** when the job's median work rose to ``job_ratio`` × the median of its
  previous windows (a change point on the job's step time, as Greyhound / FALCON do): one job
  alert, and no rank is named for that window, since all ranks slowed together. A slowdown that
  lasts more than ``n`` windows is the job's new pace: the baseline starts again from it, and
  ranks are judged again.

Alerts come once per episode (a named rank re-arms once it is no longer slow in k of n).
The caller (the processor's per-job view, or a node agent that sees all local ranks) supplies
the per-rank numbers and enriches the alert with what NVML shows on that rank's GPU.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from otel_gpu.detect.model import Alert

STRAGGLER = "straggler"
JOB_SLOWDOWN = "job_slowdown"


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    window_s: float = 30.0
    k: int = 3  # slow windows ...
    n: int = 5  # ... out of the last n
    z: float = 3.5  # robust score above which a rank is slow in a window
    min_ratio: float = 1.25  # and at least this much of the job's median work
    mad_floor: float = 0.02  # MAD floor, as a fraction of the median
    job_ratio: float = 1.5  # job median over its recent baseline that is a job-wide slowdown
    min_ranks: int = 3  # fewer ranks: no median to compare with
    max_samples: int = 10_000  # per rank per window (the oldest go first): bounded state


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where a rank runs (for the alert sentence)."""

    host: str = ""
    gpu: str = ""


class StragglerJudge:
    """One job's ranks; :meth:`add` per rank step, alerts when windows close."""

    def __init__(self, job: str, config: StragglerConfig | None = None) -> None:
        self.job = job
        self.cfg = config or StragglerConfig()
        self._start: float | None = None
        self._steps: dict[int, list[float]] = {}
        self._slow: dict[int, deque[bool]] = {}
        self._named: set[int] = set()
        self._job_medians: deque[float] = deque(maxlen=8)
        self._job_slow = False
        self._slow_run = 0  # windows in a row the job has been slow
        self.info: dict[int, RankInfo] = {}
        self.windows = 0  # windows closed so far
        self.closed_at: float | None = None  # data time the last window closed

    @property
    def named(self) -> set[int]:
        return set(self._named)

    def is_named(self, rank: int) -> bool:
        return rank in self._named

    @property
    def job_slowed(self) -> bool:
        """The last window closed was a job-wide slowdown."""
        return self._job_slow

    def add(
        self, time: float, rank: int, work_s: float, info: RankInfo | None = None
    ) -> list[Alert]:
        """One step of ``rank`` that ended at ``time`` and computed for ``work_s`` seconds."""
        out: list[Alert] = []
        if self._start is None:
            self._start = time
        while time >= self._start + self.cfg.window_s:
            self._start += self.cfg.window_s
            self.closed_at = self._start
            out.extend(self._close(self._start))
        if work_s >= 0 and work_s == work_s:  # not NaN
            self._steps.setdefault(rank, []).append(work_s)
            if len(self._steps[rank]) > self.cfg.max_samples:
                del self._steps[rank][0]
        if info is not None:
            self.info[rank] = info
        return out

    def _close(self, at: float) -> list[Alert]:
        cfg = self.cfg
        self.windows += 1
        steps, self._steps = self._steps, {}
        work = {r: statistics.median(v) for r, v in steps.items() if v}
        if len(work) < cfg.min_ranks:
            return []
        med = statistics.median(work.values())
        mad = statistics.median(abs(w - med) for w in work.values())
        scale = 1.4826 * max(mad, cfg.mad_floor * med, 1e-9)
        out: list[Alert] = []
        baseline = statistics.median(self._job_medians) if len(self._job_medians) >= 2 else None
        job_slow = baseline is not None and med >= cfg.job_ratio * baseline
        self._slow_run = self._slow_run + 1 if job_slow else 0
        if self._slow_run > cfg.n:  # slow for longer than n windows: the job's new pace
            self._job_medians.clear()
            job_slow = False
        if job_slow and not self._job_slow:
            out.append(self._job_alert(at, med, baseline or med))
        self._job_slow = job_slow
        if not job_slow:
            self._job_medians.append(med)
        for rank, w in sorted(work.items()):
            slow = not job_slow and (w - med) / scale > cfg.z and w >= cfg.min_ratio * med
            hist = self._slow.setdefault(rank, deque(maxlen=cfg.n))
            hist.append(slow)
            if sum(hist) >= cfg.k:
                if rank not in self._named:
                    self._named.add(rank)
                    out.append(self._rank_alert(at, rank, w, med, sum(hist), len(hist)))
            else:
                self._named.discard(rank)
        return out

    def _rank_alert(self, at: float, rank: int, w: float, med: float, k: int, n: int) -> Alert:
        info = self.info.get(rank, RankInfo())
        where = ", ".join(p for p in (f"host {info.host}" if info.host else "",
                                      f"GPU {info.gpu}" if info.gpu else "") if p)  # fmt: skip
        where = f" ({where})" if where else ""
        return self._alert(
            at,
            f"rank {rank}{where} is a straggler: it computes {w:.3g} s per step, "
            f"{w / med:.1f}x the job's median {med:.3g} s, in {k} of the last {n} windows; "
            "the other ranks wait for it in their collectives",
            {
                "rule": STRAGGLER,
                "rank": float(rank),
                "work_s": w,
                "job_median_s": med,
                "ratio": w / med,
                "host": info.host,
                "gpu": info.gpu,
            },
        )

    def _job_alert(self, at: float, med: float, baseline: float) -> Alert:
        return self._alert(
            at,
            f"the whole job slowed down: every rank computes {med:.3g} s per step, "
            f"{med / baseline:.1f}x its recent {baseline:.3g} s (no single straggler)",
            {"rule": JOB_SLOWDOWN, "job_median_s": med, "baseline_s": baseline},
        )

    def _alert(self, at: float, message: str, evidence: dict[str, float | str]) -> Alert:
        """A straggler-kind warning about the job (a rank's or the whole job's slowdown)."""
        return Alert(
            kind=STRAGGLER,
            subject=self.job,
            time=at,
            severity="warning",
            message=message,
            window_s=self.cfg.window_s,
            evidence=evidence,
        )
