"""The live view of `otel-gpu run` as a person sees it: in a real pseudo-terminal (rendered by
pyte, a terminal emulator), and as one line per interval when stderr is a pipe."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest
from support.cli import CLI, clean_env

from otel_gpu.core import units
from otel_gpu.outputs.view import LIVE, OFF, PLAIN, choose_mode

OUTPUT = Path(__file__).parent / "output"
JOB = "import time; print('job says hi', flush=True); time.sleep(3)"
# A job that keeps printing while the view is drawn.
CHATTY = (
    "import time\nfor i in range(8):\n    print(f'job line {i}', flush=True)\n    time.sleep(0.4)"
)
RUN = [*CLI, "run", "--simulate", "leak", "--exporter", "none", "--interval", "0.3"]
COLOUR = re.compile(rb"\x1b\[(?:[0-9;]*;)?(?:3[0-7]|9[0-7]|38;[25];[0-9;]+)m")


def run_in_terminal(args: list[str], columns: int, rows: int = 30, **env: str) -> bytes:
    """Run ``args`` with stdin/stdout/stderr on a new pseudo-terminal of that size; all bytes."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    environ = clean_env(TERM="xterm-256color", **env)
    for name in ("COLUMNS", "LINES"):  # a CI runner's own size would override the terminal's
        environ.pop(name, None)
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=environ)
    os.close(follower)
    out = bytearray()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    return bytes(out)


def screen(data: bytes, columns: int, rows: int = 30) -> list[str]:
    """The terminal's scrollback and screen at the end, line by line (trailing blanks dropped)."""
    scr = pyte.HistoryScreen(columns, rows, history=1000)
    pyte.ByteStream(scr).feed(data)
    history = ["".join(line[x].data for x in range(columns)) for line in scr.history.top]
    return [line.rstrip() for line in history + scr.display]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("quiet", "force", "terminal", "mode"),
    [
        (False, False, True, LIVE),
        (False, False, False, PLAIN),
        (False, True, False, LIVE),
        (True, False, True, OFF),
        (True, False, False, OFF),
    ],
)
def test_mode_follows_the_terminal_and_the_flags(quiet, force, terminal, mode) -> None:
    assert choose_mode(quiet, force, terminal) == mode


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (units.memory(31.25 * units.GIB), "31.2 GiB"),
        (units.memory(512 * units.MIB), "512 MiB"),
        (units.memory(None), "-"),
        (units.memory_of(33.4 * units.GIB, 80 * units.GIB), "33.4/80.0 GiB"),
        (units.rate(400e6 / 3600), "+400 MB/h"),
        (units.rate(-50e6 / 3600), "-50 MB/h"),
        (units.gpu_label(0, "GPU-51a1a7ed-0000-4000-8000-000000000000"), "GPU0 51a1a7ed"),
        (units.gpu_label(1, "MIG-5d3c0000-1111-4000-8000-000000000001"), "MIG1 5d3c0000"),
        (units.fraction(0.934), "93%"),
    ],
)
def test_units_are_gib_mib_and_mb_per_hour(value: str, text: str) -> None:
    assert value == text


@pytest.mark.process
def test_terminal_view_is_a_table_redrawn_in_place_using_a_wide_terminal() -> None:
    # A wide terminal: the table takes its width (issue 19.6), no more.
    data = run_in_terminal([*RUN, "--", sys.executable, "-c", JOB], columns=160)
    lines = screen(data, 160)
    OUTPUT.mkdir(exist_ok=True)
    (OUTPUT / "live_view.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    text = "\n".join(lines)
    assert "job says hi" in text  # the job's own output is on the same terminal
    header = next(i for i, line in enumerate(lines) if re.match(r"GPU\s+model\s+memory", line))
    gpu = lines[header + 1]
    assert re.match(
        r"GPU0 51a1a7ed\s+Simulated H.*\s[\d.]+/80\.0 GiB\s+\d+%\s+\d+ W\s+\d+°C\s+ok", gpu
    )
    proc_header = next(i for i, line in enumerate(lines) if re.match(r"\s+PID\s+process", line))
    assert re.search(r"^\s+\d+\s+python\S*\s+GPU0\s+[\d.]+ (GiB|MiB)\s", lines[proc_header + 1])
    assert any(line.startswith("breaker all closed") for line in lines)
    assert any(line.startswith("last alert: none") for line in lines)
    top = next(i for i, line in enumerate(lines) if line.startswith("otel-gpu run python  up"))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("last alert"))
    assert max(len(line) for line in lines[top : bottom + 1]) <= 160
    assert len(lines[header]) > 80  # the names got the room an 80-column table lacks
    # Drawn in place below the job's output: the header is on screen once though drawn many times.
    assert sum(1 for line in lines if re.match(r"GPU\s+model", line)) == 1
    assert data.count(b"\x1b7") >= 3  # drawn again and again, cursor saved around each
    assert COLOUR.search(data)  # coloured states and utilization
    assert "otel-gpu summary" in text


@pytest.mark.process
def test_job_output_scrolls_above_the_view_intact() -> None:
    data = run_in_terminal([*RUN, "--", sys.executable, "-c", CHATTY], columns=80, rows=24)
    lines = screen(data, 80, rows=24)
    job = [line for line in lines if line.startswith("job line")]
    assert job == [f"job line {i}" for i in range(8)]  # none overwritten by a redraw
    view = next(i for i, line in enumerate(lines) if re.match(r"GPU\s+model", line))
    assert view > max(lines.index(line) for line in job)


@pytest.mark.process
def test_no_color_keeps_the_live_table_without_colour() -> None:
    data = run_in_terminal([*RUN, "--", sys.executable, "-c", JOB], columns=80, NO_COLOR="1")
    assert not COLOUR.search(data)
    assert data.count(b"\x1b7") >= 3
    lines = screen(data, 80)
    assert any(re.match(r"GPU0 51a1a7ed\s", line) for line in lines)


@pytest.mark.process
def test_quiet_terminal_shows_only_the_job() -> None:
    data = run_in_terminal([*RUN, "--quiet", "--", sys.executable, "-c", JOB], columns=80)
    assert [line for line in screen(data, 80) if line] == ["job says hi"]


@pytest.mark.process
def test_pipes_get_one_plain_line_per_interval_and_a_clean_stdout() -> None:
    res = subprocess.run(
        # --no-instrument: the plain job's 3 s, without the in-process part's start-up
        [*RUN, "--interval", "1", "--no-instrument", "--", sys.executable, "-c", JOB],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout == "job says hi\n"  # the job's stdout, untouched
    assert "\x1b[" not in res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("otel-gpu: watching python (PID ")
    assert "every 1 s, no metric export, detection on" in lines[0]
    status = [line for line in lines if line.startswith("otel-gpu run python up ")]
    assert 2 <= len(status) <= 5  # one per sweep (3 s at 1 s)
    assert len(set(status)) == len(status)  # each a new sweep, none repeated
    assert all(
        " | GPU0 51a1a7ed " in line and line.endswith("breaker all closed") for line in status
    )
    assert re.search(r" \| python\S* \d+ GPU0 [\d.]+ (GiB|MiB) floor ", status[-1])


@pytest.mark.process
def test_view_flag_forces_the_table_onto_a_pipe() -> None:
    res = subprocess.run(
        [*RUN, "--view", "--", sys.executable, "-c", JOB], capture_output=True, timeout=60,
        env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0
    assert res.stdout == b"job says hi\n"
    assert res.stderr.count(b"\x1b7") >= 2  # pinned and redrawn
    plain = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[78]", b"", res.stderr)
    assert re.search(rb"GPU\s+model\s+memory", plain)
    assert not re.search(rb"^otel-gpu run python up ", plain, re.M)


@pytest.mark.process
def test_quiet_and_view_together_is_a_usage_error() -> None:
    res = subprocess.run(
        [*RUN, "--quiet", "--view", "--", "true"], capture_output=True, text=True, timeout=60,
        env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 2 and "--quiet and --view" in res.stderr
    assert len(res.stderr.splitlines()) == 1


@pytest.mark.process
def test_watch_shows_the_view_and_the_summary_for_an_attached_tree(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        res = subprocess.run(
            [*CLI, "watch", "--pid", str(job.pid), "--simulate", "steady", "--exporter", "none",
             "--interval", "0.3", "--summary-json", str(tmp_path / "s.json")],
            capture_output=True, text=True, timeout=60, env=clean_env(),
        )  # fmt: skip
    finally:
        job.kill()
        job.wait()
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0].startswith("otel-gpu: watching python") and f"(PID {job.pid})" in lines[0]
    status = [line for line in lines if line.startswith("otel-gpu watch python")]
    assert status and f" {job.pid} GPU0 " in status[-1]
    assert "otel-gpu summary" in res.stderr
    assert json.loads((tmp_path / "s.json").read_text())["exit_code"] is None


def _full_pipe() -> tuple[int, object]:
    """A pipe nobody reads, already full: any further write blocks (a stalled terminal)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)
    return read_end, os.fdopen(write_end, "w")


@pytest.mark.unit
def test_a_stalled_terminal_blocks_only_the_view_never_the_sampler() -> None:
    from otel_gpu.agent.agent import Agent
    from otel_gpu.agent.settings import Settings
    from otel_gpu.outputs.view import LiveView, make_console
    from otel_gpu.sampling.sim import SimulatedSource

    read_end, stream = _full_pipe()
    agent = Agent(Settings(interval_s=0.05, exporter="none"), source=SimulatedSource("leak"))
    view = LiveView(PLAIN, "otel-gpu run x", console=make_console(stream)).attach(
        agent.sampler, agent.watchdog
    )
    view.start("first line")  # the view's thread is stuck writing this from now on
    agent.start()
    try:
        deadline = time.monotonic() + 20
        while agent.sampler.sweeps < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.sampler.sweeps >= 10  # sampling (and detection) went on
        began = time.monotonic()
        view.stop(timeout_s=0.5)  # bounded although its thread cannot finish
        assert time.monotonic() - began < 5
    finally:
        agent.shutdown(2.0)
        os.close(read_end)  # unblocks the view's thread (EPIPE), which then ends
