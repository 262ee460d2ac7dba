"""How otel-gpu writes quantities for people: one set of units in the live view, the end-of-run
summary and the report. Memory in GiB / MiB (binary, as NVML and ``nvidia-smi`` count it),
growth rates in MB/h (decimal, as the detector's alert sentences say), GPUs as ``GPU0`` plus
the first 8 hex digits of their UUID."""

from __future__ import annotations

from otel_gpu.core.printable import printable

MIB = 1 << 20
GIB = 1 << 30


def memory(n: float | None) -> str:
    """``31.2 GiB``, ``512 MiB``; ``-`` when unknown."""
    if n is None:
        return "-"
    if abs(n) >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB"


def memory_of(used: float | None, limit: float | None) -> str:
    """``31.2/80.0 GiB`` (both in the limit's unit)."""
    if used is None:
        return "-"
    if limit is None:
        return memory(used)
    if limit >= GIB:
        return f"{used / GIB:.1f}/{limit / GIB:.1f} GiB"
    return f"{used / MIB:.0f}/{limit / MIB:.0f} MiB"


def rate(bytes_per_s: float | None) -> str:
    """Signed MB/h: ``+120 MB/h``; ``-`` when unknown."""
    if bytes_per_s is None:
        return "-"
    return f"{bytes_per_s * 3600 / 1e6:+.0f} MB/h"


def fraction(f: float | None) -> str:
    """A 0..1 fraction as a whole percentage: ``93%``."""
    return "-" if f is None else f"{100 * f:.0f}%"


def watts(w: float | None) -> str:
    return "-" if w is None else f"{w:.0f} W"


def celsius(c: float | None) -> str:
    return "-" if c is None else f"{c:.0f}°C"


def short_uuid(uuid: str) -> str:
    """The first 8 hex digits after ``GPU-`` / ``MIG-``: enough to tell a node's GPUs apart."""
    head, sep, rest = uuid.partition("-")
    return (rest if sep and head in ("GPU", "MIG") else uuid)[:8]


def gpu_label(index: int | None, uuid: str) -> str:
    """``GPU0 51a1a7ed`` (``MIG0 5d3c0000`` for a MIG device of GPU 0)."""
    kind = "MIG" if uuid.startswith("MIG-") else "GPU"
    return f"{kind}{'' if index is None else index} {printable(short_uuid(uuid))}"


def duration(s: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``, ``2.1 d``."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"
