"""Where and why: the logic behind ``otel-gpu diagnose`` and the diagnoses on alerts.

Pure where it can be (parsers, grouping, ranking on plain data), with the I/O at its edges;
imports :mod:`otel_gpu.core` only (torch lazily). See docs/inprocess.md.
"""
