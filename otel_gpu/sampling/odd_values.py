"""Readings NVML returns that cannot be right, and what the agent reports instead.

Each rule returns the value to report and, when the reading was odd, a short description for
the log (NvmlSource logs it once per device and metric). The "Odd values" table of docs/metrics.md
documents the same rules; a counter that goes backwards is handled where series are exported
(otel_gpu/agent/series.py: a new start time).

* utilization (device, engines, per process) above 100 %: unknown. A share of time cannot
  exceed the whole; clamping to 100 % would report a busy GPU that may be idle, and a hung
  collective is recognised by exactly that reading.
* temperature 0 or 255 °C (or outside them): unknown. 0 is a sensor not read yet, 255 the
  all-ones "no reading"; a running GPU is never at either.
* memory "used" above "total": used is clamped to total (the device is full as far as NVML
  can tell, and the ratio stays within 0..1); a total of 0 is unknown; reserved memory is at
  most "used".
* a process's usedGpuMemory above its device's total memory: unknown for that process.
* process utilization samples stamped more than ``SAMPLE_CLOCK_SLACK_S`` in the future, or not
  after the newest one seen: ignored (a future stamp would otherwise make NVML answer "nothing
  newer" until the clock catches up); a sample value above 100 %: left out of the average.
* names: invalid UTF-8 bytes become U+FFFD, escape sequences and control characters are
  removed, blanks trimmed,
  cut to ``NAME_MAX`` characters; empty: no ``hw.name``. Duplicate names are normal (eight
  identical boards).
* UUIDs (the series key, ``hw.id``): one that is empty, not printable ASCII or longer than
  NVML's buffer cannot identify a device: that device is not watched (logged). A UUID that
  another device already has is not watched either: its points would mix with the first's.
"""

from __future__ import annotations

from typing import Any

from otel_gpu.core.printable import printable

NAME_MAX = 64  # characters of hw.name; NVML model and MIG profile names fit in 40
UUID_MAX = 95  # NVML_DEVICE_UUID_V2_BUFFER_SIZE - 1
TEMPERATURE_NO_READING = (0, 255)
SAMPLE_CLOCK_SLACK_S = 10.0  # NVML stamps samples with the host's wall clock, as time.time()


def fraction(pct: Any) -> float | None:
    """NVML percent -> 0..1; None above 100 % (or below 0)."""
    return pct / 100.0 if 0 <= pct <= 100 else None


def temperature(celsius: Any) -> float | None:
    """°C, or None for 0, 255 and anything outside them."""
    low, high = TEMPERATURE_NO_READING
    return float(celsius) if low < celsius < high else None


def memory(
    total: int, used: int, reserved: int | None
) -> tuple[int | None, int, int | None, str | None]:
    """(total, used, reserved, what was odd and done) of a device's memory reading."""
    odd = None
    if reserved is not None and reserved > used:
        reserved, odd = used, f"reserved {reserved} B > used {used} B: reserved clamped"
    if total <= 0:
        return None, used, reserved, f"total {total} B: limit skipped"
    if used > total:
        odd = f"used {used} B > total {total} B: used clamped to total"
        used = total
        if reserved is not None:
            reserved = min(reserved, used)
    return total, used, reserved, odd


def process_memory(used: int | None, device_total: int | None) -> int | None:
    """A process's GPU bytes, or None when more than its device has."""
    if used is not None and device_total and used > device_total:
        return None
    return used


def name(raw: Any) -> str | None:
    """A printable device name of at most NAME_MAX characters, or None."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    # Escape sequences go whole (not their printable tail: an OSC's title, a CSI's "[2J").
    text = "".join(c for c in printable(text) if c.isprintable()).strip()[:NAME_MAX].rstrip()
    return text or None


def uuid(raw: Any) -> str | None:
    """The UUID as text, or None when it cannot be a key (empty, not printable ASCII)."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
    text = str(raw)
    if not 0 < len(text) <= UUID_MAX or not all("!" <= c <= "~" for c in text):
        return None
    return text
