"""Traces across the SDK and a real worker: the SDK's submit spans, read from OpenTelemetry's
in-memory exporter in this process, and the spans a worker process (``--tracing otlp``)
exports over OTLP/HTTP to a collector this test runs (``producers.testing.otlp``), against
the real broker and Redis."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from producers import AsyncClient, Client, ClientSettings, Status
from producers.admin import create_model_topics
from producers.testing import Fleet, produce, until, until_all_ready, wait_for_results
from producers.testing.otlp import CollectedSpan, TraceCollector
from schemas import ContentType, encode_request, topics_for

WORKER_ID = "traced-worker"


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def processed(spans: list[CollectedSpan]) -> dict[str, CollectedSpan]:
    """The worker's ``process`` spans by request id."""
    return {
        str(span.attributes["messaging.message.id"]): span
        for span in spans
        if span.name.startswith("process ")
    }


@pytest.mark.timeout(180)
async def test_a_submitted_trace_continues_through_the_worker_s_stages(
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    workers: Fleet,
    drop_topics: list[str],
    digits: list[tuple[bytes, int]],
    sdk_spans: InMemorySpanExporter,
) -> None:
    topics = topics_for(model_name)
    await create_model_topics(client_settings, model_name, partitions=3)
    drop_topics.append(model_name)
    pngs = [png for png, _digit in digits[:3]]
    with TraceCollector() as collector:
        worker = workers.start(
            "--tracing",
            "otlp",
            "--worker-id",
            WORKER_ID,
            env={
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            },
        )
        await until_all_ready([worker])

        # The sync client in the caller's span: its submit span is a child of it.
        with (
            trace.get_tracer("test").start_as_current_span("caller") as caller,
            Client(client_settings) as client,
        ):
            batch = client.submit_many(pngs[:2], model=model_name)
        async with AsyncClient(client_settings) as aclient:
            alone = await aclient.submit(pngs[2], model=model_name)
            bad = await aclient.submit(
                b"\x89PNG not really", model=model_name, content_type=ContentType.PNG
            )
        # A request without a traceparent, from a plain producer: no spans for it.
        plain = f"{model_name}-plain"
        record = encode_request(
            pngs[0], request_id=plain, content_type=ContentType.PNG, source="tests"
        )
        await produce(kafka_bootstrap, topics.requests, [record])

        traced = [*batch, alone, bad]
        results = await wait_for_results(redis_url, [*traced, plain], timeout_s=60)
        assert [results[i].status for i in [*batch, alone, plain]] == [Status.ok] * 4
        refused = results[bad].error
        assert refused is not None

        def all_exported() -> bool:
            return set(traced) <= set(processed(collector.spans()))

        await until(all_exported, "the worker's spans of every traced request", 30, worker.log)
        exported = collector.spans()

    submits = [span for span in sdk_spans.get_finished_spans() if span.name != "caller"]
    assert [span.name for span in submits] == [f"submit {topics.requests}"] * 3
    assert {span.kind for span in submits} == {SpanKind.PRODUCER}
    sdk_batch, sdk_alone, sdk_bad = submits  # in the order they ended
    assert dict(sdk_batch.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "submit",
        "messaging.destination.name": topics.requests,
        "messaging.batch.message_count": 2,
    }
    assert (sdk_alone.attributes or {})["messaging.message.id"] == alone
    assert (sdk_bad.attributes or {})["messaging.message.id"] == bad
    assert sdk_batch.parent is not None
    assert sdk_batch.parent.span_id == caller.get_span_context().span_id
    assert sdk_alone.parent is None  # no span was current: a trace of its own
    parents = {batch[0]: sdk_batch, batch[1]: sdk_batch, alone: sdk_alone, bad: sdk_bad}

    spans = processed(exported)
    assert len(exported) == len(spans) == len(traced)  # one span each, none for `plain`
    for request_id in traced:
        process, submit = spans[request_id], parents[request_id]
        assert (process.trace_id, process.parent_span_id) == hex_ids(submit), request_id
        assert process.kind == "CONSUMER"
        assert process.resource["service.name"] == "conveyor-worker"
        assert process.resource["service.instance.id"] == WORKER_ID
        assert process.resource["conveyor.model"] == model_name
        assert process.attributes["messaging.system"] == "kafka"
        assert process.attributes["messaging.operation.type"] == "process"
        assert process.attributes["messaging.destination.name"] == topics.requests
        assert process.attributes["messaging.consumer.group.name"] == f"conveyor.{model_name}"
        # The same instants as the result document's timings, in the order of the stages.
        timings = results[request_id].timings
        assert timings is not None
        assert process.start_ns == int(timings.received_ms * 1_000_000)
        marks = dict(process.events)
        assert process.start_ns <= marks["publish_start"] <= process.end_ns
        if request_id == bad:  # refused before the model: no batch
            assert [name for name, _ in process.events] == ["publish_start"]
            assert (process.status, process.status_message) == ("ERROR", refused.message)
            assert process.attributes["error.type"] == refused.code
            continue
        assert process.status == "UNSET"
        assert [name for name, _ in process.events] == [
            "batch_start",
            "model_finished",
            "publish_start",
        ]
        assert timings.batch_start_ms is not None
        assert marks["batch_start"] == int(timings.batch_start_ms * 1_000_000)
        assert marks["model_finished"] == int(timings.finished_ms * 1_000_000)
        assert process.start_ns <= marks["batch_start"] <= marks["model_finished"]
        assert marks["model_finished"] <= marks["publish_start"]
        assert process.attributes["conveyor.batch.size"] == timings.batch_size
