"""The GPU benchmark: ceilings, the naive baseline, the model stage and the worker end to end.

    python -m bench.gpu --stages forward,decode,naive,checks,pipeline --out OUT [--compile]
    python -m bench.gpu --stages e2e,kill --kafka-bootstrap HOST:PORT --redis-url URL \
        --e2e-configs 1x1,2x1 --pin --out OUT
    python -m bench.gpu --report --previous OUT1/gpu-bench.json OUT2/gpu-bench.json --out OUT

Stages (each a few minutes at most on an H100 or H200):

- ``forward`` (a): ResNet-50 with random weights, channels-last float16 (and
  ``torch.compile``d with ``--compile``), on uint8 batches already on the GPU,
  normalization included as the worker runs it; CUDA events, median of N.
- ``decode`` (b): decode + fit to 224x224 ceilings for each corpus: Pillow on one
  thread and on a thread per core (with and without ``draft``), nvJPEG batched
  decode alone and with the batched resize (the worker's GPU path), and the GPU's
  hardware JPEG engine through nvImageCodec when it is installed.
- ``naive`` (c): one request at a time, Pillow decode, the same model, synchronous:
  what a tutorial endpoint does per request, minus HTTP.
- ``checks``: float16 vs float32 top-1 agreement on the same inputs and weights,
  and the GPU decode path vs the CPU one (pixel differences after normalization).
- ``pipeline``: the worker's model stage without Kafka (``workers.model.inference``:
  preprocess in a thread pool, then prepare ─▶ launch ─▶ finish on three threads
  and two CUDA streams) for each decode path; img/s and the GPU's idle time
  between forwards (CUDA events): the ceiling of the decode and forward overlapped.
- ``e2e`` (d): the real workers as subprocesses, in each layout of
  ``--e2e-configs`` (worker processes x GPUs). Every worker must be ready and the
  group settled before anything is produced; then each repeat produces a backlog
  from ``--producers`` processes at once, in Kafka transactions committed together
  once all of it is written (the workers read ``read_committed``, so they see the
  whole backlog at once and the producers' rate does not bound theirs), and times
  the steady state (the middle 80% of results by their durable time),
  median/min/max over ``--repeats``, with the GPU's busy share and each worker's
  model stage from its results' timings (busy share, idle gaps between batches,
  ``bench.stats.model_stage``); then p50/p99 latency to durability at about
  half that rate, open loop, from each request's append in Kafka
  (``--latency-from``), with the producers' acknowledgement after due beside it.
  ``--pin`` gives the broker and Redis (``--service-cores``), the producers
  (``--producer-cores``) and the workers cores of their own.
- ``kill``: a worker SIGKILLed a third of the way through a backlog and replaced:
  lost and duplicate-visible counted from Redis and the reply topic. With ``--mps``
  a second worker shares the card, under the run's own MPS server, and goes on.
- ``detect``: detectors (``--detectors``, random weights) on the 640x480 corpus,
  naive against the worker's model stage (``bench.detect``).

Every run writes ``gpu-bench.json`` (merged with ``--previous`` files) and
``gpu-bench.png`` into ``--out`` and prints the summary table last. Nothing is
downloaded: the model has random weights (its outputs mean nothing; its cost is
the real one) and the JPEG corpus is synthesised in memory.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import io
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, get_args

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from bench.detect import DETECTORS, print_detect_table, stage_detect
from bench.plot import Line, Panel, draw_panels
from bench.stats import (
    LATENCY_PARTS,
    MODEL_STAGE_KEYS,
    acked_summary,
    durable_ms,
    latency_summary,
    model_stage,
    parts_line,
    percentile,
)
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import (
    WORKER_COMMAND,
    Fleet,
    WorkerConfig,
    WorkerProcess,
    await_results,
    produce,
    produce_at_rate,
    read_results,
    tally,
    unless_one_exits,
    until_all_ready,
    until_answered,
)
from schemas import DEFAULT_LIMITS, ContentType, Result, topics_for
from schemas.fastpath import FastMeta
from workers.decode.gpu import BatchDecoder, DecodeOption
from workers.decode.images import ImageSpec, crop_box, decode_image
from workers.decode.jpeg import READ_MODES, decode_jpegs
from workers.fleet import plan
from workers.handlers.base import Handler, ImageClassifier
from workers.model.inference import Inference
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner, compile_forward, resolve_device
from workers.offsets import OffsetTracker
from workers.types import Item, Outcome

STAGES = (
    "forward",
    "decode",
    "overlap",
    "naive",
    "checks",
    "pipeline",
    "e2e",
    "ready",
    "kill",
    "detect",
)
_ALIASES = {"a": "forward", "b": "decode", "c": "naive", "d": "e2e", "runner": "pipeline"}
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


def build_corpora(distinct: int, names: Sequence[str] = ("640x480", "224x224")) -> list[Corpus]:
    sizes = [tuple(int(n) for n in name.split("x")) for name in names]
    return [
        Corpus(f"{w}x{h}", w, h, tuple(synthetic_jpeg(w, h, seed) for seed in range(distinct)))
        for w, h in sizes
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


def _fastest(device: torch.device, fn: Callable[[], object], repeats: int = 3) -> float:
    """The shortest of ``repeats`` timings of ``fn``: a ceiling is the best the card does,
    and one pass of a host-driven decode varied by a fifth between runs on one H100."""
    return min(_timed(device, fn) for _ in range(repeats))


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


# -- overlap: does decoding run beside the forward on one card? ---------------------------


def stage_overlap(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    """Decode+resize and the forward, each alone and both at once from two threads (two
    streams), and how much a Python thread still runs while another decodes (the GIL).

    The worker's GPU stage overlaps them this way within one process; if a decode call
    holds the GIL while it waits for the device, the forward's launches wait too, and
    only several processes (each with its own GIL) overlap them.
    """
    out: dict[str, Any] = {}
    corpus = corpora[0]
    for decode in [p for p in decode_paths(cfg) if p != "cpu"]:
        out[f"{decode} {corpus.name}"] = row = _overlap_one(cfg, corpus, decode)
        print(f"  overlap {decode} {corpus.name}: {json.dumps(_rounded(row))}", flush=True)
    return out


def _overlap_one(cfg: Config, corpus: Corpus, decode: str) -> dict[str, Any]:
    handler = load_model(cfg, "float16", decode)
    runner = ModelRunner(handler, cfg.device)
    runner.warm_up([cfg.max_batch])
    encoded = [handler.preprocess(p, ContentType.JPEG, {}) for p in corpus.take(cfg.max_batch)]
    params: list[dict[str, Any]] = [{}] * len(encoded)
    decoded = runner.prepare(encoded)

    def forward_once() -> None:
        runner.finish(runner.launch(decoded, params))

    def decode_once() -> None:
        batch = runner.prepare(encoded)
        if batch.ready is not None:
            batch.ready.synchronize()

    row: dict[str, Any] = {
        "forward_alone_img_s": _loop_rate(forward_once, len(encoded), 2.0),
        "decode_alone_img_s": _loop_rate(decode_once, len(encoded), 2.0),
    }
    both = _concurrent_rates([forward_once, decode_once], len(encoded), 3.0)
    row["together_forward_img_s"], row["together_decode_img_s"] = both
    row["python_progress_while_decoding"] = _gil_share(decode_once)
    row["python_progress_while_forward"] = _gil_share(forward_once)
    return row


def _loop_rate(step: Callable[[], None], items: int, seconds: float) -> float:
    step()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    return _rate(count * items, time.perf_counter() - start)


def _concurrent_rates(
    steps: Sequence[Callable[[], None]], items: int, seconds: float
) -> list[float]:
    counts = [0] * len(steps)
    stop = threading.Event()

    def loop(k: int) -> None:
        while not stop.is_set():
            steps[k]()
            counts[k] += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(steps))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return [_rate(count * items, elapsed) for count in counts]


def _gil_share(step: Callable[[], None]) -> float:
    """Pure-Python loop iterations per second while ``step`` loops in another thread,
    over the same without it: near 1 when ``step`` releases the GIL while it waits."""

    def spin(seconds: float) -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            n += 1
        return n / (time.perf_counter() - start)

    alone = spin(1.0)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            step()

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.2)
    shared = spin(1.0)
    stop.set()
    thread.join()
    return shared / alone


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
        row["nvjpeg_decode"] = _rate(len(items), _fastest(cfg.device, decode_only))
        row["nvjpeg_decode_resize"] = _rate(len(items), _fastest(cfg.device, decode_resize))
        candidates = [row["nvjpeg_decode_resize"], row["pillow_threads_draft"]]
        if cfg.device.type == "cuda" and _has_nvimgcodec():
            row |= _hardware_decode(cfg, spec, batches)
            candidates.append(row["nvimgcodec_decode_resize"])
        row["best"] = max(candidates)
        out[corpus.name] = row
        print(f"  decode {corpus.name}: {json.dumps(_rounded(row))}", flush=True)
    return out


def _hardware_decode(
    cfg: Config, spec: ImageSpec, batches: list[list[torch.Tensor]]
) -> dict[str, float]:
    """The hardware JPEG engine (nvImageCodec), decode alone (into the batch buffers the
    worker's path decodes into) and decode + resize."""
    decoder = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels, backend="nvimgcodec")
    hardware = decoder._hardware
    assert hardware is not None

    def decode_only() -> None:
        for batch in batches:
            with hardware.decode_batch(batch, cfg.device):
                pass

    def decode_resize() -> None:
        for batch in batches:
            decoder.collate(batch, cfg.device)

    decode_only()
    decode_resize()
    count = sum(map(len, batches))
    return {
        "nvimgcodec_decode": _rate(count, _fastest(cfg.device, decode_only)),
        "nvimgcodec_decode_resize": _rate(count, _fastest(cfg.device, decode_resize)),
    }


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
        graph_diff = _graph_vs_eager(cfg, full, cpu_items)
        out[corpus.name] = {
            "images": len(payloads),
            "top1_agreement_half_vs_fp32": _agreement(reduced, reference),
            "max_abs_logit_diff_half": float((reduced - reference).abs().max()),
            "top1_agreement_gpu_vs_cpu_decode": _agreement(from_gpu, reference),
            "decode_max_abs_diff_levels": int(levels.max()),
            "decode_mean_abs_diff_levels": float(levels.float().mean()),
            "decode_max_abs_diff_normalized": float(normalized),
            "cuda_graph_max_abs_logit_diff": graph_diff,
        }
        if cfg.device.type == "cuda" and _has_nvimgcodec():
            out[corpus.name] |= _hardware_checks(cfg, full, encoded, cpu_items, reference)
        print(f"  checks {corpus.name}: {json.dumps(_rounded(out[corpus.name]))}", flush=True)
    return out


def _hardware_checks(
    cfg: Config,
    full: ImageClassifier,
    encoded: list[torch.Tensor],
    cpu_items: torch.Tensor,
    reference: torch.Tensor,
) -> dict[str, Any]:
    """The hardware engine against Pillow, and its reused batch buffers against its
    per-image path: batches decoded one after another (halves, then the whole corpus,
    then the halves again) must each equal the same images decoded one tensor each."""
    hw = load_model(cfg, "float32", decode="gpu-hw")
    decoder = hw.batch_decoder
    assert decoder is not None
    assert decoder._hardware is not None
    half = len(encoded) // 2
    parts = [encoded[:half], encoded[half:], encoded, encoded[half:], encoded[:half]]
    batches = [decoder.collate(part, cfg.device) for part in parts]  # all kept alive
    one_by_one = [
        decoder._assemble(
            part, list(range(len(part))), decoder._hardware.decode(part, cfg.device), cfg.device
        )
        for part in parts
    ]
    whole = batches[2]
    assert whole is not None
    with torch.inference_mode():
        from_hw = full.forward(whole).float()
    levels = (whole.cpu().int() - cpu_items.int()).abs()
    return {
        "top1_agreement_gpu_hw_vs_cpu_decode": _agreement(from_hw, reference),
        "hw_decode_max_abs_diff_levels": int(levels.max()),
        "hw_decode_mean_abs_diff_levels": float(levels.float().mean()),
        "hw_batch_buffers_equal_per_image": all(
            b is not None and torch.equal(b, o) for b, o in zip(batches, one_by_one, strict=True)
        ),
    }


def _graph_vs_eager(cfg: Config, handler: ImageClassifier, items: torch.Tensor) -> float:
    """Largest logit difference between the CUDA-graph replay and the eager forward on
    the same batch (NaN on the CPU, where there are no graphs)."""
    if cfg.device.type != "cuda":
        return math.nan
    size = len(items)
    runner = ModelRunner(handler, cfg.device, buckets=(size,), cuda_graphs=True)
    runner.warm_up([size])
    if not runner.graphed_sizes:
        return math.nan
    batch = runner.prepare(list(items))
    if batch.ready is not None:
        batch.ready.synchronize()
    tensor = batch.tensor
    assert isinstance(tensor, torch.Tensor)  # a classifier's batch is stacked, not a list
    graph = runner._graphs[tuple(tensor.shape)]
    torch.cuda.synchronize(cfg.device)
    with torch.inference_mode():
        eager = handler.forward(tensor).float()
        replayed = graph.run(tensor).float()
    return float((replayed - eager).abs().max())


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
        """Idle gaps (ms) between one forward's end and the next one's start, and the
        share of the span the model was busy."""
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


def decode_paths(cfg: Config) -> list[str]:
    """The decode options to compare: nvJPEG, the hardware engine when nvImageCodec is
    installed, and Pillow on the CPU."""
    paths = ["gpu"]
    if cfg.device.type == "cuda" and _has_nvimgcodec():
        paths.append("gpu-hw")
    return [*paths, "cpu"]


@functools.cache
def _has_nvimgcodec() -> bool:
    """Whether nvImageCodec is installed and decodes a JPEG on this card (a missing
    library or codec is reported once, and the hardware rows are left out)."""
    if not torch.cuda.is_available():
        return False
    try:
        spec = ImageSpec(height=32, width=32, mode="RGB")
        decoder = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels, backend="nvimgcodec")
        decoder.collate([decoder.example()], torch.device("cuda"))
    except Exception as exc:
        print(f"  nvImageCodec not used: {exc!r}", flush=True)
        return False
    return True


def stage_pipeline(cfg: Config, corpora: Sequence[Corpus]) -> dict[str, Any]:
    """The worker's model stage without Kafka: preprocess in a thread pool as the worker
    does, then ``workers.model.inference.Inference`` (prepare ─▶ launch ─▶ finish on a GPU);
    img/s, and the GPU's idle time between forwards (CUDA events)."""
    out: dict[str, Any] = {}
    for decode in decode_paths(cfg):
        handler = load_model(cfg, "float16" if cfg.device.type == "cuda" else "float32", decode)
        clock = ForwardClock(handler.forward) if cfg.device.type == "cuda" else None
        if clock is not None:
            handler.forward = clock  # type: ignore[method-assign]
        runner = ModelRunner(handler, cfg.device)
        runner.warm_up([cfg.max_batch])
        for corpus in corpora:
            if clock is not None:
                clock.events.clear()
            rate = asyncio.run(_drive_pipeline(handler, runner, corpus.take(cfg.runner_count), cfg))
            row: dict[str, Any] = {"img_s": rate}
            if clock is not None:
                row.update(clock.summary())
            out[f"{decode}-decode {corpus.name}"] = row
            print(
                f"  pipeline {decode}-decode {corpus.name}: {json.dumps(_rounded(row))}",
                flush=True,
            )
    return out


async def _drive_pipeline(
    handler: Handler, runner: ModelRunner, payloads: Sequence[bytes], cfg: Config
) -> float:
    answered = 0

    def on_done(outcome: Outcome) -> None:
        nonlocal answered
        answered += len(outcome.answered)

    inference = Inference(runner, on_done)
    loop = asyncio.get_running_loop()
    chunks = [payloads[n : n + cfg.max_batch] for n in range(0, len(payloads), cfg.max_batch)]
    try:
        with ThreadPoolExecutor(cfg.threads) as pool:
            start = time.perf_counter()
            ready = [loop.run_in_executor(pool, _items, handler, chunk) for chunk in chunks]
            for future in ready:
                batch = await future
                await inference.wait_for_slot()
                inference.submit(batch)
            await inference.wait_idle()
            elapsed = time.perf_counter() - start
    finally:
        inference.close()
    if answered != len(payloads):
        raise RuntimeError(f"the pipeline answered {answered} of {len(payloads)} images")
    return _rate(len(payloads), elapsed)


def _detect_pipeline(
    cfg: Config,
    handler: Handler,
    runner: ModelRunner,
    payloads: Sequence[bytes],
    batch: int,
    threads: int,
) -> float:
    """``_drive_pipeline`` for the detect stage, with its own batch size and threads."""
    sized = dataclasses.replace(cfg, max_batch=batch, threads=threads)
    return asyncio.run(_drive_pipeline(handler, runner, payloads, sized))


def _items(handler: Handler, payloads: Sequence[bytes]) -> list[Item]:
    """Requests as the worker's ingest makes them (no Kafka record behind them)."""
    span = OffsetTracker[tuple[str, int]]().open(("bench", 0), 0, len(payloads) - 1, len(payloads))
    now_ms, now = time.time() * 1000.0, time.monotonic()
    items = []
    for n, payload in enumerate(payloads):
        meta = FastMeta(f"b{n}", ContentType.JPEG, {}, None, None, None, None, None)
        tensor = handler.preprocess(payload, ContentType.JPEG, {})
        items.append(Item(None, span, meta, now_ms, now, None, tensor))  # type: ignore[arg-type]
    return items


# -- stage d: end to end through Kafka and Redis ------------------------------------------


class UtilizationSampler:
    """``nvidia-smi`` in the background: the mean utilization of the first ``gpus`` cards,
    one sample every 200 ms."""

    def __init__(self, gpus: int = 1) -> None:
        self._gpus = gpus
        self._row: list[float] = []
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
            ",".join(str(n) for n in range(self._gpus)),
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
        for line in self._proc.stdout:  # one line per card, cards in order
            try:
                self._row.append(float(line.strip()))
            except ValueError:
                continue
            if len(self._row) == self._gpus:
                self.samples.append((time.time(), statistics.fmean(self._row)))
                self._row = []

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def mean_between(self, start_s: float, end_s: float) -> float:
        inside = [p for t, p in self.samples if start_s <= t <= end_s]
        return statistics.fmean(inside) if inside else math.nan


def stage_e2e(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Each layout of ``--e2e-configs`` (processes a card x cards) on each corpus: the one
    command per host (``conveyor worker``, a supervisor and its processes), repeats per
    layout. ``checkpoint`` gets the rows so far after each (a run cut short keeps them)."""
    _pin_services(args)
    out: dict[str, Any] = {}
    variant = "".join(
        f"/{value}"
        for value, default in ((args.profile, "throughput"), (args.worker_decode, "auto"))
        if value != default
    )  # e.g. autox1/latency/gpu-hw: rows of several calls merge side by side
    for layout in args.e2e_configs.split(","):
        per_card, gpus = parse_layout(layout)

        def done(corpus: Corpus, row: dict[str, Any], layout: str = layout + variant) -> None:
            key = f"{layout} {corpus.name}"
            out[key] = row
            print(f"  e2e {key}: {json.dumps(_rounded(row))}", flush=True)
            checkpoint(out)

        asyncio.run(_e2e_one(cfg, corpora, args, per_card, gpus, done))
    return out


def parse_layout(layout: str) -> tuple[int | None, int]:
    """``PxG``: P processes a card (``auto``: the command's own choice) on G cards."""
    per_card, _, gpus = layout.lower().partition("x")
    if not gpus.isdigit() or not (per_card == "auto" or per_card.isdigit()):
        raise SystemExit(f"layout {layout!r}: write PROCESSESxCARDS, e.g. autox1, 8x2")
    return (None if per_card == "auto" else int(per_card)), int(gpus)


def expected_processes(per_card: int | None, gpus: int, args: argparse.Namespace) -> int:
    """How many processes the one command will run for a layout: what ``processes auto``
    decides from the cores it may use (the workers' ones with ``--pin``) and the cards."""
    if per_card is not None:
        return per_card * max(gpus, 1)
    if gpus == 0:
        return 1
    cores = len(_worker_cores(args)) if args.pin else len(_cores())
    return plan.per_card(None, gpus, cores) * gpus


def _pin_services(args: argparse.Namespace) -> None:
    """Broker and Redis on the last cores, so workers and producers do not share them."""
    if not args.pin:
        return
    cores = _service_cores(args)
    for pidfile in (Path(".run").glob("kafka-*/kafka.pid"), Path(".run").glob("redis-*/redis.pid")):
        for path in pidfile:
            _pin_all_threads(int(path.read_text()), cores)
    print(f"  broker and Redis pinned to cores {sorted(cores)}", flush=True)


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _core_times() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) clock ticks so far, from ``/proc/stat``; empty off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [int(field) for field in fields[:8]]
            idle = ticks[3] + ticks[4]  # idle and waiting for I/O
            times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def _cores_busy(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], args: argparse.Namespace
) -> dict[str, float]:
    """Busy share (%) of each group of cores between two ``_core_times``: with ``--pin``
    the services', the producers' and the workers' cores, else all of them."""
    groups = (
        {
            "services": _service_cores(args),
            "producers": _producer_cores(args),
            "workers": _worker_cores(args),
        }
        if args.pin
        else {"all": set(_cores())}
    )
    shares = {}
    for name, cores in groups.items():
        common = [c for c in cores if c in before and c in after]
        busy = sum(after[c][0] - before[c][0] for c in common)
        total = sum(after[c][1] - before[c][1] for c in common)
        shares[name] = 100.0 * busy / total if total else math.nan
    return shares


def _service_cores(args: argparse.Namespace) -> set[int]:
    """``--service-cores`` of the last cores; by default a quarter of them, at least two
    (with two of 16, at 9,600 requests a second, the parts of the p99 that wait on the
    broker and Redis were 2.5 and 3.5 times those with four: docs/benchmarks.md)."""
    cores = _cores()
    return set(cores[-(args.service_cores or max(2, len(cores) // 4)) :])


def _producer_cores(args: argparse.Namespace) -> set[int]:
    """``--producer-cores`` before the services'; by default a quarter of the cores, at
    least two: sending 150 KB records fast enough to keep a GPU fed takes several
    processes."""
    cores = _cores()
    services = len(_service_cores(args))
    count = args.producer_cores or max(2, len(cores) // 4)
    return set(cores[-services - count : -services])


def _worker_cores(args: argparse.Namespace) -> set[int]:
    return set(_cores()) - _service_cores(args) - _producer_cores(args)


def _pin_all_threads(pid: int, cores: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:
            continue  # a thread that ended meanwhile


async def _e2e_one(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    per_card: int | None,
    gpus: int,
    done: Callable[[Corpus, dict[str, Any]], None],
) -> None:
    """Start the one command (a partition for each of its processes) and wait until the
    host is ready and the group settled; then, corpus by corpus, produce backlogs (in
    parallel producer processes), time the steady state, and the latency at half that
    rate. ``done`` gets each corpus's row."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    processes = expected_processes(per_card, gpus, args)
    partitions = args.partitions or processes
    model = f"gpubench{layout_name(per_card, gpus)}r{run}"
    # "append": the broker stamps each request when it appends it, so the paced load's
    # latency runs from the request being in Kafka; the producers' own lag is
    # reported beside it (acknowledged after due).
    stamp = {"append": "LogAppendTime", "due": "CreateTime"}[args.latency_from]
    await create_model_topics(
        settings, model, partitions, configs={"requests": {"message.timestamp.type": stamp}}
    )
    fleet = _fleet(cfg, model, args)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, args, per_card, gpus)
        # Ready: every process owns partitions; ready again a second later: settled.
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        for n, corpus in enumerate(corpora):
            row: dict[str, Any] = {
                "processes": len(host.children()) or 1,
                "gpus": gpus,
                "partitions": partitions,
                "compiled": cfg.device.type == "cuda" and "--no-compile" not in args.worker_options,
                "profile": args.profile,
                "decode": args.worker_decode,
                "latency_from": args.latency_from,
                "ready_s": ready_s if n == 0 else math.nan,  # the host's start, once
                "command": " ".join(host.config.argv()[len(WORKER_COMMAND) :]),
            }
            load = _Load(model, f"{run}{n}", partitions, host, per_card, gpus)
            row.update(await _backlogs(cfg, corpus, args, load))
            row.update(await _paced(corpus, args, load, row["img_s"]))
            done(corpus, row)
    finally:
        await fleet.aclose()
        await delete_model_topics(settings, model)


async def _backlogs(
    cfg: Config, corpus: Corpus, args: argparse.Namespace, load: _Load
) -> dict[str, Any]:
    """``--repeats`` backlogs, each produced at once: the steady state's median and spread."""
    runs = []
    for repeat in range(args.repeats):
        prefix = f"{load.run}-b{repeat}"
        samplers: list[subprocess.Popen[bytes]] = []

        def sample(repeat: int = repeat, samplers: list[Any] = samplers) -> None:
            if args.profile_s and args.profile_phase == "backlog" and repeat == 1:
                samplers.append(_profile(args, load.host, load.per_card, load.gpus, corpus))

        with UtilizationSampler(load.gpus) as gpu:
            produced = await _produce_parallel(
                args, load.model, corpus, prefix, cfg.e2e_count, load.partitions, on_visible=sample
            )
            results = await _await_results(prefix, cfg.e2e_count, args, [load.host])
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
        runs.append(_steady_state(results, gpu) | {"producer_img_s": produced})
        print(f"    repeat {repeat}: {json.dumps(_rounded(runs[-1]))}", flush=True)
    rates = sorted(r["img_s"] for r in runs)
    return {
        "runs": runs,
        "img_s": statistics.median(rates),
        "img_s_min": rates[0],
        "img_s_max": rates[-1],
        "gpu_util_pct": statistics.median(r["gpu_util_pct"] for r in runs),
        "mean_batch": statistics.median(r["mean_batch"] for r in runs),
    } | {key: statistics.median(r[key] for r in runs) for key in MODEL_STAGE_KEYS}


@dataclass(frozen=True)
class _Load:
    """Where a layout's load goes: its model's topics, its run id, the host serving it."""

    model: str
    run: str
    partitions: int
    host: WorkerProcess
    per_card: int | None
    gpus: int


async def _paced(
    corpus: Corpus, args: argparse.Namespace, load: _Load, peak: float
) -> dict[str, Any]:
    """Latency at about half the peak, open loop (each record stamped when due)."""
    model, run, partitions, host = load.model, load.run, load.partitions, load.host
    per_card, gpus = load.per_card, load.gpus
    paced_rate = min(peak / 2, args.paced_max_rate)
    count = max(int(paced_rate * args.paced_s), 1)
    paced_samplers: list[subprocess.Popen[bytes]] = []
    cores_at_go: dict[int, tuple[int, int]] = {}

    def sample_paced() -> None:
        cores_at_go.update(_core_times())
        if args.profile_s and args.profile_phase == "paced":
            paced_samplers.append(_profile(args, host, per_card, gpus, corpus))

    sent = await _paced_parallel(
        args, model, corpus, f"{run}-p", count, paced_rate, partitions, on_go=sample_paced
    )
    achieved = sent["rate"]
    # While the paced load was sent: a group near 100% queues everything it serves.
    cores_busy = _cores_busy(cores_at_go, _core_times(), args)
    paced = await _await_results(f"{run}-p", count, args, [host])
    for sampler in paced_samplers:
        sampler.wait(timeout=args.profile_s + 30)
    summary = latency_summary(paced)
    row = {
        "paced_rate": achieved,
        "paced_target": paced_rate,
        # Producers that fell behind their rate (``paced_processes``): their own
        # lag would count as the workers' latency, so the row reports none.
        "paced_kept_up": achieved >= 0.95 * paced_rate,
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "paced_compute_p99_ms": summary["compute_p99_ms"],  # per batch
        "paced_mean_batch": summary["mean_batch_size"],
        "paced_cores_busy_pct": cores_busy,
        "in_worker_p50_ms": summary["in_worker_p50_ms"],
        "in_worker_p99_ms": summary["in_worker_p99_ms"],
        "acked_p50_ms": sent["acked_p50_ms"],
        "acked_p99_ms": sent["acked_p99_ms"],
        # The goal: p99 within 5 ms + 2 x the p99 batch compute (docs/benchmarks.md).
        "latency_bound_ms": 5.0 + 2 * summary["compute_p99_ms"],
    } | {key: value for key, value in summary.items() if key.startswith(LATENCY_PARTS)}
    print(
        f"[bench] {run} latency parts at {achieved:.0f}/s: {parts_line(row)} (worst producer);"
        f" in the worker {row['in_worker_p50_ms']:.1f}/{row['in_worker_p99_ms']:.1f} ms,"
        f" batches of {row['paced_mean_batch']:.1f}, compute p99"
        f" {row['paced_compute_p99_ms']:.1f} ms; cores busy (%)"
        f" {json.dumps({k: round(v, 1) for k, v in cores_busy.items()})}",
        flush=True,
    )
    return row


def layout_name(per_card: int | None, gpus: int) -> str:
    return f"{'auto' if per_card is None else per_card}x{gpus}"


def _profile(
    args: argparse.Namespace, host: WorkerProcess, per_card: int | None, gpus: int, corpus: Corpus
) -> subprocess.Popen[bytes]:
    """``--profile-s`` seconds of py-spy samples of the host's first worker process (the
    supervisor itself when it runs just one), named by layout, corpus and phase."""
    name = f"pyspy-{layout_name(per_card, gpus)}-{corpus.name}-{args.profile_phase}.txt"
    pid = next(iter(host.children()), host.pid)
    return _sample(pid, args.out / name, args.profile_s)


def _sample(pid: int, path: Path, seconds: float) -> subprocess.Popen[bytes]:
    """py-spy sampling a worker (every thread, 100 Hz) into collapsed stacks at ``path``,
    without pausing it for each sample: a worker paused for each sample had a p99 of
    262 ms under the paced load, against 54 in an unsampled run on another H100."""
    beside = Path(sys.executable).with_name("py-spy")
    command = [
        str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
        "--rate", "100", "--threads", "--idle", "--nonblocking", "--duration", str(int(seconds)),
        "--format", "raw", "--output", str(path),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _records(corpus: Corpus, ids: Sequence[str]) -> list[Any]:
    from schemas import encode_request

    return [
        encode_request(p, request_id=i, content_type=ContentType.JPEG, source="bench.gpu")
        for p, i in zip(corpus.take(len(ids)), ids, strict=True)
    ]


async def _produce_parallel(
    args: argparse.Namespace,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    partitions: int,
    on_visible: Callable[[], None] | None = None,
) -> float:
    """The backlog from ``--producers`` processes at once (one Python producer cannot keep
    a GPU worker fed with 150 KB images); returns the records/s they achieved together.

    Each process builds its records first and says so; all start sending together, so
    the rate counts sending only. Each writes its share in a Kafka transaction and
    commits when told, once every process has written all of its share: the workers
    (which read ``read_committed``) see the whole backlog at once, so what is timed
    is their rate, not the producers'.
    """
    procs = await _producers(
        args, "--produce", model, corpus, prefix, count, partitions, args.producers
    )
    await _all_say(procs, b"ready")  # each once its records are built
    started = time.perf_counter()
    await _tell_all(procs, b"go")
    await _all_say(procs, b"sent")  # each once its share is written, not yet committed
    rate = _rate(count, time.perf_counter() - started)
    if on_visible is not None:  # the workers are about to see the backlog
        on_visible()
    await _tell_all(procs, b"commit")
    codes = [await proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"a producer failed: exit statuses {codes}")
    return rate


# What one Python producer sends open loop with room to spare, in bytes and in records a
# second: on an H100 host one fell behind at 1,000 records of 143 KB and at 3,400 of 25 KB.
_PACED_BYTES_PER_S = 100e6
_PACED_RECORDS_PER_S = 1500.0


async def _paced_parallel(
    args: argparse.Namespace,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    rate: float,
    partitions: int,
    on_go: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """``count`` requests open loop at ``rate`` in all, from as many producer processes as
    the corpus's bytes and records per second need; each stamps a record with the time it
    was due. Returns the rate achieved together (the slowest process's share times their
    number) and the worst process's acknowledgement after due time (``produce_at_rate``),
    p50 and p99. ``on_go`` runs as the producers are told to start."""
    mean_bytes = statistics.fmean(len(image) for image in corpus.images)
    processes = min(count, paced_processes(rate, mean_bytes))
    procs = await _producers(
        args,
        "--produce-paced",
        model,
        corpus,
        prefix,
        count,
        partitions,
        processes,
        f",{rate / processes}",
    )
    await _all_say(procs, b"ready")
    on_go()
    await _tell_all(procs, b"go")
    shares = []
    for proc in procs:
        assert proc.stdout is not None
        shares.append(json.loads(await proc.stdout.readline()))
    codes = [await proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"a paced producer failed: exit statuses {codes}")
    return {
        "rate": min(share["rate"] for share in shares) * processes,
        # The worst process's: percentiles of separate processes do not merge.
        "acked_p50_ms": max(share["acked_p50_ms"] for share in shares),
        "acked_p99_ms": max(share["acked_p99_ms"] for share in shares),
    }


def paced_processes(rate: float, mean_bytes: float) -> int:
    """Producer processes a paced load of ``rate`` records of ``mean_bytes`` a second needs."""
    return max(
        1,
        math.ceil(rate * mean_bytes / _PACED_BYTES_PER_S),
        math.ceil(rate / _PACED_RECORDS_PER_S),
    )


def produce_paced_share(spec: str, args: argparse.Namespace) -> int:
    """``--produce-paced TOPIC,W,H,PREFIX,FIRST,COUNT,RATE``: one process's share of a paced
    load; prints "ready", sends when a line comes in, then prints (JSON) the rate it
    achieved and its records' acknowledgement after their due time (p50, p99)."""
    topic, width, height, prefix, first, count, rate = spec.split(",")
    corpus = make_corpus(int(width), int(height))
    ids = [f"{prefix}-{n}" for n in range(int(first), int(first) + int(count))]
    records = _records(corpus, ids)
    print("ready", flush=True)
    sys.stdin.readline()
    acked: list[float] = []
    achieved = asyncio.run(
        produce_at_rate(args.kafka_bootstrap, topic, records, float(rate), acked)
    )
    print(json.dumps({"rate": achieved} | acked_summary(acked)), flush=True)
    return 0


async def _producers(
    args: argparse.Namespace,
    mode: str,
    model: str,
    corpus: Corpus,
    prefix: str,
    count: int,
    partitions: int,
    processes: int,
    more: str = "",
) -> list[asyncio.subprocess.Process]:
    """``processes`` producer processes (``python -m bench.gpu MODE SPEC``), each with its
    share of requests ``<prefix>-0`` to ``<prefix>-<count - 1>``, pinned with ``--pin``."""
    share = [count // processes + (k < count % processes) for k in range(processes)]
    first, procs = 0, []
    for n in share:
        spec = f"{topics_for(model).requests},{corpus.width},{corpus.height},{prefix},{first},{n}"
        command = [
            sys.executable, "-m", "bench.gpu", mode, spec + more,
            "--kafka-bootstrap", args.kafka_bootstrap, "--partitions", str(partitions),
        ]  # fmt: skip
        first += n
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        procs.append(proc)
        if args.pin:
            _pin_all_threads(proc.pid, _producer_cores(args))
    return procs


async def _all_say(procs: Sequence[asyncio.subprocess.Process], word: bytes) -> None:
    for proc in procs:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if line.strip() != word:
            raise RuntimeError(f"a producer did not say {word!r}: {line!r}")


async def _tell_all(procs: Sequence[asyncio.subprocess.Process], word: bytes) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(word + b"\n")
        await proc.stdin.drain()


def make_corpus(width: int, height: int) -> Corpus:
    """The corpus every producer process rebuilds from the same seeds."""
    return Corpus(
        f"{width}x{height}",
        width,
        height,
        tuple(synthetic_jpeg(width, height, seed) for seed in range(64)),
    )


def produce_share(spec: str, args: argparse.Namespace) -> int:
    """``--produce TOPIC,W,H,PREFIX,FIRST,COUNT``: one producer process's share of a backlog
    (the corpus is rebuilt from the same seeds, so every process sends the same images).
    Prints "ready" once its records are built and sends them in a transaction when a line
    comes in; prints "sent" when all are written, and commits when the next line comes."""
    topic, width, height, prefix, first, count = spec.split(",")
    corpus = make_corpus(int(width), int(height))
    ids = [f"{prefix}-{n}" for n in range(int(first), int(first) + int(count))]
    records = _records(corpus, ids)
    print("ready", flush=True)
    sys.stdin.readline()

    async def sent() -> None:
        print("sent", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

    transaction = f"gpubench-{prefix}-{first}"
    asyncio.run(
        produce(
            args.kafka_bootstrap,
            topic,
            records,
            round_robin=True,
            transactional_id=transaction,
            before_commit=sent,
        )
    )
    return 0


async def _await_results(
    prefix: str, count: int, args: argparse.Namespace, workers: Sequence[WorkerProcess]
) -> list[Result]:
    """Every result of the requests ``<prefix>-0`` to ``<prefix>-<count - 1>``, all ``ok``;
    ``RuntimeError`` otherwise, or as soon as a worker exits."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    watch = ids[-args.producers :]  # each producer's last request
    await unless_one_exits(
        workers, await_results(args.redis_url, ids, args.e2e_timeout, watch=watch)
    )
    results = list((await read_results(args.redis_url, ids)).values())
    bad = [r for r in results if r.status.value != "ok"]
    if len(results) != count or bad:
        raise RuntimeError(f"{len(results)} of {count} results, {len(bad)} not ok: {bad[:1]}")
    return results


def _steady_state(results: Sequence[Any], gpu: UtilizationSampler) -> dict[str, Any]:
    """The rate between the 10th and 90th percentile of the results' durable times: the
    first and last tenth (the backlog arriving, the last batches draining) left out."""
    durable = sorted(durable_ms(r) for r in results)
    low, high = durable[len(durable) // 10], durable[(len(durable) * 9) // 10]
    inside = sum(1 for t in durable if low <= t <= high)
    return {
        "img_s": _rate(inside - 1, (high - low) / 1000.0),
        "first_to_last_img_s": _rate(len(durable) - 1, (durable[-1] - durable[0]) / 1000.0),
        "gpu_util_pct": gpu.mean_between(low / 1000.0, high / 1000.0),
        "mean_batch": _mean_batch(results),
    } | model_stage(results, low, high)


def _mean_batch(results: Sequence[Any]) -> float:
    batches = {(r.worker, r.timings.batch_start_ms) for r in results if r.timings}
    return len(results) / len(batches) if batches else math.nan


def _fleet(cfg: Config, model: str, args: argparse.Namespace) -> Fleet:
    """The one command of a layout (``_start_host`` starts it); its log in ``--out``.

    Only what a user with no weights file must say, and what the bench needs of its
    ports: every tuning is the command's default (``--profile``, ``--worker-decode`` and
    ``--worker-options`` change them)."""
    options = ("--weights", "random", "--metrics-host", "127.0.0.1", "--result-ttl-s", "3600")
    config = WorkerConfig(
        model, args.kafka_bootstrap, args.redis_url, model=cfg.model, options=options
    )
    return Fleet(config, args.out / "workers" / model)


def _start_host(
    fleet: Fleet, cfg: Config, args: argparse.Namespace, per_card: int | None, gpus: int
) -> WorkerProcess:
    """``conveyor worker`` for ``per_card`` processes a card on the first ``gpus`` cards;
    with ``--pin`` it starts on the workers' cores, and its processes inherit them."""
    flags: list[str] = []
    if cfg.device.type == "cuda":
        flags += ["--gpus", ",".join(str(n) for n in range(gpus))]
    if per_card is not None:
        flags += ["--processes", str(per_card * max(gpus, 1))]
    if args.profile != "throughput":
        flags += ["--profile", args.profile]
    if args.worker_decode != "auto":
        flags += ["--decode", args.worker_decode]
    if args.mps != "auto":
        flags += ["--mps", args.mps]
    if args.compile_cache is not None:
        flags += ["--compile-cache", str(args.compile_cache)]
    flags += shlex.split(args.worker_options)
    device = "cuda" if cfg.device.type == "cuda" else "cpu"
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, _worker_cores(args))  # the command inherits it, then its children
    try:
        return fleet.start(*flags, device=device, metrics_port=args.metrics_port)
    finally:
        os.sched_setaffinity(0, mine)


# -- time to ready: cold and warm compile cache -----------------------------------------------


def stage_ready(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """For each count of ``--ready-processes`` on one card: the one command started with an
    empty compile cache (cold: its first process compiles), stopped, started again on
    the same cache (warm); seconds from start to the host's /readyz 200."""
    return asyncio.run(_ready_rows(cfg, args))


async def _ready_rows(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    rows: dict[str, Any] = {}
    for text in args.ready_processes.split(","):
        per_card = None if text.strip() == "auto" else int(text)
        processes = expected_processes(per_card, 1, args)
        model = f"gpuready{processes}r{uuid.uuid4().hex[:8]}"
        await create_model_topics(settings, model, processes)
        cache = Path(tempfile.mkdtemp(prefix="conveyor-compile-"))
        timed = argparse.Namespace(**{**vars(args), "compile_cache": cache})
        try:
            for start in ("cold", "warm"):
                async with _fleet(cfg, model, timed) as fleet:
                    started = time.monotonic()
                    host = _start_host(fleet, cfg, timed, per_card, 1)
                    await until_all_ready([host], args.ready_timeout)
                    seconds = time.monotonic() - started
                rows[f"{text.strip()}x1 {start}"] = {"processes": processes, "ready_s": seconds}
                print(f"  ready {processes} processes, {start} cache: {seconds:.1f} s", flush=True)
        finally:
            await delete_model_topics(settings, model)
            shutil.rmtree(cache, ignore_errors=True)
    return rows


# -- the kill test: a GPU worker SIGKILLed mid-run loses nothing ----------------------------


def stage_kill(cfg: Config, corpora: Sequence[Corpus], args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_kill_one(cfg, corpora[0], args))


async def _kill_one(cfg: Config, corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    """The one command with two processes on a card (under its MPS server), one of them
    SIGKILLed once a third of a backlog is answered: the supervisor starts it again and
    every request is answered once in Redis, the reply topic agreeing with it (lost 0,
    duplicate-visible 0, counted as the fault tests count: ``producers.testing.tally``)."""
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gpukill{run}"
    partitions = 2
    await create_model_topics(settings, model, partitions)
    count = cfg.e2e_count
    prefix = f"{run}-k"
    ids = [f"{prefix}-{n}" for n in range(count)]
    await _produce_parallel(args, model, corpus, prefix, count, partitions)
    try:
        async with _fleet(cfg, model, args) as fleet:
            host = _start_host(fleet, cfg, args, 2, 1)
            await until_all_ready([host], args.ready_timeout)
            # Every 7th of the first third keeps the poll cheap while the GPU works.
            await host.unless_it_dies(
                until_answered(args.redis_url, ids[: count // 3 : 7], count // 21)
            )
            victims = host.children()
            if victims:
                os.kill(victims[0], signal.SIGKILL)
            await _await_results(prefix, count, args, [host])
            await until_all_ready([host], args.ready_timeout)  # the killed one is back
            log = host.log()
        counted = await tally(args.kafka_bootstrap, args.redis_url, topics_for(model).results, ids)
    finally:
        await delete_model_topics(settings, model)
    row = dataclasses.asdict(counted) | {
        "processes": 2,
        "killed": bool(victims),
        "started_again": "starting it again" in log,
    }
    print(f"  kill: {json.dumps(row)}", flush=True)
    return row


# -- report ---------------------------------------------------------------------------------


def _model_ceiling(forward: dict[str, Any], row: dict[str, Any]) -> float:
    """Forward at the largest batch timed, compiled where the layout's workers were."""
    variant = "compiled" if row.get("compiled") and "compiled" in forward else "eager"
    by_size = forward.get(variant, {})
    largest = max(by_size, key=int, default=None)
    return float(by_size[largest]["img_s"]) if largest is not None else math.nan


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per corpus: the worker (one process, one GPU) against its ceilings and the
    naive baseline; then one row per other layout measured (several workers, GPUs)."""
    rows = []
    forward = results.get("forward", {})
    e2e = results.get("e2e", {})
    for name in ("640x480", "224x224"):
        naive = results.get("naive", {}).get(name, {})
        decode = results.get("decode", {}).get(name, {})
        pipeline = results.get("pipeline", {}).get(f"gpu-decode {name}", {})
        for layout, row in sorted((k.split()[0], v) for k, v in e2e.items() if k.endswith(name)):
            ceiling = min(_model_ceiling(forward, row), decode.get("best", math.nan))
            worker = row.get("img_s", math.nan)
            one = e2e.get(f"{layout.partition('x')[0]}x1 {name}", {})  # the same, on one card
            kept_up = row.get("paced_kept_up", True)
            rows.append(
                {
                    "images": name,
                    "layout": layout,
                    "naive_img_s": naive.get("img_s", math.nan),
                    "pipeline_img_s": pipeline.get("img_s", math.nan),
                    "e2e_img_s": worker,
                    "e2e_min": row.get("img_s_min", math.nan),
                    "e2e_max": row.get("img_s_max", math.nan),
                    "p50_ms": row.get("p50_ms", math.nan) if kept_up else math.nan,
                    "p99_ms": row.get("p99_ms", math.nan) if kept_up else math.nan,
                    "bound_ms": row.get("latency_bound_ms", math.nan),
                    "profile": row.get("profile", "-"),
                    "gpu_util_pct": row.get("gpu_util_pct", math.nan),
                    "ceiling_img_s": ceiling * row.get("gpus", 1),
                    "vs_naive": worker / naive.get("img_s", math.nan),
                    "vs_ceiling": worker / (ceiling * row.get("gpus", 1)),
                    "vs_one": worker / one.get("img_s", math.nan),
                }
            )
        ceiling = min(_model_ceiling(forward, {}), decode.get("best", math.nan))  # eager
        measured = (naive.get("img_s", math.nan), pipeline.get("img_s", math.nan), ceiling)
        if not any(r["images"] == name for r in rows) and not all(map(math.isnan, measured)):
            rows.append(
                {
                    "images": name,
                    "layout": "-",
                    "naive_img_s": naive.get("img_s", math.nan),
                    "pipeline_img_s": pipeline.get("img_s", math.nan),
                    "e2e_img_s": math.nan,
                    "e2e_min": math.nan,
                    "e2e_max": math.nan,
                    "p50_ms": math.nan,
                    "p99_ms": math.nan,
                    "bound_ms": math.nan,
                    "profile": "-",
                    "gpu_util_pct": math.nan,
                    "ceiling_img_s": ceiling,
                    "vs_naive": math.nan,
                    "vs_ceiling": math.nan,
                    "vs_one": math.nan,
                }
            )
    return rows


def print_table(rows: Sequence[dict[str, Any]], card: str, model: str) -> None:
    if not rows:  # only stages without a classification row ran (detect, kill)
        return
    print(f"\nConveyor GPU benchmark on {card} ({model}, random weights)")
    header = (
        f"{'images':>8} {'layout':>7} {'profile':>10} {'naive/s':>8} {'worker/s':>9} "
        f"{'(min-max)':>13} {'p50 ms':>7} {'p99 ms':>7} {'bound':>6} {'GPU %':>6} "
        f"{'ceiling/s':>10} {'×naive':>7} {'×ceil':>6} {'×1card':>6}"
    )
    print(header)
    for r in rows:
        spread = f"{r['e2e_min']:,.0f}-{r['e2e_max']:,.0f}"
        print(
            f"{r['images']:>8} {r['layout']:>7} {r['profile']:>10} {r['naive_img_s']:>8,.0f} "
            f"{r['e2e_img_s']:>9,.0f} {spread:>13} "
            f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['bound_ms']:>6.1f} "
            f"{r['gpu_util_pct']:>6.0f} {r['ceiling_img_s']:>10,.0f} {r['vs_naive']:>7.1f} "
            f"{r['vs_ceiling']:>6.2f} {r['vs_one']:>6.2f}"
        )
    print(
        "layout: processes a card x cards of one `conveyor worker`; worker/s: median of the "
        "repeats' steady state; goals: one card ≥ 0.9× ceiling (min of the forward at the "
        "batch size and the best decode+resize) and ≥ 30× naive, 2 cards ≥ 1.9× one, 4 ≥ "
        "3.6×; p99 at half the peak ≤ bound (5 ms + 2 × p99 batch compute), nan where the "
        "paced producers fell behind their rate"
    )


def plot(results: dict[str, Any], rows: Sequence[dict[str, Any]], path: Path, card: str) -> None:
    panels = []
    names = [f"{r['images']} {r['layout']}" for r in rows]
    panels.append(
        Panel(
            title="Throughput by path",
            unit="img/s",
            groups=names,
            series=["naive", "pipeline", "worker e2e", "ceiling"],
            values=[
                _bars([r["naive_img_s"], r["pipeline_img_s"], r["e2e_img_s"], r["ceiling_img_s"]])
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
    parser.add_argument(
        "--corpora", default="640x480,224x224", help="image sizes WxH, comma-separated"
    )
    parser.add_argument("--model", default="torchvision:resnet50")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    parser.add_argument("--quick", action="store_true", help="tiny counts: checks that it runs")
    parser.add_argument("--iterations", type=int, default=30, help="timed forwards per size")
    parser.add_argument(
        "--forward-batches", default="1,32,128,256", help="forward stage: batch sizes timed"
    )
    parser.add_argument(
        "--mps",
        choices=("auto", "on", "off"),
        default="auto",
        help="e2e, kill, ready: the command's --mps (auto: its own MPS server for cards with "
        "several processes)",
    )
    parser.add_argument(
        "--profile",
        choices=("throughput", "latency"),
        default="throughput",
        help="e2e: the command's --profile",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help="e2e, kill: the command's --compile-cache (default: its own default folder)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--e2e-count", type=int, default=24576, help="backlog per repeat")
    parser.add_argument("--kafka-bootstrap", help="broker for e2e; e2e is skipped without it")
    parser.add_argument("--redis-url", help="Redis for e2e; e2e is skipped without it")
    parser.add_argument(
        "--partitions",
        type=int,
        default=0,
        help="e2e: partitions of the request topic (default: one for each process)",
    )
    parser.add_argument(
        "--worker-decode",
        default="auto",
        choices=get_args(DecodeOption),
        help="e2e: the command's --decode (auto: its default, nvJPEG on CUDA)",
    )
    parser.add_argument(
        "--e2e-configs",
        default="autox1",
        help="e2e layouts, comma-separated PROCESSESxCARDS: autox1 (the command's own count "
        "on one card), autox2, 8x1 (eight processes on one card), 1x1",
    )
    parser.add_argument(
        "--ready-processes",
        default="1,auto",
        help="ready: processes on one card to time the start of, cold and warm",
    )
    parser.add_argument("--repeats", type=int, default=3, help="e2e backlogs per layout")
    parser.add_argument("--producers", type=int, default=8, help="e2e producer processes")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin broker and Redis, the producers and the workers to cores of their own",
    )
    parser.add_argument("--metrics-port", type=int, default=19400, help="the host's port")
    parser.add_argument(
        "--worker-options",
        default="",
        help="more flags for every e2e worker, e.g. '--no-cuda-graphs'",
    )
    parser.add_argument(
        "--profile-s",
        type=float,
        default=0.0,
        help="e2e: sample the first worker with py-spy for this long (see --profile-phase)",
    )
    parser.add_argument(
        "--profile-phase",
        default="backlog",
        choices=("backlog", "paced"),
        help="--profile-s samples the second backlog (throughput) or the paced load (latency)",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--produce", help=argparse.SUPPRESS)  # a producer process's share
    parser.add_argument("--produce-paced", help=argparse.SUPPRESS)  # a paced producer's share
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
        default=math.inf,
        help="cap on the paced rate, whatever half the peak is (rows whose producers "
        "fall behind report no latency); none by default",
    )
    parser.add_argument(
        "--service-cores",
        type=int,
        default=0,
        help="with --pin: cores for the broker and Redis (the last ones; default a "
        "quarter of them, at least two)",
    )
    parser.add_argument(
        "--producer-cores",
        type=int,
        default=0,
        help="with --pin: cores for the producers (before the services'; default a "
        "quarter of them, at least two); the workers get the rest",
    )
    parser.add_argument(
        "--latency-from",
        choices=("append", "due"),
        default="append",
        help="paced latency from the broker's append of each request (its request topic "
        "stamps LogAppendTime) or from the time the producer was due to send it (which "
        "counts the producers' own lag too)",
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
        batch_sizes=tuple(int(n) for n in args.forward_batches.split(",")),
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
    for stage in ("e2e", "ready", "kill"):
        if stage in stages and not (args.kafka_bootstrap and args.redis_url):
            print(f"{stage} skipped: it needs --kafka-bootstrap and --redis-url", flush=True)
            stages.remove(stage)
    return stages


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.produce:
        return produce_share(args.produce, args)
    if args.produce_paced:
        return produce_paced_share(args.produce_paced, args)
    results: dict[str, Any] = {}
    for previous in args.previous:
        for key, value in json.loads(previous.read_text()).items():
            if key in ("e2e", "pipeline", "overlap", "stage_s") and key in results:
                results[key].update(value)  # layouts and paths measured in several calls
            else:
                results[key] = value
    if not args.report:
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", str(Path(".cache/torchinductor").resolve())
        )
        cfg = make_config(args)
        stages = selected_stages(args.stages, args)
        corpora = build_corpora(cfg.distinct_images, args.corpora.split(","))
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
            save = partial(_save_partial, results, stage, args.out)
            results[stage] = _run_stage(stage, cfg, corpora, spec, args, save)
            results.setdefault("stage_s", {})[stage] = time.perf_counter() - started
            _save_partial(results, stage, args.out, results[stage])
    card = results.get("meta", {}).get("card", "?")
    model = results.get("meta", {}).get("model", "?")
    rows = summarize(results)
    results["summary"] = rows
    _write_results(results, args.out)
    plot(results, rows, args.out / PLOT_FILE, card)
    print_detect_table(results, card)
    print_table(rows, card, model)
    return 0


def _write_results(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2, default=str))


def _save_partial(results: dict[str, Any], stage: str, out: Path, rows: dict[str, Any]) -> None:
    """The results so far, ``stage`` with ``rows``: a run stopped by a time limit keeps
    every stage and layout it finished (``--previous`` merges them into a later run)."""
    _write_results(results | {stage: rows}, out)


def _run_stage(
    stage: str,
    cfg: Config,
    corpora: Sequence[Corpus],
    spec: ImageSpec,
    args: argparse.Namespace,
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    if stage == "forward":
        return stage_forward(cfg)
    if stage == "decode":
        return stage_decode(cfg, corpora, spec)
    if stage == "naive":
        return stage_naive(cfg, corpora)
    if stage == "checks":
        return stage_checks(cfg, corpora)
    if stage == "pipeline":
        return stage_pipeline(cfg, corpora)
    if stage == "overlap":
        return stage_overlap(cfg, corpora)
    if stage == "kill":
        return stage_kill(cfg, corpora, args)
    if stage == "ready":
        return stage_ready(cfg, args)
    if stage == "detect":
        return stage_detect(
            str(cfg.device),
            [arch.strip() for arch in args.detectors.split(",") if arch.strip()],
            corpora[0].images,  # 640x480
            naive_count=max(cfg.naive_count // 10, 2),
            pipeline_count=max(cfg.runner_count // 10, 4),
            batch=args.detect_batch if not args.quick else 2,
            threads=cfg.threads,
            quick=args.quick,
            run_pipeline=functools.partial(_detect_pipeline, cfg),
        )
    return stage_e2e(cfg, corpora, args, save)


if __name__ == "__main__":
    sys.exit(main())
