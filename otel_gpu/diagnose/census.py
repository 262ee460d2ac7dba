"""Live-tensor census: every live tensor grouped by its *holder*, the reference path from a
root a person can find in their code (issue 20 §2).

Roots, in the order they are walked (the first, shortest path to a tensor names it):

- the globals of the program's own modules (not the standard library, not site-packages, not
  otel_gpu): ``train.history`` for ``history`` in ``train.py`` run as ``__main__``; a class or
  function defined there is walked too (class attributes, mutable defaults, closures);
- the local variables of every frame of every thread but otel-gpu's, outermost first:
  ``losses`` with the site ``train() at train.py:41``.

From a root the walk follows containers (``[*]``: an index or key, any), attributes
(``.name``; an ``nn.Module``'s sub-modules, parameters and buffers read as attributes:
``model.encoder._cache``), closure cells (``make_hook.<locals>.outs``), bound methods' owners,
and ``functools.partial`` arguments. It never calls user code (no
properties, no ``__getattr__``), never reads a tensor's values, and is bounded in objects,
depth and time (:class:`Bounds`); where a bound stops it, the census says so.

A tensor's bytes are its storage's, counted once (views of one storage share it, the first
holder found owns it); a tensor with an autograd graph (``grad_fn``) is counted in ``grad_fn``.
Tensors the walk did not reach (held by C++ only, or beyond the bounds) are one "unreached"
row, from ``gc``'s list of live objects.

Two things the walk does not read, because the job's threads change them with the GIL
released (inside torch ops) while the census runs: a parameter's ``.grad`` (backward's
gradient accumulation assigns it) and the tensors an autograd graph saves (backward frees them
as it goes). Reading either during a backward crashed the process with SIGSEGV in a few
seconds of censuses beside a CPU training loop (tests/test_census_beside_backward.py keeps
that loop); the job is worth more than the bytes of the graphs a leak keeps alive, which the
holder's ``grad_fn`` count and the diagnosis line ("autograd graphs alive") still name.

:func:`take` runs on the caller's thread: the channel's request thread in the trainer, never the
job's. Its walk is Python bytecode, so the interpreter switches to the job's threads every
switch interval (5 ms by default): the job runs on, sharing the GIL. :func:`rank_growth`
(pure) compares censuses. torch is imported only when the process already has it.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import sysconfig
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

UNREACHED = "(unreached)"  # the row of tensors no walked path led to
_SEP_CLOSURE = " → "

_ATOMIC = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_SKIP = (type, types.ModuleType, types.CodeType, types.FrameType, types.BuiltinFunctionType)
_MODULE_DICTS = ("_modules", "_parameters", "_buffers")  # nn.Module: read as attributes


@dataclass(frozen=True)
class Bounds:
    """What one census may spend."""

    max_objects: int = 1_000_000
    max_s: float = 5.0
    max_depth: int = 16


@dataclass
class Holder:
    """The tensors one holder path keeps alive."""

    path: str
    root: str  # "global" | "local"
    site: str  # where the root is: a file, or "train() at train.py:41"
    count: int = 0
    bytes: int = 0  # storage bytes
    grad_fn: int = 0  # tensors with a live autograd graph
    devices: dict[str, int] = field(default_factory=dict)  # device -> bytes
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> tensors


@dataclass
class Census:
    time: float  # wall clock (s) when it started
    took_s: float
    visited: int  # objects the walk visited
    tensors: int  # live tensors gc lists
    tensor_bytes: int  # their bytes (each storage once)
    holders: dict[str, Holder]
    truncated: str | None = None  # which bound stopped the walk, if one did

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "took_s": round(self.took_s, 4),
            "visited": self.visited,
            "tensors": self.tensors,
            "bytes": self.tensor_bytes,
            "holders": len(self.holders),
            "truncated": self.truncated,
        }


# -- roots ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../otel_gpu
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs if d)) + (
        os.path.join(here, ""),
    )


@functools.lru_cache(maxsize=8192)
def _is_users(filename: str | None, library: tuple[str, ...]) -> bool:
    """Whether ``filename`` is the program's own code (not a library's, not otel-gpu's)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(library) and "site-packages" not in path


def module_label(name: str, module: types.ModuleType) -> str:
    """``train`` for ``__main__`` run from ``train.py``; the module's name otherwise."""
    if name == "__main__":
        filename = getattr(module, "__file__", None)
        if isinstance(filename, str):
            return os.path.splitext(os.path.basename(filename))[0]
    return name


@dataclass(frozen=True)
class Root:
    name: str  # the first segment of every path from it
    kind: str  # "global" | "local"
    site: str
    obj: Any


def roots(skip_threads: set[int] | None = None) -> list[Root]:
    """The program's module globals, then every other thread's frame locals (outermost first)."""
    library = _library_dirs()
    out: list[Root] = []
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.startswith("otel_gpu"):
            continue
        filename = getattr(module, "__file__", None)
        if not _is_users(filename, library):
            continue
        label = module_label(name, module)
        site = os.path.basename(str(filename))
        for var, value in list(vars(module).items()):
            if var.startswith("__") or isinstance(value, (types.ModuleType, *_ATOMIC)):
                continue
            imported = getattr(value, "__module__", None) != name
            if isinstance(value, (type, types.FunctionType)) and imported:
                continue  # its own module is walked, or it is a library's
            out.append(Root(f"{label}.{var}", "global", site, value))
    # The program's own frames first, then the libraries' (a tensor a library call holds
    # for the moment, named by that call, is not left "unreached").
    local_frames: list[types.FrameType] = []
    lib_frames: list[types.FrameType] = []
    skip = set(skip_threads or ()) | {threading.get_ident()}
    skip |= {t.ident or 0 for t in threading.enumerate() if t.name.startswith("otel-gpu")}
    for ident, top in sys._current_frames().items():  # noqa: SLF001
        if ident in skip:
            continue
        frames = []
        f: types.FrameType | None = top
        while f is not None:
            frames.append(f)
            f = f.f_back
        for f in reversed(frames):  # outermost first: the training loop before forward()
            mine = _is_users(f.f_code.co_filename, library)
            (local_frames if mine else lib_frames).append(f)
        del frames, f
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for f in local_frames + lib_frames:
        code = f.f_code
        if code.co_name == "<module>" or code.co_filename.startswith(here):
            continue  # a module's body (its globals are walked above), or otel-gpu's own
        site = f"{code.co_name}() at {os.path.basename(code.co_filename)}:{f.f_lineno}"
        for var, value in list(f.f_locals.items()):
            if not isinstance(value, (types.ModuleType, *_ATOMIC)):
                out.append(Root(var, "local", site, value))
    del local_frames, lib_frames
    return out


# -- the walk ---------------------------------------------------------------------------------


def _slots(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                yield name


def _children(obj: Any, tensor_type: type | None) -> Iterator[tuple[str, Any]]:
    """``(segment, child)`` for what ``obj`` holds, without running user code."""
    if tensor_type is not None and issubclass(type(obj), tensor_type):
        return  # not its .grad: see the module docstring
    if isinstance(obj, dict):
        for value in list(obj.values()):
            yield "[*]", value
        return
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        for value in list(obj):
            yield "[*]", value
        return
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        enclosing = obj.__qualname__.rsplit(".<locals>.", 1)[0]
        for var, cell in zip(obj.__code__.co_freevars, cells, strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # empty cell
                continue
            yield f"{_SEP_CLOSURE}{enclosing}.<locals>.{var}", value
        for value in obj.__defaults__ or ():
            yield f"{_SEP_CLOSURE}{obj.__qualname__}() default", value
        for value in (obj.__kwdefaults__ or {}).values():
            yield f"{_SEP_CLOSURE}{obj.__qualname__}() default", value
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func
        for value in obj.args:
            yield ".args[*]", value
        for value in obj.keywords.values():
            yield ".keywords[*]", value
        return
    if isinstance(obj, type):  # a class of the program's own (roots only): its attributes
        for name, value in list(vars(obj).items()):
            if not name.startswith("__"):
                yield f".{name}", value
        return
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        attrs = None
    if isinstance(attrs, dict):
        for name, value in list(attrs.items()):
            if name in _MODULE_DICTS and isinstance(value, dict):
                for sub, inner in list(value.items()):  # nn.Module: .encoder, .weight
                    if inner is not None:
                        yield f".{sub}", inner
            else:
                yield f".{name}", value
    for name in _slots(type(obj)):
        try:
            value = object.__getattribute__(obj, name)
        except AttributeError:
            continue
        yield f".{name}", value


def holder_path(segments: Sequence[str]) -> str:
    """The holder of a tensor reached by ``segments``: its path without the trailing indexes
    (``train.history[*]`` is held by ``train.history``)."""
    end = len(segments)
    while end > 1 and segments[end - 1] == "[*]":
        end -= 1
    return "".join(segments[:end])


def _storage(t: Any) -> tuple[Any, int]:
    """(a key naming the tensor's storage, its bytes); never reads values."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        return ((ptr, str(t.device)) if ptr else ("obj", id(st))), int(st.nbytes())
    except Exception:  # sparse, meta, or a tensor subclass without storage
        try:
            return ("obj", id(t)), int(t.numel() * t.element_size())
        except Exception:
            return ("obj", id(t)), 0


class _Walk:
    def __init__(self, bounds: Bounds, clock: Callable[[], float]) -> None:
        self.bounds = bounds
        self.clock = clock
        self.torch = sys.modules.get("torch")
        self.tensor_type: type | None = getattr(self.torch, "Tensor", None)
        self.seen_storage: set[Any] = set()
        self.reached: set[int] = set()
        self.holders: dict[str, Holder] = {}
        self.visited = 0
        self.truncated: str | None = None

    def _count(self, t: Any, segments: list[str], root: Root) -> None:
        path = holder_path(segments)
        h = self.holders.get(path)
        if h is None:
            h = self.holders[path] = Holder(path, root.kind, root.site)
        key, size = _storage(t)
        own = 0 if key in self.seen_storage else size
        self.seen_storage.add(key)
        if getattr(t, "grad_fn", None) is not None:
            h.grad_fn += 1
        h.count += 1
        h.bytes += own
        device = str(t.device)
        h.devices[device] = h.devices.get(device, 0) + own
        dtype = str(t.dtype).removeprefix("torch.")
        h.dtypes[dtype] = h.dtypes.get(dtype, 0) + 1

    def run(self, root_list: Sequence[Root]) -> None:
        """Breadth first from the globals, then from the frame locals not reached yet: what a
        global reaches is named by its global path (``train.callbacks[*].seen``, not the
        loop variable ``cb``), the rest by the frame that holds it."""
        self._started = self.clock()
        self._seen: set[int] = set()
        self._parents: list[int] = []  # node -> parent node (-1: a root)
        self._segs: list[str] = []
        self._node_root: list[int] = []
        for tier in ("global", "local"):
            queue: deque[tuple[Any, int, int]] = deque()  # (object, node, depth)
            for i, r in enumerate(root_list):
                if r.kind != tier or id(r.obj) in self._seen:
                    continue
                self._seen.add(id(r.obj))
                self._parents.append(-1)
                self._segs.append(r.name)
                self._node_root.append(i)
                queue.append((r.obj, len(self._segs) - 1, 0))
            self._drain(queue, root_list)
            if self.truncated:
                break

    def _drain(self, queue: deque[tuple[Any, int, int]], root_list: Sequence[Root]) -> None:
        tensor_type = self.tensor_type
        b = self.bounds
        seen, parents, segs, node_root = self._seen, self._parents, self._segs, self._node_root
        while queue:
            obj, node, depth = queue.popleft()
            self.visited += 1
            if self.visited % 256 == 0:
                if self.clock() - self._started > b.max_s:
                    self.truncated = f"time: stopped after {b.max_s:g} s"
                    break
                if self.visited >= b.max_objects:
                    self.truncated = f"objects: stopped after {b.max_objects} objects"
                    break
            if tensor_type is not None and issubclass(type(obj), tensor_type):
                self.reached.add(id(obj))
                chain = []
                n = node
                while n >= 0:
                    chain.append(segs[n])
                    n = parents[n]
                chain.reverse()
                self._count(obj, chain, root_list[node_root[node]])
            if depth >= b.max_depth:
                continue
            try:
                children = list(_children(obj, tensor_type))
            except Exception:  # an object that changed under us, or an odd C type
                continue
            for seg, child in children:
                if isinstance(child, (*_ATOMIC, *_SKIP)) or id(child) in seen:
                    continue
                seen.add(id(child))
                parents.append(node)
                segs.append(seg)
                node_root.append(node_root[node])
                queue.append((child, len(segs) - 1, depth + 1))
        queue.clear()


def take(bounds: Bounds | None = None, *, clock: Callable[[], float] = time.perf_counter) -> Census:
    """One census of this process, on the caller's thread; never raises for an odd object."""
    bounds = bounds or Bounds()
    started_wall = time.time()
    started = clock()
    walk = _Walk(bounds, clock)
    if walk.tensor_type is None:  # no torch in this process: nothing to count
        return Census(started_wall, clock() - started, 0, 0, 0, {})
    # What gc sees alive before the walk (ids and sizes only: holding the tensors would keep
    # a step's activations alive for the census): totals, and the tensors no path reached.
    # Taken first, so the tensors the job makes while the walk runs are not "unreached".
    tensor_type = walk.tensor_type
    live: dict[int, tuple[Any, int]] = {
        id(o): _storage(o) for o in gc.get_objects() if issubclass(type(o), tensor_type)
    }  # type(), not isinstance(): a few objects warn when their __class__ is read
    walk.run(roots())
    total = 0
    counted: set[Any] = set()
    unreached = Holder(UNREACHED, "none", "no path from a module global or frame local")
    for ident, (key, size) in live.items():
        if key not in counted:
            counted.add(key)
            total += size
        if ident not in walk.reached:
            unreached.count += 1
            if key not in walk.seen_storage:
                walk.seen_storage.add(key)
                unreached.bytes += size
    n_live = len(live)
    del live
    holders = walk.holders
    if unreached.count:
        holders[UNREACHED] = unreached
    return Census(
        started_wall, clock() - started, walk.visited, n_live, total, holders, walk.truncated
    )


# -- growth (pure) ----------------------------------------------------------------------------


def _rising(series: Sequence[int]) -> bool:
    steps = [b - a for a, b in zip(series, series[1:], strict=False)]
    return bool(steps) and all(s > 0 for s in steps)


def rank_growth(
    censuses: Sequence[Census], *, min_single_count: int = 3, min_single_bytes: int = 1 << 20
) -> list[dict[str, Any]]:
    """Every holder of the last census (and those gone since the first), by growth of bytes
    from the first census to the last, largest first. ``growing``: its bytes or its count rose
    in every interval (with two censuses only: by at least ``min_single_count`` tensors or
    ``min_single_bytes``), so a transient local (one batch) is not named. The unreached row is
    never ``growing``: it names no holder, and tensors a step frees while a walk runs land
    there."""
    if not censuses:
        return []
    first, last = censuses[0], censuses[-1]
    paths = list(last.holders) + [p for p in first.holders if p not in last.holders]
    rows: list[dict[str, Any]] = []
    for path in paths:
        seq = [c.holders.get(path) for c in censuses]
        counts = [h.count if h else 0 for h in seq]
        sizes = [h.bytes if h else 0 for h in seq]
        now = seq[-1] or next(h for h in reversed(seq) if h)
        growth_bytes = sizes[-1] - sizes[0]
        growth_count = counts[-1] - counts[0]
        growing = (growth_bytes > 0 or growth_count > 0) and (_rising(counts) or _rising(sizes))
        # "Unreached" names nobody, and it moves with the tensors a step frees during a walk.
        growing = growing and path != UNREACHED
        if growing and len(censuses) == 2:
            growing = growth_count >= min_single_count or growth_bytes >= min_single_bytes
        rows.append(
            {
                "path": path,
                "root": now.root,
                "site": now.site,
                "count": counts[-1],
                "bytes": sizes[-1],
                "grad_fn": (seq[-1].grad_fn if seq[-1] else 0),
                "growth_count": growth_count,
                "growth_bytes": growth_bytes,
                "growing": growing,
                "devices": dict(now.devices),
                "dtypes": dict(now.dtypes),
            }
        )
    rows.sort(key=lambda r: (-r["growth_bytes"], -r["bytes"], r["path"]))
    return rows


def summary_holder(h: Holder) -> dict[str, Any]:
    """A holder of one census as plain data (the census baseline a trainer keeps)."""
    return {
        "path": h.path,
        "root": h.root,
        "site": h.site,
        "count": h.count,
        "bytes": h.bytes,
        "grad_fn": h.grad_fn,
        "devices": dict(h.devices),
        "dtypes": dict(h.dtypes),
    }


def holder_from(record: Mapping[str, Any]) -> Holder:
    return Holder(**{k: record[k] for k in Holder.__dataclass_fields__ if k in record})
