"""The SDK's span: one ``submit <topic>`` span per submit call, its context in each request.

Tracing follows the application, as OpenTelemetry's instrumentations do: with the
OpenTelemetry API installed (the ``tracing`` extra) and a tracer provider set up by
the application (``trace.set_tracer_provider``, or ``opentelemetry-instrument``),
``submit`` and ``submit_many`` each make a span of kind PRODUCER (``send`` in the
messaging conventions), a child of the caller's current span, from the call to the
broker's acknowledgement; every request of the call carries the span's context as its
``traceparent``, which a worker with ``--tracing`` continues. Without a provider,
OpenTelemetry's no-op tracer hands on the caller's current span, whose context is sent
when there is one. Without OpenTelemetry nothing is done and no ``traceparent`` sent.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tracing extra may not be installed
    from opentelemetry.trace import Span

_SCOPE = "conveyor.sdk"


class Submitting:
    """The span of one submit call, while it runs."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Span | None) -> None:
        self._span = span
        context = None if span is None else span.get_span_context()
        self.traceparent: str | None = None
        """What each request of the call carries: the span's W3C context, if it has one."""
        if context is not None and context.is_valid:
            self.traceparent = (
                f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
            )

    def sent(self, request_ids: Sequence[str]) -> None:
        """Name the requests of the call on its span."""
        span = self._span
        if span is None or not span.is_recording():
            return
        if len(request_ids) == 1:
            span.set_attribute("messaging.message.id", request_ids[0])
        else:
            span.set_attribute("messaging.batch.message_count", len(request_ids))


@contextmanager
def submit_span(topic: str) -> Iterator[Submitting]:
    """The span of a submit call to ``topic``, current while the call runs; an error
    that ends the call is recorded on it."""
    if not _installed():
        yield Submitting(None)
        return
    from opentelemetry import trace

    attributes = {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "submit",
        "messaging.destination.name": topic,
    }
    tracer = trace.get_tracer(_SCOPE)  # each call: the application may set its provider late
    with tracer.start_as_current_span(
        f"submit {topic}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        yield Submitting(span)


@functools.cache
def _installed() -> bool:
    """Whether OpenTelemetry's API is there (looked for once: a failed import is slow)."""
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except ModuleNotFoundError:  # no opentelemetry package at all
        return False


@contextmanager
def continuing(traceparent: str | None) -> Iterator[None]:
    """Make the trace of an incoming ``traceparent`` (W3C) current while the block runs,
    so that a submit inside it is that trace's child (the HTTP gateway continues each
    caller's trace this way). Without OpenTelemetry, or without a valid
    ``traceparent``, nothing changes."""
    if traceparent is None or not _installed():
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    extracted = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    token = context.attach(extracted)
    try:
        yield
    finally:
        context.detach(token)
