"""GPU allocation sites and the OOM post-mortem as pure functions on snapshot dicts in the
format torch.cuda.memory._snapshot() documents, and the guards that make them do nothing on a
CPU build (issue 20 §2). The real CUDA run needs a GPU (none lent to this suite)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from otel_gpu.diagnose import cuda_memory as cm

pytestmark = pytest.mark.unit

TORCH_FRAME = {
    "filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py",
    "line": 125,
    "name": "forward",
}
USER_FRAME = {"filename": "/home/me/train.py", "line": 41, "name": "train"}
CACHE_FRAME = {"filename": "/home/me/model.py", "line": 12, "name": "forward"}


def block(
    size: int, frames: list[dict[str, Any]], state: str = "active_allocated"
) -> dict[str, Any]:
    return {"size": size, "requested_size": size, "state": state, "frames": frames}


def snap(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {
        "segments": [{"device": 0, "total_size": 1 << 30, "blocks": list(blocks)}],
        "device_traces": [],
    }


def test_the_site_is_the_first_frame_of_the_programs_own_code() -> None:
    assert cm.site_of([TORCH_FRAME, CACHE_FRAME, USER_FRAME]) == "model.py:12 in forward"
    assert cm.site_of([TORCH_FRAME]) == cm.UNATTRIBUTED
    assert cm.site_of([]) == cm.UNATTRIBUTED


def test_sites_rank_by_growth_of_live_bytes_and_frameless_blocks_are_one_row() -> None:
    before = snap(block(1 << 20, [TORCH_FRAME, USER_FRAME]), block(4 << 20, []))
    after = snap(
        block(1 << 20, [TORCH_FRAME, USER_FRAME]),
        *(block(2 << 20, [TORCH_FRAME, CACHE_FRAME]) for _ in range(5)),
        block(4 << 20, []),
        block(8 << 20, []),
        block(64 << 20, [CACHE_FRAME], state="inactive"),  # freed: cached, not live
    )
    rows = cm.rank_sites(before, after)
    assert [(r["site"], r["growth_bytes"], r["growth_blocks"]) for r in rows] == [
        ("model.py:12 in forward", 10 << 20, 5),
        (cm.UNATTRIBUTED, 8 << 20, 1),
        ("train.py:41 in train", 0, 0),
    ]


def test_the_oom_observer_writes_its_file_once_and_never_raises(tmp_path: Path) -> None:
    calls = []

    def take() -> dict[str, Any]:
        calls.append(1)
        return snap(block(3 << 20, [CACHE_FRAME]), block(1 << 20, []))

    observe = cm.oom_observer(str(tmp_path), take, 4242)
    observe(0, 1 << 30, 70 << 30, 1 << 20)
    observe(0, 1 << 30, 70 << 30, 1 << 20)  # PyTorch may call it again for the same OOM
    path = tmp_path / "oom-4242.json"
    report = json.loads(path.read_text())
    assert calls == [1] and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert report["requested_bytes"] == 1 << 30 and report["device_free_bytes"] == 1 << 20
    assert report["sites"][0] == {"site": "model.py:12 in forward", "blocks": 1, "bytes": 3 << 20}
    broken = cm.oom_observer(str(tmp_path / "missing"), lambda: 1 / 0, 1)  # type: ignore[arg-type,return-value]
    broken(0, 1, 2, 3)  # must not raise into the allocator's error path


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-build guards")
def test_on_a_cpu_build_every_cuda_call_does_nothing_and_says_so(tmp_path: Path) -> None:
    assert cm.history_on(torch) is False and cm.history_off(torch) is False
    assert cm.snapshot(torch) is None
    assert cm.attach_oom_observer(torch, str(tmp_path)) is False
    assert list(tmp_path.iterdir()) == []
