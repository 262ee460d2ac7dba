"""The labelled dev traces that ``otel-gpu analyze`` and the engine are scored on."""

from __future__ import annotations

from support.paths import ROOT

# The team's shared dev traces beside the checkout when present (they may have grown), else the
# copy kept in tests/data so that a bare clone runs every test.
_SHARED = ROOT.parent / "shared" / "traces" / "dev"


DEV_TRACES = (
    _SHARED if (_SHARED / "labels.json").is_file() else ROOT / "tests" / "data" / "dev_traces"
)
