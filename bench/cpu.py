"""CPU benchmarks of the worker against the local Kafka broker and Redis (``make bench``).

``python -m bench.cpu [--quick] [--out DIR]`` runs four scenarios, each on a
fresh model name (so fresh topics and consumer groups), each worker a real
``conveyor worker`` process stopped with SIGTERM:

1. transport: records/s of the worker's ``workers.kafka.consumer.Consumer`` fetch loop
   (fetch, track, finish, commit every ``max_in_flight`` records; no decoding,
   no model, no publishing) on 1 KB records, against Kafka's own
   ``kafka-consumer-perf-test`` (``ConsumerPerformance``) reading the same topic.
2. overhead: requests/s of one worker serving an identity model (small
   payloads) from a backlog: Kafka in → Redis and reply topic out, counted from
   the worker's first fetch to every result being in Redis, repeated (median);
   with ``--baseline-tree`` the worker of an earlier checkout serves the same
   kind of backlog between the repeats, for a ratio measured in the same run;
   with ``--overhead-variant FLAGS`` this worker with those flags does too (e.g.
   ``--delivery exactly-once``, for the cost of transactions against at-least-once);
   with ``--overhead-traced`` every request carries a sampled ``traceparent`` and the
   workers export their spans to a collector the benchmark runs (``--tracing otlp`` as
   the variant measures the cost of tracing every request);
   then a run sampled by py-spy (steady serving only) for the profile by area.
3. latency: open-loop load at 25/50/75% of the digits CNN's peak (scenario 4's
   micro-batched rate); end-to-end percentiles from each result's timings
   (``published_ms − produced_ms``: the record timestamp to the result being
   sent to Redis, which makes it durable one round trip later).
4. batching: the digits CNN served one request at a time (``--max-batch-size 1``)
   vs micro-batched (the defaults), both from a backlog as in 2.

It prints a table last and writes ``cpu-bench.json`` and ``cpu-bench.png``
into ``--out`` (default ``docs/``). ``--only tabular`` measures feature records
instead (``bench.cpu_tabular``: the fraud demo's MLP at its peak, idle and half the
peak), printed as JSON; no run measures it unless named.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cpu_tabular import tabular
from bench.plot import Line, Panel, draw_panels
from bench.services import Services, all_results_in
from bench.stats import (
    acked_summary,
    backlog_rate,
    batch_summary,
    check_all_ok,
    latency_summary,
    parts_line,
    pyspy_summary,
)
from demo.models.digits import build_digits_model, heldout_digits
from producers.admin import create_model_topics, delete_model_topics
from producers.testing import (
    WorkerConfig,
    WorkerProcess,
    delete_results,
    produce,
    produce_at_rate,
    read_results,
    requests,
)
from producers.testing.otlp import TraceCollector
from schemas import ContentType, ModelTopics, OutgoingRecord, consumer_group, topics_for
from workers.app import start_up_objects_frozen
from workers.config.worker import WorkerSettings
from workers.kafka.consumer import Consumer
from workers.offsets import OffsetTracker

REPO = Path(__file__).resolve().parents[1]
IDENTITY = "bench.identity:IdentityHandler"
OVERHEAD_GOAL = 20_000.0  # requests/s per process (docs/benchmarks.md, scenario 2)
TRANSPORT_GOAL = 0.8  # worker consumer / kafka-consumer-perf-test (scenario 1)
LOAD_FRACTIONS = (0.25, 0.5, 0.75)
PARTITIONS = 3
TRANSPORT_PAYLOAD = 1024
SMALL_PAYLOAD = b"0123456789abcdef"
OVERHEAD_BATCH = 256  # the identity model costs nothing: the largest batch amortises most
DIGITS_DELAY_MS = 5.0  # the worker's default max_delay, stated so the latency goal can use it
_WAIT_S = 300.0


@dataclass(frozen=True)
class Plan:
    """How much work each scenario does."""

    transport_records: int
    transport_repeats: int  # alternating kafka-perf / worker runs; the best of each counts
    overhead_requests: int
    overhead_repeats: int  # per tree, interleaved with the previous design's when given
    profile_seconds: float  # py-spy sampling of a separate run; 0: no profile (quick mode)
    batching_requests: int
    latency_seconds: float  # per load level


FULL = Plan(200_000, 2, 60_000, 3, 8.0, 6_000, 8.0)
QUICK = Plan(300, 1, 300, 1, 0.0, 300, 1.0)


@dataclass
class Bench:
    """One benchmark run: where the services are, where logs go, and a run id for names."""

    services: Services
    plan: Plan
    log_dir: Path
    kafka_libs: Path
    run_id: str
    quick: bool  # tiny counts, scenarios side by side: the numbers mean nothing
    baseline_tree: Path | None = None  # a checkout of the previous design, run side by side
    only: frozenset[str] = frozenset()  # scenarios to run; empty: DEFAULT_SCENARIOS
    overhead_options: tuple[str, ...] = ()  # more worker flags for scenario 2 (both trees)
    overhead_variant: tuple[str, ...] = ()  # scenario 2 also runs this worker with these flags
    overhead_traced: bool = False  # scenario 2's requests carry a traceparent; spans collected

    def model(self, scenario: str) -> str:
        return f"bench-{self.run_id}-{scenario}"

    # -- workers -----------------------------------------------------------------------

    def worker(
        self,
        spec: str,
        model: str,
        options: Sequence[str],
        tree: Path = REPO,
        env: Mapping[str, str] | None = None,
    ) -> WorkerConfig:
        """``conveyor worker --model spec`` from the checkout ``tree``, with ``options``
        (and ``env`` over this process's environment)."""
        return WorkerConfig(
            model,
            self.services.kafka_bootstrap,
            self.services.redis_url,
            model=spec,
            # The box has 2 cores; results outlive the run, to be read back after it.
            options=("--decode-threads", "2", "--result-ttl-s", "3600", *options),
            env=env or {},
            cwd=tree,
        )

    def launch(self, config: WorkerConfig, log_path: Path) -> WorkerProcess:
        """A worker in a session of its own: a Ctrl-C at the terminal reaches only the
        benchmark, which then stops the worker with one SIGTERM (a clean drain)."""
        return WorkerProcess(config, log_path, new_session=True)

    async def serve_backlog(
        self,
        config: WorkerConfig,
        records: Sequence[OutgoingRecord],
        ids: Sequence[str],
        profile: Path | None = None,
        label: str | None = None,
    ) -> dict[str, Any]:
        """Produce ``records``, then start a worker of ``config`` on them; rate and batches
        once all are in. With ``profile``, py-spy samples the worker into that file.
        ``label`` names the worker's log (default: its tree's directory name)."""
        tree = config.cwd or REPO
        model = config.model_name
        await produce(
            self.services.kafka_bootstrap, topics_for(model).requests, records, round_robin=True
        )
        log_path = self.log_dir / f"{model}-{label or tree.name}-{len(ids)}.log"
        async with self.launch(config, log_path) as worker:
            sampler = None
            if profile is not None:
                # Sample steady serving only: start-up (imports, model, warm-up) is over
                # once the first answer is in.
                await worker.unless_it_dies(
                    all_results_in(self.services, ids[:1], ids[:1], _WAIT_S)
                )
                sampler = await _py_spy(worker.pid, profile)
            try:
                seen_at = await worker.unless_it_dies(
                    all_results_in(self.services, ids, ids[-PARTITIONS:], _WAIT_S)
                )
            finally:
                if sampler is not None:
                    sampler.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
                    await sampler.wait()
        results = list((await read_results(self.services.redis_url, ids)).values())
        check_all_ok(results, len(ids), f"{model} (log {log_path})")
        return {"requests": len(ids), "rate": backlog_rate(results, seen_at)} | batch_summary(
            results
        )

    @asynccontextmanager
    async def fresh_model(self, scenario: str) -> AsyncIterator[tuple[str, ModelTopics, list[str]]]:
        """A model name with new topics; its topics and results are deleted afterwards.

        Yields the name, its topics and a list the caller fills with the request ids it used.
        """
        model = self.model(scenario)
        settings = self.services.client_settings()
        await create_model_topics(settings, model, PARTITIONS)
        ids: list[str] = []
        try:
            yield model, topics_for(model), ids
        finally:
            await delete_results(self.services.redis_url, ids)
            await delete_model_topics(settings, model)


# -- scenario 1: transport -------------------------------------------------------------------


async def transport(bench: Bench) -> dict[str, Any]:
    n = bench.plan.transport_records
    async with bench.fresh_model("transport") as (model, topics, _ids):
        payload = bytes(i % 251 for i in range(TRANSPORT_PAYLOAD))
        records = _requests(model, payload, ContentType.TEXT, n)[0]
        await produce(bench.services.kafka_bootstrap, topics.requests, records, round_robin=True)
        settings = WorkerSettings(
            model=IDENTITY,
            model_name=model,
            kafka_bootstrap=bench.services.kafka_bootstrap,
        )
        kafka_runs, worker_runs = [], []
        for repeat in range(bench.plan.transport_repeats):
            group = f"{consumer_group(model)}.run{repeat}"
            kafka_runs.append(
                await kafka_consumer_perf(
                    bench.kafka_libs,
                    bench.services.kafka_bootstrap,
                    topics.requests,
                    n,
                    group + ".kperf",
                )
            )
            with start_up_objects_frozen():  # as the worker serves
                worker_runs.append(await consumer_fetch_loop(settings, topics.requests, n, group))
    kafka_best = max(run["records_per_s"] for run in kafka_runs)
    worker_best = max(run["records_per_s"] for run in worker_runs)
    return {
        "what": "workers.kafka.consumer.Consumer fetch loop (fetch, span tracking, finish, commit "
        "every max_in_flight records) vs kafka-consumer-perf-test fetch.nMsg.sec, same topic",
        "records": n,
        "payload_bytes": TRANSPORT_PAYLOAD,
        "partitions": PARTITIONS,
        "kafka_perf_runs": kafka_runs,
        "worker_consumer_runs": worker_runs,
        "kafka_perf_records_per_s": kafka_best,
        "worker_consumer_records_per_s": worker_best,
        "ratio": worker_best / kafka_best,
        "goal": TRANSPORT_GOAL,
        "met": worker_best / kafka_best >= TRANSPORT_GOAL,
    }


async def consumer_fetch_loop(
    settings: WorkerSettings, topic: str, n: int, group: str
) -> dict[str, float]:
    """Read ``n`` records the way the pipeline's fetch loop does; time from the first record.

    The first fetch's records are not counted: the clocks (wall and the process's CPU
    time) start when they arrive
    (group join and the first fetch's round trip stay out, as they do in
    ``ConsumerPerformance``'s fetch time).
    """
    max_records = settings.max_batch_size * 4  # what workers.pipeline asks for per fetch
    got = uncommitted = uncounted = 0
    first_at = last_at = cpu_at = 0.0
    tracker: OffsetTracker[tuple[str, int]] = OffsetTracker()
    async with Consumer(settings, topic, group) as consumer, asyncio.timeout(_WAIT_S):
        while got < n:
            chunks = await consumer.fetch(100, max_records)
            if not chunks:
                continue
            last_at = time.perf_counter()
            fetched = sum(len(records) for records in chunks.values())
            if not got:
                first_at, uncounted, cpu_at = last_at, fetched, time.process_time()
            got += fetched
            for tp, records in chunks.items():
                span = tracker.open(tp, records[0].offset, records[-1].offset, len(records))
                tracker.finish(span, len(records))
            uncommitted += fetched
            if uncommitted >= settings.max_in_flight:
                positions = tracker.committable()
                if await consumer.commit(positions):
                    tracker.mark_committed(positions)
                uncommitted = 0
    # A topic read in one fetch counts nothing (tiny smoke-test runs): rates of 0.
    elapsed, cpu = max(last_at - first_at, 1e-9), time.process_time() - cpu_at
    counted = got - uncounted
    return {
        "records": got,
        "seconds": elapsed,
        "records_per_s": counted / elapsed,
        "cpu_us_per_record": cpu / max(counted, 1) * 1e6,  # the process's, every thread
    }


async def kafka_consumer_perf(
    kafka_libs: Path, bootstrap: str, topic: str, n: int, group: str
) -> dict[str, float]:
    """Kafka's ``kafka-consumer-perf-test`` on ``topic``; its fetch-phase rate (join excluded)."""
    argv = [
        "java",
        "-cp",
        f"{kafka_libs}/*",
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        bootstrap,
        "--topic",
        topic,
        "--messages",
        str(n),
        "--group",
        group,
        "--timeout",
        "60000",
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), _WAIT_S)
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"kafka-consumer-perf-test failed ({proc.returncode}):\n{text}")
    stats = _parse_consumer_perf(text)
    if stats["data.consumed.in.nMsg"] < n:
        raise RuntimeError(f"kafka-consumer-perf-test read fewer than {n} records:\n{text}")
    return {
        "records": stats["data.consumed.in.nMsg"],
        "seconds": stats["fetch.time.ms"] / 1000.0,
        "records_per_s": stats["fetch.nMsg.sec"],
        "records_per_s_with_join": stats["nMsg.sec"],
    }


def _parse_consumer_perf(text: str) -> dict[str, float]:
    """The numeric columns of ConsumerPerformance's one-line CSV report, by header name."""
    lines = [line for line in text.splitlines() if "," in line]
    for header, values in itertools.pairwise(lines):
        if header.startswith("start.time"):
            pairs = zip(header.split(","), values.split(","), strict=True)
            return {
                name.strip(): float(value)
                for name, value in pairs
                if name.strip() not in ("start.time", "end.time")  # dates
            }
    raise RuntimeError(f"cannot read kafka-consumer-perf-test's report:\n{text}")


# -- scenario 2: per-request overhead --------------------------------------------------------


async def overhead(bench: Bench) -> dict[str, Any]:
    """The identity model from a backlog, repeated; with a baseline tree, the previous
    design's worker serves the same kind of backlog, interleaved run by run."""
    plan = bench.plan
    options = ["--max-batch-size", str(OVERHEAD_BATCH), *bench.overhead_options]
    arms = {"current": (REPO, options)}
    if bench.baseline_tree:
        arms["previous"] = (bench.baseline_tree, options)
    if bench.overhead_variant:
        arms["variant"] = (REPO, [*options, *bench.overhead_variant])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    profile_path = bench.log_dir / f"{bench.model('overhead')}.pyspy.txt"
    # Spans are sent to a collector, as in production; it counts them and throws them away.
    collector = TraceCollector(keep=False) if bench.overhead_traced else None
    env = {} if collector is None else {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": collector.url}
    profile = None
    async with bench.fresh_model("overhead") as (model, _topics, ids):
        with collector or contextlib.nullcontext():
            for repeat in range(plan.overhead_repeats):
                for name, (tree, flags) in arms.items():
                    # Same topic and group: each worker gets only the records produced for it.
                    records, batch_ids = _requests(
                        model,
                        SMALL_PAYLOAD,
                        ContentType.TEXT,
                        plan.overhead_requests,
                        f"{name}{repeat}",
                        traced=bench.overhead_traced,
                    )
                    ids += batch_ids
                    config = bench.worker(IDENTITY, model, flags, tree, env)
                    runs[name].append(
                        await bench.serve_backlog(config, records, batch_ids, label=name)
                    )
            if plan.profile_seconds:
                count = int(plan.profile_seconds * OVERHEAD_GOAL)
                records, batch_ids = _requests(
                    model, SMALL_PAYLOAD, ContentType.TEXT, count, "p", traced=bench.overhead_traced
                )
                ids += batch_ids
                config = bench.worker(IDENTITY, model, options, env=env)
                await bench.serve_backlog(config, records, batch_ids, profile=profile_path)
                profile = pyspy_summary(profile_path, count) | {"samples_file": str(profile_path)}
    rates = {name: sorted(float(run["rate"]) for run in done) for name, done in runs.items()}
    rate = statistics.median(rates["current"])
    section: dict[str, Any] = {
        "what": "identity model, 16-byte payloads, backlog: first fetch → all results in Redis "
        "(and acked on the reply topic); median of the repeats",
        "worker_options": options,
        "runs": runs,
        "rate": rate,
        "rates": rates["current"],
        "goal": OVERHEAD_GOAL,
        "ratio_to_goal": rate / OVERHEAD_GOAL,
        "met": rate >= OVERHEAD_GOAL,
        "profile": profile,
    }
    if collector is not None:
        section["traced"] = {"exports": collector.exports, "bytes": collector.bytes}
    if "variant" in rates:
        variant = statistics.median(rates["variant"])
        section |= {
            "variant_options": list(bench.overhead_variant),
            "variant_rates": rates["variant"],
            "variant_rate": variant,
            "variant_ratio": variant / rate,
        }
    if "previous" in rates:
        previous = statistics.median(rates["previous"])
        section |= {
            "previous_tree": str(bench.baseline_tree),
            "previous_rates": rates["previous"],
            "previous_rate": previous,
            "ratio_to_previous": rate / previous,
        }
    return section


async def _py_spy(pid: int, out: Path) -> asyncio.subprocess.Process:
    """py-spy sampling ``pid`` (every thread, 200 Hz) into ``out``, collapsed stacks."""
    py_spy = Path(sys.executable).with_name("py-spy")
    return await asyncio.create_subprocess_exec(
        str(py_spy),
        "record",
        "--pid",
        str(pid),
        "--rate",
        "200",
        "--threads",
        "--format",
        "raw",
        "--output",
        str(out),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


# -- scenario 4: batching gain, and the peak that scenario 3 loads against -------------------


async def batching(bench: Bench, digits: Sequence[tuple[bytes, int]]) -> dict[str, Any]:
    variants: list[tuple[str, list[str]]] = [
        ("batch_1", ["--max-batch-size", "1"]),
        ("micro_batched", []),
    ]
    runs = [_batching_run(bench, digits, name, options) for name, options in variants]
    if bench.quick:
        done = await asyncio.gather(*runs)
    else:
        done = [await one for one in runs]
    by_name = {name: result for (name, _options), result in zip(variants, done, strict=True)}
    return {
        "what": "demo digits CNN (8x8 PNGs), backlog: first fetch → all results in Redis",
        **by_name,
        "ratio": float(by_name["micro_batched"]["rate"]) / float(by_name["batch_1"]["rate"]),
    }


async def _batching_run(
    bench: Bench, digits: Sequence[tuple[bytes, int]], name: str, options: list[str]
) -> dict[str, Any]:
    async with bench.fresh_model(f"batch-{name.replace('_', '-')}") as (model, _topics, ids):
        records, ids[:] = _digit_requests(model, digits, bench.plan.batching_requests)
        result = await bench.serve_backlog(bench.worker("digits", model, options), records, ids)
    return result | {
        "worker_options": options or ["(defaults: --max-batch-size 32 --max-delay-ms 5)"]
    }


# -- scenario 3: latency under open-loop load ------------------------------------------------


async def latency(bench: Bench, digits: Sequence[tuple[bytes, int]], peak: float) -> dict[str, Any]:
    levels = []
    async with bench.fresh_model("latency") as (model, topics, ids):
        config = bench.worker("digits", model, [])
        async with bench.launch(config, bench.log_dir / f"{model}.log") as worker:
            # The first answers say the worker is up and in its group.
            warm, warm_ids = _digit_requests(model, digits, 50, "w")
            ids += warm_ids
            await produce(bench.services.kafka_bootstrap, topics.requests, warm, round_robin=True)
            await worker.unless_it_dies(all_results_in(bench.services, warm_ids, warm_ids, _WAIT_S))
            for fraction in LOAD_FRACTIONS:
                rate = fraction * peak
                count = max(20, int(rate * bench.plan.latency_seconds))
                records, level_ids = _digit_requests(
                    model, digits, count, f"r{int(fraction * 100)}"
                )
                ids += level_ids
                acked: list[float] = []
                sent_rate = await produce_at_rate(
                    bench.services.kafka_bootstrap, topics.requests, records, rate, acked
                )
                await worker.unless_it_dies(
                    all_results_in(bench.services, level_ids, level_ids[-5:], _WAIT_S)
                )
                results = list((await read_results(bench.services.redis_url, level_ids)).values())
                check_all_ok(results, count, f"latency at {fraction:.0%}")
                levels.append(
                    {
                        "load": fraction,
                        "target_rate": rate,
                        "sent_rate": sent_rate,
                        "requests": count,
                    }
                    | acked_summary(acked)
                    | latency_summary(results)
                )
                print(f"[bench] latency at {fraction:.0%}: {parts_line(levels[-1])}", flush=True)
    at_half = next(level for level in levels if level["load"] == 0.5)
    bound = DIGITS_DELAY_MS + 2 * at_half["compute_p99_ms"]
    return {
        "what": "demo digits CNN, open-loop producer (record timestamp = due time); latency = "
        "timings.published_ms - timings.produced_ms (to the result being sent to Redis); "
        "compute = timings.inference_ms per batch",
        "peak_rate": peak,
        "max_delay_ms": DIGITS_DELAY_MS,
        "levels": levels,
        "goal_p99_ms_at_half_load": bound,
        "met": at_half["p99_ms"] <= bound,
    }


# -- requests ---------------------------------------------------------------------------------


def _requests(
    model: str,
    payload: bytes,
    content_type: ContentType,
    count: int,
    tag: str = "r",
    *,
    traced: bool = False,
) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` requests of ``payload``, ids ``<model>-<tag>-<n>``; ``traced``: each with
    a sampled traceparent."""
    return requests([payload], count, f"{model}-{tag}", content_type, "bench", traced=traced)


def _digit_requests(
    model: str, digits: Sequence[tuple[bytes, int]], count: int, tag: str = "d"
) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` requests cycling through the PNGs of ``digits``."""
    pngs = [png for png, _digit in digits]
    return requests(pngs, count, f"{model}-{tag}", ContentType.PNG, source="bench")


# -- the run ----------------------------------------------------------------------------------


DEFAULT_SCENARIOS = frozenset({"transport", "overhead", "digits"})
"""What a run without ``--only`` measures: the four scenarios of the table. ``tabular`` is
a model family of its own, measured when named (``--only tabular``)."""


async def run(bench: Bench) -> dict[str, Any]:
    started = time.monotonic()
    meta = _machine() | {"load_average_before": os.getloadavg()}
    await asyncio.to_thread(build_digits_model)
    digits = await asyncio.to_thread(heldout_digits)
    report: dict[str, Any] = {"meta": meta}

    async def digits_scenarios() -> None:
        report["batching"] = await _timed(
            "4/4 batching (its micro-batched rate is the peak that 3/4 loads against)",
            batching(bench, digits),
        )
        peak = float(report["batching"]["micro_batched"]["rate"])
        report["latency"] = await _timed(
            "3/4 latency, open-loop load", latency(bench, digits, peak)
        )

    async def transport_scenario() -> None:
        report["transport"] = await _timed("1/4 transport", transport(bench))

    async def overhead_scenario() -> None:
        report["overhead"] = await _timed("2/4 per-request overhead", overhead(bench))

    async def tabular_scenario() -> None:
        counts = (300, 20) if bench.quick else (20_000, 200)
        report["tabular"] = await _timed(
            "tabular: feature records, peak, idle and half the peak",
            tabular(bench, *counts, bench.plan.latency_seconds),
        )

    scenarios = tuple(
        scenario
        for name, scenario in (
            ("transport", transport_scenario),
            ("overhead", overhead_scenario),
            ("digits", digits_scenarios),
            ("tabular", tabular_scenario),
        )
        if name in (bench.only or DEFAULT_SCENARIOS)
    )
    if bench.quick:
        # Only checks that everything runs: side by side, the workers start up together.
        async with asyncio.TaskGroup() as group:
            for scenario in scenarios:
                group.create_task(scenario())
    else:
        for scenario in scenarios:
            await scenario()
    meta["load_average_after"] = os.getloadavg()
    meta["seconds"] = time.monotonic() - started
    meta["plan"] = asdict(bench.plan)
    return {
        key: report[key]
        for key in ("meta", "transport", "overhead", "latency", "batching", "tabular")
        if key in report
    }


async def _timed(title: str, scenario: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    _say(title)
    started = time.monotonic()
    section = await scenario
    section["seconds"] = time.monotonic() - started
    _say(f"{title}: done in {section['seconds']:.0f} s")
    return section


def _machine() -> dict[str, Any]:
    import torch

    model_name = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        model_name = found.group(1) if found else ""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cpus": os.cpu_count(),
        "cpu_model": model_name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "note": "shared VM: other engineers' processes share these cores; numbers are noisy",
    }


def print_table(report: dict[str, Any]) -> None:
    t, o, b, lat = report["transport"], report["overhead"], report["batching"], report["latency"]
    rows = [
        ("scenario", "measured", "baseline / goal", "ratio", "goal met"),
        (
            "1 transport, 1 KB",
            f"{t['worker_consumer_records_per_s']:,.0f} rec/s",
            f"{t['kafka_perf_records_per_s']:,.0f} rec/s kafka perf",
            f"{t['ratio']:.2f}",
            _verdict(t["met"], f">= {TRANSPORT_GOAL}"),
        ),
        (
            "2 overhead, identity",
            f"{o['rate']:,.0f} req/s",
            f"{OVERHEAD_GOAL:,.0f} req/s goal",
            f"{o['ratio_to_goal']:.2f}",
            _verdict(o["met"], f">= {OVERHEAD_GOAL:,.0f}/s"),
        ),
    ]
    if "variant_rate" in o:
        rows.append(
            (
                "2 overhead, variant",
                f"{o['variant_rate']:,.0f} req/s",
                " ".join(o["variant_options"]),
                f"{o['variant_ratio']:.2f}x",
                "",
            )
        )
    if "previous_rate" in o:
        rows.append(
            (
                "2 overhead, previous",
                f"{o['previous_rate']:,.0f} req/s",
                "same run, earlier design",
                f"{o['ratio_to_previous']:.2f}x",
                "",
            )
        )
    for level in lat["levels"]:
        goal = ""
        if level["load"] == 0.5:
            goal = _verdict(lat["met"], f"p99 <= {lat['goal_p99_ms_at_half_load']:.1f} ms")
        rows.append(
            (
                f"3 latency @{level['load']:.0%} peak",
                f"p50 {level['p50_ms']:.1f} p95 {level['p95_ms']:.1f} p99 {level['p99_ms']:.1f} ms",
                f"{level['sent_rate']:,.0f} req/s, batch {level['mean_batch_size']:.1f}",
                "",
                goal,
            )
        )
    rows.append(
        (
            "4 batching, digits",
            f"{b['micro_batched']['rate']:,.0f} req/s batched",
            f"{b['batch_1']['rate']:,.0f} req/s batch-1",
            f"{b['ratio']:.2f}x",
            "(no CPU goal)",
        )
    )
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _verdict(met: bool, goal: str) -> str:
    return f"{'yes' if met else 'NO'} ({goal})"


def plot(report: dict[str, Any], path: Path) -> None:
    t, o, b, lat = report["transport"], report["overhead"], report["batching"], report["latency"]
    levels = lat["levels"]
    panels = [
        Panel(
            "1. Transport, 1 KB records",
            "records/s",
            ["kafka-consumer-perf-test", "worker Consumer"],
            ["records/s"],
            [[t["kafka_perf_records_per_s"]], [t["worker_consumer_records_per_s"]]],
            [Line(TRANSPORT_GOAL * t["kafka_perf_records_per_s"], "goal 0.8 x kafka")],
            f"ratio {t['ratio']:.2f} (goal >= {TRANSPORT_GOAL})",
        ),
        Panel(
            "2. Per-request overhead, identity model",
            "requests/s",
            ["one worker process"],
            ["requests/s"],
            [[o["rate"]]],
            [Line(OVERHEAD_GOAL, "goal 20,000/s")],
            f"{o['rate']:,.0f} req/s end to end, {o['ratio_to_goal']:.2f} of the goal",
        ),
        Panel(
            "3. Latency under open-loop load, digits CNN",
            "ms",
            [f"{level['load']:.0%} of peak" for level in levels],
            ["p50", "p95", "p99"],
            [[level["p50_ms"], level["p95_ms"], level["p99_ms"]] for level in levels],
            [Line(lat["goal_p99_ms_at_half_load"], "goal p99 at 50%")],
            f"peak {lat['peak_rate']:,.0f} req/s; max_delay {lat['max_delay_ms']:.0f} ms",
        ),
        Panel(
            "4. Batching on the CPU, digits CNN",
            "requests/s",
            ["batch size 1", "micro-batched"],
            ["requests/s"],
            [[b["batch_1"]["rate"]], [b["micro_batched"]["rate"]]],
            (),
            f"gain {b['ratio']:.2f}x",
        ),
    ]
    meta = report["meta"]
    title = f"Conveyor CPU benchmarks, {meta['date'][:10]}, {meta['cpus']} shared vCPUs"
    draw_panels(panels, path, title=title)


def _say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def default_kafka_libs() -> Path:
    """The jars ``compose/local`` runs the broker from (the version its pom names, in its
    cache directory: ``CONVEYOR_CACHE_DIR``, else ``.cache``)."""
    pom = (REPO / "compose/local/kafka-pom.xml").read_text()
    found = re.search(r"<kafka.version>(.+?)</kafka.version>", pom)
    version = os.environ.get("KAFKA_VERSION") or (found.group(1) if found else "")
    cache = Path(os.environ.get("CONVEYOR_CACHE_DIR") or REPO / ".cache")  # as env.sh reads it
    return cache / f"kafka-{version}" / "libs"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks the script runs")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="where JSON and PNG go")
    parser.add_argument("--log-dir", type=Path, default=REPO / ".run" / "bench")
    parser.add_argument("--kafka-bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--kafka-libs", type=Path, help="Kafka's jars, for kafka-consumer-perf-test"
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of an earlier version (git worktree add DIR COMMIT): scenario 2 "
        "runs its worker too, interleaved with this one, and reports the ratio",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated scenarios to run: transport, overhead, digits (3 and 4), tabular "
        "(feature records: bench.cpu_tabular, run only when named); default: the first three "
        "(the table and plot then show only what ran)",
    )
    parser.add_argument(
        "--overhead-options",
        default="",
        help="more worker flags for scenario 2, e.g. '--max-in-flight 8192' (both trees)",
    )
    parser.add_argument(
        "--overhead-variant",
        default="",
        help="scenario 2 also runs this worker with these flags, interleaved, and reports the "
        "ratio, e.g. '--delivery exactly-once' for the cost of transactions",
    )
    parser.add_argument(
        "--overhead-traced",
        action="store_true",
        help="scenario 2's requests carry a sampled traceparent each, and workers export "
        "spans to a collector on loopback: with --overhead-variant '--tracing otlp', the "
        "cost of tracing every request",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(
        services=Services(args.kafka_bootstrap, args.redis_url),
        plan=QUICK if args.quick else FULL,
        log_dir=args.log_dir,
        kafka_libs=args.kafka_libs or default_kafka_libs(),
        run_id=uuid.uuid4().hex[:8],
        quick=args.quick,
        baseline_tree=args.baseline_tree.resolve() if args.baseline_tree else None,
        only=frozenset(name for name in args.only.split(",") if name),
        overhead_options=tuple(shlex.split(args.overhead_options)),
        overhead_variant=tuple(shlex.split(args.overhead_variant)),
        overhead_traced=args.overhead_traced,
    )
    # aiokafka logs retries it recovers from (e.g. leader elections on new topics).
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    report = asyncio.run(run(bench))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / "cpu-bench.json", args.out / "cpu-bench.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if bench.only:
        print(json.dumps({k: v for k, v in report.items() if k != "meta"}, indent=2))
        return 0
    plot(report, png_path)
    _say(f"wrote {json_path} and {png_path} in {report['meta']['seconds']:.0f} s")
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
