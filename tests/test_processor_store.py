"""The state store never stalls or crash-loops the processor: a damaged file is moved aside, a
file locked by another process or a failing disk degrades /healthz and is retried, actions fire
after (and off) the ingestion path, and the breakers still never notify twice."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from support.processor import in_process_config, leak_requests

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.breaker import OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.engine import Engine
from otel_gpu.processor import Processor, ProcessorConfig
from otel_gpu.processor.pipeline import Detection
from otel_gpu.processor.store import StateStore


class Recorder:
    def __init__(self) -> None:
        self.transitions: list[Transition] = []
        self.threads: set[str] = set()

    def on_transition(self, t: Transition) -> None:
        self.transitions.append(t)
        self.threads.add(threading.current_thread().name)


def _leak(det: Detection, n: int = 600) -> None:
    for r in leak_requests(n):
        det.ingest_metrics(r)
    det.tick(final=True)


@pytest.mark.unit
def test_a_damaged_state_file_is_moved_aside_and_the_processor_starts(tmp_path, caplog):
    db = tmp_path / "state.db"
    good = StateStore(str(db))
    good.close()
    data = bytearray(db.read_bytes())
    data[100:4096] = b"\xa5" * (4096 - 100)  # a corrupted first page (header and schema)
    db.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        proc = Processor(in_process_config(state_path=str(db)))
    try:
        assert any("moved it to" in r.getMessage() for r in caplog.records)
        assert list(tmp_path.glob("state.db.corrupt-*"))
        assert proc.health()[0] is True
    finally:
        proc.stop(1)


@pytest.mark.unit
def test_actions_fire_once_on_the_store_writer_after_the_write(tmp_path):
    db = str(tmp_path / "state.db")
    rec = Recorder()
    store = StateStore(db)
    det = Detection(
        ProcessorConfig(state_path=db), Engine(), Breaker(BreakerConfig(cooldown_s=1e6)), store,
        rec, lambda m, b: None,
    )  # fmt: skip
    _leak(det)
    assert store.flush()
    opened = [t for t in rec.transitions if t.to_state == OPEN]
    assert opened and len({t.subject for t in opened}) == len(opened)
    assert rec.threads == {"otel-gpu-state"}  # not the ingestion thread
    rows = store.history("transitions")
    assert len(rows) == len(rec.transitions)
    store.close()


@pytest.mark.process
def test_a_locked_state_file_degrades_health_never_blocks_and_is_written_later(tmp_path):
    db = str(tmp_path / "state.db")
    StateStore(db).close()
    # Another process holds an exclusive lock on the file.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3,sys; c=sqlite3.connect(sys.argv[1], isolation_level=None); "
            "c.execute('PRAGMA journal_mode=DELETE'); c.execute('BEGIN EXCLUSIVE'); "
            "print('locked', flush=True); sys.stdin.readline()",
            db,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        rec = Recorder()
        proc = Processor(in_process_config(state_path=db), actions=rec)
        bcfg = BreakerConfig(cooldown_s=1e6)
        proc.detection.breaker = Breaker(bcfg)
        _leak(proc.detection)
        proc._store.flush()
        ok, why = proc.health()
        assert not ok and "state store" in why and "locked" in why
        assert proc.readiness() == (False, why)  # not ready: it cannot keep what it takes...
        assert proc.liveness() == (True, f"live; health: {why}")  # ...but a restart won't help
        assert proc.stats()["store"]["errors"] >= 1
        opened = [t for t in rec.transitions if t.to_state == OPEN]
        assert opened  # notified although the store could not write
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        # The next batch (or the retry) writes the newest breaker state.
        proc.detection.tick(final=True)
        for _ in range(50):
            if not proc._store.last_error:
                break
            proc._store.commit(proc.detection.breaker.export_state(), [], [], {})
            time.sleep(0.2)
        assert proc.health()[0] is True
        proc.stop(2)
        again = StateStore(db)
        restored = Breaker.from_state(again.load_breaker() or {}, bcfg)
        assert {s for s in restored.subjects() if restored.state(s) == OPEN} == {
            t.subject for t in opened
        }
        again.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)


@pytest.mark.unit
def test_a_store_that_cannot_be_opened_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="--state"):
        StateStore(str(tmp_path))  # a directory


@pytest.mark.unit
def test_closing_a_store_that_cannot_write_ends_its_writer(tmp_path):
    db = str(tmp_path / "state.db")
    StateStore(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("BEGIN EXCLUSIVE")  # held by another connection: every write fails
    try:
        store = StateStore(db)
        store.commit({"subjects": {}}, [], [], {})
        store.close(timeout_s=5.0)
        assert not store._thread.is_alive() and store.errors >= 1
    finally:
        holder.close()
