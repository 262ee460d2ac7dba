"""What the alerts' diagnoses found, kept beside the recording (``--record FILE`` also writes
``FILE.diagnoses.jsonl``) so that ``otel-gpu report FILE`` shows "Where the memory went"
(issue 20 §4). The recording itself holds only points (a replay recomputes the alerts; the
diagnoses read the live processes and cannot be recomputed).

One JSON object per diagnosed alert (``subject``, ``kind``, ``time``, ``message``,
``diagnosis``: as ``--summary-json``'s ``alerts[].diagnosis``), redacted. Kept in memory
(bounded) on the sampler thread, written when the run ends: no disk I/O on that thread.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from otel_gpu.core.private_files import open_private
from otel_gpu.detect.model import Alert
from otel_gpu.outputs.summary import diagnosis_record

log = logging.getLogger("otel_gpu.record")

SUFFIX = ".diagnoses.jsonl"
MAX_ENTRIES = 200


def sidecar(recording: str) -> str:
    return recording + SUFFIX


class DiagnosisLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = []

    def on_alert(self, alert: Alert) -> None:
        found = diagnosis_record(alert)
        if found is None or len(self.entries) >= MAX_ENTRIES:
            return
        self.entries.append(
            {
                "subject": alert.subject,
                "kind": alert.kind,
                "time": alert.time,
                "message": alert.message,
                "diagnosis": found,
            }
        )

    def close(self) -> None:
        if not self.entries:
            return
        try:
            with open_private(self.path, "w", encoding="utf-8") as f:  # they name the job's code
                for e in self.entries:
                    f.write(json.dumps(e, default=str) + "\n")
        except OSError as exc:
            log.warning("otel-gpu: diagnoses not written to %s: %s", self.path, exc)


def read(recording: str) -> list[dict[str, Any]]:
    """The diagnoses kept beside ``recording`` ([] when there are none or they are unreadable)."""
    path = sidecar(recording)
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and isinstance(e.get("diagnosis"), dict):
                out.append(e)
    return out[:MAX_ENTRIES]
