"""Training numerics: the trainer's loss and gradient norm going wrong. Pure, causal.

Judged once per training step that carries a loss or a gradient norm (``Point.loss``,
``Point.grad_norm`` at ``Point.step``; a point repeating the step already judged is skipped):

* **loss not finite** — NaN or infinite: critical at the first such step;
* **loss exploding** — above ``numerics_loss_factor`` × the median of the last
  ``numerics_window`` finite losses (and above it by more than 1e-3) for
  ``numerics_loss_steps`` steps in a row: critical;
* **gradient norm exploding** — above ``numerics_grad_explode``, or not finite, for
  ``numerics_steps`` steps in a row (one overflowed step under AMP is normal): critical;
* **gradient norm vanishing** — below ``numerics_grad_vanish`` for ``numerics_steps`` steps in a
  row: warning (the seeds: "below 1e-6 for 10 consecutive steps → lower the learning rate and
  notify").

Each is one alert per episode carrying the step and the values, and a condition that holds
while the rule does (so the breaker stays open); the rule re-arms once it stopped holding.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from statistics import median
from typing import ClassVar

from otel_gpu.detect.detector import NO_ALERTS, Condition
from otel_gpu.detect.model import NUMERICS, Alert, Point
from otel_gpu.detect.settings import DetectConfig

LOSS_NAN = "loss_not_finite"
LOSS_EXPLODING = "loss_exploding"
GRAD_EXPLODING = "grad_norm_exploding"
GRAD_VANISHING = "grad_norm_vanishing"
RULES = (LOSS_NAN, LOSS_EXPLODING, GRAD_EXPLODING, GRAD_VANISHING)
_MIN_HISTORY = 5  # finite losses needed before "exploding" can be judged
_LOSS_STEPS = 3  # consecutive exploding losses (fixed: one spike of a bad batch is normal)


def _shown(x: float | None) -> float | str:
    """A value for evidence: JSON has no NaN or infinity, so those are words."""
    if x is None:
        return "none"
    return x if math.isfinite(x) else str(x)


class NumericsDetector:
    """One subject's loss and gradient-norm rules (a detector.Detector)."""

    KINDS: ClassVar[tuple[str, ...]] = (NUMERICS,)
    __slots__ = ("cfg", "losses", "last_step", "runs", "active", "since")

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.numerics_window)
        self.last_step: float | None = None
        self.runs = dict.fromkeys(RULES, 0)  # consecutive steps each rule held
        self.active: set[str] = set()  # rules alerted and still holding
        self.since = dict.fromkeys(RULES, 0.0)

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        return cfg.numerics_enabled

    def conditions(self, now: float) -> Sequence[Condition]:
        return [Condition(NUMERICS, self.since[r]) for r in RULES if r in self.active]

    def observe(self, subject: str, p: Point) -> Sequence[Alert]:
        loss, grad = p.loss, p.grad_norm
        if loss is None and grad is None:
            return NO_ALERTS
        if p.step is not None:
            if p.step == self.last_step:
                return NO_ALERTS  # this step was judged already
            self.last_step = p.step
        cfg = self.cfg
        held: dict[str, bool] = dict.fromkeys(RULES, False)
        base = median(self.losses) if len(self.losses) >= _MIN_HISTORY else None
        if loss is not None:
            if not math.isfinite(loss):
                held[LOSS_NAN] = True
            else:
                held[LOSS_EXPLODING] = (
                    base is not None
                    and loss > cfg.numerics_loss_factor * abs(base)
                    and loss - base > 1e-3
                )
                self.losses.append(loss)
        if grad is not None:
            held[GRAD_EXPLODING] = not math.isfinite(grad) or grad > cfg.numerics_grad_explode
            held[GRAD_VANISHING] = math.isfinite(grad) and grad < cfg.numerics_grad_vanish
        need = {
            LOSS_NAN: 1,
            LOSS_EXPLODING: _LOSS_STEPS,
            GRAD_EXPLODING: cfg.numerics_steps,
            GRAD_VANISHING: cfg.numerics_steps,
        }
        out: list[Alert] = []
        for rule in RULES:
            judged = (loss is not None) if rule in (LOSS_NAN, LOSS_EXPLODING) else grad is not None
            if not judged:
                continue
            if not held[rule]:
                self.runs[rule] = 0
                self.active.discard(rule)
                continue
            self.runs[rule] += 1
            if rule not in self.active and self.runs[rule] >= need[rule]:
                self.active.add(rule)
                self.since[rule] = p.time
                out.append(self._alert(subject, p, rule, base))
        return out or NO_ALERTS

    def _alert(self, subject: str, p: Point, rule: str, base: float | None) -> Alert:
        cfg = self.cfg
        step = "" if p.step is None else f" at step {p.step:g}"
        loss, grad = p.loss, p.grad_norm
        k = self.runs[rule]
        if rule == LOSS_NAN:
            severity = "critical"
            message = f"loss is {loss}{step}: training diverged; stop and resume from a checkpoint"
        elif rule == LOSS_EXPLODING:
            severity = "critical"
            value, median_ = loss or 0.0, base or 0.0
            ratio = f"{value / median_:.0f}x " if median_ else "above "
            message = (
                f"loss {value:g}{step} is {ratio}its recent median {median_:g} for {k} steps: "
                "training is diverging"
            )
        elif rule == GRAD_EXPLODING:
            severity = "critical"
            message = (
                f"gradient norm {grad:g}{step} above {cfg.numerics_grad_explode:g} (or not "
                f"finite) for {k} consecutive steps: exploding gradients; lower the learning "
                "rate or clip gradients"
            )
        else:
            severity = "warning"
            message = (
                f"gradient norm {grad:g}{step} below {cfg.numerics_grad_vanish:g} for {k} "
                "consecutive steps: vanishing gradients, the model has stopped learning; lower "
                "the learning rate or check the data"
            )
        evidence: dict[str, float | str] = {
            "rule": rule,
            "step": _shown(p.step),
            "loss": _shown(loss),
            "grad_norm": _shown(grad),
            "steps": float(k),
        }
        if base is not None:
            evidence["loss_median"] = base
        return Alert(
            kind=NUMERICS,
            subject=subject,
            time=p.time,
            severity=severity,
            message=message,
            evidence=evidence,
        )
