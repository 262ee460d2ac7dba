"""A leak alert's memory diagnosis is kept beside the recording (FILE.diagnoses.jsonl) and
`otel-gpu report FILE` shows it as "Where the memory went" (issue 20 §4)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from otel_gpu.agent.memory_diagnosis import diagnosis_from
from otel_gpu.cli import main
from otel_gpu.detect.model import LEAK, Alert
from otel_gpu.outputs.diagnoses import DiagnosisLog, read, sidecar
from otel_gpu.outputs.record import COLUMNS

pytestmark = pytest.mark.unit

HOLDER = {
    "path": "train.model.encoder._cache", "root": "global", "site": "train.py", "count": 900,
    "bytes": 9 << 20, "graph_bytes": 0, "grad_fn": 0, "growth_count": 600,
    "growth_bytes": 6 << 20, "growing": True, "devices": {"cpu": 9 << 20},
    "dtypes": {"float32": 900},
}  # fmt: skip
STILL = {**HOLDER, "path": "train.replay", "growth_count": 0, "growth_bytes": 0, "growing": False}


def test_the_diagnosis_is_kept_beside_the_recording_and_reported(tmp_path: Path) -> None:
    recording = tmp_path / "run.csv"
    with recording.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for i in range(30):
            row = {"subject": "rss:42", "label": "python train.py", "time_s": 60.0 * i}
            row["used_bytes"] = 1e9 + 1e6 * i
            w.writerow([row.get(c, "") for c in COLUMNS])
    reply = {
        "over_s": 65.0,
        "holders": [HOLDER, STILL],
        "lines": ["train.model.encoder._cache: +600 tensors"],
    }
    found = diagnosis_from(42, reply, 1.5)
    log = DiagnosisLog(sidecar(str(recording)))
    log.on_alert(Alert(LEAK, "rss:42", 1500.0, "warning", "memory leak suspected", diagnosis=found))
    log.on_alert(Alert(LEAK, "rss:43", 1500.0, "warning", "no diagnosis here"))  # not kept
    log.close()
    [kept] = read(str(recording))
    assert kept["subject"] == "rss:42" and kept["diagnosis"]["data"]["growing"] == [HOLDER["path"]]
    out = tmp_path / "report.html"
    assert main(["report", str(recording), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<h3>Where the memory went</h3>" in page
    section = page.split("Where the memory went")[1]
    assert "train.model.encoder._cache" in section and "+600" in section and "+6.0 MiB" in section
    assert "train.replay" not in section  # not growing: not where the memory went


def test_a_recording_without_diagnoses_has_no_such_table(tmp_path: Path) -> None:
    assert read(str(tmp_path / "none.csv")) == []
    DiagnosisLog(str(tmp_path / "x.diagnoses.jsonl")).close()
    assert not (tmp_path / "x.diagnoses.jsonl").exists()
