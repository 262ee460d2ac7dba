"""Stall detector: idle and spinning hangs are found; saves, loads, slow jobs and the end are not."""

from __future__ import annotations

import math

import pytest
from support.tracegen import COLUMNS_FULL, generate

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import STALL, Point

pytestmark = pytest.mark.unit

NO_PHASE = ("util", "procs", "power_w", "power_limit_w")
NO_POWER = ("util", "procs", "phase")
HOUR = 3600.0


def alerts_of(points, engine=None):
    engine = Engine() if engine is None else engine
    out = []
    for p in points:
        out.extend(engine.observe("gpu:GPU-0", p))
    return out


STALL_CASES = [
    ("stall_idle", 5.0, COLUMNS_FULL),
    ("stall_idle", 60.0, NO_PHASE),
    ("stall_idle", 15.0, NO_POWER),
    ("stall_spin", 15.0, COLUMNS_FULL),
    ("stall_spin", 30.0, NO_PHASE),
]


@pytest.mark.parametrize(("shape", "interval", "cols"), STALL_CASES)
def test_stall_found_once_after_onset(shape, interval, cols):
    tr = generate(shape, seed=11, interval_s=interval, columns=cols, duration_s=6 * HOUR)
    alerts = alerts_of(tr.points)
    assert [a.kind for a in alerts] == [STALL], [a.message for a in alerts]
    delay = alerts[0].time - tr.onset_s
    assert 0 <= delay <= 900 + 4 * interval + 120
    assert ("spinning" in alerts[0].message) == (shape == "stall_spin")


@pytest.mark.parametrize("shape", ["longsave", "inputbound", "finished", "flat"])
@pytest.mark.parametrize("cols", [COLUMNS_FULL, NO_PHASE], ids=["phase", "nophase"])
def test_working_or_finished_jobs_are_not_stalled(shape, cols):
    tr = generate(shape, seed=5, interval_s=15.0, columns=cols, duration_s=8 * HOUR)
    assert [a.message for a in alerts_of(tr.points)] == []


def _job(segments, interval=30.0, limit=80e9, used=40e9):
    """Points from (duration_s, util, power_w, phase) segments after a short working start."""
    pts, t = [], 0.0
    for duration, util, power, phase in segments:
        end = t + duration
        while t < end:
            pts.append(
                Point(
                    time=t,
                    used_bytes=used,
                    limit_bytes=limit,
                    util=util,
                    procs=1,
                    phase=phase,
                    power_w=power,
                    power_limit_w=700.0,
                )
            )
            t += interval
    return pts


def test_checkpoint_save_without_phase_shorter_than_window_is_quiet():
    pts = _job([(3600, 0.9, 600, None), (12 * 60, 0.01, 75, None), (3600, 0.9, 600, None)])
    assert alerts_of(pts) == []


def test_known_save_phase_suppresses_but_not_forever():
    quiet = _job([(3600, 0.9, 600, "train"), (40 * 60, 0.0, 70, "save"), (600, 0.9, 600, "train")])
    assert alerts_of(quiet) == []
    cfg = DetectConfig(stall_phase_max_s=3600)
    stuck = _job([(3600, 0.9, 600, "train"), (3 * HOUR, 0.0, 70, "save")])
    alerts = alerts_of(stuck, Engine(cfg))
    assert [a.kind for a in alerts] == [STALL]
    # The save began at 1 h; the phase excuses it for 1 h, then it is plainly stalled.
    assert 2 * 3600 <= alerts[0].time <= 2 * 3600 + 120


def test_recovered_pauses_stretch_the_window():
    # Hourly 20-minute pauses (no phase info) that always recover teach the detector.
    seg = [(3600, 0.9, 600, None)]
    first = _job(seg + [(20 * 60, 0.01, 75, None)])
    assert [a.kind for a in alerts_of(first)] == [STALL]  # the first one is alarming
    cfg = DetectConfig(stall_window_s=25 * 60)
    pts = _job((seg + [(20 * 60, 0.01, 75, None)]) * 3 + seg + [(40 * 60, 0.01, 75, None)])
    alerts = alerts_of(pts, Engine(cfg))
    # 20-min pauses pass; the 40-min one exceeds 1.5 x 20 min and alarms.
    assert [a.kind for a in alerts] == [STALL]
    assert alerts[0].time >= 4 * 3600 + 3 * 1200 + 30 * 60


def test_steps_that_stop_advancing_are_a_stall_even_at_full_util():
    pts, step = [], 0.0
    for t in range(0, 4 * 3600, 10):
        if t < 2 * 3600:
            step += 2
        pts.append(Point(time=t, used_bytes=40e9, limit_bytes=80e9, util=0.95, procs=1, step=step))
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL]
    assert "step stuck" in alerts[0].message
    assert 2 * 3600 - 10 + 900 <= alerts[0].time <= 2 * 3600 + 1000


def test_a_trainers_host_memory_with_steps_is_judged_by_its_steps_however_small():
    # A host without GPUs: the steps ride on the trainer's RSS (40 MB of 64 GB), no util.
    def trainer(with_steps: bool) -> list[Point]:
        pts, step = [], 0.0
        for t in range(0, 2 * 3600, 10):
            if t < 3600:
                step += 1
            pts.append(Point(time=t, used_bytes=40e6, limit_bytes=64e9, phase="train",
                             step=step if with_steps else None))  # fmt: skip
        return pts

    alerts = alerts_of(trainer(True))
    assert [a.kind for a in alerts] == [STALL] and "step stuck" in alerts[0].message
    assert alerts[0].message.endswith("while holding 38 MiB")  # not "0.0 GiB"
    assert 3590 + 200 <= alerts[0].time <= 3590 + 220  # max(60 s, 20 x 10 s) after the last step
    assert alerts_of(trainer(False)) == []  # memory alone, small: nothing held, no stall
    # Steps that move on to a GPU's subject (NVML came up): the host-memory subject, even a
    # large one, forgets them instead of calling their absence a stall.
    engine, moved = Engine(), []
    for t in range(0, 2 * 3600, 10):
        step = float(t // 10) if t < 600 else None
        p = Point(time=t, used_bytes=30e9, limit_bytes=64e9, phase="train", step=step)
        moved.extend(engine.observe("rss:7", p))
    assert moved == []


def test_slow_steps_with_low_util_are_working():
    pts = []
    for i, t in enumerate(range(0, 3 * 3600, 20)):
        pts.append(
            Point(time=t, used_bytes=40e9, limit_bytes=80e9, util=0.03, procs=1, step=i // 3)
        )
    assert alerts_of(pts) == []


def test_stall_clears_and_can_alert_again():
    seg_work = (1800, 0.9, 600, None)
    seg_hang = (30 * 60, 0.0, 70, None)
    pts = _job([seg_work, seg_hang, seg_work, seg_hang])
    assert [a.kind for a in alerts_of(pts)] == [STALL, STALL]


def test_released_memory_is_not_a_stall():
    pts = _job([(1800, 0.9, 600, None)]) + [
        Point(time=1800 + i * 30, used_bytes=0, limit_bytes=80e9, util=0.0, procs=0)
        for i in range(200)
    ]
    assert alerts_of(pts) == []


def test_activity_blips_do_not_hide_a_hang():
    # Hung job: one sample of 40% util every 5 minutes (a watchdog kernel), otherwise idle.
    pts = _job([(1800, 0.9, 600, None)])
    t = 1800.0
    while t < 1800 + 3600:
        blip = int(t) % 300 == 0
        pts.append(
            Point(
                time=t,
                used_bytes=40e9,
                limit_bytes=80e9,
                util=0.4 if blip else 0.02,
                procs=1,
                power_w=120 if blip else 75,
                power_limit_w=700.0,
            )
        )
        t += 30
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL]
    assert alerts[0].time <= 1800 + 900 + 120


# --- step-aware stalls (issue 21.1) ----------------------------------------------------------


def _stepping(segments, interval=15.0, t0=0.0, step0=0.0):
    """Points every ``interval`` s: segments of (seconds, step_time_s or None (no steps), util,
    phase). Steps advance by interval / step_time per sample (fractions carried)."""
    pts, t, step, frac = [], t0, step0, 0.0
    for seconds, step_time, util, phase in segments:
        end = t + seconds
        while t < end:
            if step_time is not None:
                frac += interval / step_time
                whole = math.floor(frac)
                step, frac = step + whole, frac - whole
            power = 100 + 500 * util
            pts.append(
                Point(
                    time=t,
                    used_bytes=40e9,
                    limit_bytes=80e9,
                    util=util,
                    procs=1,
                    phase=phase,
                    power_w=power,
                    power_limit_w=700.0,
                    step=step,
                )
            )
            t += interval
    return pts


@pytest.mark.parametrize(
    ("step_time", "util", "latest_s"),
    [
        (0.5, 0.95, 60 + 15),  # a hung collective spins at full utilization
        (1.0, 0.02, 60 + 15),  # an idle hang: found by its steps long before the idle window
        (6.0, 0.95, 120 + 15),  # 20 typical steps
    ],
)
def test_steps_frozen_in_train_are_found_within_two_minutes(step_time, util, latest_s):
    work = _stepping([(1800, step_time, 0.9, "train")])
    hang_at = work[-1].time
    hung = _stepping([(1800, None, util, "train")], t0=hang_at + 15, step0=work[-1].step)
    alerts = alerts_of(work + hung)
    assert [a.kind for a in alerts] == [STALL]  # one alert, not one per rule
    delay = alerts[0].time - hang_at
    assert 60 <= delay <= latest_s, delay
    assert "step stuck" in alerts[0].message
    assert alerts[0].evidence["mode"] == "steps"


def test_steps_that_slow_down_but_keep_coming_are_not_a_stall():
    # Step time grows 1 s -> 120 s over hours (data starving, a thermally throttled GPU).
    pts, t, step, frac = [], 0.0, 0.0, 0.0
    while t < 6 * HOUR:
        step_time = 1.0 * (120.0 ** (t / (6 * HOUR)))
        frac += 15.0 / step_time
        whole = math.floor(frac)
        step, frac = step + whole, frac - whole
        pts.append(
            Point(time=t, used_bytes=40e9, limit_bytes=80e9, util=0.3, procs=1, phase="train",
                  step=step)
        )  # fmt: skip
        t += 15.0
    assert alerts_of(pts) == []


@pytest.mark.parametrize("eval_name", ["evaluate", "eval", "validation", "val"])
def test_hourly_twenty_minute_evaluations_are_not_a_stall(eval_name):
    seg = [(3600, 1.0, 0.9, "train"), (20 * 60, None, 0.02, eval_name)]
    pts = _stepping(seg * 4 + [(3600, 1.0, 0.9, "train")])
    assert alerts_of(pts) == []


@pytest.mark.parametrize("save_name", ["save", "checkpoint", "save_checkpoint"])
def test_eight_minute_checkpoint_saves_are_not_a_stall(save_name):
    seg = [(3600, 2.0, 0.9, "train"), (8 * 60, None, 0.01, save_name)]
    pts = _stepping(seg * 4 + [(600, 2.0, 0.9, "train")])
    assert alerts_of(pts) == []


def test_after_an_evaluation_the_step_clock_restarts_with_training():
    # A 30-min eval, then training that hangs at once: found a minute after training resumed,
    # not at once (the steps were "frozen" through the evaluation) nor after 15 min.
    pts = _stepping(
        [(1800, 1.0, 0.9, "train"), (30 * 60, None, 0.05, "eval"), (1800, None, 0.95, "train")]
    )
    resumed = 1800 + 30 * 60
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL]
    assert resumed + 60 <= alerts[0].time <= resumed + 75


def test_the_fast_step_rule_needs_the_train_phase():
    # The same hang without phase information waits for the window (a save could be running).
    work = _stepping([(1800, 1.0, 0.9, None)])
    hung = _stepping([(1800, None, 0.95, None)], t0=1800, step0=work[-1].step)
    alerts = alerts_of(work + hung)
    assert [a.kind for a in alerts] == [STALL]
    assert alerts[0].time - 1785 >= 900


def test_step_floor_and_factor_are_settings():
    work = _stepping([(1800, 1.0, 0.9, "train")])
    hung = _stepping([(1800, None, 0.95, "train")], t0=1800, step0=work[-1].step)
    cfg = DetectConfig(stall_step_floor_s=300.0)
    alerts = alerts_of(work + hung, Engine(cfg))
    assert 300 <= alerts[0].time - 1785 <= 315
    cfg = DetectConfig(stall_step_factor=200.0)  # 200 x 1 s
    alerts = alerts_of(work + hung, Engine(cfg))
    assert 200 <= alerts[0].time - 1785 <= 215


def test_train_pauses_that_end_on_their_own_stretch_the_step_limit():
    # Hourly 2-minute pauses in "train" (a checkpoint save nobody marked): the first is
    # indistinguishable from a hang and alarms; the later ones are known and pass; a real hang
    # is still found, within 1.5 x the learned pause.
    seg = [(3600, 1.0, 0.9, "train"), (120, None, 0.01, "train")]
    pts = _stepping(seg * 4 + [(3600, 1.0, 0.9, "train"), (1800, None, 0.01, "train")])
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL, STALL]
    assert alerts[0].time < 3720  # the first pause
    hang = 4 * 3720 + 3600
    assert hang + 60 <= alerts[1].time <= hang + 1.5 * 135 + 15


def test_a_csv_eval_phase_is_read_as_evaluate(tmp_path):
    # `otel-gpu analyze` on a CSV whose evaluations say "eval" / "Validation": not training.
    from otel_gpu.detect.trace import read_trace

    rows = ["time_s,used_bytes,limit_bytes,util,procs,phase,step"]
    t, step = 0, 0
    for seconds, util, phase, stepping in [
        (3600, 0.9, "train", True),
        (25 * 60, 0.02, "eval", False),
        (3600, 0.9, "train", True),
        (25 * 60, 0.02, "Validation", False),
        (600, 0.9, "train", True),
    ]:
        for _ in range(0, seconds, 30):
            step += 30 if stepping else 0
            rows.append(f"{t},40e9,80e9,{util},1,{phase},{step}")
            t += 30
    path = tmp_path / "job.csv"
    path.write_text("\n".join(rows) + "\n")
    points = read_trace(path)
    assert {p.phase for p in points} == {"train", "evaluate"}
    assert alerts_of(points) == []
