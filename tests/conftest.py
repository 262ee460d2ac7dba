"""Shared pytest fixtures. Each section belongs to one concern; add yours in its own section."""

# ---- fake NVML (tests/fakenvml): fake_nvml_library (session), fake_nvml (per test) ----------
from fakenvml.fixtures import FakeNvml, fake_nvml, fake_nvml_library  # noqa: F401
