"""Loaded by Python's ``site`` at start-up in the processes of a job that ``otel-gpu run``
started (its folder is first on their ``PYTHONPATH``): the in-process part, as
``opentelemetry-instrument`` would load it.

1. Any other ``sitecustomize`` further down the path (the user's, a distribution's) is
   imported first, as if this one were not there.
2. Then (unless this is ``opentelemetry-instrument`` itself, which does it in the program it
   execs) OpenTelemetry's auto-instrumentation starts (``initialize()``: the ``otel_gpu`` distro
   and configurator decide the process's role), with this folder taken off ``PYTHONPATH``
   meanwhile, so a process started during start-up does not start it again.

Never raises: an interpreter without OpenTelemetry (another Python than the one otel-gpu is
installed in) just runs without it. Imported under any other name (the test that imports
every module), it does nothing.
"""

from __future__ import annotations

import os
import sys


def _chain(here: str) -> None:
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            print(f"otel-gpu: the next sitecustomize failed: {exc}", file=sys.stderr)
    except Exception as exc:  # as site.py does: say it, run on
        print(f"otel-gpu: the next sitecustomize failed: {exc}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _load() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    _chain(here)
    argv = getattr(sys, "orig_argv", sys.argv)
    if any(os.path.basename(a) == "opentelemetry-instrument" for a in argv[:2]):
        return  # it loads the in-process part itself, in the program it execs
    try:
        from opentelemetry.instrumentation.auto_instrumentation import initialize
    except Exception:
        return  # not the interpreter otel-gpu is installed in
    path = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in path.split(os.pathsep) if os.path.abspath(p or os.curdir) != here
        )
    try:
        initialize()
    except Exception as exc:
        print(f"otel-gpu: in-process part not loaded: {exc}", file=sys.stderr)
    finally:
        if path is not None:
            current = os.environ.get("PYTHONPATH", "")
            os.environ["PYTHONPATH"] = here + (os.pathsep + current if current else "")


if __name__ == "sitecustomize":
    _load()
