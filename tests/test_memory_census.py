"""The live-tensor census (otel_gpu/diagnose/census.py) in this process: holders named by the
path a person can find, bytes counted once per storage, autograd graphs seen, bounds kept,
and growth that names only holders that rose in every interval (issue 20 §2)."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from otel_gpu.core.errors import UsageError
from otel_gpu.diagnose import census, memory
from otel_gpu.diagnose.census import UNREACHED, Bounds, Census, Holder, holder_path, rank_growth
from otel_gpu.diagnose.memory_settings import MemorySettings

pytestmark = pytest.mark.unit


def _census_on_a_thread(bounds: Bounds | None = None) -> Census:
    """A census from another thread, as the channel runs it (this thread's frames are roots)."""
    out: dict[str, Census] = {}
    t = threading.Thread(target=lambda: out.update(c=census.take(bounds)), name="census-test")
    t.start()
    t.join(60)
    return out["c"]


@pytest.fixture
def user_module(tmp_path: Path) -> Any:
    """A module of 'the program' (its file outside the libraries), with leaky shapes."""
    path = tmp_path / "mytrain.py"
    path.write_text("# planted\n")
    mod = types.ModuleType("mytrain")
    mod.__file__ = str(path)

    class Memo:  # a class attribute cache
        table: list[torch.Tensor] = [torch.zeros(10) for _ in range(3)]

    Memo.__module__ = "mytrain"

    def make() -> Any:
        kept = [torch.ones(4) for _ in range(2)]

        def fn() -> int:
            return len(kept)

        return fn

    base = torch.zeros(256)
    mod.history = [base[:128], base[128:], torch.zeros(64, dtype=torch.float16)]
    mod.Memo = Memo
    mod.callback = make()
    mod.callback.__module__ = "mytrain"  # defined there (a function imported from elsewhere is not)
    sys.modules["mytrain"] = mod
    yield mod
    del sys.modules["mytrain"]


def test_globals_class_attributes_closures_and_frame_locals_are_named(user_module: Any) -> None:
    losses = [torch.ones(3, requires_grad=True) * 2 for _ in range(5)]  # graphs alive
    c = _census_on_a_thread()
    h = c.holders
    assert h["mytrain.history"].count == 3
    # two views of one 1 KiB storage count once, the float16 tensor its own 128 bytes
    assert h["mytrain.history"].bytes == 256 * 4 + 64 * 2
    assert h["mytrain.history"].dtypes == {"float32": 2, "float16": 1}
    assert h["mytrain.Memo.table"].count == 3
    closure = "mytrain.callback → user_module.<locals>.make.<locals>.kept"
    assert h[closure].count == 2 and h[closure].bytes == 2 * 16
    local = h["losses"]
    assert local.root == "local" and local.count == 5 and local.grad_fn == 5
    assert local.site.startswith(
        "test_globals_class_attributes_closures_and_frame_locals_are_named() at "
        "test_memory_census.py:"
    )
    # the graphs' saved tensors are not read (backward frees them concurrently): own bytes only
    assert local.bytes == 5 * 12
    assert c.truncated is None and c.tensors >= 3 + 3 + 2 + 5
    del losses


def test_the_walk_stops_at_its_bounds_and_says_which(user_module: Any) -> None:
    user_module.many = [[torch.zeros(1)] for _ in range(3000)]
    c = _census_on_a_thread(Bounds(max_objects=1000))
    assert c.truncated == "objects: stopped after 1000 objects"
    assert c.visited <= 1024
    deep = _census_on_a_thread(Bounds(max_depth=1))
    assert "mytrain.many" not in deep.holders  # two references deep
    assert deep.holders[UNREACHED].count >= 3000  # seen by gc, reached by no path


def test_tensor_values_are_never_read(user_module: Any) -> None:
    class Poisoned(torch.Tensor):
        def __repr__(self) -> str:
            raise AssertionError("read")

        def tolist(self) -> Any:
            raise AssertionError("read")

    user_module.poisoned = [torch.zeros(2).as_subclass(Poisoned)]
    c = _census_on_a_thread()
    assert c.holders["mytrain.poisoned"].count == 1


def test_holder_paths_drop_trailing_indexes_only() -> None:
    assert holder_path(["train.history", "[*]"]) == "train.history"
    assert holder_path(["train.cbs", "[*]", ".seen", "[*]", "[*]"]) == "train.cbs[*].seen"
    assert holder_path(["x"]) == "x"


def _c(**holders: tuple[int, int]) -> Census:
    return Census(
        0.0, 0.0, 0, 0, 0,
        {p.replace("_", "."): Holder(p.replace("_", "."), "global", "t.py", n, b)
         for p, (n, b) in holders.items()},
    )  # fmt: skip


def test_growth_names_holders_that_rose_in_every_interval() -> None:
    series = [
        _c(t_hist=(10, 100), t_local=(0, 0), t_cache=(8, 80), t_swap=(1, 50)),
        _c(t_hist=(20, 200), t_local=(1, 40), t_cache=(8, 80), t_swap=(1, 60)),
        _c(t_hist=(30, 300), t_local=(1, 40), t_cache=(8, 80), t_swap=(1, 70)),
    ]
    rows = rank_growth(series)
    by = {r["path"]: r for r in rows}
    assert [r["path"] for r in rows if r["growing"]] == ["t.hist", "t.swap"]  # most growth first
    assert by["t.hist"]["growth_count"] == 20 and by["t.hist"]["growth_bytes"] == 200
    assert not by["t.local"]["growing"]  # one batch that appeared: not a leak
    assert not by["t.cache"]["growing"] and by["t.cache"]["growth_bytes"] == 0
    assert memory.lines(rows, 30.0)[0] == (
        "t.hist: +20 tensors, +200 B in 30 s (now 30, 300 B; ? on ?) — global in t.py"
    )


def test_two_censuses_need_a_clear_rise_and_unreached_names_nobody() -> None:
    def h(path: str, n: int, b: int) -> Holder:
        return Holder(path, "global", "t.py", n, b)

    two = rank_growth(
        [
            Census(0, 0, 0, 0, 0, {"a": h("a", 1, 10), "b": h("b", 5, 10), UNREACHED: h(UNREACHED, 0, 0)}),
            Census(0, 0, 0, 0, 0, {"a": h("a", 2, 20), "b": h("b", 9, 50), UNREACHED: h(UNREACHED, 90, 9000)}),
        ]
    )  # fmt: skip
    by = {r["path"]: r for r in two}
    assert not by["a"]["growing"] and by["b"]["growing"]
    assert by[UNREACHED]["growth_bytes"] == 9000 and not by[UNREACHED]["growing"]


def test_settings_bound_the_census_and_refuse_bad_values_in_one_line() -> None:
    s = MemorySettings.load({"OTEL_GPU_DIAGNOSE_CENSUS_MAX_S": "0.5"})
    assert s.census_max_s == 0.5 and s.census_max_objects == 1_000_000
    with pytest.raises(UsageError, match=r"^OTEL_GPU_DIAGNOSE_CENSUS_MAX_OBJECTS='10': use a"):
        MemorySettings.load({"OTEL_GPU_DIAGNOSE_CENSUS_MAX_OBJECTS": "10"})
