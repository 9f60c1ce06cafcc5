"""What every stage measures with: the run's ``Config``, its timers, its model and its card.

The ``Config`` the command line asks for (quick-mode sizes applied), the timing
helpers (device work included, CUDA events on a GPU), the benchmark model with random
weights, and what the card is: its name and the decode paths it offers.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from schemas import DEFAULT_LIMITS
from workers.decode.gpu import BatchDecoder
from workers.decode.images import ImageSpec
from workers.handlers.base import ImageClassifier
from workers.model.loader import load_handler
from workers.model.runner import resolve_device


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


def make_config(args: argparse.Namespace) -> Config:
    device = resolve_device(args.device)
    # The ceiling is the forward the command runs: compiled wherever its workers compile
    # (by default on a GPU), else an eager ceiling would flatter the end to end.
    compiled = args.compile or (device.type == "cuda" and "--no-compile" not in args.worker_options)
    if args.quick:
        return Config(device, args.model, (1, 2), 2, compiled, 2, 8, 4, 8, 16, 2, 4)
    return Config(
        device=device,
        model=args.model,
        batch_sizes=tuple(int(n) for n in args.forward_batches.split(",")),
        iterations=args.iterations,
        compile=compiled,
        distinct_images=64,
        decode_count=2048,
        naive_count=500,
        runner_count=8192,
        e2e_count=args.e2e_count,
        threads=args.threads,
        max_batch=args.max_batch_size,
    )


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


# -- the card -----------------------------------------------------------------------------


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


def _card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
