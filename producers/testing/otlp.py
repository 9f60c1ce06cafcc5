"""A trace collector on loopback: the spans workers export over OTLP/HTTP, decoded.

A worker started with ``--tracing otlp`` and ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
set to ``TraceCollector.url`` sends its spans here, as it would to an OpenTelemetry
Collector: protobuf ``ExportTraceServiceRequest`` bodies POSTed to ``/v1/traces``
(gzipped when ``OTEL_EXPORTER_OTLP_COMPRESSION=gzip``). They are decoded with
OpenTelemetry's own protobuf package (``opentelemetry-proto``, which the tracing
extra's exporter brings) and kept as ``CollectedSpan``; ``keep=False`` only counts
them, for benchmarks. The server runs on a thread of its own, so it answers while the
caller's event loop waits.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

PATH = "/v1/traces"
Value = str | bool | int | float | bytes | list["Value"] | dict[str, "Value"] | None


@dataclass(frozen=True)
class CollectedSpan:
    """One exported span, as the exporter sent it."""

    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    kind: str  # INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER
    start_ns: int  # epoch nanoseconds
    end_ns: int
    attributes: Mapping[str, Value]
    events: Sequence[tuple[str, int]]  # (name, epoch nanoseconds), in the order recorded
    status: str  # UNSET, OK, ERROR
    status_message: str
    resource: Mapping[str, Value]  # the exporting process's (service.name, ...)


class TraceCollector:
    """An OTLP/HTTP trace receiver on 127.0.0.1 while entered (``with``)."""

    def __init__(self, *, keep: bool = True) -> None:
        """``keep``: decode and keep every span; otherwise count the export calls and
        their bytes only."""
        self._keep = keep
        self._lock = threading.Lock()
        self._spans: list[CollectedSpan] = []
        self.exports = 0
        """Export calls received."""
        self.bytes = 0
        """Their bodies' bytes, as sent."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-collector", daemon=True
        )

    @property
    def url(self) -> str:
        """The endpoint to export to (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}{PATH}"

    def spans(self) -> list[CollectedSpan]:
        """Every span received so far, in the order received."""
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _received(self, body: bytes, encoding: str | None) -> None:
        spans = []
        if self._keep:
            raw = gzip.decompress(body) if encoding == "gzip" else body
            spans = _decoded(ExportTraceServiceRequest.FromString(raw))
        with self._lock:
            self.exports += 1
            self.bytes += len(body)
            self._spans += spans


def _handler_for(collector: TraceCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != PATH:
                self.send_error(404, f"traces go to {PATH}")
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                collector._received(body, self.headers.get("Content-Encoding"))
            except Exception as exc:  # a body that is no OTLP message: the exporter is told
                self.send_error(400, f"not an OTLP trace export: {exc!r}")
                return
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the exporter calls several times a second."""

    return Handler


def _decoded(request: ExportTraceServiceRequest) -> list[CollectedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    CollectedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=[(event.name, event.time_unix_nano) for event in span.events],
                        status=Status.StatusCode.Name(span.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                        status_message=span.status.message,
                        resource=resource,
                    )
                )
    return spans


def _attributes(pairs: list[KeyValue]) -> dict[str, Value]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Value:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    if which == "kvlist_value":
        return _attributes(list(value.kvlist_value.values))
    found: Value = getattr(value, which)
    return found
