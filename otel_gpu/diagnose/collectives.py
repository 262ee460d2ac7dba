"""The collective picture of a hung job: PyTorch's flight recorder (issue 21 §3).

Every rank's process group records its recent collectives (sequence number, op, process group;
on by default, ``TORCH_FR_BUFFER_SIZE`` entries). Each rank's dump comes from its in-process
part (the channel operation ``fr.dump``, :func:`handle_fr_dump`: the recorder's JSON, trimmed
to the last entries) — for gloo (CPU) and NCCL alike. Compared across ranks the way
``torchfrtrace`` does it, the dumps say which collective a rank has not joined ("collective 5
all_reduce (default_pg): rank 1 missing"), which ranks called different collectives at the same
sequence number (a mismatch), or that every rank joined one that never completed.

:func:`findings` is pure (dumps in, findings out); :func:`collect_dumps` does the asking.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.core.channel import ChannelError, request, socket_path
from otel_gpu.diagnose.jobprocs import JobProcess, runtime_dirs_of

MAX_ENTRIES = 64  # the last entries a rank sends (the recorder keeps up to 2000)
DUMP_TIMEOUT_S = 3.0  # the first dump of a process can take ~1 s

MISSING = "missing"
MISMATCH = "mismatch"
STUCK = "stuck"
NO_DUMP = "no_dump"

# The flight-recorder variables of PyTorch (the first is the old name of the second).
FR_BUFFER_OLD = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
FR_PIPE = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
FR_TEMP = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_BUFFER_DEFAULT = "2000"


def flight_recorder_env(env: Mapping[str, str], directory: str) -> dict[str, str]:
    """The flight-recorder variables to add to a job's environment ``env``: each only when the
    user has not set it (either name of the buffer size counts). ``directory``: this user's
    private runtime directory, where the per-rank pipes and dumps go."""
    add: dict[str, str] = {}
    if FR_BUFFER not in env and FR_BUFFER_OLD not in env:
        add[FR_BUFFER] = FR_BUFFER_DEFAULT
    if FR_PIPE not in env:
        add[FR_PIPE] = os.path.join(directory, "fr-pipe-")
    if FR_TEMP not in env:
        add[FR_TEMP] = os.path.join(directory, "fr-dump-")
    return add


# --- the in-process side ------------------------------------------------------------------


def handle_fr_dump(request: Mapping[str, Any]) -> Mapping[str, Any]:
    """The channel operation ``fr.dump``: this rank's flight-recorder entries (the last
    ``max_entries``), process-group status and configuration. Never imports torch: a process
    that has not initialised ``torch.distributed`` has nothing recorded."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"available": False, "reason": "torch.distributed is not initialised here"}
    limit = request.get("max_entries", MAX_ENTRIES)
    limit = limit if isinstance(limit, int) and 0 < limit <= 2000 else MAX_ENTRIES
    c10d = sys.modules["torch"]._C._distributed_c10d
    backend = str(dist.get_backend())
    # NCCL process groups keep their own recorder; gloo (and the rest) the generic one.
    nccl = getattr(c10d, "_dump_nccl_trace_json", None) if "nccl" in backend else None
    dump = nccl or c10d._dump_fr_trace_json
    started = time.monotonic()
    data = json.loads(dump(includeCollectives=True, onlyActive=False))
    entries = data.get("entries") or []
    return {
        "available": True,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": backend,
        "entries": [_slim(e) for e in entries[-limit:]],
        "pg_status": data.get("pg_status") or {},
        "pg_config": data.get("pg_config") or {},
        "took_s": round(time.monotonic() - started, 4),
    }


def _slim(e: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("collective_seq_id", "p2p_seq_id", "is_p2p", "pg_id", "process_group",
            "profiling_name", "state", "retired", "input_sizes", "time_created_ns")  # fmt: skip
    return {k: e.get(k) for k in keep}


# --- the findings (pure) ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # MISSING, MISMATCH, STUCK or NO_DUMP
    line: str
    pg: str | None = None
    seq: int | None = None
    op: str | None = None
    ranks: tuple[int, ...] = ()  # the ranks at fault (missing, odd op, without a dump)
    ops: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "line": self.line,
            "process_group": self.pg,
            "seq": self.seq,
            "op": self.op,
            "ranks": list(self.ranks),
            "ops": self.ops,
        }


def op_name(profiling_name: object) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce_coalesced`` -> ``all_reduce`` ..."""
    name = str(profiling_name or "?")
    return name.split(":", 1)[1] if ":" in name else name


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _pg_label(pg: str, names: Mapping[str, str]) -> str:
    return names.get(pg) or f"pg {pg}"


def findings(dumps: Mapping[int, Mapping[str, Any]], absent: Mapping[int, str]) -> list[Finding]:
    """What the ranks' dumps (rank -> ``fr.dump`` reply with ``available``) say, most telling
    first; ``absent``: ranks of the job without a dump, and why."""
    out: list[Finding] = []
    # pg id -> rank -> seq -> op; the last sequence number each rank enqueued.
    seen: dict[str, dict[int, dict[int, tuple[str, bool]]]] = {}
    last: dict[str, dict[int, int]] = {}
    names: dict[str, str] = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries") or []:
            if e.get("is_p2p"):
                continue
            pg = e.get("process_group") or [str(e.get("pg_id", "0")), ""]
            pg_id = str(pg[0])
            if len(pg) > 1 and pg[1]:
                names[pg_id] = str(pg[1])
            seq = int(e.get("collective_seq_id") or 0)
            if seq <= 0:
                continue
            seen.setdefault(pg_id, {}).setdefault(rank, {})[seq] = (
                op_name(e.get("profiling_name")),
                bool(e.get("retired")),
            )
        for pg_id, status in (dump.get("pg_status") or {}).items():
            try:
                enq = int(status.get("last_enqueued_collective", -1))
            except (TypeError, ValueError):
                continue
            if enq >= 0:
                last.setdefault(str(pg_id), {})[rank] = enq
    for pg_id, by_rank in sorted(seen.items()):
        lasts = {r: last.get(pg_id, {}).get(r, max(s, default=0)) for r, s in by_rank.items()}
        for r in dumps:  # a rank that never joined this group's collectives at all
            if r not in lasts and pg_id == "0":
                lasts[r] = 0
        label = _pg_label(pg_id, names)
        front = max(lasts.values())
        behind = sorted(r for r, n in lasts.items() if n < front)
        if behind:
            seq = min(lasts[r] for r in behind) + 1
            ops = _ops_at(by_rank, seq)
            op = _majority(ops) or "?"
            joined = sorted(r for r, n in lasts.items() if n >= seq)
            missing = sorted(r for r, n in lasts.items() if n < seq)
            out.append(
                Finding(
                    MISSING,
                    f"collective {seq} {op} ({label}): {_ranks_text(missing)} missing"
                    f" ({_ranks_text(joined)} waiting)",
                    pg_id, seq, op, tuple(missing), ops,
                )
            )  # fmt: skip
        mismatch = _first_mismatch(by_rank)
        if mismatch is not None:
            seq, ops = mismatch
            common = _majority(ops)
            odd = sorted(r for op, rs in ops.items() if op != common for r in rs)
            parts = sorted(ops.items(), key=lambda kv: (len(kv[1]), kv[0]))
            text = ", ".join(f"{_ranks_text(rs)} {op}" for op, rs in parts)
            out.append(
                Finding(MISMATCH, f"collective {seq} mismatch ({label}): {text}", pg_id, seq,
                        None, tuple(odd), ops)
            )  # fmt: skip
        if not behind and mismatch is None:
            entries = [by_rank[r].get(front) for r in by_rank]
            if entries and all(e is not None and not e[1] for e in entries):
                op = entries[0][0] if entries[0] else "?"
                out.append(
                    Finding(STUCK, f"collective {front} {op} ({label}): every rank joined, "
                            "not completed", pg_id, front, op)
                )  # fmt: skip
    for rank, why in sorted(absent.items()):
        out.append(Finding(NO_DUMP, f"rank {rank}: no flight-recorder dump ({why})", ranks=(rank,)))
    return out


def _ops_at(
    by_rank: Mapping[int, Mapping[int, tuple[str, bool]]], seq: int
) -> dict[str, list[int]]:
    ops: dict[str, list[int]] = {}
    for r, entries in sorted(by_rank.items()):
        if seq in entries:
            ops.setdefault(entries[seq][0], []).append(r)
    return ops


def _majority(ops: Mapping[str, list[int]]) -> str | None:
    if not ops:
        return None
    return max(ops.items(), key=lambda kv: (len(kv[1]), kv[0]))[0]


def _first_mismatch(
    by_rank: Mapping[int, Mapping[int, tuple[str, bool]]],
) -> tuple[int, dict[str, list[int]]] | None:
    seqs = sorted({s for entries in by_rank.values() for s in entries})
    for seq in seqs:
        ops = _ops_at(by_rank, seq)
        if len(ops) > 1:
            return seq, ops
    return None


# --- collection ---------------------------------------------------------------------------


def _ask(jp: JobProcess, timeout_s: float) -> Mapping[str, Any]:
    reasons = []
    for d in runtime_dirs_of(dict(jp.environ)):
        path = socket_path(d, jp.pid)
        if not os.path.exists(path):
            continue
        try:
            return request(path, "fr.dump", timeout_s=timeout_s)
        except ChannelError as exc:
            reasons.append(str(exc))
    raise RuntimeError(reasons[0] if reasons else "no in-process part serves it")


def collect_dumps(
    procs: Sequence[JobProcess], timeout_s: float = DUMP_TIMEOUT_S
) -> tuple[dict[int, Mapping[str, Any]], dict[int, str]]:
    """(rank -> dump, rank -> why none) for the ranks (not workers) among ``procs``."""
    ranks = [jp for jp in procs if jp.rank is not None and not jp.worker]
    dumps: dict[int, Mapping[str, Any]] = {}
    absent: dict[int, str] = {}
    if not ranks:
        return dumps, absent

    def one(jp: JobProcess) -> tuple[JobProcess, Mapping[str, Any] | None, str]:
        try:
            reply = _ask(jp, timeout_s)
        except Exception as exc:  # reported per rank, never fatal
            return jp, None, str(exc)
        if not reply.get("available"):
            return jp, None, str(reply.get("reason") or "not available")
        return jp, reply, ""

    with ThreadPoolExecutor(max_workers=min(8, len(ranks))) as pool:
        for jp, reply, why in pool.map(one, ranks):
            assert jp.rank is not None
            if reply is None:
                absent[jp.rank] = why
            else:
                dumps[jp.rank] = reply
    return dumps, absent


def expected_local_ranks(procs: Sequence[JobProcess]) -> set[int]:
    """The ranks this node should have, from torchrun's variables of the ranks alive here
    (``RANK - LOCAL_RANK + 0..LOCAL_WORLD_SIZE-1``); empty when they do not say."""
    expected: set[int] = set()
    for jp in procs:
        if jp.rank is None or jp.worker:
            continue
        try:
            local = int(jp.environ["LOCAL_RANK"])
            size = int(jp.environ["LOCAL_WORLD_SIZE"])
        except (KeyError, ValueError):
            continue
        base = jp.rank - local
        expected.update(range(base, base + size))
    return expected
