"""Fake-NVML scenarios (tests/fakenvml/README.md) several tests start from."""

from __future__ import annotations

ONE_GPU_SCENARIO = """
devices = 1
gpu.0.memory.total = 85899345920
gpu.0.memory.used = 21474836480
gpu.0.util.gpu = 80
gpu.0.power.usage = 300000
gpu.0.power.limit = 700000
"""
