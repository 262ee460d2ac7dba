"""Action settings: argument > ``OTEL_GPU_*`` environment > config file > default.

Validated once, at start. Errors name the setting and the accepted values but never echo a
webhook URL, secret or header value (they are credentials).

The config file (``OTEL_GPU_ACTIONS_CONFIG``, ``.json`` or ``.toml``) uses the setting names
(the variable names without ``OTEL_GPU_`` / ``OTEL_GPU_ACTIONS_``, in lower case), e.g. ``{"slack_webhook_url": "...",
"notify_on": ["open", "closed"], "webhook_headers": {"Authorization": "Bearer ..."}}``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.actions.notifiers import VENDORS, WebhookNotifier
from otel_gpu.actions.options import Parser
from otel_gpu.actions.stop import parse_signal
from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import Setting, boolean, number, read_settings_file, resolve
from otel_gpu.detect.engine import ALERT_KINDS
from otel_gpu.detect.model import LEAK, STALL

# Which breaker transitions notify. "open" = a new episode (CLOSED -> OPEN); "reopen" = an alert
# during probation (HALF_OPEN -> OPEN, same episode); "half_open" = probing; "closed" = resolved.
NOTIFY_CHOICES = ("open", "reopen", "half_open", "closed")
KINDS = ALERT_KINDS  # what the registered detectors raise (detect/engine.py)
MAX_ATTEMPTS = 100  # the most tries per notification OTEL_GPU_ACTIONS_MAX_ATTEMPTS accepts
_PREFIX = "OTEL_GPU_"
_CONFIG = "OTEL_GPU_ACTIONS_CONFIG"  # the settings file (read before the settings it holds)
_DELIVERY = (
    "queue_size",
    "max_attempts",
    "timeout_s",
    "backoff_s",
    "backoff_max_s",
    "retry_after_max_s",
)


@dataclass(frozen=True)
class ActionsConfig:
    """Where notifications go, how they are sent, and whether alerts stop the job."""

    # Vendor settings that were set (setting name -> value, e.g. "slack_webhook_url"); they are
    # declared by the notifier classes in VENDORS.
    webhooks: Mapping[str, Any] = field(default_factory=dict, repr=False)
    notify_on: frozenset[str] = frozenset({"open", "closed"})
    queue_size: int = 256  # waiting notifications per destination; the oldest is dropped
    max_attempts: int = 5  # per notification, first try included
    timeout_s: float = 5.0  # per HTTP request
    backoff_s: float = 1.0  # first retry delay; doubles each retry
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 60.0  # cap on a server's Retry-After
    span_events: bool = True
    stop_on_alert: bool = False  # opt-in: stop the watched job when its breaker opens
    stop_kinds: frozenset[str] = frozenset({LEAK, STALL})
    stop_signal: str = "SIGUSR1"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ActionsConfig:
        """Read ``overrides`` > environment > ``OTEL_GPU_ACTIONS_CONFIG`` file > defaults."""
        env = os.environ if environ is None else environ
        path = env.get(_CONFIG, "").strip()
        file = read_settings_file(path, _CONFIG, "action settings") if path else None
        for key in file or {}:
            if key not in _FIELDS:
                raise UsageError(
                    f"{_CONFIG} file {path}: unknown setting {key!r}; "
                    f"accepted: {', '.join(sorted(_FIELDS))}"
                )
        for name in overrides:
            if name not in _FIELDS:
                raise TypeError(f"unknown action setting {name!r}")
        values, origin = resolve(DECLARED, env=env, args=overrides, file=file, file_name=path)
        webhooks = {name: values.pop(name) for name in _VENDOR_PARSERS if name in values}
        _check_urls(webhooks, origin)
        return cls(webhooks=webhooks, **values)

    def notifiers(self) -> list[WebhookNotifier]:
        """One notifier per configured destination, in the order of VENDORS."""
        built = (vendor.from_settings(self.webhooks) for vendor in VENDORS)
        return [n for n in built if n is not None]

    def describe(self) -> list[str]:
        """Safe one-line descriptions of the destinations (for `doctor` and start-up logs)."""
        return [f"{n.name} {n.redacted}" for n in self.notifiers()]


def env_name(setting: str) -> str:
    """The environment variable for a setting: delivery tuning sits under OTEL_GPU_ACTIONS_."""
    if setting in _DELIVERY:
        return f"{_PREFIX}ACTIONS_{setting.upper()}"
    return _PREFIX + setting.upper()


def _check_urls(webhooks: Mapping[str, Any], origin: Mapping[str, str]) -> None:
    """A vendor's credential (a signing secret, headers) without its URL is a mistake: it was
    meant for a destination that is not configured. Other options may stand alone."""
    for vendor in VENDORS:
        (url, _), *options = vendor.settings().items()
        for name, option in options:
            if option.secret and webhooks.get(name) and not webhooks.get(url):
                raise UsageError(f"{origin[name]} is set but {env_name(url)} is not: set both")


def _choices(allowed: tuple[str, ...], allow_none: bool) -> Parser:
    def parse(where: str, value: Any) -> frozenset[str]:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise UsageError(f"{where} must be a comma-separated list of {', '.join(allowed)}")
        got = {str(x).strip().lower() for x in items if str(x).strip()}
        if allow_none and got == {"none"}:
            return frozenset()
        bad = got - set(allowed)
        if bad or not got:
            accepted = ", ".join(allowed) + (" (or none)" if allow_none else "")
            raise UsageError(f"{where}={','.join(sorted(got))!r} is invalid: use any of {accepted}")
        return frozenset(got)

    return parse


def _bool(where: str, value: Any) -> bool:
    return boolean(value, where)


def _number(minimum: float, integer: bool = False, maximum: float = math.inf) -> Parser:
    kind = "an integer" if integer else "a number"
    accepted = (
        f"use {kind} >= {minimum:g}"
        if math.isinf(maximum)
        else f"use {kind} from {minimum:g} to {maximum:g}"
    )
    parse = number(minimum, maximum, integer=integer, accepted=accepted)
    return lambda where, value: parse(value, where)


def _signal_name(where: str, value: Any) -> str:
    try:
        return parse_signal(str(value)).name
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


_VENDOR_PARSERS: dict[str, Parser] = {
    name: option.parse for vendor in VENDORS for name, option in vendor.settings().items()
}
_PARSERS: dict[str, Parser] = {
    **_VENDOR_PARSERS,
    "notify_on": _choices(NOTIFY_CHOICES, allow_none=True),
    "queue_size": _number(1, integer=True),
    # Bounded: with a backoff capped at backoff_max_s, more tries only hold the queue.
    "max_attempts": _number(1, integer=True, maximum=MAX_ATTEMPTS),
    "timeout_s": _number(0.001),
    "backoff_s": _number(0.0),
    "backoff_max_s": _number(0.0),
    "retry_after_max_s": _number(0.0),
    "span_events": _bool,
    "stop_on_alert": _bool,
    "stop_kinds": _choices(KINDS, allow_none=False),
    "stop_signal": _signal_name,
}
_FIELDS = tuple(_PARSERS)
_DOC = 'see docs/detection.md "Breaker and action settings"'


# The declarations the resolver reads (the parsers here take the source first); each is
# documented in docs/detection.md "Breaker and action settings".
def _declare(name: str, parse: Parser) -> Setting:
    return Setting(name, env_name(name), lambda value, where: parse(where, value), _DOC)


DECLARED = tuple(_declare(name, parse) for name, parse in _PARSERS.items())
