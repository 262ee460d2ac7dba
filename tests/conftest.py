"""Shared pytest fixtures and hooks. Each section belongs to one concern; add yours in its own section."""

# ---- fake NVML (tests/fakenvml): fake_nvml_library (session), fake_nvml (per test), legacy_nvml,
# nvml_driver (a driver branch's build, per test)
from fakenvml.fixtures import (  # noqa: F401
    FakeNvml,
    fake_nvml,
    fake_nvml_driver_libraries,
    fake_nvml_legacy_library,
    fake_nvml_library,
    legacy_nvml,
    nvml_driver,
)

# ---- plugins: tiers (exactly one per test; a unit test stays in-process) and parallel workers
# (how many, what each keeps to itself, which tests share one): tests/support/{tiers,parallel}.py
pytest_plugins = ["support.tiers", "support.parallel"]
