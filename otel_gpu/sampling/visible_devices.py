"""Which GPUs a job sees, from a ``CUDA_VISIBLE_DEVICES`` value (pure, no NVML).

CUDA's rules: a comma-separated list of device indices, ``GPU-<uuid>`` identifiers or unique
prefixes of them; an empty value hides every GPU; parsing stops at the first entry that names
no device (so ``0,1,-1,2`` means ``0,1``). ``MIG-<uuid>`` entries name MIG instances, which this
agent reports as their parent GPU only when listed by GPU; they are skipped with a warning.

Indices are taken in NVML order (PCI bus order). CUDA orders "fastest first" unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; on machines with mixed GPU models set that variable so both
agree (UUIDs never have this problem).
"""

from __future__ import annotations

from collections.abc import Sequence


def select_visible(spec: str | None, uuids: Sequence[str]) -> tuple[list[int], list[str]]:
    """Return the NVML indices ``spec`` selects (in ``spec`` order) and warnings to log once.

    ``spec`` None selects every GPU; ``uuids[i]`` is the UUID of NVML device ``i``.
    """
    if spec is None:
        return list(range(len(uuids))), []
    chosen: list[int] = []
    warnings: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            if spec.strip():
                warnings.append(f"CUDA_VISIBLE_DEVICES={spec!r}: empty entry ends the list")
            break
        if token.upper().startswith("MIG-"):
            warnings.append(
                f"CUDA_VISIBLE_DEVICES entry {token!r} is a MIG instance; it is not mapped to a "
                "GPU (list the GPU's UUID to watch it)"
            )
            continue
        index = _resolve(token, uuids)
        if index is None:
            warnings.append(
                f"CUDA_VISIBLE_DEVICES={spec!r}: {token!r} names no GPU (or is an ambiguous "
                "UUID prefix); entries from here on are ignored, as CUDA does"
            )
            break
        if index not in chosen:
            chosen.append(index)
    return chosen, warnings


def _resolve(token: str, uuids: Sequence[str]) -> int | None:
    if token.lstrip("+").isdigit():
        index = int(token)
        return index if index < len(uuids) else None
    if not token.upper().startswith("GPU-"):
        return None
    matches = [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(token.lower())]
    return matches[0] if len(matches) == 1 else None
