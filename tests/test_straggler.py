"""Stragglers (issue 22.2), the judging part: per-rank work per window, MAD-based naming in k of
n windows, a job-wide slowdown told apart from one slow rank. Synthetic per-rank step times on
the data's own clock (the real torchrun job, through the processor: tests/test_straggler_job.py)."""

from __future__ import annotations

import random

import pytest

from otel_gpu.detect.straggler import (
    JOB_SLOWDOWN,
    STRAGGLER,
    RankInfo,
    StragglerConfig,
    StragglerJudge,
)

pytestmark = pytest.mark.unit


def _job(seconds: float, work, ranks: int = 4, step_s: float = 1.0, seed: int = 0):
    """Feed ``ranks`` ranks one step per ``step_s`` for ``seconds``; ``work(rank, i)`` is a
    step's compute time (with 5 % noise). Returns (judge, [(time, alert)])."""
    rng = random.Random(seed)
    judge = StragglerJudge("job:j1")
    found = []
    t = 0.0
    i = 0
    while t < seconds:
        for r in range(ranks):
            w = work(r, i) * rng.uniform(0.95, 1.05)
            for a in judge.add(t, r, w, RankInfo(host=f"node-{r // 2}", gpu=f"GPU-{r}")):
                found.append((t, a))
        t += step_s
        i += 1
    return judge, found


def test_a_rank_computing_three_times_longer_is_named_within_two_minutes() -> None:
    judge, found = _job(300, lambda r, i: 0.3 if r == 2 else 0.1)
    (t, alert), *rest = found
    assert rest == []  # once per episode
    assert alert.kind == STRAGGLER and alert.evidence["rank"] == 2.0
    assert alert.evidence["host"] == "node-1" and alert.evidence["gpu"] == "GPU-2"
    assert "rank 2 (host node-1, GPU GPU-2)" in alert.message and "3.0x" in alert.message
    cfg = StragglerConfig()
    assert t <= cfg.k * cfg.window_s + cfg.window_s  # the detection delay: k windows
    assert t < 120 and judge.named == {2}


def test_a_balanced_job_and_rare_slow_steps_name_nobody() -> None:
    assert _job(600, lambda r, i: 0.1)[1] == []
    # rank 1 is 5x slower in one step out of 20 (a checkpoint, a GC pause): never named
    assert _job(600, lambda r, i: 0.5 if r == 1 and i % 20 == 0 else 0.1)[1] == []


def test_all_ranks_slowing_together_is_a_job_slowdown_not_a_straggler() -> None:
    judge, found = _job(400, lambda r, i: 0.1 if i < 150 else 0.25)
    assert [a.evidence["rule"] for _t, a in found] == [JOB_SLOWDOWN]
    assert "whole job slowed down" in found[0][1].message and judge.named == set()


def test_a_lasting_slowdown_is_the_new_pace_and_ranks_are_judged_again() -> None:
    # every rank 2.5x slower from step 100 on; rank 3 alone 3x slower again from step 400
    def work(r: int, i: int) -> float:
        base = 0.1 if i < 100 else 0.25
        return base * 3 if r == 3 and i >= 400 else base

    judge, found = _job(700, work)
    rules = [(a.evidence["rule"], a.evidence.get("rank")) for _t, a in found]
    assert rules == [(JOB_SLOWDOWN, None), (STRAGGLER, 3.0)]
    assert 400 < found[1][0] < 400 + 150 and judge.named == {3}


def test_too_few_ranks_judge_nothing() -> None:
    assert _job(300, lambda r, i: 0.3 if r == 1 else 0.1, ranks=2)[1] == []
