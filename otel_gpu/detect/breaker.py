"""Circuit breaker per subject: the moments actions fire.

CLOSED --(alerts_to_open alerts within window_s)--> OPEN
OPEN --(cooldown_s over, and every condition that opened it cleared)--> HALF_OPEN
HALF_OPEN --(probation_s without an alert or an active condition)--> CLOSED ("resolved")
HALF_OPEN --(any alert, or a condition that opened it active again)--> OPEN

Conditions come from the detection engine (``Engine.active_kinds``): the alert kinds whose
problem still holds for a subject. The breaker remembers the kinds that opened it in this
episode and never leaves OPEN, let alone closes, while one of them is active; probation starts
once they cleared (a leak's floor stopped rising, a stalled job works again). Callers that do
not pass conditions get the plain time-driven breaker.

Pure and driven by the data's own time: every method takes the time from its arguments (an
alert's ``time`` or ``now``), never from a clock, so replayed and live data give the same
transitions. An *episode* is one CLOSED -> OPEN ... -> CLOSED cycle; a re-open from HALF_OPEN
stays in the same episode, so actions keyed on the episode notify once per persistent problem.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from otel_gpu.core.settings import Setting, number, resolve
from otel_gpu.detect.model import BREAKER, NO_BREAKER, Alert, alert_from_dict

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)

# Value of the otel_gpu.breaker.state gauge for each state (higher is worse).
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}

_STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Breaker settings; times are seconds of data time."""

    alerts_to_open: int = 1  # alerts within window_s that open the breaker
    window_s: float = 300.0  # window over which alerts are counted while CLOSED
    cooldown_s: float = 600.0  # time OPEN before probing (HALF_OPEN)
    probation_s: float = 300.0  # alert-free time HALF_OPEN needs to close

    def __post_init__(self) -> None:
        for s in DECLARED:  # the same bounds as the variables'
            s.parse(getattr(self, s.name), f"breaker {s.name}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> BreakerConfig:
        """Explicit ``overrides`` > ``OTEL_GPU_BREAKER_*`` (:data:`DECLARED`) > defaults; a bad
        value raises UsageError naming the variable and the accepted values."""
        env = os.environ if environ is None else environ
        values, _origin = resolve(DECLARED, env=env, args=overrides)
        return cls(**values)


_SECONDS = "use a number of seconds >= 0"
DECLARED = (
    Setting(
        "alerts_to_open", "OTEL_GPU_BREAKER_ALERTS_TO_OPEN",
        number(1, integer=True, accepted="use an integer >= 1"),
        "alerts within the window that open a subject's breaker", "1",
    ),
    Setting(
        "window_s", "OTEL_GPU_BREAKER_WINDOW_S",
        number(0, low_open=True, accepted="use a number of seconds > 0"),
        "window (s of data time) for counting those alerts", "300",
    ),
    Setting(
        "cooldown_s", "OTEL_GPU_BREAKER_COOLDOWN_S", number(0, accepted=_SECONDS),
        "least time OPEN before probing (HALF_OPEN); probing also waits for the condition to "
        "clear", "600",
    ),
    Setting(
        "probation_s", "OTEL_GPU_BREAKER_PROBATION_S", number(0, accepted=_SECONDS),
        "time HALF_OPEN needs without an alert or an active condition to close", "300",
    ),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Transition:
    """One state change of one subject's breaker, at data time ``time``."""

    subject: str
    from_state: str
    to_state: str
    time: float
    reason: str  # one human sentence
    alert: Alert | None  # the alert that caused it; None for time-driven transitions
    episode: int  # 1 for the subject's first CLOSED -> OPEN, +1 for each later one

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the alert as a nested dict, or None)."""
        return {
            "subject": self.subject,
            "from_state": self.from_state,
            "to_state": self.to_state,
            "time": self.time,
            "reason": self.reason,
            "episode": self.episode,
            "alert": None if self.alert is None else asdict(self.alert),
        }


@dataclass(slots=True)
class _Subject:
    state: str = CLOSED
    since: float = -math.inf  # data time the current state was entered
    last_time: float = -math.inf  # latest data time seen for this subject
    episode: int = 0
    alert_times: deque[float] = field(default_factory=deque)  # recent alerts while CLOSED
    last_alert: Alert | None = None
    held: set[str] = field(default_factory=set)  # alert kinds that opened this episode
    # Data time from which no held condition was active; None while one is. Presumed clear
    # from the opening alert until conditions are reported (a hardware error is an event).
    clear_since: float | None = None


# The conditions of a subject: subject -> alert kinds active now.
ActiveKinds = Callable[[str], Collection[str]]


class Breaker:
    """Circuit breakers for many subjects, one state machine each. Not thread-safe."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._subjects: dict[str, _Subject] = {}

    def state(self, subject: str) -> str:
        """Current state of ``subject`` (CLOSED for a subject never seen)."""
        s = self._subjects.get(subject)
        return CLOSED if s is None else s.state

    def episode(self, subject: str) -> int:
        """Number of CLOSED -> OPEN transitions ``subject`` has had."""
        s = self._subjects.get(subject)
        return 0 if s is None else s.episode

    def subjects(self) -> list[str]:
        """Every subject the breaker holds state for."""
        return list(self._subjects)

    def record_alert(self, alert: Alert) -> list[Transition]:
        """Feed one alert; returns the transitions it causes, oldest first.

        Time first advances to ``alert.time`` (an OPEN breaker whose cool-down ended is probed
        before the alert lands, so the alert re-opens it). An alert older than the subject's
        latest time is judged at that latest time: data time never runs backwards.
        """
        if not math.isfinite(alert.time):
            return []  # no place in time: cannot be judged
        if alert.evidence.get(BREAKER) == NO_BREAKER:
            return []  # an annotation (an application's Xid): the subject is not at fault
        s = self._subjects.setdefault(alert.subject, _Subject())
        out = self._advance(alert.subject, s, alert.time)
        t = max(alert.time, s.last_time)
        s.last_time = t
        s.last_alert = alert
        cfg = self.config
        if s.state == CLOSED:
            s.alert_times.append(t)
            _prune(s.alert_times, t - cfg.window_s)
            if len(s.alert_times) >= cfg.alerts_to_open:
                s.episode += 1
                count = len(s.alert_times)
                s.alert_times.clear()
                window = f" within {_fmt_s(cfg.window_s)}" if cfg.alerts_to_open > 1 else ""
                reason = (
                    f"{alert.subject}: opened on {count} {alert.kind} alert"
                    f"{'s' if count != 1 else ''}{window}: {alert.message}"
                )
                s.held = {alert.kind}
                s.clear_since = t
                out.append(self._move(alert.subject, s, OPEN, t, reason, alert))
        elif s.state == HALF_OPEN:
            reason = (
                f"{alert.subject}: re-opened, {alert.kind} alert during probation: {alert.message}"
            )
            s.held.add(alert.kind)
            s.clear_since = t
            out.append(self._move(alert.subject, s, OPEN, t, reason, alert))
        else:
            # While OPEN an alert notifies nobody (the episode is already being acted on), but
            # its condition now holds the breaker open too.
            s.held.add(alert.kind)
        return out

    def forget(self, subject: str) -> None:
        """Drop a subject's state (e.g. its process is gone); it starts CLOSED if seen again."""
        self._subjects.pop(subject, None)

    def advance(
        self, subject: str, now: float, active: ActiveKinds | None = None
    ) -> list[Transition]:
        """Let data time pass to ``now`` for one subject; returns the transitions that brings.

        ``active(subject)`` names the alert kinds whose condition holds at ``now`` (it is only
        asked while the breaker is not CLOSED); without it the breaker is driven by time alone.
        """
        s = self._subjects.get(subject)
        if s is None:
            return []
        return self._advance(subject, s, now, active)

    def advance_all(self, now: float, active: ActiveKinds | None = None) -> list[Transition]:
        """Let data time pass to ``now`` for every subject (``active`` as in :meth:`advance`)."""
        out: list[Transition] = []
        for subject, s in self._subjects.items():
            out.extend(self._advance(subject, s, now, active))
        return out

    def _advance(
        self, subject: str, s: _Subject, now: float, active: ActiveKinds | None = None
    ) -> list[Transition]:
        if not now >= s.last_time:  # also rejects NaN
            return []
        s.last_time = now
        cfg = self.config
        out: list[Transition] = []
        holding: Collection[str] = ()
        if s.state != CLOSED and active is not None:
            holding = s.held.intersection(active(subject))
            if holding:
                s.clear_since = None
            elif s.clear_since is None:
                s.clear_since = now
        # Transitions carry the time they became due, not `now`, so a late tick reports the
        # same times as a punctual one.
        if s.state == OPEN and s.clear_since is not None:
            at = max(s.since + cfg.cooldown_s, s.clear_since)
            if now >= at:
                what = _kinds(s.held)
                reason = (
                    f"{subject}: {what} cleared and cool-down of {_fmt_s(cfg.cooldown_s)} over, "
                    f"probing for {_fmt_s(cfg.probation_s)}"
                )
                out.append(self._move(subject, s, HALF_OPEN, at, reason, None))
        if s.state == HALF_OPEN and holding:
            reason = f"{subject}: re-opened, {_kinds(holding)} active again during probation"
            s.clear_since = None
            out.append(self._move(subject, s, OPEN, now, reason, None))
        elif s.state == HALF_OPEN and now >= s.since + cfg.probation_s:
            at = s.since + cfg.probation_s
            reason = (
                f"{subject}: resolved, no alert and no active {_kinds(s.held)} for "
                f"{_fmt_s(cfg.probation_s)} of probation"
            )
            s.held = set()
            out.append(self._move(subject, s, CLOSED, at, reason, None))
        if s.state == CLOSED:
            _prune(s.alert_times, now - cfg.window_s)
        return out

    @staticmethod
    def _move(
        subject: str, s: _Subject, to: str, at: float, reason: str, alert: Alert | None
    ) -> Transition:
        t = Transition(subject, s.state, to, at, reason, alert, s.episode)
        s.state = to
        s.since = at
        return t

    def export_state(self) -> dict[str, Any]:
        """JSON-serializable snapshot for persistence across restarts."""
        subjects = {}
        for name, s in self._subjects.items():
            subjects[name] = {
                "state": s.state,
                "since": _num_out(s.since),
                "last_time": _num_out(s.last_time),
                "episode": s.episode,
                "alert_times": list(s.alert_times),
                "last_alert": None if s.last_alert is None else asdict(s.last_alert),
                "held": sorted(s.held),
                "clear_since": s.clear_since,
            }
        return {"version": _STATE_VERSION, "subjects": subjects}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], config: BreakerConfig | None = None) -> Breaker:
        """Rebuild a breaker from :meth:`export_state` output; ValueError if it is malformed."""
        b = cls(config)
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"unsupported version {state.get('version')!r}")
            for name, d in state["subjects"].items():
                if d["state"] not in STATES:
                    raise ValueError(f"unknown state {d['state']!r}")
                alert = d.get("last_alert")
                b._subjects[str(name)] = _Subject(
                    state=d["state"],
                    since=_num_in(d["since"]),
                    last_time=_num_in(d["last_time"]),
                    episode=int(d["episode"]),
                    alert_times=deque(float(x) for x in d["alert_times"]),
                    last_alert=None if alert is None else alert_from_dict(alert),
                    held={str(k) for k in d.get("held", ())},
                    clear_since=_clear_since_in(d),
                )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"invalid breaker state: {e}") from None
        return b


def _prune(times: deque[float], oldest: float) -> None:
    while times and times[0] <= oldest:
        times.popleft()


def _num_out(x: float) -> float | None:
    # JSON has no infinities; None stands for "never".
    return x if math.isfinite(x) else None


def _num_in(x: Any) -> float:
    return -math.inf if x is None else float(x)


def _clear_since_in(d: Mapping[str, Any]) -> float | None:
    if "clear_since" not in d:
        return _num_in(d["since"])  # written before conditions existed: presumed clear
    raw = d["clear_since"]
    return None if raw is None else float(raw)


def _kinds(kinds: Collection[str]) -> str:
    names = sorted(kinds)
    if not names:
        return "condition"
    return " and ".join(names) + (" conditions" if len(names) > 1 else " condition")


def _fmt_s(seconds: float) -> str:
    if seconds >= 3600 and seconds % 360 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 6 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"
