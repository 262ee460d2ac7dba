"""The leak detector's memory floor as a display reads it: where it is and how fast it moves,
leak or not (the live view's ``floor`` column, the summary, the report's floor line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from otel_gpu.detect.leak import _Level

# A slope needs this many envelope values of one level (fewer say nothing about a slope).
TREND_MIN_VALUES = 6
# The recent trend: the last values of one level, as many as the detector's short window.
TREND_VALUES = 16


@dataclass(frozen=True, slots=True)
class FloorTrend:
    time: float  # data time of the latest floor value
    floor: float  # bytes: the latest two-bucket lower envelope value of the finest level
    rate: float | None  # By/s, Theil-Sen slope of the floor; None until enough buckets closed
    window_s: float  # the span the rate was fitted over


def floor_trend(levels: list[_Level]) -> FloorTrend:
    """Slope over the last 16 values of the coarsest level that has them (the recent trend,
    not a warm-up long past), else over the finest level once it holds a few values."""
    from otel_gpu.detect.leak import theil_sen

    fine = levels[0]
    chosen = next((lv for lv in reversed(levels) if len(lv.env_y) >= TREND_VALUES), fine)
    rate: float | None = None
    window = 0.0
    if len(chosen.env_y) >= TREND_MIN_VALUES:
        ts = list(chosen.env_t)[-TREND_VALUES:]
        ys = list(chosen.env_y)[-TREND_VALUES:]
        rate = theil_sen([t - ts[0] for t in ts], ys)
        window = ts[-1] - ts[0]
    return FloorTrend(fine.env_t[-1], fine.env_y[-1], rate, window)
