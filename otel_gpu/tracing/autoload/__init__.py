"""The folder ``otel-gpu run`` puts first on a Python job's ``PYTHONPATH`` so that its
interpreters load the in-process part without ``opentelemetry-instrument``: its only other
file, ``sitecustomize.py``, is what Python's ``site`` imports at start-up (see there).
:data:`AUTOLOAD_DIR` is its path."""

from __future__ import annotations

import os

AUTOLOAD_DIR = os.path.dirname(os.path.abspath(__file__))
