"""The argv of every Python interpreter we start (the sampling helper, the GPU host probe, the
job guard, the demo's workload): one that never imports code from the working directory.

A plain ``python -m mod`` or ``python -c code`` puts the working directory first on
``sys.path``: a ``json.py`` another user leaves in ``/tmp`` or ``/scratch``, where jobs are
launched, would run as whoever runs ``otel-gpu run`` there, root included (issue 18.2).
``python /path/train.py`` is not exposed (its ``sys.path[0]`` is ``/path``), so without this
the agent would add a hole the job does not have.

Why not ``-I``: isolated mode also ignores ``PYTHONPATH`` and every other ``PYTHON*`` variable,
and the helper must import the ``otel_gpu`` (and NVML bindings) the user's ``PYTHONPATH``
provides, as our tests do. ``-P`` (Python >= 3.11) drops only the working directory; before
3.11 a ``-c`` bootstrap removes ``sys.path[0]`` (``''`` for ``-c``) before anything is imported
and runs the module with :mod:`runpy`. The job guard, which needs nothing from the environment,
is the one caller that asks for ``-I -S`` (``isolated=True``).

``tests/test_child_python.py`` fails if a module of the package names ``sys.executable``
anywhere but here.
"""

from __future__ import annotations

import sys

SAFE_PATH_FLAG = sys.version_info >= (3, 11)  # -P exists

# Runs before anything is imported: -c puts '' (the working directory) at sys.path[0].
_DROP_CWD = "import sys as _s; del _s.path[0]; del _s\n"


def interpreter() -> str:
    """The interpreter children run on: this one."""
    return sys.executable


def python_argv(*args: str, isolated: bool = False) -> list[str]:
    """The argv that runs ``python ARGS`` without the working directory on ``sys.path``.

    ``args`` start with ``-m MODULE``, ``-c CODE`` or a script path; ``isolated`` adds
    ``-I -S`` (no ``PYTHON*`` variables, no site-packages: for children that need neither)."""
    if not args:
        raise ValueError("python_argv needs -m MODULE, -c CODE or a script")
    exe = interpreter()
    if isolated:
        return [exe, "-I", "-S", *args]  # -I also keeps the working directory out
    if SAFE_PATH_FLAG:
        return [exe, "-P", *args]
    return [exe, *_bootstrapped(list(args))]


def _bootstrapped(args: list[str]) -> list[str]:
    """``args`` for an interpreter without ``-P``: the same program behind a ``-c`` bootstrap
    that removes the working directory from ``sys.path`` first."""
    if args[0] == "-c":
        return ["-c", _DROP_CWD + args[1], *args[2:]]
    if args[0] == "-m":
        run = f"import runpy as _r; _r.run_module({args[1]!r}, run_name='__main__', alter_sys=True)"
        return ["-c", _DROP_CWD + run, *args[2:]]
    return args  # a script: sys.path[0] is its own directory, never the working directory
