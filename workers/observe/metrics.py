"""The worker's Prometheus metrics, in a registry of their own.

Every metric is named ``conveyor_*`` and labelled with the served ``model``; those that
compare versions (results by status, queue wait, inference and end-to-end time) also
with the model's ``version`` (the handler's, in every result) and the worker's ``role``
(``primary``, ``canary`` or ``shadow``), and ``conveyor_model_info`` says which version
and role a worker serves. A worker process serves one version: a new one is a new
process (``conveyor worker``'s rolling restart), whose series start at 0. The
pipeline reports once per batch or per publish round-trip, never per record, so
the cost stays flat at tens of thousands of requests per second: values that come
one per record (queue wait, end-to-end time) go into ``workers.observe.instruments.BulkHistogram``,
which takes a whole batch under one lock.

The autoscaling signal is ``conveyor_backlog_drain_seconds``: this worker's lag
divided by its recent answer rate (``instruments.RateMeter``), i.e. how long the records
already waiting would take to serve at the current pace.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.process_collector import ProcessCollector

from schemas import Status
from schemas.canary import BUCKETS
from workers.batching.batcher import CloseReason
from workers.observe.instruments import (
    BulkHistogram,
    LabelledBulkHistogram,
    RateMeter,
    drain_seconds,
)

__all__ = ["CONTENT_TYPE", "GenerationMetrics", "Metrics", "Totals", "cuda_memory_allocated"]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus version reads

# Powers of two up to the largest max_batch_size the settings allow.
_BATCH_SIZE_BUCKETS = tuple(float(2**k) for k in range(13))
_QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# End to end includes time spent in the topic, which a backlog stretches to minutes.
_E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600, 1800)


def cuda_memory_allocated() -> int | None:
    """Bytes held by tensors on the current CUDA device; None without an active GPU.

    torch is looked up, not imported: a process that never imported it holds no GPU
    memory, and a scrape must not pay for a multi-second import. Reading the
    allocator's counter never creates a CUDA context (it is 0 before one exists).
    """
    if "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_allocated())


@dataclass(frozen=True, slots=True)
class Totals:
    """What a worker did since it started, read from its counters (for its last log line)."""

    by_status: dict[str, int]  # results written, by status (statuses never seen left out)
    duplicates: int  # redelivered requests whose result was already in Redis
    handed_back: int  # records of revoked partitions left to their next owner

    @property
    def answered(self) -> int:
        return sum(self.by_status.values())


class Metrics:
    """All of one worker's metrics, and the cheap calls the pipeline makes to feed them.

    ``render()`` gives the Prometheus text exposition of this registry only (plus
    the process collector: CPU, memory, open files), never the global default one.
    """

    content_type: ClassVar[str] = CONTENT_TYPE  # of what render() returns

    def __init__(
        self,
        model: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        rate_window_s: float = 60.0,
        gpu_memory: Callable[[], int | None] = cuda_memory_allocated,
        role: str = "primary",
    ) -> None:
        """``role``: the worker's (``WorkerSettings.role``); the version is the handler's,
        known once the model is loaded (``serving``), "" until then."""
        self.registry = CollectorRegistry()
        self._model = model
        self._role = role
        self._version = ""
        self._clock = clock
        self._gpu_memory = gpu_memory
        self._throughput = RateMeter(rate_window_s)
        self._lag_series: dict[tuple[str, int], Gauge] = {}  # label children, by partition
        self._lag_total = 0
        self._lane_queue: LabelledBulkHistogram | None = None  # with priority lanes only
        self._lane_e2e: LabelledBulkHistogram | None = None
        ProcessCollector(registry=self.registry)
        self._define(model)

    def _define(self, model: str) -> None:
        reg, by_model = self.registry, {"model": model}

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model", *labels], registry=reg)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, ["model", *labels], registry=reg)

        self._requests = counter(
            "conveyor_requests_total",
            "Requests answered, by final status.",
            "version",
            "role",
            "status",
        )
        self._batches = counter(
            "conveyor_batches_total", "Batches closed, by why they closed.", "reason"
        )
        self._info = gauge(
            "conveyor_model_info",
            "1 for the version this worker serves (the handler's) and its role (primary, "
            "canary, shadow).",
            "version",
            "role",
        )
        # Every series exists from the start, so rate() sees the zeros; children are
        # kept because a labels() lookup costs more than the increment itself.
        self._by_status = self._status_series()
        self._by_reason = {r.value: self._batches.labels(model, r.value) for r in CloseReason}
        self._dead_letters = counter(
            "conveyor_dead_letters_total", "Records copied to the dead-letter topic."
        ).labels(model)
        self._unreadable = counter(
            "conveyor_unreadable_records_total",
            "Records the Kafka client could not parse (e.g. header names that are not UTF-8): "
            "read leniently, refused and dead-lettered.",
        ).labels(model)
        self._fetch_errors = counter(
            "conveyor_fetch_errors_total", "Fetches from Kafka that failed and were retried."
        ).labels(model)
        self._handed_back = counter(
            "conveyor_handed_back_total",
            "Records of revoked partitions not finished within max_drain_ms: left to the "
            "partition's next owner (redelivered).",
        ).labels(model)
        self._reply_fallbacks = counter(
            "conveyor_reply_topic_fallbacks_total",
            "Results sent to the model's results topic because their ce_replyto topic "
            "does not exist.",
        ).labels(model)
        self._chain_sent = counter(
            "conveyor_chain_children_sent_total",
            "Child requests sent to the next model of a pipeline (--then): a crop each.",
        ).labels(model)
        self._chain_answered = counter(
            "conveyor_chain_parents_answered_total",
            "Pipeline joins this worker completed, answering a parent's last child: the "
            "parent's result written (a redelivered last child completes one again; Redis "
            "keeps the first result).",
        ).labels(model)
        self._chain_orphans = counter(
            "conveyor_chain_orphans_total",
            "Answers of child requests whose parent's join was gone (expired, or never "
            "started): written under the child's own id.",
        ).labels(model)
        self._superseded = counter(
            "conveyor_superseded_total",
            "Frames answered 'superseded' without reaching the model: a newer frame of their "
            "stream was already waiting (freshest-frame mode).",
        ).labels(model)
        self._skipped = counter(
            "conveyor_skipped_total",
            "Records read and committed past without an answer: canary markers, and requests "
            "that the model's other consumer group answers (the canary's share, or the rest).",
        ).labels(model)
        self._canary_share = gauge(
            "conveyor_canary_share",
            "The canary's share of the model's requests (0 to 1) as this worker last read it: "
            "from a canary marker, or the commit it resumed from.",
        ).labels(model)
        self._redeliveries = counter(
            "conveyor_redeliveries_total",
            "Redelivered requests whose result was already in Redis (left unchanged).",
        ).labels(model)
        self._cancelled = counter(
            "conveyor_cancelled_total",
            "Requests answered 'cancelled' before their batch ran: the model never saw them.",
        ).labels(model)
        self._admission_failures = counter(
            "conveyor_admission_failures_total",
            "Batches run without their cancellation and status check (Redis did not answer).",
        ).labels(model)
        self._dataref_objects = counter(
            "conveyor_dataref_objects_total", "Payloads read by reference (ce_dataref)."
        ).labels(model)
        self._dataref_bytes = counter(
            "conveyor_dataref_bytes_total", "Bytes of payloads read by reference."
        ).labels(model)
        self._dataref_retries = counter(
            "conveyor_dataref_retries_total",
            "Calls to a payload store that failed (unreachable, time-out) and were retried.",
            "store",
        )
        self._dataref_store_down = gauge(
            "conveyor_dataref_store_down",
            "1 while calls to a payload store fail and are being retried (an outage), else 0.",
            "store",
        )
        self._batch_size = Histogram(
            "conveyor_batch_size",
            "Requests per batch sent to the model.",
            ["model"],
            registry=reg,
            buckets=_BATCH_SIZE_BUCKETS,
        ).labels(model)
        self._inference_family = Histogram(
            "conveyor_inference_seconds",
            "Time the model took per batch, preprocessing excluded.",
            ["model", "version", "role"],
            registry=reg,
            buckets=_INFERENCE_BUCKETS,
        )
        self._inference = self._inference_family.labels(model, self._version, self._role)
        by_version = {**by_model, "version": self._version, "role": self._role}
        self._queue = BulkHistogram(
            "conveyor_queue_wait_seconds",
            "Per request: from the worker receiving it to its batch starting on the model.",
            _QUEUE_BUCKETS,
            by_version,
        )
        self._e2e = BulkHistogram(
            "conveyor_end_to_end_seconds",
            "Per request: from the Kafka record timestamp to its result being written.",
            _E2E_BUCKETS,
            by_version,
        )
        reg.register(self._queue)
        reg.register(self._e2e)
        self._in_flight = gauge(
            "conveyor_in_flight_requests", "Records fetched and not yet answered."
        ).labels(model)
        self._lag = gauge(
            "conveyor_consumer_lag",
            "Records of an assigned partition not yet answered (in flight included).",
            "topic",
            "partition",
        )
        self._drain = gauge(
            "conveyor_backlog_drain_seconds",
            "Lag divided by the recent answer rate: time to serve what is waiting (+Inf if "
            "records wait and none are answered).",
        ).labels(model)
        self._ready = gauge("conveyor_ready", "1 while /readyz answers 200, else 0.").labels(model)
        self._loop_lag = gauge(
            "conveyor_event_loop_lag_seconds",
            "How late the last heartbeat woke up: time the event loop was blocked.",
        ).labels(model)
        self._gpu = gauge(
            "conveyor_gpu_memory_allocated_bytes", "Bytes held by tensors on the GPU."
        )

    def _status_series(self) -> dict[str, Counter]:
        model, version, role = self._model, self._version, self._role
        return {s.value: self._requests.labels(model, version, role, s.value) for s in Status}

    def serving(self, version: str) -> None:
        """The model is loaded: its series are those of ``version`` (the handler's) from now
        on, and ``conveyor_model_info`` says so. Call it before the first request."""
        model, role, before = self._model, self._role, self._version
        for status in self._by_status:
            self._requests.remove(model, before, role, status)
        self._inference_family.remove(model, before, role)
        self._version = version
        self._by_status = self._status_series()
        self._inference = self._inference_family.labels(model, version, role)
        for histogram in (self._queue, self._e2e):
            histogram.relabel({"version": version})
        self._info.labels(model, version, role).set(1)

    def define_lanes(self, lanes: Sequence[str]) -> None:
        """Add per-lane series of queue wait and end-to-end time (priority lanes)."""
        by_model = {"model": self._model}
        self._lane_queue = LabelledBulkHistogram(
            "conveyor_lane_queue_wait_seconds",
            "Per request, by priority lane: from the worker receiving it to its batch starting.",
            _QUEUE_BUCKETS,
            by_model,
            "lane",
            lanes,
        )
        self._lane_e2e = LabelledBulkHistogram(
            "conveyor_lane_end_to_end_seconds",
            "Per request, by priority lane: from the Kafka record timestamp to its result "
            "being written.",
            _E2E_BUCKETS,
            by_model,
            "lane",
            lanes,
        )
        self.registry.register(self._lane_queue)
        self.registry.register(self._lane_e2e)

    def define_generation(self) -> GenerationMetrics:
        """Add the series of a generation model (``workers.generation``)."""
        return GenerationMetrics(self.registry, self._model)

    # -- per batch ------------------------------------------------------------------------

    def batch_closed(self, reason: str) -> None:
        """Count one closed batch (``CloseReason`` value), whether or not it had items."""
        child = self._by_reason.get(reason) or self._batches.labels(self._model, reason)
        child.inc()

    def observe_batch(self, size: int, queue_s: Sequence[float], inference_s: float) -> None:
        """A batch of ``size`` requests ran on the model in ``inference_s`` seconds;
        ``queue_s`` holds each request's wait before the batch started."""
        self._batch_size.observe(size)
        self._inference.observe(inference_s)
        self._queue.observe_many(queue_s)

    def observe_results(self, status_counts: Mapping[str, int], e2e_s: Sequence[float]) -> None:
        """Results made durable in one publish: counts by status, and each result's
        end-to-end seconds (negative values, from producer clock skew, count as 0)."""
        total = 0
        for status, count in status_counts.items():
            if count:
                child = self._by_status.get(status) or self._requests.labels(
                    self._model, self._version, self._role, status
                )
                child.inc(count)
                total += count
        self._e2e.observe_many(e2e_s)
        self._throughput.add(total, self._clock())

    def lane_queue_wait(self, lane: str, queue_s: Sequence[float]) -> None:
        """Queue waits of one batch's requests, all of ``lane`` (after `define_lanes`)."""
        if self._lane_queue is not None:
            self._lane_queue.series(lane).observe_many(queue_s)

    def lane_end_to_end(self, lane: str, e2e_s: Sequence[float]) -> None:
        """End-to-end seconds of results of requests of ``lane`` (after `define_lanes`)."""
        if self._lane_e2e is not None:
            self._lane_e2e.series(lane).observe_many(e2e_s)

    def superseded(self, count: int) -> None:
        """``count`` frames were answered 'superseded' (freshest-frame mode)."""
        if count:
            self._superseded.inc(count)

    def cancelled(self, count: int) -> None:
        """``count`` requests were cancelled before their batch ran."""
        self._cancelled.inc(count)

    def admission_failed(self) -> None:
        self._admission_failures.inc()

    def dataref_fetched(self, objects: int, nbytes: int) -> None:
        """``objects`` payloads of ``nbytes`` in all were read by reference."""
        if objects:
            self._dataref_objects.inc(objects)
            self._dataref_bytes.inc(nbytes)

    def dataref_retry(self, store: str) -> None:
        self._dataref_retries.labels(self._model, store).inc()

    def dataref_store_down(self, store: str, down: bool) -> None:
        """Whether calls to payload store ``store`` are failing now."""
        self._dataref_store_down.labels(self._model, store).set(1 if down else 0)

    def skipped(self, count: int, share: int) -> None:
        """``count`` records were left to the model's other group; ``share`` (basis points)
        is the canary's share as last read."""
        self._skipped.inc(count)
        self._canary_share.set(share / BUCKETS)

    def dead_letters(self, count: int) -> None:
        """``count`` records were written to the dead-letter topic."""
        if count:
            self._dead_letters.inc(count)

    def unreadable_records(self, count: int = 1) -> None:
        """``count`` records could only be read leniently (and were refused)."""
        self._unreadable.inc(count)

    def fetch_error(self) -> None:
        self._fetch_errors.inc()

    def handed_back(self, count: int) -> None:
        """``count`` records of revoked partitions were left to their next owner."""
        if count:
            self._handed_back.inc(count)

    def chain(self, sent: int, answered: int, orphans: int) -> None:
        """One publish's pipeline step: child requests sent, parents answered, child
        answers whose join was gone."""
        if sent:
            self._chain_sent.inc(sent)
        if answered:
            self._chain_answered.inc(answered)
        if orphans:
            self._chain_orphans.inc(orphans)

    def reply_fallbacks(self, count: int) -> None:
        if count:
            self._reply_fallbacks.inc(count)

    def duplicates(self, count: int) -> None:
        """``count`` redelivered requests already had a result in Redis."""
        if count:
            self._redeliveries.inc(count)

    def totals(self) -> Totals:
        """The counts so far of results by status, duplicates and records handed back."""
        read = self.registry.get_sample_value
        model = {"model": self._model}
        series = {**model, "version": self._version, "role": self._role}
        by_status = {
            status: int(read("conveyor_requests_total", {**series, "status": status}) or 0)
            for status in self._by_status
        }
        return Totals(
            by_status={status: count for status, count in by_status.items() if count},
            duplicates=int(read("conveyor_redeliveries_total", model) or 0),
            handed_back=int(read("conveyor_handed_back_total", model) or 0),
        )

    # -- state ----------------------------------------------------------------------------

    def set_in_flight(self, count: int) -> None:
        self._in_flight.set(count)

    def set_lag(self, lag: Mapping[tuple[str, int], int]) -> None:
        """Replace the per-partition lag with ``{(topic, partition): records}``.

        Partitions missing from ``lag`` (revoked in a rebalance) lose their series, so
        a sum over workers never counts a partition twice.
        """
        for gone in self._lag_series.keys() - lag.keys():
            del self._lag_series[gone]
            self._lag.remove(self._model, gone[0], str(gone[1]))
        total = 0
        for key, records in lag.items():
            child = self._lag_series.get(key)
            if child is None:
                child = self._lag_series[key] = self._lag.labels(self._model, key[0], str(key[1]))
            child.set(max(0, records))
            total += max(0, records)
        self._lag_total = total
        self._update_drain()

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def set_loop_lag(self, seconds: float) -> None:
        self._loop_lag.set(seconds)

    def render(self) -> bytes:
        """The exposition text; refreshes values that are read rather than pushed."""
        self._update_drain()
        allocated = self._gpu_memory()
        if allocated is not None:
            self._gpu.labels(self._model).set(allocated)
        return bytes(generate_latest(self.registry))

    def _update_drain(self) -> None:
        rate = self._throughput.rate(self._clock())
        self._drain.set(drain_seconds(self._lag_total, rate))


_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GenerationMetrics:
    """A generation model's series: per request at its end, gauges once per step.

    ``conveyor_generation_time_to_first_token_seconds`` and ``..._time_between_tokens_seconds``
    (the mean gap of each request: one value per request, not per token, so that a
    scrape's cost stays flat), ``conveyor_generation_tokens_total`` (``kind`` prompt or
    output: output tokens/s is its rate), ``conveyor_generation_sequences`` (``state``
    running or waiting, in the engine) and ``conveyor_generation_kv_cache_bytes``
    (``use``: in_use or capacity)."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self._ttft = Histogram(
            "conveyor_generation_time_to_first_token_seconds",
            "Per generation: from joining the engine to its first token.",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        ).labels(model)
        self._tbt = Histogram(
            "conveyor_generation_time_between_tokens_seconds",
            "Per generation: the mean time between its tokens.",
            ["model"],
            buckets=_TBT_BUCKETS,
            registry=registry,
        ).labels(model)
        tokens = Counter(
            "conveyor_generation_tokens_total",
            "Tokens of finished generations: prompt or output.",
            ["model", "kind"],
            registry=registry,
        )
        self._prompt_tokens, self._output_tokens = (
            tokens.labels(model, "prompt"),
            tokens.labels(model, "output"),
        )
        sequences = Gauge(
            "conveyor_generation_sequences",
            "Sequences in the engine: running (in the batch) or waiting (for cache room).",
            ["model", "state"],
            registry=registry,
        )
        self._running, self._waiting = (
            sequences.labels(model, "running"),
            sequences.labels(model, "waiting"),
        )
        kv = Gauge(
            "conveyor_generation_kv_cache_bytes",
            "The engine's KV cache: bytes in use, and its capacity.",
            ["model", "use"],
            registry=registry,
        )
        self._kv_used, self._kv_capacity = kv.labels(model, "in_use"), kv.labels(model, "capacity")

    def finished(
        self, prompt_tokens: int, output_tokens: int, ttft_s: float | None, tbt_s: float | None
    ) -> None:
        """One generation ended (answered, stopped, cancelled or expired)."""
        self._prompt_tokens.inc(prompt_tokens)
        self._output_tokens.inc(output_tokens)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tbt_s is not None:
            self._tbt.observe(tbt_s)

    def engine(self, running: int, waiting: int, kv_in_use: int, kv_capacity: int) -> None:
        """The engine's state now."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_used.set(kv_in_use)
        self._kv_capacity.set(kv_capacity)
