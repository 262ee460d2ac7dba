"""The flight-recorder finder (issue 21 §3) on dumps in the recorder's own JSON shape (as
``fr.dump`` sends them; real dumps from torchrun jobs are in tests/test_diagnose_stall.py)."""

from __future__ import annotations

import pytest

from otel_gpu.diagnose import collectives
from otel_gpu.diagnose.jobprocs import JobProcess

pytestmark = pytest.mark.unit


def _dump(*ops: str, retired_upto: int | None = None) -> dict:
    done = len(ops) - 1 if retired_upto is None else retired_upto
    entries = [
        {"collective_seq_id": i, "p2p_seq_id": 0, "is_p2p": False, "pg_id": 0,
         "process_group": ["0", "default_pg"], "profiling_name": f"gloo:{op}",
         "state": "scheduled", "retired": i <= done}
        for i, op in enumerate(ops, start=1)
    ]  # fmt: skip
    status = {"0": {"last_enqueued_collective": str(len(ops)), "last_completed_collective": "-1"}}
    return {"available": True, "entries": entries, "pg_status": status}


AR = "all_reduce"


def test_the_collective_a_rank_has_not_joined():
    dumps = {0: _dump(AR, AR, AR, AR), 1: _dump(AR, AR, AR), 2: _dump(AR, AR, AR, AR)}
    [f] = collectives.findings(dumps, {})
    assert (f.kind, f.seq, f.op, f.ranks) == ("missing", 4, "all_reduce", (1,))
    assert f.line == "collective 4 all_reduce (default_pg): rank 1 missing (ranks 0, 2 waiting)"


def test_different_collectives_at_one_sequence_number_are_a_mismatch():
    dumps = {0: _dump(AR, AR, AR, AR), 1: _dump(AR, AR, AR, "broadcast"), 2: _dump(AR, AR, AR, AR)}
    [f] = collectives.findings(dumps, {})
    assert (f.kind, f.seq, f.ranks) == ("mismatch", 4, (1,))
    assert f.line == "collective 4 mismatch (default_pg): rank 1 broadcast, ranks 0, 2 all_reduce"


def test_every_rank_in_one_collective_that_never_completes():
    dumps = {r: _dump(AR, AR, "all_gather", retired_upto=2) for r in range(2)}
    [f] = collectives.findings(dumps, {})
    assert f.kind == "stuck" and f.line == (
        "collective 3 all_gather (default_pg): every rank joined, not completed"
    )


def test_a_healthy_picture_says_nothing_and_ranks_without_a_dump_are_listed():
    dumps = {r: _dump(AR, AR, retired_upto=2) for r in range(2)}
    assert collectives.findings(dumps, {}) == []
    [f] = collectives.findings(dumps, {2: "no process on this node: it exited"})
    assert f.line == "rank 2: no flight-recorder dump (no process on this node: it exited)"


def test_p2p_entries_do_not_count_as_collectives():
    d0, d1 = _dump(AR, AR, retired_upto=2), _dump(AR, AR, retired_upto=2)
    d0["entries"].append({"collective_seq_id": 0, "p2p_seq_id": 1, "is_p2p": True,
                          "process_group": ["0", "default_pg"], "profiling_name": "gloo:send"})  # fmt: skip
    assert collectives.findings({0: d0, 1: d1}, {}) == []


def test_the_expected_ranks_of_this_node_come_from_torchruns_variables():
    env = {"LOCAL_WORLD_SIZE": "4"}
    procs = [
        JobProcess(10, 4, False, {**env, "LOCAL_RANK": "0"}),
        JobProcess(12, 6, False, {**env, "LOCAL_RANK": "2"}),
    ]
    assert collectives.expected_local_ranks(procs) == {4, 5, 6, 7}


def test_the_job_environment_gets_the_flight_recorder_unless_the_user_set_it():
    add = collectives.flight_recorder_env({}, "/run/u/otel-gpu")
    assert add == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/run/u/otel-gpu/fr-pipe-",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/run/u/otel-gpu/fr-dump-",
    }
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/d"}
    assert collectives.flight_recorder_env(mine, "/r") == {
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/r/fr-pipe-"
    }


def test_fr_dump_in_a_process_without_torch_distributed_says_so():
    reply = collectives.handle_fr_dump({})
    assert reply["available"] is False and "not initialised" in reply["reason"]
