"""The ceilings and the naive baseline, each measured without Kafka.

``forward`` (the model alone at each batch size), ``overlap`` (decode and forward at
once from two threads, and what the GIL lets through), ``decode`` (Pillow, nvJPEG and
the hardware engine, decode and resize to the model's input), ``naive`` (one request
at a time, synchronous) and ``checks`` (reduced precision, the GPU decode paths and
the CUDA-graph replay against their references).
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.gpu.config import (
    Config,
    _device_batch,
    _fastest,
    _has_nvimgcodec,
    _median_forward_s,
    _rate,
    _timed,
    decode_paths,
    load_model,
)
from bench.gpu.corpus import Corpus
from bench.gpu.report import _rounded
from bench.stats import (
    percentile,
)
from schemas import DEFAULT_LIMITS, ContentType
from workers.decode.gpu import BatchDecoder
from workers.decode.images import ImageSpec, crop_box, decode_image
from workers.decode.jpeg import READ_MODES, decode_jpegs
from workers.handlers.base import ImageClassifier
from workers.model.runner import ModelRunner, compile_forward

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
        payloads = list(corpus.payloads)
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
