"""The Grafana dashboard's panels, drawn from a real worker's metrics without Grafana.

compose/grafana/dashboards/conveyor.json is the dashboard that compose provisions
beside Prometheus. This module reads its queries (``queries``), names what a
worker exports (``exported_names``: what the dashboard test checks the queries
against), and ``run`` draws the panels from a real run: one ``conveyor worker``
serving ``bench.paced`` (40 ms a batch of at most 16, so at most 400 requests/s
on any machine) under a load of one minute that goes past its capacity and back
(150, 600, then 100 requests/s, idle 5 s before and 15 s after), with requests
that expire, frames that are superseded and records that are refused among
them. ``/metrics`` is scraped
every second; each panel's queries are evaluated over those scrapes with
``bench.promql`` (``$__rate_interval`` as Grafana sets it for a one-second
scrape: 4 s), as Prometheus would evaluate them, and drawn with ``bench.plot``.

``python -m bench.dashboard`` runs it against the services of ``make up`` and
writes docs/dashboard.png and docs/dashboard.json (the evaluated series).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from bench.plot import Timeline, draw_timelines
from bench.promql import Scrapes, evaluate, metric_names, parse
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    Fleet,
    WorkerConfig,
    free_port,
    http_get,
    produce_at_rate,
    until_all_ready,
)
from schemas import ContentType, OutgoingRecord, encode_request, topics_for

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "compose" / "grafana" / "dashboards" / "conveyor.json"
DATASOURCES = REPO / "compose" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
JOB = "conveyor-worker"  # compose/prometheus.yml's job name, which Prometheus adds as `job`
SCRAPE_S = 1.0
RATE_INTERVAL_S = 4 * SCRAPE_S  # Grafana: max(4 x scrape interval, step + scrape interval)
BATCH_MS, MAX_BATCH = 40, 16  # bench.paced: at most 16 / 0.04 = 400 requests/s
PHASES = ((20.0, 150.0), (15.0, 600.0), (25.0, 100.0))  # (seconds, requests/s)
IDLE_S = 5.0
_UNITS = {
    "reqps": "requests/s",
    "ops": "per second",
    "s": "seconds",
    "bytes": "bytes",
    "percentunit": "share",
    "short": "",
    "none": "",
}


class Query(NamedTuple):
    """One query of one panel."""

    panel: str  # the panel's title
    ref_id: str
    expr: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """Every panel query, in panel order."""
    return [
        Query(panel["title"], target["refId"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def variable_metrics(dashboard: Mapping[str, Any]) -> set[str]:
    """Metrics the template variables read (``label_values(metric, label)``)."""
    found = set()
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        found.update(re.findall(r"label_values\(\s*([A-Za-z_:][\w:]*)", text))
    return found


def grafana_expr(expr: str, model: str, rate_interval_s: float) -> str:
    """``expr`` with the dashboard's variables set as Grafana sets them before querying."""
    interval = f"{rate_interval_s:g}s"
    return expr.replace("$__rate_interval", interval).replace("$model", re.escape(model))


def expr_metrics(expr: str) -> set[str]:
    """The metrics a dashboard query selects (its variables set to anything)."""
    return metric_names(parse(grafana_expr(expr, "any", RATE_INTERVAL_S)))


def exported_names(exposition: str) -> set[str]:
    """Every series name a ``/metrics`` text declares or holds.

    A family declared with no sample yet (e.g. GPU memory on a CPU worker) counts:
    its series appear once there is something to report. Counters are named with
    ``_total``, histograms with ``_bucket``, ``_sum`` and ``_count``, as queried.
    """
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def scraped(exposition: str, instance: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of one scrape, labelled with ``job`` and ``instance`` as Prometheus does."""
    target = {"job": JOB, "instance": instance}
    return [
        (sample.name, {**sample.labels, **target}, float(sample.value))
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    ]


async def run(kafka_bootstrap: str, redis_url: str, log_dir: Path) -> tuple[Scrapes, str]:
    """Serve the load of ``PHASES`` with one worker; its scrapes, and the model's name."""
    model = f"dash{uuid.uuid4().hex[:8]}"
    settings = ClientSettings(kafka_bootstrap=kafka_bootstrap)
    await create_model_topics(settings, model, partitions=4)
    config = WorkerConfig(
        model,
        kafka_bootstrap,
        redis_url,
        model="bench.paced:PacedHandler",
        options=("--max-batch-size", str(MAX_BATCH), "--decode-threads", "1"),
        env={"CONVEYOR_PACED_BATCH_MS": str(BATCH_MS)},
        metrics_port=free_port(),
    )
    scrapes = Scrapes()
    try:
        async with Fleet(config, log_dir) as fleet:
            worker = fleet.start()
            await until_all_ready([worker])
            port = config.metrics_port
            scraping = asyncio.create_task(_scrape(port, f"127.0.0.1:{port}", scrapes))
            try:
                # The scenario's idle ends: an idle worker before the load, and after it
                # long enough for the backlog to drain and the rates to fall back.
                await asyncio.sleep(IDLE_S)
                await _load(kafka_bootstrap, topics_for(model).requests, model)
                await asyncio.sleep(3 * IDLE_S)
            finally:
                scraping.cancel()
    finally:
        await delete_model_topics(settings, model)
    return scrapes, model


async def _scrape(port: int, instance: str, scrapes: Scrapes) -> None:
    started = time.monotonic()
    while True:
        status, body = await http_get(port, "/metrics")
        if status == 200:
            scrapes.add(time.monotonic() - started, scraped(body.decode(), instance))
        await asyncio.sleep(SCRAPE_S - (time.monotonic() - started) % SCRAPE_S)


async def _load(bootstrap: str, topic: str, model: str) -> None:
    for n, (seconds, rate) in enumerate(PHASES):
        records = _records(model, n, int(seconds * rate), rate)
        await produce_at_rate(bootstrap, topic, records, rate)


def _records(model: str, phase: int, count: int, rate: float) -> list[OutgoingRecord]:
    """Requests of one phase: a fifth with a deadline 1 s after they are due, a tenth frames
    of four streams in freshest-frame mode, one in a hundred refused (a media type no
    model takes); the rest plain."""
    start = datetime.now(UTC)
    records = []
    for i in range(count):
        request_id = f"{model}-{phase}-{i}"
        deadline = start + timedelta(seconds=i / rate + 1.0) if i % 5 == 1 else None
        stream = f"{model}-cam{i % 4}" if i % 10 == 3 else None
        record = encode_request(
            i.to_bytes(16, "big"),
            request_id=request_id if stream is None else f"{stream}:{i}",
            content_type=ContentType.TEXT,
            source="bench.dashboard",
            deadline=deadline,
            stream=stream,
            seq=i if stream is not None else None,
            supersede=True if stream is not None else None,
        )
        if i % 100 == 7:
            headers = [(k, b"image/gif" if k == "content-type" else v) for k, v in record.headers]
            record = record._replace(headers=headers)
        records.append(record)
    return records


def panels(scrapes: Scrapes, model: str, dashboard: Mapping[str, Any]) -> list[Timeline]:
    """Each graph panel of ``dashboard``, its queries evaluated at every scrape."""
    charts = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        series: dict[str, list[float]] = {}
        for target in panel["targets"]:
            expr = parse(grafana_expr(target["expr"], model, RATE_INTERVAL_S))
            for at in range(len(scrapes.times)):
                value = evaluate(expr, scrapes, at)
                vector = {frozenset(): value} if isinstance(value, float) else value
                for labels, number in vector.items():
                    name = _legend(target.get("legendFormat", ""), dict(labels))
                    values = series.setdefault(name, [math.nan] * len(scrapes.times))
                    values[at] = number
        unit = _UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), "")
        title = panel["title"] if series else f"{panel['title']}: no series in this run"
        shown: dict[str, Sequence[float]] = dict(series)
        charts.append(Timeline(title, unit, scrapes.times, shown))
    return charts


def _legend(template: str, labels: Mapping[str, str]) -> str:
    name = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    return name or ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = parser.parse_args(argv)
    log_dir = REPO / ".run" / "dashboard"
    scrapes, model = asyncio.run(run(args.kafka_bootstrap, args.redis_url, log_dir))
    charts = panels(scrapes, model, load())
    title = (
        "Conveyor workers dashboard: its queries evaluated over one worker's /metrics, "
        f"scraped every {SCRAPE_S:g} s (rates over {RATE_INTERVAL_S:g} s); not drawn by Grafana"
    )
    draw_timelines(charts, args.out, title, columns=2)
    series = {c.title: {"times": list(c.times), "series": dict(c.series)} for c in charts}
    args.out.with_suffix(".json").write_text(json.dumps(series, allow_nan=True) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
