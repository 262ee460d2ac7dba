"""What a signal is: a metric's name, instrument kind, UCUM unit and description."""

from dataclasses import dataclass

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
