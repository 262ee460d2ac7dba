"""What a signal is: a metric's name, instrument kind, UCUM unit and description."""

from dataclasses import dataclass

# The semantic conventions the names follow (the meters' schema_url; tests/test_semconv.py
# holds the hw, process, vcs and k8s names against a pinned excerpt of this release).
SEMCONV_VERSION = "1.44.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

# Instrument kinds (all observable: every value is read from a sweep, a scrape or a counter).
GAUGE = "gauge"
COUNTER = "counter"  # monotonic
UPDOWN = "updowncounter"


@dataclass(frozen=True)
class Signal:
    """One metric: its name, instrument kind, unit (UCUM) and description."""

    name: str
    kind: str
    unit: str
    description: str
