"""OpenTelemetry spans of traced requests, built once their answers are durable.

A request whose ``traceparent`` header names a trace continues that trace in the
worker: one ``process <topic>`` span (kind CONSUMER) from the record's fetch to
its answer being durable, a child of the request's context, with a child span
for each stage it went through::

    submit conveyor.m.requests          (the producer's span: the SDK's, or any)
    └── process conveyor.m.requests     fetched → durable in Redis and on the reply topic
        ├── batch                       fetched → its batch starts (preprocess, batcher)
        ├── model                       the batch's run on the model
        └── publish                     the publish call that made its answer durable

Every time is already measured for the result document and the metrics, so the
spans are made afterwards, in one pass per publish call, with their real start
and end times: nothing is carried through the stages and no thread but the event
loop touches a span. A request without a traceparent gets no span; one whose
context says not sampled gets what the sampler decides (by default none).

Only imported when ``--tracing`` is on (``workers.app``): a worker with tracing
off never loads OpenTelemetry's trace SDK and builds no span. The OpenTelemetry SDK reads
its own variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``),
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Sequence
from typing import Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from workers.types import BatchTiming, Outcome, Record

Exporter = Literal["otlp", "console"]
SERVICE_NAME = "conveyor-worker"
"""``service.name`` of the worker's spans unless ``OTEL_SERVICE_NAME`` says otherwise."""
CLOSE_S = 2.0
"""After the drain, how long the worker waits for its last spans to be exported."""
_SCOPE = "conveyor.worker"
_MS_NS = 1_000_000


class Tracing:
    """Makes the spans of each publish call's traced requests (``record``)."""

    def __init__(self, provider: TracerProvider, group: str) -> None:
        """``provider`` exports the spans; ``group`` is the worker's consumer group."""
        self._provider = provider
        self._tracer = provider.get_tracer(_SCOPE)
        self._group = group

    @classmethod
    def start(
        cls, exporter: Exporter, *, group: str, worker: str, model: str, model_version: str
    ) -> Tracing:
        """Spans exported by ``exporter`` in the background (OpenTelemetry's batch
        processor), described by the worker's id and model."""
        resource = Resource.create(
            {
                "service.name": SERVICE_NAME,
                "service.instance.id": worker,
                "conveyor.model": model,
                "conveyor.model.version": model_version,
            }
        ).merge(OTELResourceDetector().detect())  # OTEL_SERVICE_NAME and others win
        # No exit handler: it would wait 30 s for a collector that does not answer.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(_processor(exporter))
        return cls(provider, group)

    async def aclose(self) -> None:
        """Export the spans not exported yet, waiting ``CLOSE_S`` at most: what is left
        then (a collector that does not answer) is dropped, and the process may exit."""
        stopping = threading.Thread(
            target=self._provider.shutdown, name="conveyor-tracing-stop", daemon=True
        )
        stopping.start()
        await asyncio.to_thread(stopping.join, CLOSE_S)

    def record(self, outcomes: Sequence[Outcome], sent_ms: float, durable_ms: float) -> None:
        """Spans of the traced requests that ``outcomes`` answered, in a publish call
        made at ``sent_ms`` and durable at ``durable_ms`` (epoch ms)."""
        for outcome in outcomes:
            timing = outcome.timing
            for item in outcome.answered:
                traceparent = item.meta.traceparent
                if traceparent is not None:
                    process = self._process(
                        item.record, item.meta.id, traceparent, item.received_ms, timing
                    )
                    self._end(process, sent_ms, durable_ms)
            for refusal in outcome.refused:
                if refusal.traceparent is not None:
                    process = self._process(
                        refusal.record,
                        refusal.request_id,
                        refusal.traceparent,
                        refusal.received_ms,
                        refusal.batch,
                    )
                    if process.is_recording():
                        process.set_attribute("error.type", refusal.code.value)
                        process.set_status(Status(StatusCode.ERROR, refusal.message))
                    self._end(process, sent_ms, durable_ms)

    def _process(
        self,
        record: Record,
        request_id: str | None,
        traceparent: str,
        received_ms: float,
        batch: BatchTiming | None,
    ) -> trace.Span:
        """The request's ``process`` span, a child of ``traceparent``, and its ``batch``
        and ``model`` spans when it ran on the model."""
        attributes: dict[str, str | int] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": record.topic,
            "messaging.destination.partition.id": str(record.partition),
            "messaging.kafka.offset": record.offset,
            "messaging.consumer.group.name": self._group,
        }
        if request_id is not None:
            attributes["messaging.message.id"] = request_id
        received_ns = int(received_ms * _MS_NS)
        span = self._tracer.start_span(
            f"process {record.topic}",
            trace.set_span_in_context(NonRecordingSpan(_remote(traceparent))),
            SpanKind.CONSUMER,
            attributes,
            start_time=received_ns,
        )
        if batch is not None and span.is_recording():
            parent = trace.set_span_in_context(span)
            start_ns = int(batch.start_ms * _MS_NS)
            self._tracer.start_span("batch", parent, start_time=received_ns).end(start_ns)
            model = self._tracer.start_span(
                "model",
                parent,
                attributes={"conveyor.batch.size": batch.size},
                start_time=start_ns,
            )
            model.end(int(batch.finished_ms * _MS_NS))
        return span

    def _end(self, process: trace.Span, sent_ms: float, durable_ms: float) -> None:
        """The ``publish`` span under ``process``, then the end of both at ``durable_ms``."""
        durable_ns = int(durable_ms * _MS_NS)
        if process.is_recording():
            parent = trace.set_span_in_context(process)
            publish = self._tracer.start_span("publish", parent, start_time=int(sent_ms * _MS_NS))
            publish.end(durable_ns)
        process.end(durable_ns)


def _remote(traceparent: str) -> SpanContext:
    """The context a ``traceparent`` names (already checked: ``schemas.headers``)."""
    # version-traceid-parentid-flags: fixed places in every version of W3C Trace Context.
    return SpanContext(
        int(traceparent[3:35], 16),
        int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
    )


def _processor(exporter: Exporter) -> SpanProcessor:
    chosen: SpanExporter
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        chosen = OTLPSpanExporter()
    else:
        chosen = ConsoleSpanExporter(out=sys.stdout, formatter=_one_line)
    return BatchSpanProcessor(chosen)


def _one_line(span: ReadableSpan) -> str:
    """One JSON object per line, for a log collector to read (not the SDK's indented form)."""
    text: str = span.to_json(indent=None)
    return text + "\n"
