"""OpenTelemetry spans of traced requests, made once their answers are durable.

A request whose ``traceparent`` header names a trace continues that trace in the
worker: one ``process <topic>`` span (kind CONSUMER), a child of the request's
context, from the record's fetch to its answer being durable in Redis and on the
reply topic. Events on it mark where each stage began and ended::

    submit conveyor.m.requests        the producer's span (the SDK's, or any)
    └── process conveyor.m.requests   starts when the record is fetched
          batch_start                 its batch leaves the batcher and starts on the model
          model_finished              the model's outputs are ready
          publish_start               the publish call that makes its answer durable starts
                                      ends when that call has made it durable

Events rather than a child span per stage: the spans' cost is the SDK's, per span
made and per span encoded for export, and one span with three events costs about a
third of four spans (docs/operations.md#tracing).

Every instant is already measured for the result document and the metrics, so the
spans are made afterwards, in one pass per publish call on the event loop: nothing
travels with a request through the stages. A request without a traceparent gets no
span; one whose context says not sampled gets what the sampler decides (by default
none, and a span that records nothing).

Only imported when ``--tracing`` is on (``workers.app``): a worker with tracing
off never loads OpenTelemetry's trace SDK and builds no span. The OpenTelemetry SDK
reads its own variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``),
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
        sent_ns, durable_ns = int(sent_ms * _MS_NS), int(durable_ms * _MS_NS)
        for outcome in outcomes:
            timing = outcome.timing
            for item in outcome.answered:
                traceparent = item.meta.traceparent
                if traceparent is not None:
                    span = self._process(
                        item.record, item.meta.id, traceparent, item.received_ms, timing
                    )
                    span.add_event("publish_start", timestamp=sent_ns)
                    span.end(durable_ns)
            for refusal in outcome.refused:
                if refusal.traceparent is not None:
                    span = self._process(
                        refusal.record,
                        refusal.request_id,
                        refusal.traceparent,
                        refusal.received_ms,
                        refusal.batch,
                    )
                    span.set_attribute("error.type", refusal.code.value)
                    span.set_status(Status(StatusCode.ERROR, refusal.message))
                    span.add_event("publish_start", timestamp=sent_ns)
                    span.end(durable_ns)

    def _process(
        self,
        record: Record,
        request_id: str | None,
        traceparent: str,
        received_ms: float,
        batch: BatchTiming | None,
    ) -> trace.Span:
        """The request's ``process`` span, a child of ``traceparent``, from its fetch, with
        its batch's events when it ran on the model (a span that records nothing when
        the sampler says so: every call on it does nothing)."""
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
        if batch is not None:
            attributes["conveyor.batch.size"] = batch.size
        span = self._tracer.start_span(
            f"process {record.topic}",
            trace.set_span_in_context(NonRecordingSpan(_remote(traceparent))),
            SpanKind.CONSUMER,
            attributes,
            start_time=int(received_ms * _MS_NS),
        )
        if batch is not None:
            span.add_event("batch_start", timestamp=int(batch.start_ms * _MS_NS))
            span.add_event("model_finished", timestamp=int(batch.finished_ms * _MS_NS))
        return span


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
