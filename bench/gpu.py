"""The GPU benchmark: ceilings, the naive baseline and the worker end to end, on one card.

    python -m bench.gpu --stages forward,decode,naive,checks,runner --out OUT [--compile]
    python -m bench.gpu --stages e2e --kafka-bootstrap HOST:PORT --redis-url URL --out OUT
    python -m bench.gpu --report OUT1/gpu-bench.json OUT2/gpu-bench.json --out OUT

Stages (each well under five minutes on an H100; run them in one call or several):

- ``forward`` (a): ResNet-50 with random weights, channels-last float16 (and
  ``torch.compile``d with ``--compile``), on uint8 batches already on the GPU,
  normalization included as the worker runs it; CUDA events, median of N.
- ``decode`` (b): decode + fit to 224x224 ceilings for each corpus: Pillow on one
  thread and on a thread per core (with and without ``draft``), nvJPEG batched
  decode alone, and nvJPEG + the batched resize (the worker's GPU path).
- ``naive`` (c): one request at a time, Pillow decode, the same model, synchronous:
  what a tutorial endpoint does per request, minus HTTP.
- ``checks``: float16 vs float32 top-1 agreement on the same inputs and weights,
  and the GPU decode path vs the CPU one (pixel differences after normalization).
- ``runner``: the worker's decode/stage/infer split without Kafka: preprocess in a
  thread pool, ``ModelRunner.prepare`` on a staging thread, ``infer`` on the model
  thread; reports img/s and the GPU's idle time between forwards (CUDA events).
- ``e2e`` (d): requests in Kafka (contract headers), the real worker as a
  subprocess, all results in Redis: img/s first to last result, then p50/p99
  latency at about half that rate; GPU utilization sampled with nvidia-smi.
- ``detect``: detectors (``--detectors``, random weights) on the 640x480 corpus,
  naive against the runner's batched path (``bench.detect``).

Every run writes ``gpu-bench.json`` (merged with ``--previous`` files) and
``gpu-bench.png`` into ``--out`` and prints the summary table last. Nothing is
downloaded: the model has random weights (its outputs mean nothing; its cost is
the real one) and the JPEG corpus is synthesised in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from bench.detect import DETECTORS, print_detect_table, stage_detect
from bench.plot import Line, Panel, draw_panels
from bench.stats import percentile
from schemas import DEFAULT_LIMITS, ContentType
from workers.gpu_decode import READ_MODES, BatchDecoder, decode_jpegs
from workers.handlers import Handler, ImageClassifier
from workers.loader import load_handler
from workers.preprocess import ImageSpec, crop_box, decode_image
from workers.runner import DeviceBatch, ModelRunner, compile_forward, resolve_device

STAGES = ("forward", "decode", "naive", "checks", "runner", "e2e", "detect")
_ALIASES = {"a": "forward", "b": "decode", "c": "naive", "d": "e2e"}
RESULTS_FILE = "gpu-bench.json"
PLOT_FILE = "gpu-bench.png"
_NOISE = 19.0  # sigma of the pixel noise: gives ~146 KB at 640x480 and ~25 KB at 224x224


@dataclass(frozen=True)
class Corpus:
    """Distinct JPEGs of one size; benchmarks cycle through them."""

    name: str  # e.g. "640x480"
    width: int
    height: int
    images: tuple[bytes, ...]

    @property
    def mean_kb(self) -> float:
        return sum(map(len, self.images)) / len(self.images) / 1000

    def take(self, count: int) -> list[bytes]:
        return [self.images[n % len(self.images)] for n in range(count)]


@dataclass(frozen=True)
class Config:
    """What the command line asked for, with the quick-mode sizes applied."""

    device: torch.device
    model: str
    batch_sizes: tuple[int, ...]
    iterations: int
    compile: bool
    distinct_images: int
    decode_count: int
    naive_count: int
    runner_count: int
    e2e_count: int
    threads: int
    max_batch: int


def synthetic_jpeg(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG: gradients, blurred shapes and sensor-like noise.

    Pure noise would compress far worse than photos and flat colour far better; this
    lands near real photos' sizes at quality 90 (~0.48 bytes per pixel).
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    ramps = rng.uniform(-80, 160, (3, 3))
    base = np.stack([a + b * x / width + c * y / height for a, b, c in ramps], axis=-1)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.uniform(0, width), rng.uniform(0, height)
        side = rng.uniform(0.05, 0.3) * width
        box = (x0, y0, x0 + side, y0 + side * rng.uniform(0.5, 1.5))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour)
        else:
            draw.rectangle(box, fill=colour)
    smooth = np.asarray(image.filter(ImageFilter.GaussianBlur(1.0)), dtype=np.float32)
    pixels = np.clip(smooth + rng.normal(0, _NOISE, smooth.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def build_corpora(distinct: int) -> list[Corpus]:
    return [
        Corpus(f"{w}x{h}", w, h, tuple(synthetic_jpeg(w, h, seed) for seed in range(distinct)))
        for w, h in ((640, 480), (224, 224))
    ]


# -- timing helpers -------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes, device work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _event() -> Any:
    # torch.cuda.Event has no annotations in torch's sources.
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _median_forward_s(
    forward: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    iterations: int,
    device: torch.device,
) -> float:
    """Median seconds of one forward: CUDA events on the GPU, perf_counter on the CPU."""
    with torch.inference_mode():
        for _ in range(3):
            forward(batch)
        _sync(device)
        samples: list[float] = []
        for _ in range(iterations):
            if device.type == "cuda":
                start, end = (
                    _event(),
                    _event(),
                )
                start.record()
                forward(batch)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000.0)
            else:
                samples.append(_timed(device, lambda: forward(batch)))
    return statistics.median(samples)


# -- model --------------------------------------------------------------------------------


def load_model(cfg: Config, dtype: str, decode: str = "cpu") -> ImageClassifier:
    """The benchmark model with random weights: the same seed gives the same weights."""
    torch.manual_seed(0)
    handler = load_handler(
        cfg.model,
        device=str(cfg.device),
        weights="random",
        dtype=dtype,
        channels_last=cfg.device.type == "cuda",
        limits=DEFAULT_LIMITS,
        decode=decode,  # type: ignore[arg-type]
    )
    assert isinstance(handler, ImageClassifier)
    return handler


def _device_batch(handler: ImageClassifier, size: int) -> torch.Tensor:
    spec = handler.image
    shape = (size, spec.channels, spec.height, spec.width)
    generator = torch.Generator().manual_seed(size)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(handler.device)


# -- stage a: forward ---------------------------------------------------------------------


def stage_forward(cfg: Config) -> dict[str, Any]:
    handler = load_model(cfg, "float16" if cfg.device.type == "cuda" else "float32")
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"eager": handler.forward}
    if cfg.compile:
        variants["compiled"] = compile_forward(handler.forward, cfg.batch_sizes)
    out: dict[str, Any] = {"precision": str(handler.dtype), "channels_last": True}
    for name, forward in variants.items():
        rows = {}
        for size in cfg.batch_sizes:
            batch = _device_batch(handler, size)
            compile_s = _timed(cfg.device, partial(forward, batch))
            seconds = _median_forward_s(forward, batch, cfg.iterations, cfg.device)
            rows[str(size)] = {
                "img_s": size / seconds,
                "ms": seconds * 1000,
                "first_call_s": compile_s,
            }
            print(f"  forward {name} batch {size}: {size / seconds:,.0f} img/s", flush=True)
        out[name] = rows
    return out


# -- stage b: decode ceilings -------------------------------------------------------------


def _pillow_no_draft(payload: bytes, spec: ImageSpec) -> np.ndarray[Any, Any]:
    """Pillow at full scale, then one resize with the crop box: the path without ``draft``."""
    with Image.open(io.BytesIO(payload), formats=["JPEG"]) as img:
        rgb = img.convert(spec.mode)
        box = crop_box(rgb.width, rgb.height, spec)
        return np.asarray(rgb.resize((spec.width, spec.height), spec.resample, box=box))


def _pillow_rate(payloads: Sequence[bytes], spec: ImageSpec, threads: int, draft: bool) -> float:
    def work(chunk: Sequence[bytes]) -> None:
        for payload in chunk:
            if draft:  # the worker's CPU path
                decode_image(payload, ContentType.JPEG, spec, max_pixels=DEFAULT_LIMITS.max_pixels)
            else:
                _pillow_no_draft(payload, spec)

    chunks = [payloads[n::threads] for n in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(work, chunks))
        return _rate(len(payloads), time.perf_counter() - start)


def stage_decode(cfg: Config, corpora: Sequence[Corpus], spec: ImageSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    decoder = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels)
    mode = READ_MODES[spec.mode]
    for corpus in corpora:
        payloads = corpus.take(cfg.decode_count)
        single = payloads[: max(cfg.decode_count // 8, 8)]
        row: dict[str, Any] = {"kb": corpus.mean_kb}
        row["pillow_1"] = _pillow_rate(single, spec, 1, draft=False)
        row["pillow_1_draft"] = _pillow_rate(single, spec, 1, draft=True)
        row["pillow_threads"] = _pillow_rate(payloads, spec, cfg.threads, draft=False)
        row["pillow_threads_draft"] = _pillow_rate(payloads, spec, cfg.threads, draft=True)
        row["threads"] = cfg.threads
        encoded = [decoder.encoded(p) for p in payloads]
        items = [t for t in encoded if t is not None]
        batches = [items[n : n + cfg.max_batch] for n in range(0, len(items), cfg.max_batch)]

        def decode_only(batches: list[list[torch.Tensor]] = batches) -> None:
            for batch in batches:
                decode_jpegs(batch, mode, cfg.device)

        def decode_resize(batches: list[list[torch.Tensor]] = batches) -> None:
            for batch in batches:
                decoder.collate(batch, cfg.device)

        decode_only()  # nvJPEG start-up and allocator growth, untimed
        decode_resize()
        row["nvjpeg_decode"] = _rate(len(items), _timed(cfg.device, decode_only))
        row["nvjpeg_decode_resize"] = _rate(len(items), _timed(cfg.device, decode_resize))
        row["best"] = max(row["nvjpeg_decode_resize"], row["pillow_threads_draft"])
        out[corpus.name] = row
        print(f"  decode {corpus.name}: {json.dumps(_rounded(row))}", flush=True)
    return out


# -- stage c: the naive baseline ----------------------------------------------------------


def stage_naive(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    handler = load_model(cfg, "float16" if cfg.device.type == "cuda" else "float32")
    runner = ModelRunner(handler, cfg.device)
    out: dict[str, Any] = {}
    for corpus in corpora:
        payloads = corpus.take(cfg.naive_count)
        for payload in payloads[:3]:  # cuDNN choice for batch 1, untimed
            runner.run([handler.preprocess(payload, ContentType.JPEG, {})], [{}])
        latencies = []
        start = time.perf_counter()
        for payload in payloads:
            began = time.perf_counter()
            item = handler.preprocess(payload, ContentType.JPEG, {})
            runner.run([item], [{}])  # postprocess copies the top-5 to the host: synchronous
            latencies.append((time.perf_counter() - began) * 1000)
        elapsed = time.perf_counter() - start
        out[corpus.name] = {
            "img_s": _rate(len(payloads), elapsed),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
        }
        print(f"  naive {corpus.name}: {out[corpus.name]['img_s']:,.0f} img/s", flush=True)
    return out


# -- checks: precision and decode agreement -----------------------------------------------


def stage_checks(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    full = load_model(cfg, "float32")
    # Reduced precision on a CPU is slow emulation, not what is served: compare on CUDA only.
    half_dtype = "float16" if cfg.device.type == "cuda" else "float32"
    half = load_model(cfg, half_dtype)  # the same seed: the same random weights
    gpu = load_model(cfg, "float32", decode="gpu")
    out: dict[str, Any] = {"reduced_precision": half_dtype}
    for corpus in corpora:
        payloads = list(corpus.images)
        cpu_items = torch.stack([full.preprocess(p, ContentType.JPEG, {}) for p in payloads])
        encoded = [gpu.preprocess(p, ContentType.JPEG, {}) for p in payloads]
        gpu_items = gpu.collate(encoded, cfg.device)
        assert gpu_items is not None
        with torch.inference_mode():
            reference = full.forward(cpu_items.to(cfg.device)).float()
            reduced = half.forward(cpu_items.to(cfg.device)).float()
            from_gpu = full.forward(gpu_items).float()
            normalized = (full.normalize(gpu_items) - full.normalize(cpu_items)).abs().max()
        levels = (gpu_items.cpu().int() - cpu_items.int()).abs()
        out[corpus.name] = {
            "images": len(payloads),
            "top1_agreement_half_vs_fp32": _agreement(reduced, reference),
            "max_abs_logit_diff_half": float((reduced - reference).abs().max()),
            "top1_agreement_gpu_vs_cpu_decode": _agreement(from_gpu, reference),
            "decode_max_abs_diff_levels": int(levels.max()),
            "decode_mean_abs_diff_levels": float(levels.float().mean()),
            "decode_max_abs_diff_normalized": float(normalized),
        }
        print(f"  checks {corpus.name}: {json.dumps(_rounded(out[corpus.name]))}", flush=True)
    return out


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(dim=1) == b.argmax(dim=1)).float().mean())


# -- the runner stage: the worker's split without Kafka -----------------------------------


class ForwardClock:
    """Wraps a forward with CUDA events to measure how long the GPU waits between batches."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._forward = forward
        self.events: list[tuple[Any, Any]] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        start, end = _event(), _event()
        start.record()
        out = self._forward(batch)
        end.record()
        self.events.append((start, end))
        return out

    def summary(self) -> dict[str, float]:
        """Idle gaps (ms) between one forward's end and the next one's start."""
        torch.cuda.synchronize()
        gaps = [
            self.events[n][1].elapsed_time(self.events[n + 1][0])
            for n in range(len(self.events) - 1)
        ]
        busy = sum(s.elapsed_time(e) for s, e in self.events)
        span = self.events[0][0].elapsed_time(self.events[-1][1]) if self.events else math.nan
        return {
            "forwards": len(self.events),
            "idle_gap_p50_ms": percentile(gaps, 50),
            "idle_gap_p99_ms": percentile(gaps, 99),
            "model_busy_share": busy / span if span else math.nan,
        }


def stage_runner(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for decode in ("gpu", "cpu"):
        handler = load_model(cfg, "float16" if cfg.device.type == "cuda" else "float32", decode)
        clock = ForwardClock(handler.forward) if cfg.device.type == "cuda" else None
        if clock is not None:
            handler.forward = clock  # type: ignore[method-assign]
        runner = ModelRunner(handler, cfg.device)
        runner.warm_up([cfg.max_batch])
        for corpus in corpora:
            if clock is not None:
                clock.events.clear()
            rate = _run_split(
                handler, runner, corpus.take(cfg.runner_count), cfg.max_batch, cfg.threads
            )
            row: dict[str, Any] = {"img_s": rate}
            if clock is not None:
                row.update(clock.summary())
            out[f"{decode}-decode {corpus.name}"] = row
            print(
                f"  runner {decode}-decode {corpus.name}: {json.dumps(_rounded(row))}", flush=True
            )
    return out


def _run_split(
    handler: Handler, runner: ModelRunner, payloads: Sequence[bytes], batch: int, threads: int
) -> float:
    """Preprocess in a pool, prepare batch k+1 on a staging thread while batch k infers."""

    def preprocess(chunk: Sequence[bytes]) -> list[torch.Tensor]:
        return [handler.preprocess(p, ContentType.JPEG, {}) for p in chunk]

    def prepare(decoded: Future[list[torch.Tensor]]) -> DeviceBatch:
        return runner.prepare(decoded.result())

    def infer(prepared: Future[DeviceBatch]) -> None:
        batch = prepared.result()
        runner.infer(batch, [{}] * batch.size)

    chunks = [payloads[n : n + batch] for n in range(0, len(payloads), batch)]
    with ThreadPoolExecutor(threads) as pool, ThreadPoolExecutor(1) as stage:
        start = time.perf_counter()
        decoded = [pool.submit(preprocess, chunk) for chunk in chunks]
        pending: Future[DeviceBatch] | None = None
        for future in decoded:
            staged = stage.submit(prepare, future)
            if pending is not None:
                infer(pending)
            pending = staged
        if pending is not None:
            infer(pending)
        _sync(runner.device)
        return _rate(len(payloads), time.perf_counter() - start)


# -- stage d: end to end through Kafka and Redis ------------------------------------------


class UtilizationSampler:
    """``nvidia-smi`` in the background, one GPU utilization sample every 200 ms."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (epoch s, percent)
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        command = [
            "nvidia-smi",
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
            "-lms",
            "200",
            "-i",
            os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        ]
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mean_between(self, start_s: float, end_s: float) -> float:
        inside = [p for t, p in self.samples if start_s <= t <= end_s]
        return statistics.fmean(inside) if inside else math.nan


def stage_e2e(cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for corpus in corpora:
        out[corpus.name] = asyncio.run(_e2e_one(cfg, corpus, args))
        print(f"  e2e {corpus.name}: {json.dumps(_rounded(out[corpus.name]))}", flush=True)
    return out


async def _e2e_one(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: only this stage needs the Kafka and Redis clients.
    from bench.services import (
        Services,
        create_topics,
        delete_topics,
        produce_at_rate,
        produce_backlog,
        read_results,
        wait_for_results,
    )
    from schemas import encode_request

    services = Services(args.kafka_bootstrap, args.redis_url)
    run = uuid.uuid4().hex[:8]
    model = f"gpubench{corpus.width}x{corpus.height}r{run}"
    topics = await create_topics(services, model, args.partitions)

    def records(prefix: str, count: int) -> tuple[list[Any], list[str]]:
        ids = [f"{prefix}-{n}" for n in range(count)]
        recs = [
            encode_request(p, request_id=i, content_type=ContentType.JPEG, source="bench.gpu")
            for p, i in zip(corpus.take(count), ids, strict=True)
        ]
        return recs, ids

    backlog, ids = records(f"{run}-b", cfg.e2e_count)
    await produce_backlog(services, topics.requests, backlog, args.partitions)
    workers = [_start_worker(cfg, model, args, k) for k in range(args.workers)]
    try:
        with UtilizationSampler() as gpu:
            last_ids = ids[-args.partitions :]
            await wait_for_results(services, ids, last_ids, timeout_s=args.e2e_timeout)
            results = await read_results(services, ids)
            finished = sorted(r.timings.finished_ms for r in results if r.timings)
            span_s = (finished[-1] - finished[0]) / 1000
            rate = _rate(len(finished) - 1, span_s)
            row: dict[str, Any] = {
                "requests": len(results),
                "ok": sum(r.status.value == "ok" for r in results),
                "img_s": rate,
                "gpu_util_pct": gpu.mean_between(finished[0] / 1000, finished[-1] / 1000),
                "mean_batch": _mean_batch(results),
                "compiled": cfg.compile,
                "workers": args.workers,
                "gpus": args.gpus,
            }
            # Latency at about half the peak, open loop (each record stamped when due).
            paced_rate = min(rate / 2, args.paced_max_rate)
            paced, paced_ids = records(f"{run}-p", max(int(paced_rate * args.paced_s), 1))
            achieved = await produce_at_rate(services, topics.requests, paced, paced_rate)
            await wait_for_results(services, paced_ids, paced_ids[-1:], timeout_s=120)
            paced_results = await read_results(services, paced_ids)
            latencies = [
                r.timings.finished_ms - r.timings.produced_ms for r in paced_results if r.timings
            ]
            row.update(
                {
                    "paced_rate": achieved,
                    "p50_ms": percentile(latencies, 50),
                    "p99_ms": percentile(latencies, 99),
                }
            )
    finally:
        for worker in workers:
            _stop_worker(worker)
        await delete_topics(services, topics)
    return row


def _mean_batch(results: Sequence[Any]) -> float:
    batches = {(r.worker, r.timings.batch_start_ms) for r in results if r.timings}
    return len(results) / len(batches) if batches else math.nan


def _start_worker(
    cfg: Config, model: str, args: argparse.Namespace, index: int = 0
) -> subprocess.Popen[bytes]:
    """Worker ``index`` of ``args.workers``: spread over ``args.gpus`` cards, cores shared."""
    from workers.settings import WorkerSettings

    device = cfg.device
    if device.type == "cuda" and args.gpus > 1:
        device = torch.device("cuda", index % args.gpus)
    threads = max(1, cfg.threads // args.workers)
    command = [
        sys.executable, "-m", "producers.cli", "worker",
        "--model", cfg.model, "--model-name", model, "--weights", "random",
        "--device", str(device), "--max-batch-size", str(cfg.max_batch),
        "--kafka-bootstrap", args.kafka_bootstrap, "--redis-url", args.redis_url,
        "--decode-threads", str(threads), "--max-in-flight", str(cfg.max_batch * 16),
        "--dtype", "float16", "--channels-last", "--metrics-port", "0",
    ]  # fmt: skip
    if "decode" in WorkerSettings.model_fields:  # the option exists once settings have it
        command += ["--decode", args.worker_decode]
    if cfg.compile:
        command.append("--compile")
    print("  worker:", " ".join(command), flush=True)
    return subprocess.Popen(command)


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


# -- report ---------------------------------------------------------------------------------


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per corpus: the worker against its ceilings and the naive baseline."""
    rows = []
    forward = results.get("forward", {})
    for name in ("640x480", "224x224"):
        e2e = results.get("e2e", {}).get(name, {})
        # The model ceiling: forward at the largest batch, compiled only if the worker was.
        variant = "compiled" if e2e.get("compiled") and "compiled" in forward else "eager"
        by_size = forward.get(variant, {})
        naive = results.get("naive", {}).get(name, {})
        decode = results.get("decode", {}).get(name, {})
        runner = results.get("runner", {}).get(f"gpu-decode {name}", {})
        largest = max(by_size, key=int, default=None)
        model_ceiling = by_size[largest]["img_s"] if largest is not None else math.nan
        ceiling = min(model_ceiling, decode.get("best", math.nan))
        worker = e2e.get("img_s", math.nan)
        rows.append(
            {
                "images": name,
                "naive_img_s": naive.get("img_s", math.nan),
                "runner_img_s": runner.get("img_s", math.nan),
                "e2e_img_s": worker,
                "p50_ms": e2e.get("p50_ms", math.nan),
                "p99_ms": e2e.get("p99_ms", math.nan),
                "gpu_util_pct": e2e.get("gpu_util_pct", math.nan),
                "ceiling_img_s": ceiling,
                "vs_naive": worker / naive.get("img_s", math.nan),
                "vs_ceiling": worker / ceiling,
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]], card: str, model: str) -> None:
    print(f"\nConveyor GPU benchmark on {card} ({model}, random weights)")
    header = (
        f"{'images':>8} {'naive/s':>9} {'runner/s':>9} {'worker/s':>9} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'GPU %':>6} {'ceiling/s':>10} {'×naive':>7} {'×ceiling':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['images']:>8} {r['naive_img_s']:>9,.0f} {r['runner_img_s']:>9,.0f} "
            f"{r['e2e_img_s']:>9,.0f} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} "
            f"{r['gpu_util_pct']:>6.0f} {r['ceiling_img_s']:>10,.0f} {r['vs_naive']:>7.1f} "
            f"{r['vs_ceiling']:>8.2f}"
        )
    print("goals: worker ≥ 30× naive, ≥ 0.8× ceiling = min(forward at batch, best decode)")


def plot(results: dict[str, Any], rows: Sequence[dict[str, Any]], path: Path, card: str) -> None:
    panels = []
    names = [r["images"] for r in rows]
    panels.append(
        Panel(
            title="Throughput by path",
            unit="img/s",
            groups=names,
            series=["naive", "runner", "worker e2e", "ceiling"],
            values=[
                _bars([r["naive_img_s"], r["runner_img_s"], r["e2e_img_s"], r["ceiling_img_s"]])
                for r in rows
            ],
            note="0 = not measured in this run",
        )
    )
    decode = results.get("decode", {})
    if decode:
        keys = ["pillow_1_draft", "pillow_threads_draft", "nvjpeg_decode", "nvjpeg_decode_resize"]
        panels.append(
            Panel(
                title="Decode + resize to 224",
                unit="img/s",
                groups=list(decode),
                series=["Pillow 1", "Pillow N threads", "nvJPEG", "nvJPEG+resize"],
                values=[_bars([decode[g].get(k, math.nan) for k in keys]) for g in decode],
            )
        )
    forward = results.get("forward", {})
    variants = [v for v in ("eager", "compiled") if v in forward]
    if variants:
        sizes = list(forward[variants[0]])
        model = results.get("meta", {}).get("model")
        panels.append(
            Panel(
                title=f"{model} forward ({forward.get('precision')})",
                unit="img/s",
                groups=[f"batch {s}" for s in sizes],
                series=variants,
                values=[
                    _bars([forward[v].get(s, {}).get("img_s", math.nan) for v in variants])
                    for s in sizes
                ],
                lines=[Line(max((r["naive_img_s"] for r in rows), default=math.nan), "naive")],
            )
        )
    draw_panels(panels, path, title=f"Conveyor on {card}")


def _bars(values: Sequence[float]) -> list[float]:
    """Missing measurements drawn as 0 (the table and the JSON say n/a / NaN)."""
    return [v if math.isfinite(v) else 0.0 for v in values]


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4) if abs(value) < 10 else round(value, 1)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--stages",
        default="forward,decode,naive,checks,runner,e2e",
        help=f"comma-separated: {', '.join(STAGES)} (or a, b, c, d)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: smoke test)")
    parser.add_argument("--model", default="torchvision:resnet50")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks that it runs")
    parser.add_argument("--iterations", type=int, default=30, help="timed forwards per size")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--e2e-count", type=int, default=16384, help="backlog per corpus")
    parser.add_argument("--kafka-bootstrap", help="broker for e2e; e2e is skipped without it")
    parser.add_argument("--redis-url", help="Redis for e2e; e2e is skipped without it")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument(
        "--workers", type=int, default=1, help="e2e: worker processes in one consumer group"
    )
    parser.add_argument("--gpus", type=int, default=1, help="e2e: cards the workers spread over")
    parser.add_argument("--worker-decode", default="auto", choices=("auto", "cpu", "gpu"))
    parser.add_argument("--e2e-timeout", type=float, default=240.0)
    parser.add_argument(
        "--detectors",
        default=",".join(DETECTORS),
        help="detect: comma-separated torchvision detection architectures",
    )
    parser.add_argument("--detect-batch", type=int, default=32, help="detect: batch size")
    parser.add_argument("--paced-s", type=float, default=4.0, help="seconds of paced load")
    parser.add_argument(
        "--paced-max-rate",
        type=float,
        default=4000.0,
        help="cap on the paced rate (what one Python producer can send)",
    )
    parser.add_argument(
        "--previous",
        nargs="*",
        default=[],
        type=Path,
        help="earlier gpu-bench.json files to merge (stages run in other calls)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: merge --previous files, print the table, plot",
    )
    parser.add_argument("--out", type=Path, default=Path(".run/gpu-bench"))
    return parser.parse_args(argv)  # fmt: skip


def make_config(args: argparse.Namespace) -> Config:
    device = resolve_device(args.device)
    if args.quick:
        return Config(device, args.model, (1, 2), 2, args.compile, 2, 8, 4, 8, 16, 2, 4)
    return Config(
        device=device,
        model=args.model,
        batch_sizes=(1, 32, 128, 256),
        iterations=args.iterations,
        compile=args.compile,
        distinct_images=64,
        decode_count=2048,
        naive_count=500,
        runner_count=8192,
        e2e_count=args.e2e_count,
        threads=args.threads,
        max_batch=args.max_batch_size,
    )


def selected_stages(text: str, args: argparse.Namespace) -> list[str]:
    stages = [_ALIASES.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    if "e2e" in stages and not (args.kafka_bootstrap and args.redis_url):
        print("e2e skipped: it needs --kafka-bootstrap and --redis-url", flush=True)
        stages.remove("e2e")
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    for previous in args.previous:
        results.update(json.loads(previous.read_text()))
    if not args.report:
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/torchinductor").resolve())
        )
        cfg = make_config(args)
        stages = selected_stages(args.stages, args)
        corpora = build_corpora(cfg.distinct_images)
        spec = load_model(cfg, "float32").image
        results["meta"] = {
            "card": _card(cfg.device),
            "model": cfg.model,
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv),
            "weights": "random (throughput only; outputs are meaningless)",
            "corpus_kb": {c.name: c.mean_kb for c in corpora},
        }
        for stage in stages:
            print(f"stage {stage}", flush=True)
            started = time.perf_counter()
            results[stage] = _run_stage(stage, cfg, corpora, spec, args)
            results.setdefault("stage_s", {})[stage] = time.perf_counter() - started
    card = results.get("meta", {}).get("card", "?")
    model = results.get("meta", {}).get("model", "?")
    rows = summarize(results)
    results["summary"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))
    plot(results, rows, args.out / PLOT_FILE, card)
    print_detect_table(results, card)
    print_table(rows, card, model)
    return 0


def _run_stage(
    stage: str, cfg: Config, corpora: Sequence[Corpus], spec: ImageSpec, args: argparse.Namespace
) -> dict[str, Any]:
    if stage == "forward":
        return stage_forward(cfg)
    if stage == "decode":
        return stage_decode(cfg, corpora, spec)
    if stage == "naive":
        return stage_naive(cfg, corpora)
    if stage == "checks":
        return stage_checks(cfg, corpora)
    if stage == "runner":
        return stage_runner(cfg, corpora)
    if stage == "detect":
        return stage_detect(
            str(cfg.device),
            [arch.strip() for arch in args.detectors.split(",") if arch.strip()],
            corpora[0].images,  # 640x480
            naive_count=max(cfg.naive_count // 10, 2),
            runner_count=max(cfg.runner_count // 10, 4),
            batch=args.detect_batch if not args.quick else 2,
            threads=cfg.threads,
            quick=args.quick,
            run_split=_run_split,
        )
    return stage_e2e(cfg, corpora, args)


if __name__ == "__main__":
    sys.exit(main())
