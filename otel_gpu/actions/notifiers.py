"""Webhook payloads and signing for Slack, DingTalk, Feishu/Lark, WeCom and generic JSON.

Each notifier turns a breaker Transition into one HTTP POST (built fresh for every attempt, so a
signature's timestamp is current) and judges the vendor's reply. No I/O here: the dispatcher
sends. A vendor is one ``WebhookNotifier`` subclass (its name, options, payload and reply
judgement) plus its row in ``VENDORS``: the settings (``<name>_webhook_url`` and one per option),
their validation and the redaction of its credentials all derive from the class.
Vendor formats (checked 2026-11):

- Slack incoming webhook: ``{"text": ...}``; errors are non-2xx with a plain-text reason.
  https://api.slack.com/messaging/webhooks
- DingTalk custom robot: ``{"msgtype": "text", "text": {"content": ...}}``; with signing,
  ``sign = urlencode(base64(HmacSHA256(key=secret, msg=f"{timestamp_ms}\\n{secret}")))`` appended
  as ``&timestamp=..&sign=..``; replies 200 with ``{"errcode": 0}``.
  https://open.dingtalk.com/document/group/custom-robot-access (and its security settings page)
- Feishu/Lark custom bot: ``{"msg_type": "text", "content": {"text": ...}}``; with signing,
  ``sign = base64(HmacSHA256(key=f"{timestamp_s}\\n{secret}", msg=b""))`` and ``"timestamp"``,
  ``"sign"`` fields in the body; replies ``{"code": 0}`` (older: ``{"StatusCode": 0}``).
  https://open.feishu.cn/document/client-docs/bot-v3/add-custom-bot
- WeCom group robot: ``{"msgtype": "text", "text": {"content": ...}}`` or ``"markdown"``;
  replies ``{"errcode": 0}``; 20 messages/min per robot.
  https://developer.work.weixin.qq.com/document/path/91770
"""

from __future__ import annotations

import abc
import base64
import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import quote_plus

from otel_gpu.actions.options import Option, http_headers, one_of, signing_secret, webhook_url
from otel_gpu.actions.redact import redact_url, secret_fragments
from otel_gpu.core.printable import printable
from otel_gpu.core.redact import redact_text, redact_value
from otel_gpu.detect.breaker import CLOSED, HALF_OPEN, OPEN, Transition

# Vendor error codes in a 200 reply that mean "rate limited": worth retrying later.
_DINGTALK_RETRY = frozenset({130101})  # "send too fast" (20 messages/min per robot)
_WECOM_RETRY = frozenset({45009})  # "api freq out of limit"
_FEISHU_RETRY = frozenset({9499, 11232})  # "too many requests", frequency limited


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One POST to send. ``url`` and ``headers`` may hold secrets: never log them."""

    url: str
    body: bytes
    headers: dict[str, str]


@dataclass(frozen=True, slots=True)
class Reply:
    """How a vendor judged a delivery: ok, or an error and whether retrying may help."""

    ok: bool
    retry: bool = False
    error: str = ""  # safe to log (never contains the URL or secret)


OK = Reply(True)


def format_text(t: Transition, source: str = "") -> tuple[str, str]:
    """(title, body) in plain text for chat messages, credentials masked (otel_gpu.core.redact)."""
    a = t.alert
    where = f" [{source}]" if source else ""
    if t.to_state == OPEN:
        kind = a.kind if a else "alert"
        sev = f" ({a.severity})" if a else ""
        title = f"otel-gpu ALERT{where}: {kind}{sev} on {t.subject}"
    elif t.to_state == CLOSED:
        title = f"otel-gpu RESOLVED{where}: {t.subject}"
    elif t.to_state == HALF_OPEN:
        title = f"otel-gpu PROBING{where}: {t.subject}"
    else:
        title = f"otel-gpu {t.to_state}{where}: {t.subject}"
    lines = [a.message if (a and t.to_state == OPEN) else t.reason]
    if a is not None and t.to_state == OPEN:
        facts = []
        if a.rate_bytes_per_s is not None and math.isfinite(a.rate_bytes_per_s):
            facts.append(f"rate {a.rate_bytes_per_s * 3600 / 1e6:.0f} MB/h")
        if a.eta_s is not None and math.isfinite(a.eta_s):
            facts.append(f"full in {_fmt_duration(a.eta_s)}")
        if a.confidence is not None:
            facts.append(f"confidence {a.confidence:.2f}")
        if facts:
            lines.append(", ".join(facts))
        if a.diagnosis is not None:
            lines.extend(a.diagnosis.shown(3))
    lines.append(f"episode {t.episode}, {t.from_state} -> {t.to_state} at t={t.time:g} s")
    # Names and UUIDs come from the outside world: no escape sequence reaches a chat client.
    return printable(redact_text(title)), printable(redact_text("\n".join(lines)), multiline=True)


_URL = Option("webhook_url", webhook_url, secret=True, arg="url")


class WebhookNotifier(abc.ABC):
    """One webhook destination. The base of every vendor: its settings and the redaction of its
    credentials derive from the declared ``options``."""

    name: str = "webhook"  # "slack", "dingtalk", ... (safe to log); settings prefix "<name>_"
    prefix: ClassVar[str | None] = None  # settings prefix when it is not "<name>_"
    options: ClassVar[tuple[Option, ...]] = ()  # settings beside the URL

    def __init__(self, url: str, **values: object) -> None:
        """``values``: the options' keyword arguments; the secret ones are never shown."""
        self._url = url
        self.redacted = redact_url(url)  # scheme://host/… (safe to log)
        secret = {o.keyword for o in self.options if o.secret}
        shown: list[str] = []
        for key, value in values.items():
            if key in secret and value:
                shown.extend(map(str, value.values() if isinstance(value, Mapping) else [value]))
        # Substrings to scrub from any text that might echo the request.
        self.secrets = secret_fragments(url, shown)

    def __repr__(self) -> str:  # never the URL
        return f"{type(self).__name__}({self.redacted})"

    @classmethod
    def settings(cls) -> dict[str, Option]:
        """Setting name -> option: the webhook URL first, then the declared options."""
        prefix = f"{cls.name}_" if cls.prefix is None else cls.prefix
        return {prefix + o.name: o for o in (_URL, *cls.options)}

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> WebhookNotifier | None:
        """The notifier for resolved settings (name -> value); None when its URL is not set."""
        kwargs = {o.keyword: values[k] for k, o in cls.settings().items() if k in values}
        return cls(**kwargs) if kwargs.get("url") else None

    @abc.abstractmethod
    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        """The request for ``t``; ``wall_time_s`` (Unix seconds) feeds signatures."""

    def judge(self, status: int, body: bytes) -> Reply:
        """Judge a 2xx reply's body (non-2xx statuses are judged by the dispatcher); by default
        any 2xx is a delivery."""
        return OK


class SlackNotifier(WebhookNotifier):
    """Slack incoming webhook."""

    name = "slack"

    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        title, text = format_text(t, source)
        return _json_request(self._url, {"text": f"*{title}*\n{text}"})


class _SignedNotifier(WebhookNotifier):
    """A robot that signs each message when it is given a secret."""

    options = (Option("secret", signing_secret, secret=True),)

    def __init__(self, url: str, secret: str | None = None) -> None:
        super().__init__(url, secret=secret)
        self._secret = secret


class DingTalkNotifier(_SignedNotifier):
    """DingTalk custom robot, optionally signed ("加签")."""

    name = "dingtalk"

    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        title, text = format_text(t, source)
        url = self._url
        if self._secret:
            ts = str(int(wall_time_s * 1000))  # milliseconds
            sep = "&" if "?" in url else "?"
            url = f"{url}{sep}timestamp={ts}&sign={quote_plus(dingtalk_sign(ts, self._secret))}"
        return _json_request(url, {"msgtype": "text", "text": {"content": f"{title}\n{text}"}})

    def judge(self, status: int, body: bytes) -> Reply:
        return _judge_code(body, ("errcode",), _DINGTALK_RETRY)


class FeishuNotifier(_SignedNotifier):
    """Feishu / Lark custom bot, optionally signed."""

    name = "feishu"

    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        title, text = format_text(t, source)
        payload: dict[str, object] = {"msg_type": "text", "content": {"text": f"{title}\n{text}"}}
        if self._secret:
            ts = str(int(wall_time_s))  # seconds
            payload = {"timestamp": ts, "sign": feishu_sign(ts, self._secret), **payload}
        return _json_request(self._url, payload)

    def judge(self, status: int, body: bytes) -> Reply:
        return _judge_code(body, ("code", "StatusCode"), _FEISHU_RETRY)


class WeComNotifier(WebhookNotifier):
    """WeCom (WeChat Work) group robot; ``message_format="markdown"`` sends that message type."""

    name = "wecom"
    options = (Option("format", one_of("text", "markdown"), arg="message_format"),)

    def __init__(self, url: str, message_format: str = "text") -> None:
        super().__init__(url)
        self._markdown = message_format == "markdown"

    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        title, text = format_text(t, source)
        if self._markdown:
            body = {"msgtype": "markdown", "markdown": {"content": f"**{title}**\n{text}"}}
        else:
            body = {"msgtype": "text", "text": {"content": f"{title}\n{text}"}}
        return _json_request(self._url, body)

    def judge(self, status: int, body: bytes) -> Reply:
        return _judge_code(body, ("errcode",), _WECOM_RETRY)


class JsonNotifier(WebhookNotifier):
    """Generic JSON POST: the transition (with its alert) as JSON, plus optional headers."""

    name = "webhook"
    prefix = ""  # webhook_url, webhook_headers
    options = (Option("webhook_headers", http_headers, secret=True, arg="headers"),)

    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        hdrs = dict(headers or {})
        super().__init__(url, headers=hdrs)
        self._headers = hdrs

    def __repr__(self) -> str:
        return f"JsonNotifier({self.redacted}, headers={sorted(self._headers)})"

    def build(self, t: Transition, wall_time_s: float, source: str = "") -> HttpRequest:
        title, text = format_text(t, source)
        doc = {"title": title, "text": text, "source": source, "sent_at": wall_time_s}
        doc.update(redact_value(t.to_dict()))
        req = _json_request(self._url, doc)
        req.headers.update(self._headers)
        return req


# The vendors, in the order their notifications are sent. A new vendor: its class above and
# one row here.
VENDORS: tuple[type[WebhookNotifier], ...] = (
    SlackNotifier,
    DingTalkNotifier,
    FeishuNotifier,
    WeComNotifier,
    JsonNotifier,
)


def dingtalk_sign(timestamp_ms: str, secret: str) -> str:
    """DingTalk signature (base64, before URL encoding)."""
    msg = f"{timestamp_ms}\n{secret}".encode()
    return base64.b64encode(hmac.new(secret.encode(), msg, hashlib.sha256).digest()).decode()


def feishu_sign(timestamp_s: str, secret: str) -> str:
    """Feishu signature: the key is "timestamp\\nsecret", the message is empty."""
    key = f"{timestamp_s}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()


def _json_request(url: str, payload: object) -> HttpRequest:
    body = json.dumps(payload, ensure_ascii=False, allow_nan=False, default=_json_default)
    return HttpRequest(url, body.encode(), {"Content-Type": "application/json; charset=utf-8"})


def _json_default(x: object) -> object:
    return str(x)


def _judge_code(body: bytes, keys: tuple[str, ...], retry_codes: frozenset[int]) -> Reply:
    try:
        doc = json.loads(body.decode("utf-8", "replace") or "{}")
    except ValueError:
        return OK  # a 2xx with a non-JSON body: nothing more to learn
    if not isinstance(doc, dict):
        return OK
    for key in keys:
        code = doc.get(key)
        if isinstance(code, int) and not isinstance(code, bool):
            if code == 0:
                return OK
            msg = doc.get("errmsg", doc.get("msg", doc.get("StatusMessage", "")))
            return Reply(False, code in retry_codes, f"{key}={code} {str(msg)[:200]}".strip())
    return OK


def _fmt_duration(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"
