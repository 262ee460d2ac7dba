"""The redaction rules (:mod:`otel_gpu.core.redact`) applied to what the OTel SDK exports itself:
resources and log records.

A resource is built once per process, so it is redacted once where it is built
(:func:`redact_resource`). Log records are redacted as they are emitted, before any exporter's
processor sees them (:class:`RedactingLogProcessor`, registered first).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk._logs import LogRecordProcessor
from opentelemetry.sdk.resources import Resource

from otel_gpu.core.redact import (
    COMMAND_EXECUTABLE,
    COMMAND_REDACTED,
    MASK,
    is_secret_name,
    program,
    redact_args,
    redact_text,
    redact_value,
)

# The process resource detector's command attributes (semconv). Newer SDKs put the whole argv in
# command_args and command_line only when asked to, older ones always did (sys.argv).
COMMAND_LINE = "process.command_line"
COMMAND_ARGS = "process.command_args"
COMMAND = "process.command"


def redact_resource(resource: Resource, mode: str = COMMAND_REDACTED) -> Resource:
    """``resource`` with its command attributes shaped by ``OTEL_GPU_PROCESS_COMMAND``
    (``mode``), the value of a key that names a credential (``db.password``) masked, and
    credentials masked in every other string value (``OTEL_RESOURCE_ATTRIBUTES`` is user input
    too)."""
    attrs: dict[str, Any] = {}
    for key, value in resource.attributes.items():
        if key == COMMAND_LINE and isinstance(value, str):
            if mode == COMMAND_REDACTED:
                attrs[key] = redact_text(value)
            elif mode == COMMAND_EXECUTABLE:
                attrs[key] = program(value.split())
        elif key == COMMAND_ARGS and isinstance(value, list | tuple):
            if mode == COMMAND_REDACTED:
                attrs[key] = redact_args([str(v) for v in value])
        elif key in (COMMAND_LINE, COMMAND_ARGS):
            continue  # off (or a value of an unexpected type): dropped
        elif is_secret_name(key):  # db.password=..., api.token=...: whatever the value looks like
            attrs[key] = MASK
        else:
            attrs[key] = redact_value(value)
    return Resource(attrs, resource.schema_url)


class RedactingLogProcessor(LogRecordProcessor):
    """Masks credentials in every log record's body and attributes, in place, before the
    processors registered after it (the exporters' batch processors) take the record."""

    def on_emit(self, log_record: Any) -> None:  # ReadWriteLogRecord (SDK >= 1.3x: LogData)
        record = log_record.log_record
        try:
            if record.body is not None:
                record.body = redact_value(record.body)
            attributes = record.attributes
            if attributes:
                for key, value in list(attributes.items()):
                    redacted = redact_value(value)
                    if redacted != value:
                        attributes[key] = redacted
        except Exception:  # never raise into the code that logged; never export unchecked text
            record.body = MASK
            record.attributes = {}

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
