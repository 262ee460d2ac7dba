"""Compile the fake ``libnvidia-ml.so.1`` and prove its ABI against NVIDIA's ``nvml.h``.

``build_fake(out_dir)`` compiles ``fakenvml.c`` with the system C compiler into
``out_dir/<source hash>/libnvidia-ml.so.1`` (cached: a rebuild happens only when the sources or
flags change); ``build_fake(out_dir, driver="r470")`` builds an older driver branch's library
(:data:`DRIVERS`): only the entry points that branch's ``nvml.h`` declares, process entries of
the size it gives (``-DFAKENVML_DRIVER``; see fakenvml.c). ``check_abi(out_dir)`` compiles the
same source against NVIDIA's own ``nvml.h`` (from the ``nvidia-nvml-dev`` wheel,
``$NVML_INCLUDE_DIR``, or a CUDA install), so every function definition must match NVIDIA's
prototype and the static asserts pin struct sizes, offsets and constants; without ``nvml.h``
it reports ``ran=False`` rather than passing. ``check_abi(out_dir, driver=...)`` does the same
for a branch, against the header in ``$NVML_INCLUDE_DIR`` (that release's nvml.h).

Run as a script to build every branch and print the ABI result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "fakenvml.c", HERE / "fakenvml_types.h")
LIB_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-Wl,-soname,{LIB_NAME}")
ABI_CFLAGS = ("-c", "-O2", "-Wall", "-Werror", "-DFAKENVML_REAL_NVML_H")

# Driver branches the fake can be built as: name -> (FAKENVML_DRIVER, the releases whose nvml.h
# has that export set and those entry sizes). docs/sampling.md "Driver branches" has the table.
DRIVERS: dict[str, tuple[int | None, str]] = {
    "r470": (470042, "470.42.01-495.x: process lists unversioned and _v2 only"),
    "r510": (510039, "510.39.01-530.x: + the _v3 lists (24-byte entries), memory info v2"),
    "r535.43": (535043, "535.43.02-535.86.x: _v3 entries of 32 bytes (CC protected memory)"),
    "r535.98": (535098, "535.98: no _v3 lists"),
    "r535.104": (535104, "535.104.05-560.x: _v3 back at 24 bytes, the process detail list"),
    "current": (None, "565.57.01 on: + nvmlDeviceGetTemperatureV"),
}


def _driver_flags(driver: str) -> tuple[str, ...]:
    if driver not in DRIVERS:
        raise ValueError(f"unknown driver branch {driver!r} (one of {', '.join(DRIVERS)})")
    number = DRIVERS[driver][0]
    return () if number is None else (f"-DFAKENVML_DRIVER={number}",)


@dataclass(frozen=True)
class AbiCheck:
    """Result of compiling the fake against NVIDIA's nvml.h."""

    ran: bool  # False: no nvml.h found, nothing was proven
    ok: bool
    header: Path | None
    detail: str


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    return cc


def _digest(*extra: str) -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    for part in extra:
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_fake(out_dir: str | os.PathLike[str], *, driver: str = "current") -> Path:
    """Compile the fake (cached by source hash) and return the path of ``libnvidia-ml.so.1``;
    ``driver``: the branch of :data:`DRIVERS` whose entry points and entry sizes it has."""
    cc = _compiler()
    flags = (*CFLAGS, *_driver_flags(driver))
    target_dir = Path(out_dir) / _digest(cc, *flags)
    lib = target_dir / LIB_NAME
    if lib.exists():
        return lib
    target_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name and rename: concurrent builds (xdist, several sessions) never
    # see a half-written library.
    tmp = target_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = [cc, *flags, str(SOURCES[0]), "-o", str(tmp), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building the fake NVML failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, lib)
    return lib


def find_nvml_header() -> Path | None:
    """NVIDIA's nvml.h: $NVML_INCLUDE_DIR, the nvidia-nvml-dev wheel, or a CUDA install."""
    candidates: list[Path] = []
    if os.environ.get("NVML_INCLUDE_DIR"):
        candidates.append(Path(os.environ["NVML_INCLUDE_DIR"]) / "nvml.h")
    try:
        import nvidia  # namespace package of NVIDIA's wheels (nvidia-nvml-dev)

        for root in getattr(nvidia, "__path__", []):
            candidates.extend(sorted(Path(root).glob("*/include/nvml.h"), reverse=True))
    except ImportError:
        pass
    candidates += [Path("/usr/local/cuda/include/nvml.h"), Path("/usr/include/nvml.h")]
    return next((c for c in candidates if c.is_file()), None)


def check_abi(out_dir: str | os.PathLike[str], *, driver: str = "current") -> AbiCheck:
    """Compile ``fakenvml.c`` (as ``driver``) against NVIDIA's nvml.h with ``-Werror`` (result
    cached); for an older branch, point ``$NVML_INCLUDE_DIR`` at that release's header."""
    flags = (*ABI_CFLAGS, *_driver_flags(driver))
    header = find_nvml_header()
    if header is None:
        return AbiCheck(
            ran=False,
            ok=False,
            header=None,
            detail="ABI check NOT RUN: nvml.h not found (pip install nvidia-nvml-dev)",
        )
    cc = _compiler()
    stamp = Path(out_dir) / f"abi-{_digest(cc, *flags, header.read_text(errors='replace'))}.ok"
    if stamp.exists():
        return AbiCheck(ran=True, ok=True, header=header, detail=stamp.read_text())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    obj = Path(out_dir) / f".abi.{os.getpid()}.o"
    cmd = [cc, *flags, f"-I{header.parent}", str(SOURCES[0]), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    obj.unlink(missing_ok=True)
    if proc.returncode != 0:
        return AbiCheck(ran=True, ok=False, header=header, detail=proc.stderr)
    detail = f"fakenvml.c ({driver}) compiles with -Werror against {header}"
    tmp_stamp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    tmp_stamp.write_text(detail)
    os.replace(tmp_stamp, stamp)  # parallel workers never read half a stamp
    return AbiCheck(ran=True, ok=True, header=header, detail=detail)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "build"
    for branch in DRIVERS:
        print(branch, build_fake(out, driver=branch))
    result = check_abi(out)
    print(result.detail)
    sys.exit(0 if result.ok or not result.ran else 1)
