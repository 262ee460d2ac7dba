"""What an Xid means: NVIDIA's Xid catalog as code -> resolution bucket -> our action. Pure.

Source: NVIDIA's Xid catalog for Ampere and newer GPUs ("Analyzing Xid Errors with the Xid
Catalog", https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, its
Xid-Catalog.xlsx, column "Resolution Bucket (Immediate Action)"), plus DCGM's always-checked
Xids (48, 74, 79, 94, 95, 119, 120, 140), reset class whatever the catalog says. They differ on
94 only (a contained ECC error: the catalog restarts the application; DCGM 4.4-4.5 fail the GPU,
4.6 warns and advises a deferred reset): it stays reset class, since the GPU needs that reset.
``tests/data/xid_catalog_excerpt.csv`` pins the rows this table is built from (checked row by
row against the spreadsheet NVIDIA/NVSentinel pins by checksum) and ``tests/test_xid.py``
keeps the two equal.

Our action follows from the bucket:

* ``application`` (RESTART_APP, IGNORE): the job's own bug (a kernel's illegal address, a
  graphics engine exception) or a follow-on of one (45, preemptive cleanup). The alert
  annotates the process; no GPU breaker opens, readiness stays up.
* ``reset`` (RESET_GPU, RESTART_BM, RESTART_VM and the catalog's reset workflows, and every
  DCGM-fatal code): the GPU needs a drain and a reset (or the node a reboot). The GPU's breaker
  opens, readiness fails, the shipped Prometheus rules page.
* ``severe``: a code the table does not know, or one the catalog sends to support. Treated as a
  reset-class Xid until someone looks: an unknown code is never assumed harmless.

Kernel-log lines (``/dev/kmsg``) are parsed here too (:func:`parse_kernel_line`): DCGM's
maintainers note that NVML's events never carry 79, 119 or 120, which the kernel log does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

APPLICATION = "application"
RESET = "reset"
SEVERE = "severe"
CLASSES = (APPLICATION, RESET, SEVERE)

# Resolution bucket -> our class. Buckets not listed (CONTACT_SUPPORT, UPDATE_SW, XID_154 --
# "follow the recovery action the Xid reports" --, ...) and codes not in the table are SEVERE.
BUCKET_CLASS = {
    "RESTART_APP": APPLICATION,
    "IGNORE": APPLICATION,
    # 45, preemptive removal: the catalog says "Solo: RESTART_FM; Not Solo: IGNORE": a
    # follow-on cleanup of another error (whose own Xid carries the action)
    "WORKFLOW_XID_45": APPLICATION,
    "RESET_GPU": RESET,
    "RESTART_BM": RESET,
    "RESTART_VM": RESET,
    "WORKFLOW_XID_48": RESET,
    "WORKFLOW_NVLINK_ERR": RESET,
}

# DCGM's fatal Xids: reset class whatever the catalog's bucket says.
DCGM_FATAL = frozenset({48, 74, 79, 94, 95, 119, 120, 140})

# What we say, by class (one clause each; alert sentences start with the GPU and the code).
ACTION = {
    APPLICATION: "the application's error: check the job (its process is annotated); no GPU action",
    RESET: "drain / reset the GPU",
    SEVERE: "no known safe action, treated as a GPU fault: drain / reset the GPU and check the "
    "code in NVIDIA's Xid catalog",
}


@dataclass(frozen=True, slots=True)
class Xid:
    """One catalog row and what it means to us."""

    code: int
    mnemonic: str
    bucket: str  # the catalog's immediate-action resolution bucket ("" when unknown)
    cls: str  # APPLICATION, RESET or SEVERE

    @property
    def action(self) -> str:
        return ACTION[self.cls]

    @property
    def opens_breaker(self) -> bool:
        """Whether the GPU's breaker opens (and readiness fails) on this Xid."""
        return self.cls != APPLICATION


# (code, mnemonic, immediate-action bucket) from the catalog; see the module docstring.
_ROWS: tuple[tuple[int, str, str], ...] = (
    (8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "RESTART_APP"),
    (13, "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY", "RESTART_APP"),
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP"),
    (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE"),
    (45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45"),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48"),
    (61, "PMU_BREAKPOINT", "CONTACT_SUPPORT"),
    (62, "PMU_HALT_ERROR", "RESET_GPU"),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE"),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU"),
    (68, "ROBUST_CHANNEL_NVDEC0_ERROR", "RESTART_APP"),
    (69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP"),
    (74, "NVLINK_ERROR", "WORKFLOW_NVLINK_ERR"),
    (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM"),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "IGNORE"),
    (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP"),
    (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU"),
    (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU"),
    (119, "GSP_RPC_TIMEOUT", "RESET_GPU"),
    (120, "GSP_ERROR", "RESET_GPU"),
    (121, "C2C_ERROR", "IGNORE"),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU"),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "XID_154"),
)


def _class(code: int, bucket: str) -> str:
    if code in DCGM_FATAL:
        return RESET
    return BUCKET_CLASS.get(bucket, SEVERE)


CATALOG: dict[int, Xid] = {
    code: Xid(code, mnemonic, bucket, _class(code, bucket)) for code, mnemonic, bucket in _ROWS
}

# The codes that need a GPU reset (the readiness gate's default; unknown codes count too).
RESET_CODES = frozenset(c for c, x in CATALOG.items() if x.cls == RESET)


def classify(code: int) -> Xid:
    """The catalog row of ``code``; an unknown code is SEVERE (never assumed harmless)."""
    found = CATALOG.get(code)
    if found is not None:
        return found
    return Xid(code, "unknown", "", SEVERE)


def sentence(code: int, where: str) -> str:
    """One human sentence for an Xid on ``where`` (a GPU's name)."""
    x = classify(code)
    name = "" if x.mnemonic == "unknown" else f" ({x.mnemonic})"
    return f"{where}: Xid {code}{name}: {x.action}"


# --- the kernel log ------------------------------------------------------------------------

# "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus." (older drivers omit
# "PCI:"); "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus."
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})[^)]*\): (\d{1,5})\b"
)
_FALLEN = re.compile(
    r"NVRM: GPU(?: at)? (?:PCI:)?([0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})"
    r"[^:]*:.*fallen off the bus"
)
FALLEN_OFF = 79  # what a "fallen off the bus" line means, as an Xid code


@dataclass(frozen=True, slots=True)
class KernelXid:
    """An Xid (or a GPU fallen off the bus) the kernel log reported."""

    pci: str  # normalised bus id: "0000:3b:00" (domain:bus:device, lower case)
    code: int
    fallen_off: bool = False


def normalise_pci(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` and the kernel's ``0000:3b:00`` as one key: the last four
    hex digits of the domain, bus and device, lower case."""
    text = bus_id.strip().lower()
    text = text.split(".", 1)[0]  # drop the function
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return text
    domain, bus, dev = parts
    try:
        return f"{int(domain, 16) & 0xFFFF:04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
    except ValueError:
        return text


def parse_kernel_line(line: str) -> KernelXid | None:
    """The Xid a kernel-log line reports, or None for any other line (hostile ones included:
    the match is anchored on fixed text and bounded digit counts)."""
    if "NVRM" not in line:
        return None
    m = _XID.search(line)
    if m is not None:
        code = int(m.group(2))
        return KernelXid(normalise_pci(m.group(1)), code, code == FALLEN_OFF)
    m = _FALLEN.search(line)
    if m is not None:
        return KernelXid(normalise_pci(m.group(1)), FALLEN_OFF, True)
    return None


class XidDedup:
    """One Xid event counted once when both NVML's events and the kernel log report it.

    An event from one source cancels a not yet matched event of the same GPU and code from the
    other source seen within ``window_s``; anything else is new. Pure (times are arguments)
    and bounded: ``max_keys`` (GPU, code, source) keys of at most ``max_pending`` times each.
    """

    def __init__(self, window_s: float = 30.0, max_keys: int = 256, max_pending: int = 64) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self.max_pending = max_pending
        self._pending: dict[tuple[str, int, str], list[float]] = {}

    def is_new(self, gpu: str, code: int, source: str, now: float) -> bool:
        """Whether this report is a new event (True) or the other source's echo (False)."""
        other = "kmsg" if source == "nvml" else "nvml"
        theirs = self._pending.get((gpu, code, other))
        if theirs:
            while theirs and theirs[0] < now - self.window_s:
                theirs.pop(0)
            if theirs:
                theirs.pop(0)
                return False
        mine = self._pending.setdefault((gpu, code, source), [])
        mine.append(now)
        if len(mine) > self.max_pending:
            del mine[0]
        if len(self._pending) > self.max_keys:
            stale = [
                k
                for k, times in self._pending.items()
                if not times or times[-1] < now - self.window_s
            ]
            for k in stale or list(self._pending)[: len(self._pending) - self.max_keys]:
                del self._pending[k]
        return True
