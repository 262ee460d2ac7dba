"""What an Xid means (issue 22.3): the catalog table and its source, the classes the detector
and readiness act on (an application's Xid opens no breaker, a reset-class or unknown one does),
the kernel-log reader on a FIFO fed hostile lines, and one count per event when NVML and the
kernel log both report it (the C fake NVML)."""

from __future__ import annotations

import csv
import os
import threading
import time
from pathlib import Path

import pytest
from fakenvml.fixtures import FakeNvml

from otel_gpu.core import xid
from otel_gpu.detect.breaker import CLOSED, OPEN, Breaker
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import HARDWARE, Point
from otel_gpu.inference.readiness import Readiness
from otel_gpu.sampling.kmsg import KernelLog
from otel_gpu.sampling.snapshot import GpuSample, Snapshot

pytestmark = pytest.mark.unit

EXCERPT = Path(__file__).parent / "data" / "xid_catalog_excerpt.csv"


def _excerpt() -> list[dict[str, str]]:
    lines = [ln for ln in EXCERPT.read_text().splitlines() if not ln.startswith("#")]
    return list(csv.DictReader(lines))


def test_the_table_is_the_pinned_catalog_excerpt_row_for_row() -> None:
    rows = _excerpt()
    assert len(rows) >= 20
    pinned = {int(r["code"]): (r["mnemonic"], r["immediate_action"]) for r in rows}
    table = {code: (x.mnemonic, x.bucket) for code, x in xid.CATALOG.items()}
    assert table == pinned


def test_classes_follow_the_bucket_with_dcgm_fatal_codes_on_top() -> None:
    for r in _excerpt():
        code, bucket = int(r["code"]), r["immediate_action"]
        expected = xid.RESET if code in xid.DCGM_FATAL else xid.BUCKET_CLASS.get(bucket, xid.SEVERE)
        assert xid.classify(code).cls == expected, code
    # the anchors: the job's own Xids, DCGM's fatal list, unknown is severe
    assert {xid.classify(c).cls for c in (13, 31, 43, 45)} == {xid.APPLICATION}
    assert {xid.classify(c).cls for c in (48, 74, 79, 94, 95, 119, 120, 140)} == {xid.RESET}
    assert xid.classify(9999).cls == xid.SEVERE and xid.classify(9999).opens_breaker
    # the spreadsheet's word where a guess would differ: 109 resets, 121 (GB200 C2C) is
    # ignored, 61 goes to support and 154 names its own recovery action (both severe)
    assert xid.classify(109).cls == xid.RESET and xid.classify(121).cls == xid.APPLICATION
    assert {xid.classify(c).cls for c in (61, 154)} == {xid.SEVERE}
    assert "unknown" not in xid.sentence(61, "GPU 1")
    assert not xid.classify(13).opens_breaker
    assert "drain / reset the GPU" in xid.sentence(79, "GPU 1")


def _gpu(t: float, total: int, reset: int = 0, severe: int = 0, last: int | None = None) -> Point:
    return Point(
        time=t,
        used_bytes=1e9,
        limit_bytes=8e10,
        xid_errors=total,
        xid_reset=reset,
        xid_severe=severe,
        xid_last=last,
    )


def _judge(points: list[Point]) -> tuple[list, Breaker]:
    engine, breaker = Engine(), Breaker()
    alerts = []
    for p in points:
        for a in engine.observe("gpu:GPU-1", p):
            alerts.append(a)
            breaker.record_alert(a)
    return alerts, breaker


def test_an_application_xid_annotates_and_opens_no_gpu_breaker() -> None:
    alerts, breaker = _judge([_gpu(0, 0), _gpu(5, 1, last=13), _gpu(10, 3, last=13)])
    assert [a.severity for a in alerts] == ["warning", "warning"]
    first = alerts[0]
    assert first.kind == HARDWARE and first.evidence["xid_class"] == xid.APPLICATION
    assert first.evidence["xid"] == 13 and "no GPU action" in first.message
    assert "ROBUST_CHANNEL_GR_EXCEPTION" in first.message
    assert breaker.state("gpu:GPU-1") == CLOSED and breaker.episode("gpu:GPU-1") == 0


def test_a_reset_class_xid_opens_the_breaker_even_when_an_application_xid_follows() -> None:
    # 79 then 45 (the follow-on cleanup) within one collection: the last code is 45, yet the
    # reset-class count rose, so the GPU is at fault
    alerts, breaker = _judge([_gpu(0, 0), _gpu(5, 2, reset=1, last=45)])
    assert len(alerts) == 1 and alerts[0].severity == "critical"
    assert alerts[0].evidence["xid_class"] == xid.RESET
    assert "drain / reset the GPU" in alerts[0].message
    assert breaker.state("gpu:GPU-1") == OPEN


def test_an_unknown_xid_is_severe() -> None:
    alerts, breaker = _judge([_gpu(0, 0), _gpu(5, 1, severe=1, last=4242)])
    assert alerts[0].severity == "critical" and alerts[0].evidence["xid_class"] == xid.SEVERE
    assert "Xid 4242" in alerts[0].message and breaker.state("gpu:GPU-1") == OPEN


def test_without_class_counts_the_latest_code_decides() -> None:
    """Older reporters and CSV traces carry the total and the last code only."""

    def old(t: float, total: int, last: int | None) -> Point:
        return Point(time=t, xid_errors=total, xid_last=last, temperature_c=40)

    app, b1 = _judge([old(0, 0, None), old(5, 1, 31)])
    assert app[0].severity == "warning" and b1.state("gpu:GPU-1") == CLOSED
    reset, b2 = _judge([old(0, 0, None), old(5, 1, 79)])
    assert reset[0].severity == "critical" and b2.state("gpu:GPU-1") == OPEN
    unknown, b3 = _judge([old(0, 0, None), old(5, 1, None)])
    assert unknown[0].evidence["xid_class"] == xid.SEVERE and b3.state("gpu:GPU-1") == OPEN


def test_readiness_ignores_the_applications_xids_and_fails_on_unknown_ones() -> None:
    def snap(t: float, codes: tuple[int, ...]) -> Snapshot:
        return Snapshot(time=t, gpus=(GpuSample(uuid="GPU-1", index=0, xid_codes=codes),))

    r = Readiness()
    r.observe(snap(1, (13, 31, 43, 45)))
    assert r.verdict()[0]
    r.observe(snap(2, (4242,)))
    ready, why = r.verdict()
    assert not ready and "Xid 4242" in why and "drain / reset the GPU" in why


# --- the kernel log ----------------------------------------------------------------------------


def test_kernel_lines_parse_to_gpu_and_code() -> None:
    parse = xid.parse_kernel_line
    assert parse("4,1234,5678,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off") == (
        xid.KernelXid("0000:3b:00", 79, True)
    )
    assert parse("NVRM: Xid (0000:01:00): 13, Graphics Exception") == xid.KernelXid(
        "0000:01:00", 13
    )
    assert parse("NVRM: GPU at PCI:0000:2B:00: GPU-0b11: GPU has fallen off the bus.") == (
        xid.KernelXid("0000:2b:00", 79, True)
    )
    assert parse("usb 1-1: new device") is None
    assert parse("NVRM: Xid (PCI:zz): 13") is None
    assert parse("NVRM: Xid (PCI:0000:3b:00): 99999999999999, overflow") is None
    assert xid.normalise_pci("00000000:3B:00.0") == "0000:3b:00"


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    return path


def test_the_kernel_log_reader_survives_hostile_lines_within_its_bounds(tmp_path: Path) -> None:
    """A FIFO stands in for /dev/kmsg: over-long records with and without a newline, binary
    junk, invalid UTF-8, a record split across writes, a flood. Only the real Xid lines count,
    and one poll reads at most max_bytes."""
    path = _fifo(tmp_path)
    keep = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer end, so the open never blocks
    log = KernelLog(str(path), max_bytes=64 * 1024, max_line=1024)
    try:
        assert log.off_reason is None
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b"6,1,1,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=4, Graphics\n")
        os.write(w, b"A" * 5000 + b"NVRM: Xid (PCI:0000:3b:00): 48, hidden in a huge line\n")
        os.write(w, b"\xff\xfe\x00\x01 NVRM: Xid (PCI:0000:3b:00): 95, after junk \xc3\n")
        os.write(w, b"6,2,2,-;NVRM: Xid (PCI:00")  # split across writes
        assert log.poll() == [xid.KernelXid("0000:3b:00", 13), xid.KernelXid("0000:3b:00", 95)]
        os.write(w, b"00:3b:00): 79, GPU has fallen off the bus.\n")
        os.write(w, b"B" * 3000)  # a record with no newline in sight, then a good one
        assert log.poll() == [xid.KernelXid("0000:3b:00", 79, True)]
        os.write(w, b"C" * 10 + b"\n6,3,3,-;NVRM: Xid (PCI:0000:3b:00): 31, fault\n")
        assert log.poll() == [xid.KernelXid("0000:3b:00", 31)]
        assert log.dropped_lines == 2

        stop = threading.Event()

        def flood() -> None:  # more than a pipe buffer of noise while we poll
            line = b"6,9,9,-;eth0: link flap " + b"x" * 200 + b"\n"
            while not stop.is_set():
                try:
                    os.write(w, line)
                except BlockingIOError:
                    time.sleep(0.001)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        time.sleep(0.05)
        began = time.perf_counter()
        assert log.poll() == []
        took = time.perf_counter() - began
        stop.set()
        t.join(2)
        assert took < 1.0  # bounded: one poll stops at max_bytes however fast the writer
        os.close(w)
    finally:
        log.close()
        os.close(keep)


def test_an_unreadable_kernel_log_turns_the_reader_off_with_a_reason(tmp_path: Path) -> None:
    log = KernelLog(str(tmp_path / "missing"))
    assert log.poll() == [] and "cannot read" in (log.off_reason or "")


def test_dedup_counts_one_event_reported_by_both_sources() -> None:
    d = xid.XidDedup(window_s=30)
    assert d.is_new("GPU-1", 79, "kmsg", 0.0)
    assert not d.is_new("GPU-1", 79, "nvml", 1.0)  # NVML's copy of the same event
    assert d.is_new("GPU-1", 79, "nvml", 2.0)  # a second event
    assert d.is_new("GPU-1", 79, "kmsg", 100.0)  # the NVML one was too long ago to match
    assert d.is_new("GPU-2", 79, "nvml", 100.5)  # another GPU
    for i in range(1000):  # bounded however many GPUs and codes
        d.is_new(f"GPU-{i}", i, "nvml", 200.0 + i)
    assert len(d._pending) <= d.max_keys + 1


def test_nvml_and_the_kernel_log_together_count_each_xid_once(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """On the C fake: Xid 13 from NVML and from the kernel log is one event; 119, which NVML's
    events never carry, is counted from the kernel log alone, as a reset-class Xid."""
    fake_nvml.write("devices = 2\ngpu.1.pci_bus_id = 00000000:3B:00.0")
    path = _fifo(tmp_path)
    keep = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    src = fake_nvml.source(kernel_log=str(path))
    try:
        src.sample([])
        fake_nvml.append("gpu.1.xid = 13")
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, b"4,1,1,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, Graphics Exception\n")
        os.write(w, b"4,2,2,-;NVRM: Xid (PCI:0000:3b:00): 119, Timeout waiting for RPC\n")
        os.write(w, b"4,3,3,-;NVRM: Xid (PCI:0000:99:00): 79, a GPU this agent does not see\n")
        os.close(w)
        gpus = {g.index: g for g in src.sample([]).gpus}
        one = gpus[1]
        assert one.xid_errors == 2 and sorted(one.xid_codes) == [13, 119]
        assert (one.xid_application, one.xid_reset, one.xid_severe) == (1, 1, 0)
        assert gpus[0].xid_errors == 0 and gpus[0].xid_reset == 0
    finally:
        src.close()
        os.close(keep)
