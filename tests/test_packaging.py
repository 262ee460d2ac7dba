"""The package as pip builds it (issue 23.5): one version (``otel_gpu.__version__``), the
``Framework :: OpenTelemetry`` and Development Status classifiers, and the ``py.typed`` marker
(PEP 561) in the wheel, so type checkers read our annotations."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from otel_gpu import __version__

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "otel_gpu", src / "otel_gpu", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = src / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(src), "-w", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (found,) = out.glob("otel_gpu-*.whl")
    return found


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


@pytest.mark.process  # builds the wheel with pip
def test_the_version_has_one_source(wheel: Path) -> None:
    assert _metadata(wheel)["Version"] == __version__
    assert wheel.name.startswith(f"otel_gpu-{__version__}-")
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.process  # builds the wheel with pip
def test_the_classifiers_say_what_it_is(wheel: Path) -> None:
    classifiers = _metadata(wheel).get_all("Classifier") or []
    assert "Framework :: OpenTelemetry" in classifiers
    assert "Framework :: OpenTelemetry :: Distros" in classifiers
    assert [c for c in classifiers if c.startswith("Development Status :: ")]
    assert "Typing :: Typed" in classifiers


@pytest.mark.process  # builds the wheel with pip
def test_the_wheel_carries_the_typed_marker(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        assert "otel_gpu/py.typed" in z.namelist()


def _floors() -> dict[str, tuple[int, ...]]:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)>=([0-9.]+)(b0)?", dep)
        if m:
            out[m.group(1)] = tuple(int(x) for x in m.group(2).split(".") if x)
    return out


@pytest.mark.unit
def test_the_opentelemetry_floors_are_one_release_that_installs_together() -> None:
    """OpenTelemetry Python releases core 1.N with contrib 0.(N+21)b0, and each contrib package
    pins the SDK to its own release (exporter-prometheus 0.66b0: sdk ~=1.45.0): floors from
    different releases cannot be installed together (checked by hand in a fresh venv, see
    docs/development.md; the suite reaches no registry)."""
    floors = _floors()
    core = {n: v[:2] for n, v in floors.items() if n.startswith("opentelemetry-") and v[0] == 1}
    contrib = {n: v[:2] for n, v in floors.items() if n.startswith("opentelemetry-") and v[0] == 0}
    assert len(core) >= 4 and len(contrib) >= 2, floors
    (minor,) = {v[1] for v in core.values()}
    assert {v[1] for v in contrib.values()} == {minor + 21}, (core, contrib)
    assert floors["grpcio"] >= (1, 63, 2)  # what opentelemetry-exporter-otlp-proto-grpc 1.45 asks
