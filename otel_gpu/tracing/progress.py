"""Training progress as metrics: ``training.step``, ``training.phase``, the training numbers
(``training.loss``, ``training.learning_rate``, ``training.grad_norm``, step time, samples and
tokens per second, and how a step splits between work and waiting in collectives) and torch's
allocator.

The job's threads only assign Python variables here (:func:`set_step`, :func:`push_phase`);
the observable callbacks run on the metric reader's thread and read those variables. Every
callback checks that it runs in the process that set the values up: a forked DataLoader worker
inherits the SDK, whose reader thread restarts after ``fork()`` (docs/background.md §2), and must not
export duplicates.

``training.phase`` is a state set, like semconv's ``hw.status``: one point per known phase,
1 for the current one and 0 for the others, attribute ``training.phase``. Nothing is reported
before the first phase or after training ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from otel_gpu.core.signals import (
    GPU_INDEX,
    HW_ID,
    PHASE,
    SCHEMA_URL,
    TORCH_ALLOCATED,
    TORCH_PEAK,
    TORCH_RESERVED,
    TRAINING_GRAD_NORM,
    TRAINING_LEARNING_RATE,
    TRAINING_LOSS,
    TRAINING_PHASE,
    TRAINING_SAMPLES_RATE,
    TRAINING_STEP,
    TRAINING_STEP_COLLECTIVE_WAIT,
    TRAINING_STEP_DURATION,
    TRAINING_STEP_WORK,
    TRAINING_TOKENS_RATE,
    observable,
)
from otel_gpu.detect.model import (
    PHASE_ALIASES,
    PHASE_EVALUATE,
    PHASE_LOAD,
    PHASE_SAVE,
    PHASE_TRAIN,
)
from otel_gpu.tracing import collective_timing

log = logging.getLogger("otel_gpu.tracing")

PHASES = (PHASE_LOAD, PHASE_TRAIN, PHASE_EVALUATE, PHASE_SAVE)

_owner_pid = os.getpid()
_step: int | None = None
_phases: list[str] = []  # innermost last
_load_started_ns: int | None = None
_load_reported = False
_registered: set[int] = set()  # id() of meter providers that have our instruments
_lock = threading.Lock()
# The last step ends, (sequence number, step, wall time s), for whoever polls this process over
# its control socket (tracing/inprocess.py): a poller that remembers the last sequence number it
# saw loses no step between two polls, as long as fewer than STEP_RING steps end in between.
STEP_RING = 1024
_step_ends: deque[tuple[int, int, float]] = deque(maxlen=STEP_RING)
_step_seq = 0
# The training numbers: the last value logged of each (loss, learning rate, grad norm), the
# seconds per step over the last step, and how many samples / tokens a step takes.
NUMBER_NAMES = {
    "loss": "loss",
    "learning_rate": "learning_rate",
    "lr": "learning_rate",
    "grad_norm": "grad_norm",
}
PER_STEP_NAMES = ("samples", "tokens")
_numbers: dict[str, float] = {}
_per_step: dict[str, float] = {}
_step_s: float | None = None
# How the last step split (seconds waiting in timed collectives, seconds of work: the rest),
# once collectives were timed (tracing/collective_timing.py); one tuple, assigned at once, so a
# reader never pairs one step's wait with another's work. _wait_mark: the timing's total at
# the last step end.
_split: tuple[float, float] | None = None
_wait_mark: float | None = None
# The numbers the numerics detector judges, (sequence number, step, loss, grad norm) as logged
# for each step (NaN and infinities kept: they are the finding), read by the in-process agent
# with a cursor like the step ends.
NUMBERS = ("loss", "grad_norm")
_step_numbers: deque[tuple[int, int, float | None, float | None]] = deque(maxlen=STEP_RING)
_step_numbers_seq = 0
# Seconds spent in each phase (the innermost one counts), for the wrapper's summary: kept here,
# where every phase change happens, rather than sampled by a poll that misses short phases.
_phase_s: dict[str, float] = {}
_phase_mark: float | None = None  # monotonic time the innermost phase was entered or resumed
_clock = time.monotonic


def _reset_after_fork() -> None:
    # A forked child is not the owner; it must report nothing (see module docstring).
    global _step, _step_seq, _step_s, _step_numbers_seq, _split, _wait_mark, _lock, _phase_mark
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _phase_mark = None
    _step = None
    _phases.clear()
    _step_ends.clear()
    _step_seq = 0
    _numbers.clear()
    _per_step.clear()
    _step_s = None
    _split = _wait_mark = None
    _step_numbers.clear()
    _step_numbers_seq = 0
    _phase_s.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def in_owner() -> bool:
    """True in the process whose values these are (False in a forked child)."""
    return os.getpid() == _owner_pid


def set_step(step: int) -> None:
    """The current global step (optimizer steps done); a new value is a step's end."""
    global _step, _step_seq, _step_s, _split, _wait_mark
    step = int(step)
    if step != _step:
        now = time.time()
        calls, waited = collective_timing.totals()
        last = _step_ends[-1] if _step_ends else None
        if last is not None and step > last[1] and now > last[2]:
            _step_s = (now - last[2]) / (step - last[1])
            if calls and _wait_mark is not None:
                wait = (waited - _wait_mark) / (step - last[1])
                _split = (wait, max(0.0, _step_s - wait))
        _wait_mark = waited
        _step_seq += 1
        _step_ends.append((_step_seq, step, now))  # deque.append: atomic under the GIL
    _step = step


def set_numbers(values: Mapping[str, float]) -> None:
    """The finite numbers a step logged (``loss``, ``lr`` / ``learning_rate``, ``grad_norm``,
    and ``samples`` / ``tokens`` a step takes); other keys are ignored. Plain assignments."""
    for key, value in values.items():
        name = NUMBER_NAMES.get(key)
        if name is not None:
            _numbers[name] = float(value)
        elif key in PER_STEP_NAMES and value > 0:
            _per_step[key] = float(value)


def numbers() -> dict[str, float]:
    """The training numbers now: ``loss``, ``learning_rate``, ``grad_norm`` (each once
    logged), ``step_s`` (seconds per step over the last step), ``samples_per_s`` and
    ``tokens_per_s`` (when the trainer said how many a step takes), ``collective_wait_s`` and
    ``work_s`` (of the last step, once a collective was timed)."""
    out = dict(_numbers)
    step_s = _step_s
    if step_s is not None:
        out["step_s"] = step_s
        for key, count in list(_per_step.items()):
            out[f"{key}_per_s"] = count / step_s
    split = _split
    if split is not None:
        out["collective_wait_s"], out["work_s"] = split
    return out


def step_ends_since(seq: int) -> tuple[int, list[tuple[int, int, float]]]:
    """The latest sequence number and the step ends after ``seq`` (oldest first)."""
    ends = list(_step_ends)  # one copy: the training thread may append meanwhile
    latest = ends[-1][0] if ends else _step_seq
    return latest, [e for e in ends if e[0] > seq]


def _number(value: Any) -> float | None:
    """A float from a logged value (a Python number or a 0-d CPU tensor), NaN kept; None for
    anything else (a GPU tensor is never read: ``.item()`` would wait for its stream)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if item is None or getattr(value, "ndim", 0) != 0:
        return None
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return None
    try:
        out = item()
    except Exception:
        return None
    return float(out) if isinstance(out, (int, float)) and not isinstance(out, bool) else None


def record_step_numbers(step: int, values: Mapping[str, Any]) -> None:
    """The loss and gradient norm logged for ``step`` (HF's ``logs``, ``otel_gpu.step``'s
    keywords), when either is there, for the numerics detector. Never raises."""
    global _step_numbers_seq
    try:
        loss, grad = (_number(values.get(k)) for k in NUMBERS)
        if loss is None and grad is None:
            return
        _step_numbers_seq += 1
        _step_numbers.append((_step_numbers_seq, int(step), loss, grad))
    except Exception:  # the job is sacred: a bad value costs us the value, never the step
        return


def numbers_since(seq: int) -> tuple[int, list[tuple[int, int, float | None, float | None]]]:
    """The latest sequence number and the numbers logged after ``seq`` (oldest first)."""
    found = list(_step_numbers)  # one copy: the training thread may append meanwhile
    latest = found[-1][0] if found else _step_numbers_seq
    return latest, [n for n in found if n[0] > seq]


def current_step() -> int | None:
    return _step


def _charge_phase() -> None:
    """Credit the innermost phase with the time since it was entered or resumed (under
    ``_lock``, before the phases change)."""
    global _phase_mark
    now = _clock()
    if _phases and _phase_mark is not None:
        _phase_s[_phases[-1]] = _phase_s.get(_phases[-1], 0.0) + (now - _phase_mark)
    _phase_mark = now


def push_phase(name: str) -> str | None:
    """Enter a phase; returns the canonical phase pushed, or None if ``name`` is not one."""
    phase = PHASE_ALIASES.get(name.lower())
    if phase is not None:
        with _lock:
            _charge_phase()
            _phases.append(phase)
    return phase


def pop_phase(phase: str | None) -> None:
    """Leave ``phase`` (the value :func:`push_phase` returned)."""
    if phase is None:
        return
    with _lock:
        for i in range(len(_phases) - 1, -1, -1):
            if _phases[i] == phase:
                _charge_phase()
                del _phases[i]
                return


def phase_seconds() -> dict[str, float]:
    """Seconds spent in each phase so far, the innermost counting, the current one included."""
    with _lock:
        out = dict(_phase_s)
        if _phases and _phase_mark is not None:
            out[_phases[-1]] = out.get(_phases[-1], 0.0) + (_clock() - _phase_mark)
    return {k: round(v, 3) for k, v in out.items()}


def current_phase() -> str | None:
    last = _phases[-1:]  # one atomic read: the training thread may pop meanwhile
    return last[0] if last else None


def mark_load_started() -> None:
    """Called at start-up: remember when this process began (the ``load`` span's start)."""
    global _load_started_ns
    if _load_started_ns is None:
        _load_started_ns = time.time_ns()


def expect_training() -> None:
    """This process will train (a Trainer was built, or a known training command started):
    it is loading until training begins.

    Not assumed at start-up, nor when a framework is merely imported (``swift infer`` imports
    ``transformers.trainer``): a process that never trains would report ``load`` forever and
    hide its idle GPUs from the detectors.
    """
    global _load_reported
    if _load_started_ns is not None and not _load_reported:
        _load_reported = True
        with _lock:
            _charge_phase()
            _phases.append(PHASE_LOAD)


def take_load_started() -> int | None:
    """The start-up time once, for the first ``load`` span; ends the start-up load phase."""
    global _load_started_ns, _load_reported
    started, _load_started_ns = _load_started_ns, None
    if _load_reported:
        _load_reported = False
        pop_phase(PHASE_LOAD)
    return started


# -- instruments -------------------------------------------------------------------------------


def _observe_step(_options: CallbackOptions) -> Iterable[Observation]:
    step = _step
    if step is not None and in_owner():
        yield Observation(step)


def _observe_phase(_options: CallbackOptions) -> Iterable[Observation]:
    current = current_phase()
    if current is None or not in_owner():
        return
    for phase in PHASES:
        yield Observation(1 if phase == current else 0, {PHASE: phase})


def _number_callback(key: str) -> Any:
    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        if in_owner():
            value = numbers().get(key)
            if value is not None:
                yield Observation(value)

    return observe


NUMBER_SIGNALS = (
    (TRAINING_LOSS, "loss"),
    (TRAINING_LEARNING_RATE, "learning_rate"),
    (TRAINING_GRAD_NORM, "grad_norm"),
    (TRAINING_STEP_DURATION, "step_s"),
    (TRAINING_STEP_COLLECTIVE_WAIT, "collective_wait_s"),
    (TRAINING_STEP_WORK, "work_s"),
    (TRAINING_SAMPLES_RATE, "samples_per_s"),
    (TRAINING_TOKENS_RATE, "tokens_per_s"),
)


def register(meter_provider: MeterProvider | None = None) -> bool:
    """Register ``training.step``, ``training.phase`` and the training numbers (once per
    provider); never raises."""
    provider = meter_provider or metrics.get_meter_provider()
    with _lock:
        if id(provider) in _registered:
            return False
        _registered.add(id(provider))
    try:
        meter = provider.get_meter("otel_gpu.tracing", schema_url=SCHEMA_URL)
        observable(meter, TRAINING_STEP, [_observe_step])
        observable(meter, TRAINING_PHASE, [_observe_phase])
        for signal, key in NUMBER_SIGNALS:
            observable(meter, signal, [_number_callback(key)])
        return True
    except Exception as exc:  # never harm the job
        log.warning("otel-gpu: training instruments not registered: %s", exc)
        return False


# -- torch allocator ---------------------------------------------------------------------------


def _torch_devices(torch: Any) -> list[int]:
    """Devices this process uses; only once CUDA is initialized (never initialize it here)."""
    if not in_owner() or not torch.cuda.is_initialized():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        if index == torch.cuda.current_device() or torch.cuda.memory_reserved(index) > 0:
            devices.append(index)
    return devices


def _torch_callback(torch: Any, key: str) -> Any:
    uuids: dict[int, str] = {}

    def observe(_options: CallbackOptions) -> Iterable[Observation]:
        for index in _torch_devices(torch):
            stats = torch.cuda.memory_stats(index)
            value = stats.get(key)
            if value is None:
                continue
            attributes: dict[str, str | int] = {GPU_INDEX: index}
            if index not in uuids:
                try:
                    uuids[index] = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
                except Exception:
                    uuids[index] = ""
            if uuids[index]:
                attributes[HW_ID] = uuids[index]
            yield Observation(int(value), attributes)

    return observe


def register_torch(torch: Any, meter_provider: MeterProvider | None = None) -> bool:
    """Per-device allocator metrics, for CUDA builds of torch only; never raises.

    The callbacks read the caching allocator's counters (no CUDA calls) and skip devices until
    CUDA is initialized, so a CPU-only run reports nothing and a CPU build has no instruments.
    """
    if getattr(getattr(torch, "version", None), "cuda", None) is None:
        return False
    try:
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(
            "otel_gpu.tracing", schema_url=SCHEMA_URL
        )
        for signal, stat in (
            (TORCH_ALLOCATED, "allocated_bytes.all.current"),
            (TORCH_RESERVED, "reserved_bytes.all.current"),
            (TORCH_PEAK, "allocated_bytes.all.peak"),
        ):
            observable(meter, signal, [_torch_callback(torch, stat)])
        return True
    except Exception as exc:
        log.warning("otel-gpu: torch allocator instruments not registered: %s", exc)
        return False
