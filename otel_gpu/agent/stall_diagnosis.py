"""The stall alert's diagnosis: where the watched job is stuck (issue 21 §5).

Registered for ``stall`` alerts on the watchdog's :class:`~otel_gpu.agent.diagnosis.DiagnosisQueue`
(so it runs on the queue's worker thread, never the sampler's nor the job's): every rank's
stacks, grouped, and the flight recorder's collective findings, by
:func:`otel_gpu.diagnose.hang.look` from the watched tree's root (the wrapper's job, or the
in-process node agent's torchrun). Bounded by the ways it uses (a few seconds per rank, ranks
in parallel) and by the queue's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_gpu.detect.model import STALL, Alert, Diagnosis
from otel_gpu.diagnose import hang, stacks


class StallDiagnoser:
    """``diagnose(alert) -> Diagnosis`` for the job under ``roots``."""

    def __init__(self, roots: Sequence[int], proc_root: str = "/proc") -> None:
        self.roots = list(roots)
        self.proc_root = proc_root

    def __call__(self, alert: Alert) -> Diagnosis | None:
        reasons = []
        for root in self.roots:
            try:
                report = hang.look(root, pyspy=stacks.find_pyspy(), proc=self.proc_root)
            except hang.CannotLook as exc:
                reasons.append(str(exc))
                continue
            return Diagnosis(
                STALL, tuple(report.alert_lines()), report.alert_data(), took_s=report.took_s
            )
        why = "; ".join(reasons) or "no process to look at"
        return Diagnosis(STALL, (), error=f"cannot look into the job: {why}")
