"""The signal contract: every metric the project exports or reads, declared once.

Each :class:`Signal` is a name with its instrument kind, UCUM unit and description (names are a
contract: the tables of docs/metrics.md). The declarations live in one module per family:

======================  ==========================================================
``gpu``                 the agent's GPU signals (NVML)
``process``             the agent's per-process signals (NVML and ``/proc``)
``training``            training progress and torch's allocator (the trainer's process)
``detector``            detector outputs (the agent's watchdog and the processor)
``agent``               the agent's own health (``otel_gpu.agent.*``)
``inference``           an inference server's metrics (the sidecar's scrape)
``k8s``                 Kubernetes allocation and orphaned GPU memory
``processor``           the processor's own telemetry (``otel_gpu.processor.*``)
======================  ==========================================================

``attributes`` holds the attribute keys that identify a series and the keys of alert and
transition records; ``inputs`` the :data:`FEEDS`, which say which points of which signal the
detection engine reads; ``reading`` :func:`observable`, through which every instrument is made.
Every public name of those modules is importable from here, so a new declaration is written
once: :data:`SIGNALS` is read off the family modules, and the tests export every one of them
through the real SDK (or the processor's OTLP encoding) and check its row in the docs.
"""

from otel_gpu.core.signals import agent, detector, gpu, inference, k8s, process, processor, training
from otel_gpu.core.signals.agent import *  # noqa: F403
from otel_gpu.core.signals.attributes import *  # noqa: F403
from otel_gpu.core.signals.detector import *  # noqa: F403
from otel_gpu.core.signals.gpu import *  # noqa: F403
from otel_gpu.core.signals.inference import *  # noqa: F403
from otel_gpu.core.signals.inputs import COUNT as COUNT
from otel_gpu.core.signals.inputs import FEEDS as FEEDS
from otel_gpu.core.signals.inputs import OF_GPU as OF_GPU
from otel_gpu.core.signals.inputs import VALUE as VALUE
from otel_gpu.core.signals.inputs import Feed as Feed
from otel_gpu.core.signals.inputs import feeds as feeds
from otel_gpu.core.signals.k8s import *  # noqa: F403
from otel_gpu.core.signals.model import COUNTER as COUNTER
from otel_gpu.core.signals.model import GAUGE as GAUGE
from otel_gpu.core.signals.model import SCHEMA_URL as SCHEMA_URL
from otel_gpu.core.signals.model import SEMCONV_VERSION as SEMCONV_VERSION
from otel_gpu.core.signals.model import UPDOWN as UPDOWN
from otel_gpu.core.signals.model import Signal as Signal
from otel_gpu.core.signals.process import *  # noqa: F403
from otel_gpu.core.signals.processor import *  # noqa: F403
from otel_gpu.core.signals.reading import GuardedReader as GuardedReader
from otel_gpu.core.signals.reading import observable as observable
from otel_gpu.core.signals.training import *  # noqa: F403

# The family modules, by name: each Signal is declared in exactly one of them.
FAMILIES = {
    m.__name__.rsplit(".", 1)[1]: m
    for m in (gpu, process, training, detector, agent, inference, k8s, processor)
}


def family_signals(family: str) -> tuple[Signal, ...]:
    """The signals declared in one family module, in declaration order."""
    found = (v for v in vars(FAMILIES[family]).values() if isinstance(v, Signal))
    return tuple(dict.fromkeys(found))


# Every Signal, read off the family modules so that a new one cannot be left out.
SIGNALS: tuple[Signal, ...] = tuple(s for family in FAMILIES for s in family_signals(family))
BY_NAME: dict[str, Signal] = {s.name: s for s in SIGNALS}
