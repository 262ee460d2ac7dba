"""Webhook delivery against a real HTTP server on 127.0.0.1 that fails, rate-limits and stalls."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from otel_gpu.actions import ActionDispatcher, ActionsConfig
from otel_gpu.actions.http import retry_after_s
from otel_gpu.actions.notifiers import DingTalkNotifier, JsonNotifier, SlackNotifier
from otel_gpu.detect.breaker import Breaker, BreakerConfig, Transition
from otel_gpu.detect.model import LEAK, Alert

DING_SECRET = "SECdingSecret0123456789abcdef"
FEISHU_SECRET = "feishuSecretKEY987"
TOKEN = "tok3nABCDEF123456"
BEARER = "bearerVALUE-42-xyz"


@dataclass
class Seen:
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    at: float

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Server:
    """Replies per path from a plan: "ok", "500", "400", "429:<retry-after>", "stall:<s>",
    "json:<body>" (200 with that body), "echo500" (500 echoing the request line)."""

    port: int = 0
    plans: dict[str, deque[str]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    got: threading.Condition = field(default_factory=threading.Condition)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def plan(self, path: str, *steps: str) -> None:
        self.plans[path] = deque(steps)

    def wait_for(self, n: int, timeout: float = 5.0) -> list[Seen]:
        end = time.monotonic() + timeout
        with self.got:
            while len(self.seen) < n and time.monotonic() < end:
                self.got.wait(end - time.monotonic())
            return list(self.seen)

    def on(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]


def _handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            parts = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with server.got:
                server.seen.append(
                    Seen(
                        parts.path,
                        parse_qs(parts.query),
                        dict(self.headers),
                        body,
                        time.monotonic(),
                    )
                )
                server.got.notify_all()
                plan = server.plans.get(parts.path)
                step = plan.popleft() if plan and len(plan) > 1 else (plan[0] if plan else "ok")
            kind, _, arg = step.partition(":")
            if kind == "stall":
                server.release.wait(float(arg))
                kind = "ok"
            headers: dict[str, str] = {}
            if kind == "ok":
                status, reply = 200, b"ok"
            elif kind == "json":
                status, reply = 200, arg.encode()
            elif kind == "429":
                status, reply = 429, b"slow down"
                headers["Retry-After"] = arg
            elif kind == "echo500":
                status, reply = 500, f"failed handling {self.path}".encode()
            else:
                status, reply = int(kind), b"nope"
            try:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
            except OSError:
                pass  # the client gave up (stall test)

    return H


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    state = Server()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield state
    state.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def opened(subject: str = "gpu0", episode: int = 1, t: float = 100.0) -> Transition:
    a = Alert(
        LEAK,
        subject,
        t,
        "critical",
        f"GPU memory of {subject} grows 50 MB/h",
        rate_bytes_per_s=13_888.9,
        eta_s=7200.0,
        window_s=1800.0,
        confidence=0.97,
    )
    return Transition(subject, "closed", "open", t, f"{subject}: opened", a, episode)


def fast(notifiers: list, **kw: object) -> ActionDispatcher:
    opts: dict = {
        "timeout_s": 2.0,
        "backoff_s": 0.05,
        "backoff_max_s": 0.5,
        "jitter": 0.0,
        "span_events": False,
    }
    opts.update(kw)
    return ActionDispatcher(notifiers, **opts)


@pytest.mark.process
def test_every_vendor_payload_and_signature(server: Server) -> None:
    cfg = ActionsConfig.from_env(
        {
            "OTEL_GPU_SLACK_WEBHOOK_URL": server.url("/services/T000/B000/XXXX"),
            "OTEL_GPU_DINGTALK_WEBHOOK_URL": server.url(f"/robot/send?access_token={TOKEN}"),
            "OTEL_GPU_DINGTALK_SECRET": DING_SECRET,
            "OTEL_GPU_FEISHU_WEBHOOK_URL": server.url("/open-apis/bot/v2/hook/5e3d587e"),
            "OTEL_GPU_FEISHU_SECRET": FEISHU_SECRET,
            "OTEL_GPU_WECOM_WEBHOOK_URL": server.url(f"/cgi-bin/webhook/send?key={TOKEN}"),
            "OTEL_GPU_WECOM_FORMAT": "markdown",
            "OTEL_GPU_WEBHOOK_URL": server.url("/hook"),
            "OTEL_GPU_WEBHOOK_HEADERS": f"Authorization=Bearer%20{BEARER},X-Team=ml",
        }
    )
    server.plan("/robot/send", 'json:{"errcode":0,"errmsg":"ok"}')
    server.plan("/open-apis/bot/v2/hook/5e3d587e", 'json:{"code":0,"msg":"success"}')
    server.plan("/cgi-bin/webhook/send", 'json:{"errcode":0,"errmsg":"ok"}')
    d = ActionDispatcher.from_config(cfg, source="job-7")
    before = time.time()
    d.on_transition(opened())
    assert d.flush(5) and d.close(1)
    assert d.stats.delivered == 5 and d.stats.failed == 0

    (slack,) = server.on("/services/T000/B000/XXXX")
    text = slack.json()["text"]
    assert "ALERT [job-7]: leak (critical) on gpu0" in text and "full in 2.0 h" in text

    (ding,) = server.on("/robot/send")
    assert ding.query["access_token"] == [TOKEN]
    (ts,), (sign,) = ding.query["timestamp"], ding.query["sign"]
    assert before * 1000 - 1 <= int(ts) <= time.time() * 1000 + 1  # milliseconds
    expected = base64.b64encode(
        hmac.new(DING_SECRET.encode(), f"{ts}\n{DING_SECRET}".encode(), hashlib.sha256).digest()
    ).decode()
    assert sign == expected  # parse_qs already URL-decoded it
    assert ding.json()["msgtype"] == "text" and "gpu0" in ding.json()["text"]["content"]

    (fs,) = server.on("/open-apis/bot/v2/hook/5e3d587e")
    doc = fs.json()
    assert before - 1 <= int(doc["timestamp"]) <= time.time() + 1  # seconds
    key = f"{doc['timestamp']}\n{FEISHU_SECRET}".encode()
    assert doc["sign"] == base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
    assert doc["msg_type"] == "text" and "gpu0" in doc["content"]["text"]

    (wc,) = server.on("/cgi-bin/webhook/send")
    assert wc.query["key"] == [TOKEN]
    assert (
        wc.json()["msgtype"] == "markdown"
        and "**otel-gpu ALERT" in wc.json()["markdown"]["content"]
    )

    (gen,) = server.on("/hook")
    assert gen.headers["Authorization"] == f"Bearer {BEARER}" and gen.headers["X-Team"] == "ml"
    g = gen.json()
    assert (g["subject"], g["from_state"], g["to_state"], g["episode"]) == (
        "gpu0",
        "closed",
        "open",
        1,
    )
    assert g["alert"]["kind"] == LEAK and g["alert"]["eta_s"] == 7200.0 and g["source"] == "job-7"


@pytest.mark.process
def test_dingtalk_signature_appends_to_query(server: Server) -> None:
    d = fast([DingTalkNotifier(server.url("/robot/send"), DING_SECRET)])
    d.on_transition(opened())
    assert d.flush(5)
    (seen,) = server.on("/robot/send")
    assert set(seen.query) == {"timestamp", "sign"}


@pytest.mark.process
def test_default_notifies_open_and_resolved_once_per_episode(server: Server) -> None:
    d = fast([JsonNotifier(server.url("/hook"))])
    b = Breaker(BreakerConfig(cooldown_s=60, probation_s=60))
    alert = opened().alert
    assert alert is not None
    for t in (0, 30, 70, 100, 200, 300):  # open; still open; probe; re-open; probe; close
        for tr in (
            b.record_alert(Alert(LEAK, "gpu0", t, "critical", "m"))
            if t in (0, 30, 70, 100)
            else b.advance("gpu0", t)
        ):
            d.on_transition(tr)
    assert d.flush(5)
    got = [(s.json()["from_state"], s.json()["to_state"]) for s in server.on("/hook")]
    assert got == [("closed", "open"), ("half_open", "closed")]

    everything = fast(
        [JsonNotifier(server.url("/all"))], notify_on=("open", "reopen", "half_open", "closed")
    )
    nothing = fast([JsonNotifier(server.url("/none"))], notify_on=())
    b = Breaker(BreakerConfig(cooldown_s=60, probation_s=60))
    for tr in b.record_alert(Alert(LEAK, "gpu1", 0, "critical", "m")) + b.record_alert(
        Alert(LEAK, "gpu1", 70, "critical", "m")
    ):
        everything.on_transition(tr)
        nothing.on_transition(tr)
    assert everything.flush(5) and nothing.flush(5)
    assert [s.json()["to_state"] for s in server.on("/all")] == ["open", "half_open", "open"]
    assert server.on("/none") == []


@pytest.mark.process
def test_retries_5xx_with_exponential_backoff(server: Server) -> None:
    server.plan("/s", "500", "503", "ok")
    d = fast([SlackNotifier(server.url("/s"))], backoff_s=0.1)
    d.on_transition(opened())
    assert d.flush(5)
    seen = server.on("/s")
    assert len(seen) == 3
    gaps = [seen[1].at - seen[0].at, seen[2].at - seen[1].at]
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19  # 0.1 s, then doubled
    st = d.stats
    assert (st.delivered, st.retried, st.failed) == (1, 2, 0)


@pytest.mark.process
def test_gives_up_after_max_attempts_and_permanent_4xx_is_not_retried(server: Server) -> None:
    server.plan("/down", "500")
    server.plan("/bad", "400")
    d = fast(
        [SlackNotifier(server.url("/down")), SlackNotifier(server.url("/bad"))], max_attempts=3
    )
    d.on_transition(opened())
    assert d.flush(5)
    assert len(server.on("/down")) == 3 and len(server.on("/bad")) == 1
    assert (d.stats.failed, d.stats.delivered) == (2, 0)


@pytest.mark.process
def test_429_retry_after_is_honoured_within_a_cap(server: Server) -> None:
    server.plan("/limited", "429:1", "ok")
    server.plan("/capped", "429:3600", "ok")
    d = fast(
        [SlackNotifier(server.url("/limited")), SlackNotifier(server.url("/capped"))],
        backoff_s=0.01,
        retry_after_max_s=0.3,
    )
    d2 = fast([SlackNotifier(server.url("/limited2"))], backoff_s=0.01, retry_after_max_s=5)
    server.plan("/limited2", "429:1", "ok")
    d.on_transition(opened())
    d2.on_transition(opened())
    assert d.flush(5) and d2.flush(5)
    a, b = server.on("/limited2")
    assert 0.95 <= b.at - a.at < 2.0  # waited the server's 1 s, not the 0.01 s backoff
    a, b = server.on("/capped")
    assert 0.28 <= b.at - a.at < 1.5  # 3600 s asked, capped at 0.3 s


@pytest.mark.process
def test_vendor_error_codes_in_a_200_reply(server: Server) -> None:
    server.plan(
        "/rate",
        '{"errcode":130101,"errmsg":"send too fast"}'.join(["json:", ""]),
        'json:{"errcode":0}',
    )
    server.plan("/sign", 'json:{"errcode":310000,"errmsg":"sign not match"}')
    d = fast(
        [DingTalkNotifier(server.url("/rate")), DingTalkNotifier(server.url("/sign"), "s3cr3t")]
    )
    d.on_transition(opened())
    assert d.flush(5)
    assert len(server.on("/rate")) == 2 and len(server.on("/sign")) == 1
    assert (d.stats.delivered, d.stats.failed) == (1, 1)


@pytest.mark.process
def test_stalled_server_times_out_and_is_retried(server: Server) -> None:
    server.plan("/slow", "stall:10", "ok")
    d = fast([SlackNotifier(server.url("/slow"))], timeout_s=0.3)
    start = time.monotonic()
    d.on_transition(opened())
    assert time.monotonic() - start < 0.25  # the caller never waits for the network
    assert d.flush(5)
    elapsed = time.monotonic() - start
    assert len(server.on("/slow")) == 2 and d.stats.delivered == 1
    assert 0.3 <= elapsed < 2.0


@pytest.mark.process
def test_close_is_bounded_even_with_a_stalled_request(server: Server) -> None:
    server.plan("/slow", "stall:20")
    d = fast([SlackNotifier(server.url("/slow"))], timeout_s=10.0)
    for i in range(3):
        d.on_transition(opened(f"gpu{i}"))
    server.wait_for(1)
    start = time.monotonic()
    assert d.close(timeout_s=0.5) is False  # not everything was delivered
    assert time.monotonic() - start < 1.5  # not the 10 s request timeout
    assert d.stats.abandoned == 2
    d.on_transition(opened("late"))  # after close: dropped, counted, no error
    assert d.stats.dropped == 1


@pytest.mark.process
def test_close_waits_for_backoff_only_within_its_deadline(server: Server) -> None:
    server.plan("/down", "500")
    d = fast([SlackNotifier(server.url("/down"))], backoff_s=5.0, backoff_max_s=10, max_attempts=5)
    d.on_transition(opened())
    server.wait_for(1)
    start = time.monotonic()
    assert d.close(timeout_s=1.0) is False
    assert time.monotonic() - start < 0.9  # the next retry is after the deadline: give up now
    assert d.stats.abandoned == 1


@pytest.mark.process
def test_queue_is_bounded_and_drops_the_oldest(server: Server) -> None:
    server.plan("/slow", "stall:10", "ok")
    d = fast([JsonNotifier(server.url("/slow"))], queue_size=3)
    d.on_transition(opened("s0"))
    server.wait_for(1)  # s0 is in flight, held by the server
    start = time.monotonic()
    for i in range(1, 10):
        d.on_transition(opened(f"s{i}"))
    assert time.monotonic() - start < 1.0  # while the server holds s0 for 10 s
    assert d.stats.dropped == 6
    server.release.set()
    assert d.flush(5)
    assert [s.json()["subject"] for s in server.on("/slow")] == ["s0", "s7", "s8", "s9"]


@pytest.mark.process
def test_secrets_never_reach_logs(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="otel_gpu")
    server.plan("/robot/send", "echo500")
    server.plan(f"/services/T1/B2/{TOKEN}", "echo500")
    server.plan("/slow", "stall:10")
    # A port nothing listens on: connection refused.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    notifiers = [
        DingTalkNotifier(server.url(f"/robot/send?access_token={TOKEN}"), DING_SECRET),
        SlackNotifier(server.url(f"/services/T1/B2/{TOKEN}")),
        JsonNotifier(f"http://127.0.0.1:{dead}/x/{TOKEN}", {"Authorization": f"Bearer {BEARER}"}),
        JsonNotifier(server.url(f"/slow?token={TOKEN}"), {"Authorization": f"Bearer {BEARER}"}),
    ]
    d = fast(notifiers, max_attempts=2, timeout_s=0.2)
    d.on_transition(opened())
    assert d.flush(5)
    d.close(1)
    assert d.stats.failed == 4
    text = "\n".join(
        [caplog.text] + [r.getMessage() for r in caplog.records] + [repr(n) for n in notifiers]
    )
    for secret in (TOKEN, DING_SECRET, BEARER):
        assert secret not in text
    assert f"http://127.0.0.1:{server.port}/…" in text  # the redacted form is what shows
    assert "HTTP 500" in text and "gave up" in text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("7", 7.0),
        (" 1.5 ", 1.5),
        ("-3", 0.0),
        ("Sun, 29 Nov 2026 10:00:30 GMT", 30.0),  # HTTP-date, 30 s after "now"
        ("Sun, 29 Nov 2026 09:59:00 GMT", 0.0),
        ("soon", None),
        ("nan", None),
        (None, None),
    ],
)
def test_retry_after_header_forms(header: str | None, seconds: float | None) -> None:
    now = 1_795_946_400.0  # Sun, 29 Nov 2026 10:00:00 GMT
    assert retry_after_s(header, now) == seconds
