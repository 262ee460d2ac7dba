"""Shared pytest fixtures and hooks. Each section belongs to one concern; add yours in its own section."""

# ---- fake NVML (tests/fakenvml): fake_nvml_library (session), fake_nvml (per test), legacy_nvml
from fakenvml.fixtures import (  # noqa: F401
    FakeNvml,
    fake_nvml,
    fake_nvml_legacy_library,
    fake_nvml_library,
    legacy_nvml,
)

# ---- tiers (tests/support/tiers.py): exactly one per test; a unit test stays in-process
from support.tiers import a_unit_test_stays_in_process, pytest_collection_modifyitems  # noqa: F401
