"""The node agent: settings, the sampler's instruments, the detection watchdog, self-metrics,
health, export and the one-sampler-per-node lock.

Composed by the commands (``run``, ``watch``, ``sidecar``, ``demo``) and, inside an
instrumented trainer, by :mod:`otel_gpu.distro`. The processor imports nothing from here.
"""
