"""Shared pytest fixtures. Each section belongs to one concern; add yours in its own section."""

# ---- fake NVML (tests/fakenvml): fake_nvml_library (session), fake_nvml (per test), legacy_nvml
from fakenvml.fixtures import (  # noqa: F401
    FakeNvml,
    fake_nvml,
    fake_nvml_legacy_library,
    fake_nvml_library,
    legacy_nvml,
)
