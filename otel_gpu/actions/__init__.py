"""Actions fired on circuit-breaker transitions: log records, span events, webhooks, stop.

Typical wiring (agent or processor)::

    config = ActionsConfig.from_env()               # validated once; UsageError on bad input
    actions = ActionDispatcher.from_config(config, allowed_pids=tree.trainer_pids)
    for t in breaker.record_alert(alert):
        actions.on_transition(t)                     # never blocks
    ...
    actions.close(timeout_s=5)                       # bounded
"""

from otel_gpu.actions.dispatcher import ActionDispatcher, transition_event
from otel_gpu.actions.notifiers import (
    VENDORS,
    DingTalkNotifier,
    FeishuNotifier,
    JsonNotifier,
    SlackNotifier,
    WebhookNotifier,
    WeComNotifier,
    dingtalk_sign,
    feishu_sign,
    format_text,
)
from otel_gpu.actions.options import Option
from otel_gpu.actions.outbox import DeliveryStats, Outbox, RetryPolicy
from otel_gpu.actions.redact import redact_url
from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.actions.span_event import add_alert_event, get_job_span, set_job_span
from otel_gpu.actions.stop import JobStopper, StopResult, parse_signal

__all__ = [
    "VENDORS",
    "ActionDispatcher",
    "ActionsConfig",
    "DeliveryStats",
    "DingTalkNotifier",
    "FeishuNotifier",
    "JobStopper",
    "JsonNotifier",
    "Option",
    "Outbox",
    "RetryPolicy",
    "SlackNotifier",
    "StopResult",
    "WeComNotifier",
    "WebhookNotifier",
    "add_alert_event",
    "dingtalk_sign",
    "feishu_sign",
    "format_text",
    "get_job_span",
    "parse_signal",
    "redact_url",
    "set_job_span",
    "transition_event",
]
