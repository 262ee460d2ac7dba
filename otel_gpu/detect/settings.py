"""Detection settings: one frozen dataclass whose fields are declared once, validated once.

Every field has a default that works without tuning, a parser with its bounds and a one-line
doc (in the field's metadata, read by :data:`DECLARED`). ``OTEL_GPU_DETECT_<FIELD>`` (upper
case) overrides a field, e.g. ``OTEL_GPU_DETECT_STALL_WINDOW_S=1200``; a file (JSON or TOML, see
``otel-gpu analyze --config``) may override fields by their lower-case names.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import Parser, Setting, boolean, number, refuse, resolve

ENV_PREFIX = "OTEL_GPU_DETECT_"
_MIB = float(1 << 20)

_POSITIVE = number(0, low_open=True, accepted="expected a number > 0")
_NON_NEGATIVE = number(0, accepted="expected a number >= 0")
_FRACTION = number(0, 1, accepted="expected a fraction between 0 and 1")
_FINITE = number(-math.inf, accepted="expected a finite number")


def _metric_names(raw: object, source: str) -> tuple[str, ...]:
    if isinstance(raw, str):
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    if isinstance(raw, (list, tuple)) and all(isinstance(p, str) for p in raw):
        return tuple(raw)
    refuse(source, raw, "expected a comma-separated list of metric names")


def _declare(default: Any, parse: Parser, doc: str) -> Any:
    """A field with its parser (bounds included) and doc, for :data:`DECLARED`."""
    return field(default=default, metadata={"parse": parse, "doc": doc})


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detectors. Times in seconds, sizes in bytes, fractions 0..1."""

    # --- leak: sustained growth of the memory floor -------------------------------------------
    leak_enabled: bool = _declare(True, boolean, "run the leak detector")
    leak_bucket_s: float = _declare(
        60.0,
        _POSITIVE,
        "width of the finest bucket of the decimated memory floor; coarser levels are x4 each",
    )
    leak_min_window_s: float = _declare(
        3600.0, _POSITIVE, "shortest evidence window for an ordinary (not urgent) leak alert"
    )
    leak_min_z: float = _declare(
        6.0,
        _POSITIVE,
        "slope significance: Theil-Sen rate divided by its standard error (robust noise)",
    )
    # 1.4 kB/s = 5 MB/h
    leak_min_rate_bytes_per_s: float = _declare(
        5e6 / 3600.0, _NON_NEGATIVE, "ignore growth slower than this (the default: 5 MB/h)"
    )
    leak_min_rise_bytes: float = _declare(
        32 * _MIB, _NON_NEGATIVE, "ignore growth smaller than this over the window"
    )
    leak_noise_floor_bytes: float = _declare(
        1 * _MIB,
        _NON_NEGATIVE,
        "noise floor for the residuals (allocator and NVML report in MiB-sized steps)",
    )
    leak_min_spread: float = _declare(
        0.4,
        _FRACTION,
        "each quarter of the window must contribute at least this share of the expected growth",
    )
    leak_min_steps: float = _declare(
        6.0,
        _POSITIVE,
        "growth must come from at least this many effective steps (participation ratio)",
    )
    leak_steady_ratio: float = _declare(
        0.6,
        _FRACTION,
        "the second half of a window must rise at least this fraction as fast as the first",
    )
    leak_saturation_ratio: float = _declare(
        0.8,
        _FRACTION,
        "successive quarter-to-quarter growth ratio below this means filling toward a cap",
    )
    leak_context_s: float = _declare(
        4 * 3600.0,
        _POSITIVE,
        "windows shorter than this need a look-back twice as long (to rule out a cache filling)",
    )
    leak_urgent_eta_s: float = _declare(
        1800.0,
        _NON_NEGATIVE,
        "short windows alert only if the memory runs out sooner than this",
    )
    leak_urgent_window_s: float = _declare(
        1800.0,
        _NON_NEGATIVE,
        "... and only from a window at least this long (a filling cache shows its cap by then)",
    )

    leak_suspect_enabled: bool = _declare(
        True,
        boolean,
        "the suspicion stage: a CUSUM on the floor's rise that starts attribution early",
    )
    leak_suspect_per_day: float = _declare(
        0.1,
        number(1e-6, 1000, accepted="expected a rate between 0.000001 and 1000 per day"),
        "target false suspicions per subject per day without a leak (sets the CUSUM threshold)",
    )
    leak_suspect_window_s: float = _declare(
        1800.0,
        _POSITIVE,
        "a suspicion is confirmed from the growth since its change point once it is this long",
    )
    leak_cache_tau_s: float = _declare(
        3600.0,
        _POSITIVE,
        "... and steadier than a cache filling toward its cap with this time constant could be",
    )
    leak_suspect_min_z: float = _declare(
        6.0, _POSITIVE, "the slope significance the growth since a suspicion's change point needs"
    )
    leak_suspect_min_steps: float = _declare(
        6.0,
        number(1, accepted="expected a number >= 1"),
        "the effective steps that growth must come from",
    )
    # --- stall: memory held while the GPU does no useful work --------------------------------
    stall_enabled: bool = _declare(True, boolean, "run the stall detector")
    stall_window_s: float = _declare(
        900.0,
        _POSITIVE,
        "continuous idleness needed before a stall alert (phase unknown or train)",
    )
    stall_startup_window_s: float = _declare(
        1800.0,
        _POSITIVE,
        "the same before the job has ever been seen working (model loading without phase info)",
    )
    stall_adapt_factor: float = _declare(
        1.5,
        number(1, accepted="expected a number >= 1"),
        "idle periods that ended on their own stretch the window by this factor, up to the cap",
    )
    stall_window_max_s: float = _declare(3600.0, _POSITIVE, "cap of the stretched window")
    stall_phase_max_s: float = _declare(
        7200.0,
        _POSITIVE,
        "a known load/evaluate/save phase suppresses the alert for at most this long",
    )
    stall_util_idle: float = _declare(0.10, _FRACTION, "smoothed utilization below this is idle")
    # At or above spin_util with power at or below spin_power_fraction of the limit.
    stall_spin_util: float = _declare(
        0.90, _FRACTION, "utilization of a spinning hang (a hung collective)"
    )
    stall_spin_power_fraction: float = _declare(
        0.25, _FRACTION, "power, as a fraction of the limit, at or below which it spins idle"
    )
    stall_smoothing_s: float = _declare(
        60.0, _POSITIVE, "smoothing time constant for utilization and power"
    )
    stall_min_held_bytes: float = _declare(
        256 * _MIB,
        _NON_NEGATIVE,
        "memory held means used above max(this, 1% of the limit) and processes present",
    )
    stall_step_factor: float = _declare(
        20.0,
        _POSITIVE,
        "in the train phase, no step for max(floor, this many typical step times) is a stall"
        " (phase unknown: max(window, ...))",
    )
    stall_step_floor_s: float = _declare(
        60.0,
        _POSITIVE,
        "the shortest step-aware stall limit in the train phase (fast steps, jittery sampling)",
    )

    # --- threshold and hardware --------------------------------------------------------------
    threshold_enabled: bool = _declare(True, boolean, "run the threshold detector")
    memory_utilization_limit: float = _declare(
        0.95,
        number(0, 1, low_open=True, accepted="expected a fraction in (0, 1]"),
        "memory used above this fraction of the limit is near exhaustion",
    )
    memory_rise_fraction: float = _declare(
        0.005, _NON_NEGATIVE, "of the limit, since crossing, to count as rising"
    )
    temperature_limit_c: float = _declare(87.0, _FINITE, "GPU temperature alert, °C")
    temperature_hysteresis_c: float = _declare(
        3.0, _NON_NEGATIVE, "cooling below the limit by this much ends the alert, °C"
    )
    hardware_enabled: bool = _declare(True, boolean, "run the hardware (Xid, ECC) detector")

    # --- anomaly: EWMA mean +- k sigma for metrics named here (Point.extra keys) --------------
    anomaly_metrics: tuple[str, ...] = _declare(
        (), _metric_names, "metrics watched for anomalies (comma-separated)"
    )
    anomaly_k: float = _declare(4.0, _POSITIVE, "alert beyond mean +- k sigma")
    anomaly_alpha: float = _declare(
        0.05,
        number(0, 1, low_open=True, high_open=True, accepted="expected a fraction in (0, 1)"),
        "EWMA weight of each new value",
    )
    anomaly_warmup: int = _declare(
        30, number(2, integer=True, accepted="expected an integer >= 2"),
        "values seen before a metric can alert",
    )  # fmt: skip

    # --- numerics: the trainer's loss and gradient norm ---------------------------------------
    numerics_enabled: bool = _declare(True, boolean, "run the training numerics detector")
    numerics_window: int = _declare(
        50, number(3, integer=True, accepted="expected an integer >= 3"),
        "recent finite losses whose median a new loss is compared with",
    )  # fmt: skip
    numerics_loss_factor: float = _declare(
        10.0,
        number(1, low_open=True, accepted="expected a number > 1"),
        "a loss above this many times its recent median (3 steps in a row) is exploding",
    )
    numerics_grad_vanish: float = _declare(
        1e-6, _POSITIVE, "a gradient norm below this is vanishing"
    )
    numerics_grad_explode: float = _declare(
        1e4, _POSITIVE, "a gradient norm above this is exploding"
    )
    numerics_steps: int = _declare(
        10, number(1, integer=True, accepted="expected an integer >= 1"),
        "consecutive steps a gradient norm must vanish or explode for",
    )  # fmt: skip

    # --- stragglers: one rank slower than the rest of its job (the processor, per job) -------
    straggler_enabled: bool = _declare(
        True, boolean, "judge each job's ranks for a straggler (the processor: it sees every rank)"
    )
    straggler_window_s: float = _declare(
        30.0, _POSITIVE, "window in which each rank's median work is compared with the job's"
    )
    straggler_k: int = _declare(
        3, number(1, integer=True, accepted="expected an integer >= 1"),
        "windows a rank must be slow in, of the last straggler_n, to be named",
    )  # fmt: skip
    straggler_n: int = _declare(
        5, number(1, integer=True, accepted="expected an integer >= 1"),
        "the windows straggler_k counts in",
    )  # fmt: skip
    straggler_z: float = _declare(
        3.5,
        _POSITIVE,
        "a rank is slow in a window when (work - median) / (1.4826 MAD) is above this ...",
    )
    straggler_min_ratio: float = _declare(
        1.25,
        number(1, accepted="expected a number >= 1"),
        "... and its work is at least this many times the job's median",
    )
    straggler_job_ratio: float = _declare(
        1.5,
        number(1, low_open=True, accepted="expected a number > 1"),
        "the job's median work this many times its recent baseline is a job-wide slowdown "
        "(one alert, no rank named)",
    )
    straggler_min_ranks: int = _declare(
        3, number(3, integer=True, accepted="expected an integer >= 3"),
        "fewer ranks reporting in a window: the window is not judged",
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise UsageError naming the first setting that is out of range."""
        for s in DECLARED:
            s.parse(getattr(self, s.name), s.name)
        if self.straggler_k > self.straggler_n:
            raise UsageError(
                f"straggler_k={self.straggler_k}: expected at most straggler_n "
                f"({self.straggler_n}): a rank is named when slow in k of the last n windows"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> DetectConfig:
        """Defaults overridden by ``values`` (field name -> value, from ``source``, a file);
        strings are parsed."""
        known = {s.name for s in DECLARED}
        lowered = {key.lower(): raw for key, raw in values.items()}
        for key in values:
            if key.lower() not in known:
                raise UsageError(
                    f"{source}: unknown detection setting {key!r}; "
                    f"valid settings: {', '.join(sorted(known))}"
                )
        parsed, _origin = resolve(DECLARED, env={}, file=lowered, file_name=source)
        return cls(**parsed)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DetectConfig:
        """Defaults overridden by ``OTEL_GPU_DETECT_<FIELD>`` variables (validated)."""
        env = os.environ if environ is None else environ
        known = {s.env for s in DECLARED if s.env}
        for key in env:
            if key.startswith(ENV_PREFIX) and key.upper() not in known:
                raise UsageError(
                    f"{key} is not a detection setting; valid: {', '.join(sorted(known))}"
                )
        parsed, _origin = resolve(DECLARED, env={k.upper(): v for k, v in env.items()})
        return cls(**parsed)

    def replace(self, **changes: Any) -> DetectConfig:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


def _shown(default: Any) -> str:
    """A default as the docs' table shows it: the exact value, so that parsing the table's
    text gives the object's default back (tests/test_settings.py), whole numbers without ".0"."""
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(default) or "—"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return repr(default)


def _setting(f: dataclasses.Field[Any]) -> Setting:
    return Setting(
        f.name,
        ENV_PREFIX + f.name.upper(),
        f.metadata["parse"],
        f.metadata["doc"],
        _shown(f.default),
    )


DECLARED = tuple(_setting(f) for f in fields(DetectConfig))
