"""Training numerics (issue 22.4): NaN or infinite loss, a loss exploding against its recent
median, a gradient norm vanishing or exploding for k steps, alerts carrying the step and the
values, the opt-in checkpoint-and-stop; the rules on synthetic steps, then a real HF Trainer on
a tiny model with a planted NaN and a planted vanishing gradient, judged by the in-process
agent's watchdog while it trains."""

from __future__ import annotations

import math
import threading
import time

import pytest
import transformers  # noqa: F401  (a test dependency: fail, never skip)
from opentelemetry.sdk.trace import TracerProvider
from support.tiny_training import TokenDataset, tiny_llama, training_args

from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.agent.watchdog import DetectionSettings, InProcessTrainer, Watchdog
from otel_gpu.detect.breaker import OPEN
from otel_gpu.detect.engine import ALERT_KINDS, Engine
from otel_gpu.detect.model import NUMERICS, Alert, Point
from otel_gpu.detect.numerics import (
    GRAD_EXPLODING,
    GRAD_VANISHING,
    LOSS_EXPLODING,
    LOSS_NAN,
    NumericsDetector,
)
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.sampling.snapshot import Snapshot
from otel_gpu.tracing import control, progress
from otel_gpu.tracing.hf_instrumentor import TransformersInstrumentor
from otel_gpu.tracing.settings import TracingSettings

CFG = DetectConfig()


def _run(steps: list[tuple[float | None, float | None]], cfg: DetectConfig = CFG) -> list[Alert]:
    engine = Engine(cfg)
    out = []
    for i, (loss, grad) in enumerate(steps, start=1):
        out += engine.observe("job:1", Point(float(i), step=float(i), loss=loss, grad_norm=grad))
    return out


@pytest.mark.unit
def test_a_nan_loss_alerts_at_its_step_with_the_values() -> None:
    (alert,) = _run([(2.0, 1.0)] * 5 + [(math.nan, math.nan)] + [(math.nan, 1.0)] * 3)
    assert alert.kind == NUMERICS and alert.severity == "critical"
    assert alert.evidence["rule"] == LOSS_NAN and alert.evidence["step"] == 6.0
    assert alert.evidence["loss"] == "nan" and "loss is nan at step 6" in alert.message


@pytest.mark.unit
def test_a_loss_exploding_against_its_median_for_three_steps() -> None:
    calm = [(2.0 + 0.1 * (i % 3), 1.0) for i in range(20)]
    assert _run(calm + [(50.0, 1.0), (2.0, 1.0)] * 3) == []  # single spikes: a bad batch each
    (alert,) = _run(calm + [(40.0, 1.0), (60.0, 1.0), (80.0, 1.0)])
    assert alert.evidence["rule"] == LOSS_EXPLODING and alert.evidence["step"] == 23.0
    assert alert.evidence["loss_median"] == pytest.approx(2.1) and "80" in alert.message


@pytest.mark.unit
def test_gradient_norm_vanishing_or_exploding_for_k_steps() -> None:
    vanish = _run([(2.0, 1.0)] * 3 + [(2.0, 1e-8)] * 12)
    assert [a.evidence["rule"] for a in vanish] == [GRAD_VANISHING]
    assert vanish[0].severity == "warning" and vanish[0].evidence["step"] == 13.0
    # nine vanishing steps, one normal, nine again: never ten in a row
    assert _run([(2.0, 1e-8)] * 9 + [(2.0, 1.0)] + [(2.0, 1e-8)] * 9) == []
    boom = _run([(2.0, 1.0)] * 2 + [(2.0, 1e6)] * 5 + [(2.0, math.inf)] * 5)
    assert [a.evidence["rule"] for a in boom] == [GRAD_EXPLODING]
    assert boom[0].evidence["grad_norm"] == "inf" and boom[0].evidence["step"] == 12.0
    # one overflowed step under AMP is normal
    assert _run([(2.0, 1.0), (2.0, math.inf), (2.0, 1.0)] * 6) == []


@pytest.mark.unit
def test_the_condition_holds_while_the_rule_does_and_the_rule_rearms() -> None:
    d = NumericsDetector(CFG)
    d.observe("job:1", Point(1.0, step=1.0, loss=math.nan))
    assert [c.kind for c in d.conditions(1.0)] == [NUMERICS]
    assert d.observe("job:1", Point(2.0, step=1.0, loss=math.nan)) == ()  # same step: judged
    d.observe("job:1", Point(3.0, step=2.0, loss=1.0))
    assert d.conditions(3.0) == []
    assert len(d.observe("job:1", Point(4.0, step=3.0, loss=math.inf))) == 1


@pytest.mark.unit
def test_numerics_is_a_stop_kind_and_its_settings_are_declared() -> None:
    assert NUMERICS in ALERT_KINDS
    assert NUMERICS in ActionsConfig.from_env({"OTEL_GPU_STOP_KINDS": "numerics"}).stop_kinds
    cfg = DetectConfig.from_env({"OTEL_GPU_DETECT_NUMERICS_STEPS": "3"})
    assert [a.evidence["rule"] for a in _run([(2.0, 1e-9)] * 3, cfg)] == [GRAD_VANISHING]
    assert _run([(math.nan, None)], CFG.replace(numerics_enabled=False)) == []


# --- a real HF Trainer --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instrumented():
    instrumentor = TransformersInstrumentor()
    instrumentor.instrument(
        tracer_provider=TracerProvider(),
        settings=TracingSettings(stop_enabled=True, stop_sync_steps=1),
        skip_dep_check=True,
    )
    yield
    instrumentor.uninstrument()


def _planted(scale: float, from_step: int):
    """A Trainer whose loss is multiplied by ``scale`` from global step ``from_step`` on."""
    from transformers import Trainer

    class Planted(Trainer):
        def compute_loss(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(*args, **kwargs)
            if self.state.global_step >= from_step:
                return loss * scale
            return loss

    return Planted


def _train_watched(tmp_path, scale: float, from_step: int, actions: ActionsConfig, steps: int):
    """Train while a sweep thread runs the in-process watchdog (as the node agent's sampler
    thread does); returns (train result, alerts, watchdog)."""
    progress._step_numbers.clear()  # the ring is the process's: start from this run's steps
    trainer_side = InProcessTrainer(
        progress.current_phase, progress.current_step, control.request_stop, progress.numbers_since
    )
    dog = Watchdog.build(DetectionSettings(actions=actions), trainer=trainer_side)
    alerts: list[Alert] = []
    dog.alert_listeners.append(alerts.append)
    stop = threading.Event()

    def sweeps() -> None:
        while not stop.is_set():
            dog.on_snapshot(Snapshot(time=time.time()))
            time.sleep(0.02)

    sweeper = threading.Thread(target=sweeps, daemon=True)
    trainer = _planted(scale, from_step)(
        model=tiny_llama(),
        args=training_args(
            tmp_path / "out",
            max_steps=steps,
            eval_strategy="no",
            save_steps=1000,
            logging_nan_inf_filter=False,  # HF's default replaces a NaN loss in its logs
        ),
        train_dataset=TokenDataset(n=128),
    )
    sweeper.start()
    try:
        result = trainer.train()
        time.sleep(0.1)
    finally:
        stop.set()
        sweeper.join(5)
        dog.close(5)
    return result, alerts, dog


@pytest.mark.peers  # a real training run, seconds on a shared CPU
def test_a_planted_nan_in_a_real_trainer_alerts_and_checkpoints_and_stops(
    tmp_path, instrumented
) -> None:
    actions = ActionsConfig(stop_on_alert=True, stop_kinds=frozenset({NUMERICS}))
    result, alerts, dog = _train_watched(tmp_path, math.nan, 4, actions, steps=40)
    numerics = [a for a in alerts if a.kind == NUMERICS]
    assert numerics, [a.message for a in alerts]
    first = numerics[0]
    assert first.evidence["rule"] == LOSS_NAN and first.severity == "critical"
    assert first.evidence["step"] == 5.0 and first.evidence["loss"] == "nan"
    assert dog.breaker.state(first.subject) == OPEN
    # the opt-in stop: the trainer saved a checkpoint and left the loop early
    assert result.global_step < 40
    saved = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert saved == [f"checkpoint-{result.global_step}"]


@pytest.mark.peers
def test_a_planted_vanishing_gradient_in_a_real_trainer_warns_after_k_steps(
    tmp_path, instrumented
) -> None:
    result, alerts, _dog = _train_watched(tmp_path, 1e-9, 0, ActionsConfig(), steps=14)
    assert result.global_step == 14  # nothing stops without the opt-in
    (alert,) = [a for a in alerts if a.kind == NUMERICS]
    assert alert.evidence["rule"] == GRAD_VANISHING and alert.severity == "warning"
    assert alert.evidence["step"] == float(CFG.numerics_steps)
    assert isinstance(alert.evidence["grad_norm"], float) and alert.evidence["grad_norm"] < 1e-6
    assert "vanishing gradients" in alert.message
