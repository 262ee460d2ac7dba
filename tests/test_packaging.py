"""The package as pip builds it (issue 23.5): one version (``otel_gpu.__version__``), the
``Framework :: OpenTelemetry`` and Development Status classifiers, and the ``py.typed`` marker
(PEP 561) in the wheel, so type checkers read our annotations."""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from otel_gpu import __version__

pytestmark = pytest.mark.process  # runs pip

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


def test_the_version_has_one_source(wheel: Path) -> None:
    assert _metadata(wheel)["Version"] == __version__
    assert wheel.name.startswith(f"otel_gpu-{__version__}-")
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_the_classifiers_say_what_it_is(wheel: Path) -> None:
    classifiers = _metadata(wheel).get_all("Classifier") or []
    assert "Framework :: OpenTelemetry" in classifiers
    assert "Framework :: OpenTelemetry :: Distros" in classifiers
    assert [c for c in classifiers if c.startswith("Development Status :: ")]
    assert "Typing :: Typed" in classifiers


def test_the_wheel_carries_the_typed_marker(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        assert "otel_gpu/py.typed" in z.namelist()
