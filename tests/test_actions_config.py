"""Action settings from the environment and a config file: validation and secret hygiene."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from support.docs import first_table, section

from otel_gpu.actions import ActionsConfig, redact_url
from otel_gpu.actions.notifiers import (
    VENDORS,
    DingTalkNotifier,
    FeishuNotifier,
    JsonNotifier,
    SlackNotifier,
    WebhookNotifier,
    WeComNotifier,
)
from otel_gpu.actions.redact import scrub
from otel_gpu.actions.settings import env_name
from otel_gpu.core.errors import UsageError
from otel_gpu.detect.engine import ALERT_KINDS

pytestmark = pytest.mark.unit

SLACK = "https://hooks.slack.com/services/T0001/B0002/SeCrEtToKeN99"
DING = "https://oapi.dingtalk.com/robot/send?access_token=abcdef0123456789"


def test_defaults_notify_nowhere_and_never_stop() -> None:
    cfg = ActionsConfig.from_env({})
    assert cfg.notifiers() == [] and cfg.stop_on_alert is False
    assert cfg.notify_on == {"open", "closed"} and cfg.stop_signal == "SIGUSR1"


def test_environment_builds_each_destination() -> None:
    cfg = ActionsConfig.from_env(
        {
            "OTEL_GPU_SLACK_WEBHOOK_URL": SLACK,
            "OTEL_GPU_DINGTALK_WEBHOOK_URL": DING,
            "OTEL_GPU_DINGTALK_SECRET": "SECxyz0123",
            "OTEL_GPU_FEISHU_WEBHOOK_URL": "https://open.feishu.cn/open-apis/bot/v2/hook/uuid-1234",
            "OTEL_GPU_WECOM_WEBHOOK_URL": "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=k-1234",
            "OTEL_GPU_WEBHOOK_URL": "http://127.0.0.1:9/alerts",
            "OTEL_GPU_WEBHOOK_HEADERS": "Authorization=Bearer%20t0ken-1,X-A=b",
            "OTEL_GPU_NOTIFY_ON": "open, reopen,closed",
            "OTEL_GPU_ACTIONS_MAX_ATTEMPTS": "3",
            "OTEL_GPU_ACTIONS_TIMEOUT_S": "2.5",
            "OTEL_GPU_STOP_ON_ALERT": "yes",
            "OTEL_GPU_STOP_KINDS": "leak,stall,hardware",
            "OTEL_GPU_STOP_SIGNAL": "term",
        }
    )
    kinds = [type(n) for n in cfg.notifiers()]
    assert kinds == [SlackNotifier, DingTalkNotifier, FeishuNotifier, WeComNotifier, JsonNotifier]
    assert cfg.webhooks["webhook_headers"] == {"Authorization": "Bearer t0ken-1", "X-A": "b"}
    assert cfg.notify_on == {"open", "reopen", "closed"} and cfg.max_attempts == 3
    assert cfg.timeout_s == 2.5 and cfg.stop_on_alert and cfg.stop_signal == "SIGTERM"
    assert cfg.stop_kinds == {"leak", "stall", "hardware"}
    # Nothing printable about the config shows a credential.
    shown = repr(cfg) + " ".join(cfg.describe()) + " ".join(repr(n) for n in cfg.notifiers())
    for secret in (
        "SeCrEtToKeN99",
        "abcdef0123456789",
        "SECxyz0123",
        "uuid-1234",
        "k-1234",
        "t0ken-1",
    ):
        assert secret not in shown
    assert "slack https://hooks.slack.com/…" in cfg.describe()


def test_config_file_json_and_env_precedence(tmp_path: Path) -> None:
    f = tmp_path / "actions.json"
    f.write_text(
        json.dumps(
            {
                "slack_webhook_url": SLACK,
                "webhook_url": "https://example.com/hook",
                "webhook_headers": {"Authorization": "Bearer from-file"},
                "notify_on": ["open"],
                "queue_size": 10,
                "stop_on_alert": True,
            }
        )
    )
    cfg = ActionsConfig.from_env(
        {"OTEL_GPU_ACTIONS_CONFIG": str(f), "OTEL_GPU_ACTIONS_QUEUE_SIZE": "20"}
    )
    assert cfg.webhooks["slack_webhook_url"] == SLACK and cfg.notify_on == {"open"}
    assert cfg.queue_size == 20  # environment beats the file
    assert cfg.webhooks["webhook_headers"] == {"Authorization": "Bearer from-file"}
    assert cfg.stop_on_alert
    assert ActionsConfig.from_env({"OTEL_GPU_ACTIONS_CONFIG": str(f)}, queue_size=5).queue_size == 5


def test_config_file_toml(tmp_path: Path) -> None:
    f = tmp_path / "actions.toml"
    f.write_text(
        f'dingtalk_webhook_url = "{DING}"\ndingtalk_secret = "SECabc123"\n'
        'webhook_url = "https://example.com/h"\nnotify_on = ["open", "closed"]\n'
        '[webhook_headers]\nX-Token = "abc"\n'
    )
    env = {"OTEL_GPU_ACTIONS_CONFIG": str(f)}
    if sys.version_info < (3, 11):  # no tomllib: a clear error instead
        with pytest.raises(UsageError, match="needs Python >= 3.11; use JSON"):
            ActionsConfig.from_env(env)
        return
    cfg = ActionsConfig.from_env(env)
    assert cfg.webhooks["dingtalk_webhook_url"] == DING
    assert cfg.webhooks["dingtalk_secret"] == "SECabc123"
    assert cfg.webhooks["webhook_headers"] == {"X-Token": "abc"}


@pytest.mark.parametrize(
    ("env", "names", "secret"),
    [
        (
            {"OTEL_GPU_SLACK_WEBHOOK_URL": "hooks.slack.com/services/T/B/sEcReT42"},
            "OTEL_GPU_SLACK_WEBHOOK_URL",
            "sEcReT42",
        ),
        (
            {
                "OTEL_GPU_DINGTALK_WEBHOOK_URL": "ftp://oapi.dingtalk.com/robot?access_token=sEcReT42"
            },
            "OTEL_GPU_DINGTALK_WEBHOOK_URL",
            "sEcReT42",
        ),
        (
            {"OTEL_GPU_WECOM_WEBHOOK_URL": "https:// qyapi.weixin.qq.com/?key=sEcReT42"},
            "OTEL_GPU_WECOM_WEBHOOK_URL",
            "sEcReT42",
        ),
        ({"OTEL_GPU_FEISHU_SECRET": "sEcReT42"}, "OTEL_GPU_FEISHU_SECRET", "sEcReT42"),
        (
            {
                "OTEL_GPU_WEBHOOK_URL": "https://x.example/h",
                "OTEL_GPU_WEBHOOK_HEADERS": "Bearer sEcReT42",
            },
            "OTEL_GPU_WEBHOOK_HEADERS",
            "sEcReT42",
        ),
        ({"OTEL_GPU_NOTIFY_ON": "open,sometimes"}, "OTEL_GPU_NOTIFY_ON", None),
        ({"OTEL_GPU_STOP_KINDS": "leak,oom"}, "OTEL_GPU_STOP_KINDS", None),
        ({"OTEL_GPU_STOP_SIGNAL": "SIGKILL"}, "OTEL_GPU_STOP_SIGNAL", None),
        ({"OTEL_GPU_STOP_ON_ALERT": "maybe"}, "OTEL_GPU_STOP_ON_ALERT", None),
        ({"OTEL_GPU_ACTIONS_MAX_ATTEMPTS": "0"}, "OTEL_GPU_ACTIONS_MAX_ATTEMPTS", None),
        ({"OTEL_GPU_ACTIONS_TIMEOUT_S": "fast"}, "OTEL_GPU_ACTIONS_TIMEOUT_S", None),
        ({"OTEL_GPU_WECOM_FORMAT": "html"}, "OTEL_GPU_WECOM_FORMAT", None),
    ],
)
def test_bad_settings_name_the_variable_never_the_secret(
    env: dict, names: str, secret: str | None
) -> None:
    with pytest.raises(UsageError) as e:
        ActionsConfig.from_env(env)
    msg = str(e.value)
    assert names in msg and "\n" not in msg
    if secret:
        assert secret not in msg


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"OTEL_GPU_WECOM_FORMAT": "markdown"}, None),
        ({"OTEL_GPU_WEBHOOK_HEADERS": ","}, None),  # no header at all
        (
            {"OTEL_GPU_DINGTALK_SECRET": "SECabc123"},
            "OTEL_GPU_DINGTALK_SECRET is set but OTEL_GPU_DINGTALK_WEBHOOK_URL is not: set both",
        ),
        (
            {"OTEL_GPU_WEBHOOK_HEADERS": "X-Key=abc"},
            "OTEL_GPU_WEBHOOK_HEADERS is set but OTEL_GPU_WEBHOOK_URL is not: set both",
        ),
    ],
)
def test_a_credential_needs_its_url_other_options_stand_alone(
    env: dict[str, str], error: str | None
) -> None:
    if error is None:
        assert ActionsConfig.from_env(env).notifiers() == []
        return
    with pytest.raises(UsageError) as e:
        ActionsConfig.from_env(env)
    assert str(e.value) == error


def test_config_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(UsageError, match="OTEL_GPU_ACTIONS_CONFIG=.*: cannot read"):
        ActionsConfig.from_env({"OTEL_GPU_ACTIONS_CONFIG": str(missing)})
    bad = tmp_path / "bad.json"
    bad.write_text('{"slack_webhook_url": ')
    with pytest.raises(UsageError, match="not valid JSON"):
        ActionsConfig.from_env({"OTEL_GPU_ACTIONS_CONFIG": str(bad)})
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"slak_webhook_url": "https://x.example/secret-path-1"}')
    with pytest.raises(UsageError, match="unknown setting 'slak_webhook_url'") as e:
        ActionsConfig.from_env({"OTEL_GPU_ACTIONS_CONFIG": str(unknown)})
    assert "secret-path-1" not in str(e.value)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"slack_webhook_url": "not a url sEcReT"}')
    with pytest.raises(UsageError) as e:
        ActionsConfig.from_env({"OTEL_GPU_ACTIONS_CONFIG": str(wrong)})
    assert f"slack_webhook_url in {wrong}" in str(e.value) and "sEcReT" not in str(e.value)


# Each vendor's variables (in declaration order) and a value for its secret option, if any.
VENDOR_ROWS: list[tuple[type[WebhookNotifier], list[str], object]] = [
    (SlackNotifier, ["OTEL_GPU_SLACK_WEBHOOK_URL"], None),
    (DingTalkNotifier, ["OTEL_GPU_DINGTALK_WEBHOOK_URL", "OTEL_GPU_DINGTALK_SECRET"], "0ptSecret"),
    (FeishuNotifier, ["OTEL_GPU_FEISHU_WEBHOOK_URL", "OTEL_GPU_FEISHU_SECRET"], "0ptSecret"),
    (WeComNotifier, ["OTEL_GPU_WECOM_WEBHOOK_URL", "OTEL_GPU_WECOM_FORMAT"], None),
    (JsonNotifier, ["OTEL_GPU_WEBHOOK_URL", "OTEL_GPU_WEBHOOK_HEADERS"], {"X-Key": "0ptSecret"}),
]


def test_every_registered_vendor_has_a_row_here() -> None:
    assert list(VENDORS) == [row[0] for row in VENDOR_ROWS]


@pytest.mark.parametrize(("vendor", "variables", "secret"), VENDOR_ROWS)
def test_vendor_settings_derive_from_its_class(
    vendor: type[WebhookNotifier], variables: list[str], secret: object
) -> None:
    names = list(vendor.settings())
    assert [env_name(n) for n in names] == variables
    # The docs' settings table lists every variable the class declares.
    table = first_table(section("Breaker and action settings"))
    assert all(f"`{v}`" in table for v in variables)
    # Its secret option, set from the environment, is scrubbed like the URL.
    env = {variables[0]: "https://hooks.example/services/UrlSecret99"}
    if secret is not None:
        env[variables[1]] = secret if isinstance(secret, str) else "X-Key=0ptSecret"
    (n,) = ActionsConfig.from_env(env).notifiers()
    assert type(n) is vendor
    leaked = scrub("POST https://hooks.example/services/UrlSecret99 with 0ptSecret", n.secrets)
    assert "UrlSecret99" not in leaked and ("0ptSecret" not in leaked) == (secret is not None)
    assert vendor.from_settings({k: v for k, v in env.items() if k != variables[0]}) is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (SLACK, "https://hooks.slack.com/…"),
        (DING, "https://oapi.dingtalk.com/…"),
        ("http://user:pw@127.0.0.1:8080/x?k=v", "http://127.0.0.1:8080/…"),
        ("garbage", "?://?/…"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


# -- stop kinds: derived from the registered detectors (detect/engine.py) ------------------------


@pytest.mark.parametrize("kind", ALERT_KINDS)
def test_every_alert_kind_the_detectors_raise_can_stop_the_job(kind: str) -> None:
    cfg = ActionsConfig.from_env({"OTEL_GPU_STOP_ON_ALERT": "true", "OTEL_GPU_STOP_KINDS": kind})
    assert cfg.stop_kinds == {kind}


def test_a_kind_no_detector_raises_is_refused_naming_the_ones_that_exist() -> None:
    with pytest.raises(UsageError) as e:
        ActionsConfig.from_env({"OTEL_GPU_STOP_KINDS": "oom"})
    assert all(kind in str(e.value) for kind in ALERT_KINDS)


def test_the_docs_list_exactly_the_stop_kinds() -> None:
    table = first_table(section("Breaker and action settings"))
    row = next(line for line in table.splitlines() if line.startswith("| `OTEL_GPU_STOP_KINDS`"))
    meaning = row.strip("|").split("|")[-1]
    listed = set(re.findall(r"`([a-z_]+)`", meaning.split("(", 1)[1]))
    assert listed == set(ALERT_KINDS)
