"""Every framework instrumentor wraps the framework's methods while instrumented and gives the
framework back exactly as it was on ``uninstrument()`` (real lightning, pytorch_lightning and
transformers modules, in this process)."""

from __future__ import annotations

import importlib

import pytest
from opentelemetry.sdk.trace import TracerProvider

from otel_gpu.tracing.hf_instrumentor import TransformersInstrumentor
from otel_gpu.tracing.lightning_callback import (
    LightningInstrumentor,
    lightning_callbacks,
    pytorch_lightning_callbacks,
)

pytestmark = pytest.mark.unit

CASES = [
    (LightningInstrumentor, "lightning.pytorch.trainer.trainer", ["Trainer.save_checkpoint"]),
    (LightningInstrumentor, "pytorch_lightning.trainer.trainer", ["Trainer.save_checkpoint"]),
    (TransformersInstrumentor, "transformers.trainer_callback", ["CallbackHandler.__init__"]),
    (
        TransformersInstrumentor,
        "transformers.trainer",
        ["Trainer.train", "Trainer.evaluate", "Trainer._save_checkpoint"],
    ),
]


def _methods(module_name: str, targets: list[str]) -> dict[str, object]:
    module = importlib.import_module(module_name)
    out = {}
    for target in targets:
        owner, method = target.split(".")
        out[target] = vars(getattr(module, owner))[method]
    return out


@pytest.mark.parametrize(
    ("instrumentor_class", "module_name", "targets"),
    CASES,
    ids=[f"{c[0].__name__}-{c[1]}" for c in CASES],
)
def test_uninstrument_gives_the_framework_back(instrumentor_class, module_name, targets) -> None:  # type: ignore[no-untyped-def]
    original = _methods(module_name, targets)
    instrumentor = instrumentor_class()
    for _round in range(2):  # instrumenting again after an uninstrument wraps once more
        instrumentor.instrument(tracer_provider=TracerProvider(), skip_dep_check=True)
        try:
            wrapped = _methods(module_name, targets)
            for target, method in wrapped.items():
                assert method is not original[target]
                assert method.__wrapped__ is original[target]  # once, not wrapper on wrapper
        finally:
            instrumentor.uninstrument()
        restored = _methods(module_name, targets)
        # Identity: a wrapt proxy compares equal to the function it wraps.
        assert all(restored[t] is original[t] for t in targets)


@pytest.mark.parametrize(
    "factory", [lightning_callbacks, pytorch_lightning_callbacks], ids=lambda f: f.__name__
)
def test_the_lightning_factories_add_a_callback_only_while_instrumented(factory) -> None:  # type: ignore[no-untyped-def]
    instrumentor = LightningInstrumentor()
    assert factory() == []
    instrumentor.instrument(tracer_provider=TracerProvider())
    try:
        assert [type(cb).__name__ for cb in factory()] == ["OtelGpuLightningCallback"]
    finally:
        instrumentor.uninstrument()
    assert factory() == []
