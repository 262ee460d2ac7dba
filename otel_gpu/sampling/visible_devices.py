"""Which GPUs a job sees, from a ``CUDA_VISIBLE_DEVICES`` value (pure, no NVML).

CUDA's rules: a comma-separated list of device indices, ``GPU-<uuid>`` identifiers or unique
prefixes of them; an empty value hides every GPU; parsing stops at the first entry that names
no device (so ``0,1,-1,2`` means ``0,1``). ``MIG-<uuid>`` entries (or unique prefixes) name MIG
devices; the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` form is skipped with a warning.

Indices are taken in NVML order (PCI bus order). CUDA orders "fastest first" unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; on machines with mixed GPU models set that variable so both
agree (UUIDs never have this problem).
"""

from __future__ import annotations

from collections.abc import Sequence


def select_visible(
    spec: str | None, uuids: Sequence[str], mig_uuids: Sequence[str] = ()
) -> tuple[list[int], list[str]]:
    """Return the devices ``spec`` selects (in ``spec`` order) and warnings to log once.

    ``uuids[i]`` is the UUID of NVML device ``i``; ``mig_uuids[j]`` of the j-th MIG device,
    returned as ``len(uuids) + j``. ``spec`` None selects every GPU and MIG device.
    """
    if spec is None:
        return list(range(len(uuids) + len(mig_uuids))), []
    chosen: list[int] = []
    warnings: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            if spec.strip():
                warnings.append(f"CUDA_VISIBLE_DEVICES={spec!r}: empty entry ends the list")
            break
        if token.upper().startswith("MIG-"):
            index = _unique_prefix(token, mig_uuids)
            if index is None:
                warnings.append(
                    f"CUDA_VISIBLE_DEVICES entry {token!r} names no MIG device NVML lists (the "
                    "MIG-GPU-<uuid>/<gi>/<ci> form is not supported: use the MIG device UUID "
                    "from `nvidia-smi -L`); it is skipped"
                )
                continue
            index += len(uuids)
        else:
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


def _unique_prefix(token: str, uuids: Sequence[str]) -> int | None:
    matches = [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(token.lower())]
    return matches[0] if len(matches) == 1 else None


def _resolve(token: str, uuids: Sequence[str]) -> int | None:
    if token.lstrip("+").isdigit():
        index = int(token)
        return index if index < len(uuids) else None
    if not token.upper().startswith("GPU-"):
        return None
    return _unique_prefix(token, uuids)
