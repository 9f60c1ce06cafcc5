"""The detection rows of ``bench.gpu`` (stage ``detect``): detectors, naive vs batched.

For each detector (random weights: the cost is the architecture's, the boxes mean
nothing), on the 640x480 JPEG corpus:

- naive: one request at a time, decoded by Pillow, the model called on it, the
  result document built, synchronously: what a tutorial endpoint does, minus HTTP;
- pipeline: the worker's model stage without Kafka (``workers.model.inference``, as
  ``bench.gpu``'s ``pipeline`` stage drives it): ``preprocess`` in a thread pool (JPEG
  headers only when the model is on CUDA: nvJPEG decodes in ``collate``), then
  prepare, launch and finish overlapped, batches of ``batch`` images, float16
  autocast on CUDA.

Run it with ``python -m bench.gpu --stages detect`` (``--quick --device cpu`` checks
that it runs, on tiny inputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.stats import percentile
from schemas import DEFAULT_LIMITS, ContentType
from workers.handlers.base import Handler
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

DETECTORS = ("fasterrcnn_mobilenet_v3_large_fpn", "ssdlite320_mobilenet_v3_large")
QUICK_OPTIONS: Mapping[str, Mapping[str, Any]] = {
    # R-CNNs resize to min_size inside and score 1000 region proposals whatever the
    # size; SSDlite's 320x320 input is fixed.
    "fasterrcnn_mobilenet_v3_large_fpn": {
        "min_size": 64,
        "max_size": 96,
        "rpn_pre_nms_top_n_test": 100,
        "rpn_post_nms_top_n_test": 20,
    },
}

RunPipeline = Callable[[Handler, ModelRunner, Sequence[bytes], int, int], float]
"""(handler, runner, payloads, batch, threads) -> images per second."""


def stage_detect(
    device: str,
    detectors: Sequence[str],
    payloads: Sequence[bytes],
    *,
    naive_count: int,
    pipeline_count: int,
    batch: int,
    threads: int,
    quick: bool,
    run_pipeline: RunPipeline,
) -> dict[str, Any]:
    """One row per detector (see the module doc); ``run_pipeline`` drives the worker's
    model stage (``bench.gpu``'s), returning images per second."""
    out: dict[str, Any] = {}
    for arch in detectors:
        options = dict(QUICK_OPTIONS.get(arch, {})) if quick else {}
        row: dict[str, Any] = {"batch": batch, "options": options}
        naive = _load(arch, device, "cpu", options)
        row.update(_naive(naive, ModelRunner(naive, device), payloads, naive_count))
        # The worker decodes JPEGs on the GPU where it has one; on the CPU it is the same model.
        served = _load(arch, device, "auto", options) if device != "cpu" else naive
        runner = ModelRunner(served, device)
        runner.warm_up([batch])
        row["pipeline_img_s"] = run_pipeline(
            served,
            runner,
            [payloads[n % len(payloads)] for n in range(pipeline_count)],
            batch,
            threads,
        )
        row["vs_naive"] = row["pipeline_img_s"] / row["naive_img_s"]
        out[arch] = row
        print(
            f"  detect {arch}: naive {row['naive_img_s']:,.1f} img/s, "
            f"pipeline {row['pipeline_img_s']:,.1f} img/s ({row['vs_naive']:.1f}x)",
            flush=True,
        )
    return out


def _load(arch: str, device: str, decode: str, options: Mapping[str, Any]) -> Handler:
    return load_handler(
        f"torchvision:{arch}",
        device=device,
        weights="random",
        dtype="auto",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        decode=decode,  # type: ignore[arg-type]
        options=options,
    )


def _naive(
    handler: Handler, runner: ModelRunner, payloads: Sequence[bytes], count: int
) -> dict[str, float]:
    images = [payloads[n % len(payloads)] for n in range(count)]
    for payload in images[:2]:  # allocator growth and kernel choice, untimed
        runner.run([handler.preprocess(payload, ContentType.JPEG, {})], [{}])
    latencies = []
    start = time.perf_counter()
    for payload in images:
        began = time.perf_counter()
        # The result copies to the host: synchronous, as a request handler would be.
        runner.run([handler.preprocess(payload, ContentType.JPEG, {})], [{}])
        latencies.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - start
    return {
        "naive_img_s": len(images) / elapsed,
        "naive_p50_ms": percentile(latencies, 50),
        "naive_p99_ms": percentile(latencies, 99),
    }


def print_detect_table(results: Mapping[str, Any], card: str) -> None:
    rows = results.get("detect")
    if not rows:
        return
    print(f"\nDetection on {card} (640x480 JPEGs, random weights)")
    print(
        f"{'model':<36} {'naive/s':>9} {'p50 ms':>7} {'pipeline/s':>10} {'batch':>5} {'×naive':>7}"
    )
    for arch, r in rows.items():
        print(
            f"{arch:<36} {r['naive_img_s']:>9,.1f} {r['naive_p50_ms']:>7.1f} "
            f"{r['pipeline_img_s']:>10,.1f} {r['batch']:>5} {r['vs_naive']:>7.1f}"
        )
