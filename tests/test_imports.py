"""The package's import structure: every module imports on its own, nothing imports in a circle.

A cycle held together by lazy imports (or by ``try/except ImportError`` around the project's
own modules) works until someone moves one import, then fails in a far-away process at start-up.
These checks read the source (every ``import`` statement, function-level ones included) and
start one fresh interpreter per module.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "otel_gpu"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``package`` (a folder)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = module_names(PACKAGE)


def _imported(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement loads (a name imported from a package counts
    as that package unless it is a submodule)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        assert node.level == 0, "the package uses absolute imports only"
        base = node.module or ""
        targets = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names
        ]
    return [t for t in targets if t.split(".")[0] == "otel_gpu"]


def _with_parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (packages included, since
    importing ``a.b.c`` runs ``a.b``). A module's own parent packages are left out: Python has
    always loaded them before the module itself."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, modules):
                    edges.update(
                        t
                        for t in _with_parents(target)
                        if t in modules and t != name and not name.startswith(t + ".")
                    )
    return graph


def part_of(module: str) -> str:
    """The top-level part a module belongs to: ``otel_gpu.tracing.run`` -> ``otel_gpu.tracing``."""
    return ".".join(module.split(".")[:2])


def parts_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(part_of(module), set()).update(
            part_of(t) for t in targets if part_of(t) != part_of(module)
        )
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def import_error_guards(modules: dict[str, Path]) -> list[str]:
    """``module:line`` of each project import inside a ``try`` that catches ImportError."""
    guarded = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Try):
                continue
            caught = {
                n.id
                for h in node.handlers
                if h.type is not None
                for n in ast.walk(h.type)
                if isinstance(n, ast.Name)
            }
            if not caught & {"ImportError", "ModuleNotFoundError"}:
                continue
            for stmt in node.body:
                for inner in ast.walk(stmt):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and _imported(
                        inner, modules
                    ):
                        guarded.append(f"{name}:{inner.lineno}")
    return guarded


def _sample_package(root: Path, sources: dict[str, str]) -> dict[str, Path]:
    for relative, text in sources.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return module_names(root / "otel_gpu")


@pytest.mark.unit
def test_the_checks_see_a_lazy_cycle_and_a_guarded_import(tmp_path: Path) -> None:
    # The checks below pass only if they would catch these: a function-level import closing a
    # circle between two parts (the shape agent -> watchdog -> tracing -> agent once had), and
    # a try/except ImportError around a project import holding it together.
    modules = _sample_package(
        tmp_path,
        {
            "otel_gpu/__init__.py": "",
            "otel_gpu/tracing/__init__.py": "from otel_gpu.tracing.api import phase\n",
            "otel_gpu/tracing/api.py": "from otel_gpu import __version__\nphase = 1\n",
            "otel_gpu/tracing/pipeline.py": "def f():\n    from otel_gpu.agent import A\n",
            "otel_gpu/agent.py": (
                "def g():\n    try:\n        from otel_gpu.tracing import phase\n"
                "    except ImportError:\n        pass\n"
                "try:\n    import tomllib\nexcept ImportError:\n    tomllib = None\n"
            ),
        },
    )
    graph = import_graph(modules)
    assert cycle(graph) is None  # modules alone: no circle, parent packages are not edges
    found = cycle(parts_graph(graph))
    assert found is not None and set(found) == {"otel_gpu.agent", "otel_gpu.tracing"}
    assert import_error_guards(modules) == ["otel_gpu.agent:3"]  # not the stdlib fallback


@pytest.mark.unit
@pytest.mark.parametrize(
    ("level", "make"),
    [("module", lambda g: g), ("part", parts_graph)],
    ids=["modules", "parts"],
)
def test_no_import_cycle(level: str, make) -> None:  # type: ignore[no-untyped-def]
    found = cycle(make(import_graph(MODULES)))
    assert found is None, f"import cycle between {level}s: {' -> '.join(found or [])}"


@pytest.mark.unit
def test_no_import_error_guard_around_a_project_import() -> None:
    assert import_error_guards(MODULES) == []


def _import_alone(module: str) -> str | None:
    res = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    return None if res.returncode == 0 else res.stderr.strip().splitlines()[-1]


@pytest.mark.peers
def test_every_module_imports_in_a_fresh_interpreter() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(MODULES, pool.map(_import_alone, MODULES), strict=True))
    assert {m: error for m, error in results.items() if error is not None} == {}


# Which parts may not import which: the processor is fleet-side and shares only the vocabulary
# (core), the engine (detect) and the actions with the agent; trainer code (tracing) never
# composes the node agent (that happens at the edge, in otel_gpu.distro); core is imported by
# everyone and imports no other part.
FORBIDDEN = {
    "otel_gpu.processor": {
        "otel_gpu.agent",
        "otel_gpu.outputs",
        "otel_gpu.commands",
        "otel_gpu.tracing",
        "otel_gpu.sampling",
    },
    "otel_gpu.tracing": {"otel_gpu.agent", "otel_gpu.commands", "otel_gpu.outputs"},
    "otel_gpu.detect": {"otel_gpu.agent", "otel_gpu.processor", "otel_gpu.tracing"},
    # where-and-why logic (docs/inprocess.md): core only; tracing and agent call it
    "otel_gpu.diagnose": {
        "otel_gpu.agent",
        "otel_gpu.actions",
        "otel_gpu.commands",
        "otel_gpu.detect",
        "otel_gpu.inference",
        "otel_gpu.k8s",
        "otel_gpu.outputs",
        "otel_gpu.processor",
        "otel_gpu.resource",
        "otel_gpu.sampling",
        "otel_gpu.tracing",
    },
}
ENTRY_POINTS = {"otel_gpu", "otel_gpu.cli", "otel_gpu.distro"}


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """``part -> part`` for every import edge a rule above (or core's isolation) forbids."""
    found = set()
    for part, targets in parts_graph(graph).items():
        banned = FORBIDDEN.get(part, set())
        if part == "otel_gpu.core":
            banned = {t for t in targets if t != "otel_gpu"}
        found.update(f"{part} -> {t}" for t in targets & banned)
    return sorted(found)


@pytest.mark.unit
def test_the_rule_check_sees_a_forbidden_lazy_import(tmp_path: Path) -> None:
    modules = _sample_package(
        tmp_path,
        {
            "otel_gpu/__init__.py": "",
            "otel_gpu/core/__init__.py": "",
            "otel_gpu/core/units.py": "def f():\n    from otel_gpu.agent.x import y\n",
            "otel_gpu/agent/__init__.py": "",
            "otel_gpu/agent/x.py": "y = 1\n",
            "otel_gpu/processor/__init__.py": "",
            "otel_gpu/processor/scrape.py": "def g():\n    import otel_gpu.agent.x\n",
            "otel_gpu/tracing/__init__.py": "from otel_gpu.core import units\n",
        },
    )
    assert forbidden_imports(import_graph(modules)) == [
        "otel_gpu.core -> otel_gpu.agent",
        "otel_gpu.processor -> otel_gpu.agent",
    ]


@pytest.mark.unit
def test_no_part_imports_what_its_rule_forbids() -> None:
    assert forbidden_imports(import_graph(MODULES)) == []


@pytest.mark.unit
def test_the_top_level_holds_only_entry_points_and_rooms() -> None:
    loose = {m for m, path in MODULES.items() if m.count(".") == 1 and path.name != "__init__.py"}
    assert loose | {"otel_gpu"} == ENTRY_POINTS, "a module at the top level: put it in a room"
