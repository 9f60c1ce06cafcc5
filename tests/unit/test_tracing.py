"""The worker's spans of traced requests (``workers.observe.tracing``) and the SDK's submit
span (``producers.tracing``), read back from OpenTelemetry's in-memory exporter; a worker
with tracing off never loads them, and the SDK without OpenTelemetry sends no context."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from producers.errors import InvalidInput
from producers.tracing import submit_span
from schemas import ContentType, ErrorCode
from schemas.fastpath import FastMeta
from tests.fakes import FakeRecord
from workers.observe.tracing import Tracing
from workers.offsets import OffsetTracker
from workers.types import BatchTiming, Item, Outcome, Refusal

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
SAMPLED = f"00-{TRACE}-{PARENT}-01"
GROUP = "conveyor.m"
RECEIVED_MS, START_MS, FINISHED_MS, SENT_MS, DURABLE_MS = 1000.0, 1004.0, 1010.5, 1011.0, 1013.0
TIMING = BatchTiming(START_MS, FINISHED_MS, FINISHED_MS - START_MS, 2)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, GROUP)


def item(request_id: str, traceparent: str | None, offset: int = 7) -> Item:
    meta = FastMeta(request_id, ContentType.TEXT, {}, None, None, None, None, traceparent)
    record = FakeRecord("conveyor.m.requests", 2, offset)
    span = OffsetTracker[str]().open("p", offset, offset, 1)
    return Item(record, span, meta, RECEIVED_MS, 0.0, None)


def ns(ms: float) -> int:
    return int(ms * 1_000_000)


def events(span: ReadableSpan) -> list[tuple[str, int]]:
    return [(event.name, event.timestamp) for event in span.events]


def test_a_traced_request_continues_its_trace_through_each_stage(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    answered = [item("traced", SAMPLED), item("plain", None, offset=8)]
    tracing.record([Outcome(answered, ["a", "b"], TIMING)], SENT_MS, DURABLE_MS)

    [process] = exporter.get_finished_spans()  # the request without a traceparent has none
    assert process.name == "process conveyor.m.requests"
    context = process.get_span_context()
    assert context is not None
    assert process.parent is not None
    assert (f"{context.trace_id:032x}", f"{process.parent.span_id:016x}") == (TRACE, PARENT)
    assert process.parent.is_remote
    assert process.kind is SpanKind.CONSUMER
    assert (process.start_time, process.end_time) == (ns(RECEIVED_MS), ns(DURABLE_MS))
    assert events(process) == [
        ("batch_start", ns(START_MS)),
        ("model_finished", ns(FINISHED_MS)),
        ("publish_start", ns(SENT_MS)),
    ]
    assert dict(process.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "conveyor.m.requests",
        "messaging.destination.partition.id": "2",
        "messaging.kafka.offset": 7,
        "messaging.consumer.group.name": GROUP,
        "messaging.message.id": "traced",
        "conveyor.batch.size": 2,
    }
    assert process.status.status_code is StatusCode.UNSET


def test_a_refused_request_ends_its_span_with_the_error(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    bad = Refusal.of(item("bad", SAMPLED), ErrorCode.bad_request, "ce_params: not JSON")
    tracing.record([Outcome(refused=[bad])], SENT_MS, DURABLE_MS)

    [process] = exporter.get_finished_spans()
    assert events(process) == [("publish_start", ns(SENT_MS))]  # it never reached the model
    assert process.status.status_code is StatusCode.ERROR
    assert process.status.description == "ce_params: not JSON"
    assert (process.attributes or {})["error.type"] == "bad_request"
    assert "conveyor.batch.size" not in (process.attributes or {})


def test_a_model_failure_shows_the_batch_it_failed_in(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    failed = Refusal.of(item("boom", SAMPLED), ErrorCode.model_error, "model failed")
    failed.batch = TIMING
    tracing.record([Outcome(refused=[failed])], SENT_MS, DURABLE_MS)

    [process] = exporter.get_finished_spans()
    assert [name for name, _ in events(process)] == [
        "batch_start",
        "model_finished",
        "publish_start",
    ]
    assert (process.attributes or {})["error.type"] == "model_error"
    assert (process.attributes or {})["conveyor.batch.size"] == 2


def test_requests_without_a_sampled_trace_get_no_span(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    unsampled = item("unsampled", f"00-{TRACE}-{PARENT}-00")
    plain = item("plain", None)
    refused = Refusal.of(item("refused", None), ErrorCode.expired, "late", dead_letter=False)
    unsampled_refusal = Refusal.of(
        item("late", f"00-{TRACE}-{PARENT}-00"), ErrorCode.expired, "late", dead_letter=False
    )
    outcomes = [Outcome([unsampled, plain], ["a", "b"], TIMING, [refused, unsampled_refusal])]
    tracing.record(outcomes, SENT_MS, DURABLE_MS)
    assert exporter.get_finished_spans() == ()


def test_a_later_trace_context_version_is_read_by_its_fixed_fields(
    tracing: Tracing, exporter: InMemorySpanExporter
) -> None:
    later = f"01-{TRACE}-{PARENT}-01-more-fields"  # W3C: a later version may add fields
    tracing.record([Outcome([item("later", later)], ["a"], TIMING)], SENT_MS, DURABLE_MS)
    [process] = exporter.get_finished_spans()
    assert process.parent is not None
    assert f"{process.parent.span_id:016x}" == PARENT


async def test_the_console_exporter_writes_one_json_span_a_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    tracing = Tracing.start("console", group=GROUP, worker="w-1", model="m", model_version="3")
    tracing.record([Outcome([item("traced", SAMPLED)], ["a"], TIMING)], SENT_MS, DURABLE_MS)
    await tracing.aclose()  # exports what the batch processor holds

    [line] = capsys.readouterr().out.splitlines()
    process = json.loads(line)
    assert process["name"] == "process conveyor.m.requests"
    assert process["parent_id"] == f"0x{PARENT}"
    assert process["context"]["trace_id"] == f"0x{TRACE}"
    assert process["kind"] == "SpanKind.CONSUMER"
    assert [event["name"] for event in process["events"]] == [
        "batch_start",
        "model_finished",
        "publish_start",
    ]
    assert process["resource"]["attributes"] | {"telemetry.sdk.version": "-"} == {
        "service.name": "conveyor-worker",
        "service.instance.id": "w-1",
        "conveyor.model": "m",
        "conveyor.model.version": "3",
        "deployment.environment": "test",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
        "telemetry.sdk.version": "-",
    }


async def test_otel_service_name_names_the_worker(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "digits-serving")
    tracing = Tracing.start("console", group=GROUP, worker="w-1", model="m", model_version="3")
    tracing.record([Outcome([item("traced", SAMPLED)], ["a"], TIMING)], SENT_MS, DURABLE_MS)
    await tracing.aclose()
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["resource"]["attributes"]["service.name"] == "digits-serving"


async def test_otel_traces_sampler_bounds_what_the_worker_records(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not parent-based: the worker keeps a share of the traces whatever producers sample.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    tracing = Tracing.start("console", group=GROUP, worker="w-1", model="m", model_version="3")
    # A trace id's low 64 bits below half their range are kept by a ratio of 0.5.
    kept, dropped = f"{1:032x}", f"{(1 << 64) - 1:032x}"
    answered = [item(trace_id, f"00-{trace_id}-{PARENT}-01") for trace_id in (kept, dropped)]
    tracing.record([Outcome(answered, ["a", "b"], TIMING)], SENT_MS, DURABLE_MS)
    await tracing.aclose()
    spans = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [span["attributes"]["messaging.message.id"] for span in spans] == [kept]


def test_a_worker_with_tracing_off_never_loads_the_tracing_sdk() -> None:
    # redis-py imports OpenTelemetry's API and metrics SDK itself when they are installed;
    # what the worker adds (its spans, the trace SDK, an exporter) stays out.
    code = (
        "import sys, workers.app, workers.cli, workers.pipeline\n"
        "print(sorted(m for m in sys.modules if m.startswith(\n"
        "    ('workers.observe.tracing', 'opentelemetry.sdk.trace', 'opentelemetry.exporter'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


# -- the SDK's submit span (producers.tracing) -----------------------------------------------


def test_the_submit_span_is_what_each_request_carries(sdk_spans: InMemorySpanExporter) -> None:
    with submit_span("conveyor.m.requests") as span:
        span.sent(["a", "b", "c"])
        traceparent = span.traceparent
    [submit] = sdk_spans.get_finished_spans()
    context = submit.get_span_context()
    assert context is not None
    assert context.trace_flags.sampled
    flags = f"{context.trace_flags:02x}"  # sampled, and random (W3C level 2) by the SDK's ids
    assert traceparent == f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags}"
    assert submit.name == "submit conveyor.m.requests"
    assert submit.kind is SpanKind.PRODUCER
    assert dict(submit.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "submit",
        "messaging.destination.name": "conveyor.m.requests",
        "messaging.batch.message_count": 3,
    }


def test_a_failed_submit_ends_its_span_with_the_error(sdk_spans: InMemorySpanExporter) -> None:
    def fail() -> None:
        with submit_span("conveyor.m.requests") as span:
            span.sent(["only"])
            raise InvalidInput("no such file: a.png")

    with pytest.raises(InvalidInput):
        fail()
    [submit] = sdk_spans.get_finished_spans()
    assert submit.status.status_code is StatusCode.ERROR
    assert (submit.attributes or {})["messaging.message.id"] == "only"
    assert [event.name for event in submit.events] == ["exception"]


def test_without_an_sdk_the_caller_s_context_is_passed_on() -> None:
    # OpenTelemetry's API alone (no provider set): nothing is recorded, but a context the
    # application holds (another library's, or propagated to it) still goes out.
    with submit_span("t") as span:
        assert span.traceparent is None
    caller = NonRecordingSpan(
        SpanContext(int(TRACE, 16), int(PARENT, 16), False, TraceFlags(TraceFlags.SAMPLED))
    )
    with trace.use_span(caller), submit_span("t") as span:
        assert span.traceparent == SAMPLED


def test_without_opentelemetry_no_traceparent_is_sent() -> None:
    code = (
        "import sys\n"
        "from importlib.abc import MetaPathFinder\n"
        "class NotInstalled(MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'opentelemetry':\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
        "from producers.tracing import submit_span\n"
        "with submit_span('t') as span:\n"
        "    span.sent(['a'])\n"
        "    print(span.traceparent)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "None"
