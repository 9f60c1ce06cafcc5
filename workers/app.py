"""The worker process: load the model, then run the pipeline until told to stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import torch
from aiokafka.errors import KafkaError

from common.security import (
    kafka_connect_failed,
    redis_connect_failed,
    redis_location,
    redis_options,
)
from schemas import ModelTopics
from schemas.fastpath import ResultEncoder
from workers.chain.joins import Chained, Joins
from workers.config.profiles import GPU_IMAGE_BATCH, tuned
from workers.config.worker import WorkerSettings
from workers.decode.budget import DecodeBudget
from workers.decode.cuda_sync import set_cuda_sync
from workers.delivery.transactions import Transactions
from workers.handlers.base import Costed, ImageModel
from workers.handlers.hf_models import TextServing
from workers.handlers.tabular import TabularModel
from workers.handlers.tasks.detr import DetrDetector
from workers.handlers.tasks.dual_encoder import DualEncoder
from workers.handlers.weights import ModelLoadError
from workers.intake.admission import Admission
from workers.intake.canary import Split
from workers.intake.references import Claims
from workers.kafka import fetch_buffers
from workers.kafka.consumer import Consumer
from workers.kafka.topics import TopicFacts, check_topics, max_message_bytes
from workers.model.compile_cache import mark_warm, use_compile_cache
from workers.model.description import Describer, describe
from workers.model.loader import AUTO, DTYPES, device_fault, load_handler
from workers.model.packages import PACKAGES_FOLDER
from workers.model.quantize import quantize_handler
from workers.model.runner import GRAPH_BUCKET_STEP, ModelRunner, batch_buckets, resolve_device
from workers.observe.health import Check, HealthServer
from workers.observe.metrics import Metrics
from workers.pipeline import Pipeline
from workers.publish.answers import Answers
from workers.publish.dead_letters import RECORD_OVERHEAD
from workers.publish.errors import is_outage, refused_at_start
from workers.publish.publisher import Publisher
from workers.publish.shadow import NoResultStore
from workers.types import LoadOnDeviceFailed

if TYPE_CHECKING:  # imported only when tracing is on: it loads the OpenTelemetry SDK
    from workers.generation.stage import GenerationRunner  # and only for generation
    from workers.observe.tracing import Tracing

log = logging.getLogger("conveyor.worker")

_CHILD_HEADER_BYTES = 2048  # a child request's headers, at most (ids, deadline, trace, params)
CLOSE_S = 15.0
"""After a drain (``--max-drain-ms`` at most), the time left to close connections and
leave the consumer group (5 s at most each for the consumer and the producer, 2 s for
the last spans with tracing on) before the process exits anyway (docs/operations.md)."""


@dataclass
class _Parts:
    """What readiness depends on, filled in as the worker starts."""

    stop: asyncio.Event
    runner: ModelRunner | GenerationRunner | None = None
    publisher: Publisher | None = None
    consumer: Consumer | None = None
    claims: Claims | None = None


async def run_worker(settings: WorkerSettings) -> None:
    """Serve ``settings.model`` from its request topic until SIGTERM or SIGINT.

    Raises ``ConfigError`` (missing topics, refused ACLs) and ``ConnectFailed``
    (Kafka or Redis unreachable) for the CLI to report in one line.
    """
    topics = settings.topics
    # Before anything large is allocated: glibc stops adapting its threshold once one is set.
    if settings.fetch_buffers:
        fetch_buffers.keep_large_buffers()
    else:
        _give_large_frees_back()
    # First, so a stop during start-up is a clean one too.
    stop = _stop_on_signals(settings.max_drain_ms / 1000.0 + CLOSE_S)
    metrics = Metrics(settings.served_name, role=settings.role)
    parts = _Parts(stop)
    async with AsyncExitStack() as stack:
        # First in, so liveness answers while the model loads; last out, so probes
        # read "not_draining: failed" during the drain rather than a closed port.
        await stack.enter_async_context(
            HealthServer(
                metrics,
                _readiness_checks(parts, settings),
                host=settings.metrics_host,
                port=settings.metrics_port,
            )
        )
        facts = await _preflight(settings, topics)
        runner, settings = await asyncio.to_thread(_load_model, settings)
        parts.runner = runner
        stack.enter_context(switch_interval(settings.switch_interval_ms))  # the profile's
        if stop.is_set():
            return
        handler = runner.handler
        metrics.serving(handler.version)
        encoder = ResultEncoder(settings.served_name, handler.version, settings.worker_id)
        store = NoResultStore() if settings.shadow else None  # a shadow never writes Redis
        publisher = parts.publisher = await stack.enter_async_context(
            Publisher(settings, topics, facts, encoder, store, metrics)
        )
        joins = _open_joins(settings, encoder, publisher, metrics, facts)
        if joins is not None:
            stack.push_async_callback(joins.aclose)
        group = settings.group
        request_topics = [topics.lane(lane.name) for lane in settings.request_lanes]
        split = Split(settings.role)
        consumer = Consumer(settings, request_topics, group, metrics, split)
        transactions = None
        if settings.delivery == "exactly-once":
            transactions = Transactions(
                publisher, group, settings.transaction_timeout_ms, split, joins
            )
            stack.push_async_callback(transactions.aclose)
            consumer.on_assign(transactions.open)  # fence the previous owner, then fetch
        parts.consumer = await stack.enter_async_context(consumer)
        answers = Answers(
            settings.served_name,
            handler.version,
            settings.worker_id,
            publisher.max_result_bytes,
            shadow=settings.shadow,
            chained=settings.then is not None,
            children=joins is not None,
        )
        if not isinstance(runner, ModelRunner):
            await _open_streams(runner, settings, stack)
        claims = parts.claims = await stack.enter_async_context(Claims.open(settings, metrics))
        admission = await stack.enter_async_context(Admission.open(settings, metrics))
        tracing = None
        if settings.tracing != "off":
            tracing = _start_tracing(settings, group, handler.version)
            stack.push_async_callback(tracing.aclose)  # after the drain: its spans go too
        pipeline = Pipeline(
            settings,
            consumer,
            publisher if joins is None else Chained(joins, publisher),
            runner,
            answers,
            metrics,
            claims=claims,
            admission=admission,
            transactions=transactions,
            tracing=tracing,
            split=split,
        )
        # The primary's version is the model's; a canary's or a shadow's would flap it.
        if settings.role == "primary":
            description = describe(handler, settings.served_name, settings.worker_id)
            await stack.enter_async_context(Describer(settings, description))
        log.info(
            "worker %s ready: serving %s, version %s, as %s (group %s) from %s to %s (%s)",
            settings.worker_id,
            settings.served_name,
            handler.version,
            settings.role,
            group,
            ", ".join(request_topics),
            topics.results,
            settings.delivery,
        )
        with start_up_objects_frozen():
            drained = await serve(pipeline.run, stop, settings.max_drain_ms / 1000.0)
        totals = metrics.totals()
        log.info(
            "%s and stopping: %d answered (%s), %d duplicates left unchanged, "
            "%d handed back on rebalances",
            "drained" if drained else "drain cut short",
            totals.answered,
            totals.by_status,
            totals.duplicates,
            totals.handed_back,
        )


def _open_joins(
    settings: WorkerSettings,
    encoder: ResultEncoder,
    publisher: Publisher,
    metrics: Metrics,
    facts: TopicFacts,
) -> Joins | None:
    """The pipeline step of every publish (``workers.chain``): joins the answers of child
    requests, and with ``then`` sends this worker's boxes to the next model (its request
    topic checked with the others, in ``facts``). A shadow has none: its answers are its
    own."""
    if settings.shadow:
        return None
    stage = settings.next_stage
    next_partitions, crop_limit = 1, settings.limits.max_payload_bytes
    if stage is not None:
        next_partitions = facts.partitions[stage.topic]
        room = max_message_bytes(facts, stage.topic) - RECORD_OVERHEAD - _CHILD_HEADER_BYTES
        crop_limit = min(crop_limit, room)
    return Joins.open(
        settings,
        encoder,
        publisher.retried,
        stage=stage,
        next_partitions=next_partitions,
        max_crop_bytes=crop_limit,
        max_result_bytes=publisher.max_result_bytes,
        results_topic=settings.topics.results,
        counts=metrics,
        publish=publisher.publish,
    )


async def serve(
    run: Callable[[asyncio.Event], Coroutine[object, object, None]],
    stop: asyncio.Event,
    drain_s: float,
) -> bool:
    """``run(stop)`` (``Pipeline.run``) until ``stop`` is set and it has drained; True if
    it drained.

    The drain lasts ``drain_s`` at most: it finishes the records already fetched, and
    their results may wait on a Redis or Kafka that is down or refuses this worker, as
    long as that lasts. Past the bound the pipeline is cancelled, its retries with it;
    the records it had not answered stay uncommitted, and the next owner of their
    partitions answers them (the first answer in Redis stays the answer).
    """
    serving = asyncio.ensure_future(run(stop))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            await asyncio.wait({serving}, timeout=drain_s)
        if not serving.done():
            log.warning(
                "drain cut short after %.0f s (--max-drain-ms): the records not answered yet "
                "stay uncommitted, for the next owner of their partitions",
                drain_s,
            )
            serving.cancel()
            await asyncio.wait({serving})
            if serving.cancelled():
                return False
        serving.result()  # its error, if it ended with one
        return True
    finally:
        stopping.cancel()
        if not serving.done():  # this task itself was cancelled
            serving.cancel()
            await asyncio.wait({serving})


async def _preflight(settings: WorkerSettings, topics: ModelTopics) -> TopicFacts:
    """Before the model loads: Redis answers, Kafka answers and the model's topics exist.

    Raises ``ConnectFailed`` naming the service that could not be reached (or refused the
    credentials), ``RedisRefused`` naming the grant Redis refused, ``TopicProblem`` for
    missing or forbidden topics. A shadow, which never writes to Redis, does not ask it.
    """
    if not settings.shadow:
        await _redis_answers(settings)
    try:
        return await check_topics(settings, topics)
    except (KafkaError, OSError) as exc:
        raise await kafka_connect_failed(settings.kafka_bootstrap, settings, exc) from None


async def _redis_answers(settings: WorkerSettings) -> None:
    redis = aioredis.Redis.from_url(
        settings.redis_url.get_secret_value(), socket_connect_timeout=5, **redis_options(settings)
    )
    try:
        await redis.ping()
    except Exception as exc:
        if not is_outage(exc):  # uvloop's closed transport too: Redis closed as it started
            raise
        # Connected and refused (no +ping): a grant to add, not a service to reach.
        refused = refused_at_start(redis_location(settings.redis_url), exc)
        raise refused or redis_connect_failed(settings.redis_url, exc) from None
    finally:
        await redis.aclose()


def _start_tracing(settings: WorkerSettings, group: str, model_version: str) -> Tracing:
    """Spans of traced requests, exported as ``settings.tracing`` says; imported here, so a
    worker with tracing off never loads the trace SDK (``workers.cli`` checks it is
    installed before the model loads)."""
    from workers.observe.tracing import Tracing

    exporter = settings.tracing
    assert exporter != "off"
    tracing = Tracing.start(
        exporter,
        group=group,
        worker=settings.worker_id,
        model=settings.served_name,
        model_version=model_version,
    )
    log.info("tracing on: spans of requests with a traceparent go to %s", settings.tracing)
    return tracing


def _readiness_checks(parts: _Parts, settings: WorkerSettings) -> dict[str, Check]:
    async def redis_reachable() -> bool:
        return parts.publisher is not None and await parts.publisher.ping()

    def results_durable() -> bool:
        # False while results have failed to become durable for a while (an outage), or
        # at once for a configuration error (which ends the worker unless fixed in time).
        publisher = parts.publisher
        return (
            publisher is not None
            and publisher.config_problem is None
            and publisher.stalled_for() < settings.unready_after_s
        )

    def kafka_reads() -> bool:
        return parts.consumer is not None and parts.consumer.config_problem is None

    def payload_stores() -> bool:
        # False while a store of payloads by reference (S3, Redis) has failed for a
        # while: the requests that reference it wait, as results do in a Redis outage.
        claims = parts.claims
        return claims is None or claims.failing_for() < settings.unready_after_s

    return {
        "model_loaded": lambda: parts.runner is not None,
        "partitions_assigned": lambda: parts.consumer is not None and parts.consumer.assigned(),
        "redis_reachable": redis_reachable,
        "results_durable": results_durable,
        "kafka_reads": kafka_reads,
        "payload_stores": payload_stores,
        "not_draining": lambda: not parts.stop.is_set(),
    }


async def _open_streams(
    runner: GenerationRunner, settings: WorkerSettings, stack: AsyncExitStack
) -> None:
    """Where a generation model's chunks go (``workers.publish.streams``), open until the
    worker stops."""
    from workers.publish.streams import TokenStreams

    options = runner.handler.streams
    runner.streams = await stack.enter_async_context(
        TokenStreams.open(settings, options.stream_maxlen, options.stream_ttl_s)
    )


def _generation(
    settings: WorkerSettings, device: torch.device
) -> tuple[GenerationRunner, WorkerSettings] | None:
    """``hf:FOLDER`` of a causal LM (its config names a ``*ForCausalLM``): the model in a
    running engine (``workers.generation``); None for every other spec. Its modules are
    imported here only: they load transformers, which only generation needs."""
    kind, _, path = settings.model.partition(":")
    if kind != "hf" or not path:
        return None
    from workers.generation.folder import auto_dtype, causal_lm_architecture, transformers_problem

    if causal_lm_architecture(path) is None:  # another task: the loader's
        return None
    if problem := transformers_problem():
        raise ModelLoadError(f"{settings.model}: {problem}")
    from workers.generation.loading import load_generator
    from workers.generation.stage import GenerationRunner

    dtype = DTYPES[settings.dtype] if settings.dtype != AUTO else auto_dtype(path, device)
    handler = load_generator(path, device=device, dtype=dtype, options=settings.model_options)
    # Each request joins the engine alone, at once: the engine does the batching.
    settings = settings.model_copy(update={"max_batch_size": 1, "max_delay_ms": 0.0})
    return GenerationRunner(handler, cancellation=settings.cancellation), settings


def _load_model(
    settings: WorkerSettings,
) -> tuple[ModelRunner | GenerationRunner, WorkerSettings]:
    """The model, loaded and warmed up, and ``settings`` tuned for it (``tuned``).

    Raises ``LoadOnDeviceFailed`` when the device failed it (``device_fault``: memory,
    an accelerator's error), which another card may not: the worker exits with status 9,
    not 2, so that its supervisor gives up that card rather than the model.
    """
    try:
        return _load_and_warm_up(settings)
    except Exception as exc:
        if not device_fault(exc):
            raise
        said = str(exc).strip().splitlines()
        raise LoadOnDeviceFailed(
            f"model {settings.model} did not load on device {settings.device}, by the "
            f"device's fault: {type(exc).__name__}: {said[0] if said else 'no message'}"
        ) from exc


def _load_and_warm_up(
    settings: WorkerSettings,
) -> tuple[ModelRunner | GenerationRunner, WorkerSettings]:
    started = time.monotonic()
    device = resolve_device(settings.device)
    set_cuda_sync(device, settings.cuda_sync)
    generation = _generation(settings, device)
    if generation is not None:
        log.info(
            "model %s (%s) loaded in %.1f s",
            settings.model,
            generation[0].handler.version,
            time.monotonic() - started,
        )
        return generation
    handler = load_handler(
        settings.model,
        device=settings.device,
        weights=settings.weights,
        dtype=settings.dtype,
        channels_last=settings.channels_last,
        limits=settings.limits,
        decode="gpu-hw" if settings.decode == "both" else settings.decode,
        allow_pickle=settings.allow_pickle_models,
        decode_budget=DecodeBudget(settings.decode_memory_mb * 1024 * 1024),
        preprocess=settings.preprocess,
        options=settings.model_options,
        text=TextServing(settings.task, settings.max_length, settings.truncation == "refuse"),
    )
    quantize_handler(handler, settings.quantize)
    cuda = device.type == "cuda"
    settings = tuned(
        settings,
        cuda=cuda,
        fixed_size_images=isinstance(handler, ImageModel),
        image_batch=handler.gpu_batch if isinstance(handler, DetrDetector) else GPU_IMAGE_BATCH,
        compiles=not isinstance(handler, (DetrDetector, DualEncoder)),
        feature_rows=isinstance(handler, TabularModel),
        token_rows=isinstance(handler, Costed),
    )
    cache = use_compile_cache(settings, device) if settings.compile else None
    # On by default, compiled or not: a compiled forward launched kernel by kernel from
    # Python waits on the GIL for each (batch compute p99 118-149 ms against 20 ms
    # recorded; docs/benchmarks.md).
    # Text batches (a cost per item) are sized by tokens: padding their rows up to a bucket
    # would cost whole rows of the longest text, so they take no buckets and no graphs;
    # compiled, one graph with dynamic shapes serves them.
    by_tokens = isinstance(handler, Costed)
    graphs = settings.cuda_graphs if settings.cuda_graphs is not None else cuda and not by_tokens
    if by_tokens and not settings.cuda_graphs:
        buckets: tuple[int, ...] = ()
    elif settings.compile:
        buckets = batch_buckets(settings.max_batch_size)
    elif graphs:
        buckets = batch_buckets(settings.max_batch_size, step=GRAPH_BUCKET_STEP)
    else:
        buckets = ()
    runner = ModelRunner(
        handler,
        device=settings.device,
        compile=settings.compile_form if settings.compile else None,
        packages=cache / PACKAGES_FOLDER if cache is not None else None,
        buckets=buckets,
        cuda_graphs=graphs,
        keep_images=settings.then is not None,  # crops are cut from the images the model saw
    )
    sizes = sorted(
        {1, settings.max_batch_size}
        | {
            2**k
            for k in range(settings.max_batch_size.bit_length())
            if 2**k <= settings.max_batch_size
        }
    )
    runner.warm_up(sizes)
    if cache is not None:
        mark_warm(cache)
    log.info(
        "model %s (%s) loaded and warmed up for batch sizes %s in %.1f s%s",
        settings.model,
        handler.version,
        sizes,
        time.monotonic() - started,
        f"; CUDA graphs for {list(runner.graphed_sizes)}" if runner.graphed_sizes else "",
    )
    return runner, settings


@contextmanager
def start_up_objects_frozen() -> Iterator[None]:
    """While serving, leave what start-up made (modules, the model, torch's objects)
    out of the cyclic garbage collector's passes.

    Those objects live as long as the process, and there are hundreds of thousands of
    them once torch is imported. Without this, every full collection walks all of
    them while requests wait, and the hot path allocates enough containers to start
    one often: py-spy charged about a fifth of the CPU benchmark's samples to the
    allocations that triggered them (docs/benchmarks.md). Unfrozen on the way out so
    that shutdown frees them as usual (extension modules check for leaks at exit).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def switch_interval(ms: float) -> Iterator[None]:
    """While serving, a thread running Python hands the GIL over after ``ms`` to another
    that waits for it (Python's default: 5 ms).

    The event loop waits for the GIL each time it wakes for a socket, while the
    decode, prepare, model and finish threads run Python between their GPU calls;
    with the default each wake-up may wait 5 ms per busy thread. ``bench.gil_wait``:
    records fetched at 300 a second beside two threads running Python half the time
    took 34.3 ms at p99 from their append to their fetch, 9.0 ms with 0.5 ms
    (docs/benchmarks.md).
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _give_large_frees_back() -> None:
    """On glibc, serve allocations of 1 MiB and more with mmap, so freeing one gives it
    back to the system at once.

    glibc's default threshold grows to 32 MiB as large blocks are freed, after which
    decoded images (Pillow allocates them in 16 MiB blocks) come from per-thread heaps
    that keep the memory after it is freed: with 8 decode threads the process would
    hold 8 images' worth however the decode budget spaces them. With the fixed
    threshold, resident memory follows the budget (tests/faults/test_faults.py).
    Fetch buffers (the default) set a threshold of their own, also below Pillow's
    blocks (``workers.kafka.fetch_buffers.MMAP_THRESHOLD``).
    """
    if not fetch_buffers.set_allocator(1 << 20) and sys.platform.startswith("linux"):
        log.warning("could not set glibc's mmap threshold; decode memory may stay resident")


def _stop_on_signals(bound_s: float) -> asyncio.Event:
    """First SIGTERM/SIGINT: stop fetching and drain (``serve`` bounds the drain); exit at
    once if still running ``bound_s`` later, whatever holds it up. Second: exit at once.

    Exiting at once is safe: offsets are only committed after results are durable,
    so whatever was in flight is redelivered to the next worker.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def exit_now(signum: int, why: str) -> None:
        log.warning("%s: exiting now", why)
        os._exit(128 + signum)

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            exit_now(signum, f"second {name}")
        log.info("%s: draining in-flight work, then stopping", name)
        stop.set()
        loop.call_later(bound_s, exit_now, signum, f"still running {bound_s:.0f} s after {name}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop
