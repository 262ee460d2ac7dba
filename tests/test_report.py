"""`otel-gpu report`: a recorded run as one offline HTML page, checked in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from support.cli import CLI, clean_env
from support.recording import FAST_LEAK_WINDOWS, record_simulated_leak

# Every test reads the module's report: a real agent's recording, rendered (~12 s), and Chromium.
pytestmark = pytest.mark.peers

OUTPUT = Path(__file__).parent / "output"
WINDOW = (1200, 2200)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A simulated leak recorded by the real agent, and its report."""
    folder = tmp_path_factory.mktemp("report")
    recording = folder / "leak.csv"
    live = record_simulated_leak(recording)
    config = folder / "detect.json"
    config.write_text(json.dumps(FAST_LEAK_WINDOWS))
    page = folder / "report.html"
    res = subprocess.run(
        [*CLI, "report", str(recording), "--config", str(config), "-o", str(page)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return {"page": page, "html": page.read_text(encoding="utf-8"), "live": live}


def chromium(*args: str, page: Path, profile: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "install Debian's chromium package (apt-get install -y chromium)"
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
         # Any network request would fail: the page must not need one.
         "--host-resolver-rules=MAP * ~NOTFOUND", *args, page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_page_is_self_contained(report: dict) -> None:
    html = report["html"]
    assert "<script" not in html
    # No resource outside the page: no src/href/url() to anywhere, no DOCTYPE naming a DTD.
    assert not re.search(r"""(?:src|href)\s*=\s*["'](?!#)""", html)
    assert "url(http" not in html and "<!DOCTYPE svg" not in html and "<?xml" not in html
    # The only URLs are XML namespace names, which are never fetched.
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }


def test_plots_show_memory_floor_fitted_leak_phases_alerts_and_breaker(report: dict) -> None:
    html = report["html"]
    live = report["live"]
    leak = next(a for a in live["alerts"] if a.kind == "leak" and a.subject.startswith("process:"))
    memory = html[html.index('id="memory-0"') : html.index('id="activity-0"')]
    assert memory.count("<svg") == 1
    rate = f"{leak.rate_bytes_per_s * 3600 / 1e6:+.0f} MB/h"
    for legend in ("on GPU0 floor", f"fitted leak {rate}", "phase load", "phase evaluate",
                   "leak alert", "breaker open"):  # fmt: skip
        assert legend in memory, legend
    activity = html[html.index('id="activity-0"') :]
    assert activity.count("<svg") == 1
    assert "utilization" in activity and "power" in activity
    # The summary table and the alerts and transitions, as the live run had them.
    summary = html[html.index('class="summary"') :]
    assert re.search(r"GPU0 51a1a7ed Simulated H100 80GB</td><td>[\d.]+ GiB", summary)
    events = html[html.index('class="events"') :]
    assert events.count("leak alert (") == sum(a.kind == "leak" for a in live["alerts"])
    assert events.count("breaker closed → open") == sum(
        t.to_state == "open" for t in live["transitions"]
    )


def test_chromium_renders_the_page_without_errors_and_the_layout_screenshot(
    report: dict, tmp_path: Path
) -> None:
    dom = chromium("--dump-dom", page=report["page"], profile=tmp_path / "dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 2
    assert "fitted leak" in dom.stdout and "otel-gpu report" in dom.stdout
    for log in (dom.stderr,):
        assert ":CONSOLE(" not in log, log  # console messages (errors included) are logged so
        assert "ERR_NAME_NOT_RESOLVED" not in log  # a fetch the page should not make
    OUTPUT.mkdir(exist_ok=True)
    shot = OUTPUT / "report.png"
    shot.unlink(missing_ok=True)
    res = chromium(
        f"--screenshot={shot}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--hide-scrollbars",
        page=report["page"],
        profile=tmp_path / "shot",
    )
    assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == WINDOW
    # Layout: title and summary at the top, then the two plots one above the other, each a
    # wide block of drawn (non-white) pixels in the page's 1040 px column.
    width, height = image.size
    rows = [
        sum(1 for x in range(0, width, 4) if image.getpixel((x, y)) < 200) for y in range(height)
    ]
    inked = [y for y, n in enumerate(rows) if n > 120]  # an axis line or frame across the plot
    assert inked, "no plot frame drawn"
    bands = [y for i, y in enumerate(inked) if i == 0 or y - inked[i - 1] > 40]
    assert len(bands) >= 2, bands  # two plots, apart
    assert 150 < bands[0] < 1200


def test_a_dollar_in_a_name_is_shown_as_it_is(tmp_path: Path) -> None:
    """A process named ``run$_$x`` (matplotlib's mathtext would raise on it): the report is
    written and shows the name literally, in the plots' legends and in the tables."""
    program = tmp_path / "run$_$x"
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, program)
    recording, page = tmp_path / "run.csv", tmp_path / "report.html"
    res = subprocess.run(
        [*CLI, "run", "--quiet", "--simulate", "leak", "--exporter", "none", "--interval", "0.2",
         "--record", str(recording), "--", str(program), "5"],
        capture_output=True, text=True, timeout=60, env=clean_env(OTEL_GPU_LOCK_DIR=str(tmp_path)),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "run$_$x" in recording.read_text()
    res = subprocess.run(
        [*CLI, "report", str(recording), "-o", str(page)],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    svg = re.findall(r"<svg.*?</svg>", page.read_text(encoding="utf-8"), flags=re.S)
    assert svg and any("run$_$x" in figure for figure in svg)  # the legend, as text
