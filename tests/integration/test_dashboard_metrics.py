"""The Grafana dashboard's queries against what a real worker exports.

A worker serves requests from the real broker and Redis; its ``/metrics`` is
scraped before and after. Every metric each panel (and the model picker)
queries must be one the worker exports, histograms by their ``_bucket``,
``_sum`` and ``_count`` series; and every query, evaluated over the two
scrapes as Prometheus would, must give the panel a series, except where the
worker declares a metric it has nothing to report for yet (GPU memory on a
CPU worker).
"""

from __future__ import annotations

import pytest

from bench.dashboard import (
    exported_names,
    expr_metrics,
    grafana_expr,
    load,
    queries,
    scraped,
    variable_metrics,
)
from bench.promql import Scrapes, evaluate, parse
from producers.admin import create_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    free_port,
    http_get,
    produce,
    until_all_ready,
    wait_for_results,
)
from schemas import ContentType, encode_request, topics_for
from tests.harness import digit_requests

WINDOW_S = 3600.0  # the rate window: long enough to span both scrapes


async def metrics(port: int) -> str:
    status, body = await http_get(port, "/metrics")
    assert status == 200
    return body.decode()


@pytest.mark.timeout(120)
async def test_every_dashboard_query_reads_metrics_a_real_worker_exports(
    workers: Fleet,
    client_settings: ClientSettings,
    kafka_bootstrap: str,
    redis_url: str,
    model_name: str,
    digits: list[tuple[bytes, int]],
) -> None:
    await create_model_topics(client_settings, model_name, partitions=2)
    port = free_port()
    worker = workers.start("--metrics-host", "127.0.0.1", metrics_port=port)
    await until_all_ready([worker])
    instance = f"127.0.0.1:{port}"
    scrapes = Scrapes()
    scrapes.add(0.0, scraped(await metrics(port), instance))

    records, ids = digit_requests(digits, 60, prefix=model_name)
    refused = encode_request(
        b"not an image", request_id=f"{model_name}-bad", content_type=ContentType.PNG, source="t"
    )
    await produce(kafka_bootstrap, topics_for(model_name).requests, [*records, refused])
    results = await wait_for_results(redis_url, [*ids, f"{model_name}-bad"], timeout_s=60)
    assert len(results) == 61, worker.log()[-5000:]
    exposition = await metrics(port)
    scrapes.add(10.0, scraped(exposition, instance))

    exported = exported_names(exposition)
    dashboard = load()
    assert variable_metrics(dashboard) <= exported
    empty = []
    for query in queries(dashboard):
        missing = expr_metrics(query.expr) - exported
        assert not missing, f"{query.panel} ({query.ref_id}) queries {missing}, not exported"
        result = evaluate(parse(grafana_expr(query.expr, model_name, WINDOW_S)), scrapes, 1)
        if not result:
            empty.append(query.panel)
    assert empty == ["GPU memory held by tensors, per worker"]
    assert "conveyor_gpu_memory_allocated_bytes" not in {
        name for name, _labels, _value in scraped(exposition, instance)
    }
