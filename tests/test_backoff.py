"""Every exponential backoff is bounded at any attempt number (issue 18.1): the forwarder's,
the webhook outbox's and the shared helper they use, and the attempts setting has a bound."""

from __future__ import annotations

import math

import pytest

from otel_gpu.actions.outbox import RetryPolicy
from otel_gpu.actions.settings import ActionsConfig
from otel_gpu.core.backoff import exponential
from otel_gpu.core.errors import UsageError
from otel_gpu.processor.forward import backoff

pytestmark = pytest.mark.unit

ATTEMPTS = [0, 1, 29, 30, 31, 1023, 1024, 1025, 2000, 10**6, 10**18]


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_the_shared_backoff_is_finite_and_capped_at_any_attempt(attempt: int) -> None:
    delay = exponential(attempt, 0.5, 10.0)
    assert math.isfinite(delay) and 0.5 <= delay <= 10.0
    if attempt >= 5:
        assert delay == 10.0


def test_the_shared_backoff_doubles_below_its_cap() -> None:
    assert [exponential(a, 0.5, 100.0) for a in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert exponential(-3, 0.5, 100.0) == 0.5


@pytest.mark.parametrize("attempt", ATTEMPTS)
@pytest.mark.parametrize("rand", [0.0, 0.999])
def test_forwarder_backoff_at_attempt_2000_does_not_raise(attempt: int, rand: float) -> None:
    # 0.5 * 2**1024 raised OverflowError and killed the forwarder thread for good.
    assert 5.0 <= backoff(attempt, rand) <= 15.0 or attempt < 5


@pytest.mark.parametrize("attempt", ATTEMPTS)
def test_outbox_backoff_is_bounded_at_any_attempt(attempt: int) -> None:
    policy = RetryPolicy(max_attempts=5, backoff_s=1.0, backoff_max_s=30.0, jitter=0.2)
    delay = policy.delay(attempt, None, 0.5)
    assert math.isfinite(delay) and delay <= 30.0


@pytest.mark.parametrize("value", ["101", "100000", str(2**70)])
def test_actions_max_attempts_has_an_upper_bound(value: str) -> None:
    with pytest.raises(UsageError) as e:
        ActionsConfig.from_env({"OTEL_GPU_ACTIONS_MAX_ATTEMPTS": value})
    msg = str(e.value)
    assert "OTEL_GPU_ACTIONS_MAX_ATTEMPTS" in msg and "1 to 100" in msg and "\n" not in msg


def test_actions_max_attempts_at_its_bound_is_accepted() -> None:
    cfg = ActionsConfig.from_env({"OTEL_GPU_ACTIONS_MAX_ATTEMPTS": "100"})
    assert cfg.max_attempts == 100
