"""The hardware JPEG engine's host side, on one card: how its images reach the resize,
and what batch sizes that change from call to call cost.

Two probes, for the decode path ``gpu-hw`` (``workers.decode.jpeg.HardwareJpeg``), with
nvJPEG's path beside it in the same run:

- ``handover``: decode+resize of backlogs in batches of 256 through the batch buffers
  (``decode_batch``, the worker's path for a batch of one image size) against one
  DLPack tensor an image (``decode``, the path for mixed sizes), and the engine's
  decode alone; img/s, fastest of five passes.
- ``varied``: one ``collate`` at a time with 1-64 images chosen at random (a light
  load's batches), against 32 every time, with the engine's batches padded to a
  power of two (``engine_count``, the worker's behaviour) and not; p50 and worst call.

Usage (a CUDA card with nvImageCodec installed; no broker needed):
``python -m bench.engine_probe --out runs/engine``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.gpu import build_corpora
from schemas import DEFAULT_LIMITS
from workers.decode import jpeg
from workers.decode.gpu import BatchDecoder
from workers.decode.images import ImageSpec
from workers.handlers.base import ImageClassifier
from workers.model.loader import load_handler

BATCH = 256


def _rate(device: torch.device, step: Callable[[], object], images: int) -> float:
    """Images a second of the fastest of five passes of ``step`` (after one untimed)."""
    step()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return images / best


def handover(spec: ImageSpec, device: torch.device, items: list[torch.Tensor]) -> dict[str, float]:
    nvjpeg = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels)
    engine = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels, backend="nvimgcodec")
    hardware = engine._hardware
    assert hardware is not None
    batches = [items[n : n + BATCH] for n in range(0, len(items), BATCH)]
    every = list(range(BATCH))

    def per_image() -> None:
        for batch in batches:
            engine._assemble(batch, every[: len(batch)], hardware.decode(batch, device), device)

    def decode_alone() -> None:
        for batch in batches:
            with hardware.decode_batch(batch, device):
                pass

    steps: dict[str, Callable[[], object]] = {
        "nvjpeg_decode_resize": lambda: [nvjpeg.collate(b, device) for b in batches],
        "engine_batch_buffers_decode_resize": lambda: [engine.collate(b, device) for b in batches],
        "engine_per_image_dlpack_decode_resize": per_image,
        "engine_batch_buffers_decode": decode_alone,
    }
    return {name: _rate(device, step, len(items)) for name, step in steps.items()}


def varied(
    spec: ImageSpec, device: torch.device, items: list[torch.Tensor], calls: int = 40
) -> dict[str, Any]:
    rng = random.Random(0)
    sizes = {"varied": [rng.randint(1, 64) for _ in range(calls)], "constant_32": [32] * calls}
    out: dict[str, Any] = {}
    for backend in ("nvjpeg", "nvimgcodec"):
        for pad in (True, False) if backend == "nvimgcodec" else (True,):
            decoder = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels, backend=backend)
            counts: Callable[[int], int] = jpeg.engine_count if pad else (lambda n: n)
            with mock.patch.object(jpeg, "engine_count", counts):
                for name, sequence in sizes.items():
                    times = _call_ms(decoder, device, items, sequence)[3:]  # start-up calls
                    key = f"{backend}{'' if pad else ' unpadded'} {name}"
                    out[key] = {
                        "p50_ms": statistics.median(times),
                        "max_ms": max(times),
                        "ms_per_image": sum(times) / sum(sequence[3:]),
                    }
                    print(f"  {key}: {json.dumps(out[key])}", flush=True)
    return out


def _call_ms(
    decoder: BatchDecoder, device: torch.device, items: list[torch.Tensor], sizes: Sequence[int]
) -> list[float]:
    times = []
    for size in sizes:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        decoder.collate(items[:size], device)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000.0)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--corpora", default="640x480,224x224")
    parser.add_argument("--images", type=int, default=2048, help="handover: images per pass")
    parser.add_argument("--out", type=Path, default=Path(".run/engine-probe"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        parser.error("the hardware JPEG engine needs a CUDA device")
    # The benchmark model's fit (torchvision's reference resize and crop).
    handler = load_handler(
        "torchvision:resnet50",
        device=args.device,
        weights="random",
        dtype="float16",
        channels_last=True,
        limits=DEFAULT_LIMITS,
    )
    assert isinstance(handler, ImageClassifier)
    spec = handler.image
    encoder = BatchDecoder(spec, max_pixels=DEFAULT_LIMITS.max_pixels)
    results: dict[str, Any] = {"card": torch.cuda.get_device_name(device)}
    for corpus in build_corpora(64, args.corpora.split(",")):
        items = [encoder.encoded(p) for p in corpus.take(args.images)]
        encoded = [item for item in items if item is not None]
        row = handover(spec, device, encoded)
        print(f"{corpus.name} handover: {json.dumps(row)}", flush=True)
        results[corpus.name] = {"handover_img_s": row, "varied": varied(spec, device, encoded[:64])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine-probe.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
