"""Detection settings: one frozen dataclass, validated once, overridable from the environment.

Every field has a default that works without tuning. ``OTEL_GPU_DETECT_<FIELD>`` (upper case)
overrides a field, e.g. ``OTEL_GPU_DETECT_STALL_WINDOW_S=1200``; a file (JSON or TOML, see
``otel-gpu analyze --config``) may override fields by their lower-case names.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from otel_gpu.errors import UsageError

ENV_PREFIX = "OTEL_GPU_DETECT_"
_MIB = float(1 << 20)


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detectors. Times in seconds, sizes in bytes, fractions 0..1."""

    # --- leak: sustained growth of the memory floor -------------------------------------------
    leak_enabled: bool = True
    # Width of the finest bucket of the decimated memory floor; coarser levels are x4 each.
    leak_bucket_s: float = 60.0
    # Shortest evidence window for an ordinary (not urgent) leak alert.
    leak_min_window_s: float = 3600.0
    # Slope significance: Theil-Sen rate divided by its standard error (robust noise).
    leak_min_z: float = 6.0
    # Ignore growth slower than this (1.4 kB/s = 5 MB/h) or smaller than min_rise over the window.
    leak_min_rate_bytes_per_s: float = 5e6 / 3600.0
    leak_min_rise_bytes: float = 32 * _MIB
    # Noise floor for the residuals (allocator and NVML report in MiB-sized steps).
    leak_noise_floor_bytes: float = 1 * _MIB
    # Each quarter of the window must contribute at least this share of the expected growth.
    leak_min_spread: float = 0.4
    # Growth must come from at least this many effective steps (participation ratio).
    leak_min_steps: float = 6.0
    # The second half of a window must rise at least this fraction as fast as the first.
    leak_steady_ratio: float = 0.6
    # Successive quarter-to-quarter growth ratio below this means "filling toward a cap".
    leak_saturation_ratio: float = 0.8
    # Windows shorter than this need a look-back twice as long (to rule out a cache filling).
    leak_context_s: float = 4 * 3600.0
    # Short windows (under leak_min_window_s) alert only if the memory runs out sooner than this.
    leak_urgent_eta_s: float = 1800.0
    # ... and only from a window at least this long (a cache filling fast shows its cap by then).
    leak_urgent_window_s: float = 1800.0

    # --- stall: memory held while the GPU does no useful work --------------------------------
    stall_enabled: bool = True
    # Continuous idleness needed before a stall alert (phase unknown or "train").
    stall_window_s: float = 900.0
    # Before the job has ever been seen working (model loading without phase info).
    stall_startup_window_s: float = 1800.0
    # Idle periods that ended on their own stretch the window (x this factor), up to the cap.
    stall_adapt_factor: float = 1.5
    stall_window_max_s: float = 3600.0
    # A known load/evaluate/save phase suppresses the alert for at most this long.
    stall_phase_max_s: float = 7200.0
    # Smoothed utilization below this is idle; at or above spin_util with power at or below
    # spin_power_fraction of the power limit is a spinning hang (hung collective).
    stall_util_idle: float = 0.10
    stall_spin_util: float = 0.90
    stall_spin_power_fraction: float = 0.25
    # Smoothing time constant for utilization and power.
    stall_smoothing_s: float = 60.0
    # Memory held means used above max(this, 1% of the limit) and processes present.
    stall_min_held_bytes: float = 256 * _MIB
    # Steps not advancing for max(window, this many typical step intervals) is a stall.
    stall_step_factor: float = 20.0

    # --- threshold and hardware --------------------------------------------------------------
    threshold_enabled: bool = True
    memory_utilization_limit: float = 0.95
    memory_rise_fraction: float = 0.005  # of the limit, since crossing, to count as rising
    temperature_limit_c: float = 87.0
    temperature_hysteresis_c: float = 3.0
    hardware_enabled: bool = True

    # --- anomaly: EWMA mean +- k sigma for metrics named here (Point.extra keys) --------------
    anomaly_metrics: tuple[str, ...] = ()
    anomaly_k: float = 4.0
    anomaly_alpha: float = 0.05
    anomaly_warmup: int = 30

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise UsageError naming the first setting that is out of range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                _bad(f.name, value, "a finite number")
        positive = (
            "leak_bucket_s",
            "leak_min_window_s",
            "leak_context_s",
            "leak_min_z",
            "leak_min_steps",
            "stall_window_s",
            "stall_startup_window_s",
            "stall_window_max_s",
            "stall_phase_max_s",
            "stall_smoothing_s",
            "stall_step_factor",
            "anomaly_k",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                _bad(name, getattr(self, name), "a number > 0")
        non_negative = (
            "leak_min_rate_bytes_per_s",
            "leak_min_rise_bytes",
            "leak_noise_floor_bytes",
            "leak_urgent_eta_s",
            "leak_urgent_window_s",
            "stall_min_held_bytes",
            "memory_rise_fraction",
            "temperature_hysteresis_c",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                _bad(name, getattr(self, name), "a number >= 0")
        fractions = (
            "leak_min_spread",
            "leak_saturation_ratio",
            "leak_steady_ratio",
            "stall_util_idle",
            "stall_spin_util",
            "stall_spin_power_fraction",
        )
        for name in fractions:
            if not 0 <= getattr(self, name) <= 1:
                _bad(name, getattr(self, name), "a fraction between 0 and 1")
        if not 0 < self.memory_utilization_limit <= 1:
            _bad("memory_utilization_limit", self.memory_utilization_limit, "a fraction in (0, 1]")
        if not 0 < self.anomaly_alpha < 1:
            _bad("anomaly_alpha", self.anomaly_alpha, "a fraction in (0, 1)")
        if self.anomaly_warmup < 2:
            _bad("anomaly_warmup", self.anomaly_warmup, "an integer >= 2")
        if self.stall_adapt_factor < 1:
            _bad("stall_adapt_factor", self.stall_adapt_factor, "a number >= 1")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> DetectConfig:
        """Defaults overridden by ``values`` (field name -> value); strings are parsed."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            name = key.lower()
            if name not in known:
                raise UsageError(
                    f"{source}: unknown detection setting {key!r}; "
                    f"valid settings: {', '.join(sorted(known))}"
                )
            kwargs[name] = _coerce(name, cls._default(name), raw, source)
        try:
            return cls(**kwargs)
        except UsageError as exc:
            raise UsageError(f"{source}: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DetectConfig:
        """Defaults overridden by ``OTEL_GPU_DETECT_<FIELD>`` variables (validated)."""
        env = os.environ if environ is None else environ
        values: dict[str, str] = {}
        for key, raw in env.items():
            if key.startswith(ENV_PREFIX):
                values[key[len(ENV_PREFIX) :]] = raw
        known = {f.name.upper() for f in fields(cls)}
        for key in values:
            if key.upper() not in known:
                raise UsageError(
                    f"{ENV_PREFIX}{key} is not a detection setting; "
                    f"valid: {', '.join(ENV_PREFIX + k for k in sorted(known))}"
                )
        return cls.from_mapping(values, source="environment")

    def replace(self, **changes: Any) -> DetectConfig:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def _default(cls, name: str) -> Any:
        return getattr(cls, name)


def _bad(name: str, value: object, expected: str) -> None:
    raise UsageError(
        f"detection setting {name} ({ENV_PREFIX}{name.upper()}) = {value!r} is invalid: "
        f"expected {expected}"
    )


def _coerce(name: str, default: Any, raw: Any, source: str) -> Any:
    """Parse ``raw`` into the type of ``default``; strings come from the environment."""
    try:
        if isinstance(default, bool):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(default, tuple):
            if isinstance(raw, str):
                return tuple(p.strip() for p in raw.split(",") if p.strip())
            if isinstance(raw, (list, tuple)) and all(isinstance(p, str) for p in raw):
                return tuple(raw)
            raise ValueError(raw)
        if isinstance(default, int):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if isinstance(raw, bool):
            raise ValueError(raw)
        return float(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", tuple: "a comma-separated list of metric names"}.get(
            type(default), "an integer" if isinstance(default, int) else "a number"
        )
        raise UsageError(
            f"{source}: detection setting {name} ({ENV_PREFIX}{name.upper()}) = {raw!r} "
            f"is invalid: expected {kind}"
        ) from None
