"""The detector registry cannot drift: every detector class in ``otel_gpu.detect`` is registered
in ``engine.DETECTORS`` (one left out would pass every other test and never run), each raises
and holds only the alert kinds it declares (``KINDS``), and every declared kind is raised by a
trace built for it, so the kinds the actions accept (``engine.ALERT_KINDS``) are exactly what
the engine can produce."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from support.tracegen import generate

import otel_gpu.detect
from otel_gpu.detect.detector import Detector
from otel_gpu.detect.engine import ALERT_KINDS, DETECTORS
from otel_gpu.detect.leak import LeakDetector
from otel_gpu.detect.model import Point
from otel_gpu.detect.numerics import NumericsDetector
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.stall import StallDetector
from otel_gpu.detect.threshold import AnomalyDetector, ThresholdDetector

pytestmark = pytest.mark.unit

LIMIT = 80e9


def _detector_classes() -> list[type]:
    """Classes of ``otel_gpu.detect`` with the Detector protocol's shape, where defined."""
    found = []
    for info in pkgutil.iter_modules(otel_gpu.detect.__path__, "otel_gpu.detect."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == module.__name__
                and cls is not Detector
                and all(
                    callable(getattr(cls, name, None))
                    for name in ("observe", "conditions", "enabled")
                )
            ):
                found.append(cls)
    return found


def test_every_detector_class_is_registered() -> None:
    classes = _detector_classes()
    assert len(classes) >= 4  # the walk finds them
    assert [c.__name__ for c in classes if c not in DETECTORS] == []


# Points that make each detector alert: a leak and an idle stall from the trace generator,
# memory near the limit and rising, heat, new ECC and Xid errors, a metric leaving its band.
def _rules() -> list[Point]:
    used = [0.90, 0.955, 0.956, 0.97, 0.975]
    points = [Point(float(i), used_bytes=u * LIMIT, limit_bytes=LIMIT) for i, u in enumerate(used)]
    points += [Point(10.0 + i, temperature_c=c) for i, c in enumerate((70, 90))]
    points += [Point(20.0 + i, ecc_uncorrected=e, xid_errors=x) for i, (e, x) in enumerate(
        ((3, 0), (4, 0), (4, 1)))]  # fmt: skip
    return points


def _anomaly() -> list[Point]:
    values = [10.0 + (i % 5) * 0.1 for i in range(100)] + [25.0]
    return [Point(float(i), extra={"loss": v}) for i, v in enumerate(values)]


SCENARIOS = {
    LeakDetector: lambda: generate("leak", seed=1, interval_s=60.0).points,
    StallDetector: lambda: generate("stall_idle", seed=1, interval_s=60.0).points,
    ThresholdDetector: _rules,
    AnomalyDetector: _anomaly,
    NumericsDetector: lambda: [Point(1.0, step=1.0, loss=float("nan"))],
}
CONFIG = DetectConfig(anomaly_metrics=("loss",))


def test_each_registered_detector_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(DETECTORS)


@pytest.mark.parametrize("cls", DETECTORS, ids=lambda c: c.__name__)
def test_a_detector_raises_and_holds_only_the_kinds_it_declares(cls: type[Detector]) -> None:
    assert cls.KINDS and cls.enabled(CONFIG)
    detector = cls(CONFIG)
    raised: set[str] = set()
    held: set[str] = set()
    for point in SCENARIOS[cls]():
        raised |= {a.kind for a in detector.observe("gpu:GPU-0", point)}
        held |= {c.kind for c in detector.conditions(point.time)}
    assert raised == set(cls.KINDS)  # every declared kind is raised, nothing else
    assert held <= set(cls.KINDS)


def test_the_alert_kinds_are_the_registered_detectors_kinds() -> None:
    assert set(ALERT_KINDS) == {k for d in DETECTORS for k in d.KINDS}
    assert len(ALERT_KINDS) == len(set(ALERT_KINDS))
