"""The ``zoo`` stage: the one command with its defaults on other models than ResNet-50.

For each spec of ``--zoo`` (random weights: throughput only), on one card: the
model's own forward ceiling in this process (compiled with ``torch.compile`` at the
batch size the worker uses, for models that take a fixed-size batch; eager for
detectors and segmenters, whose images keep their sizes), then ``conveyor worker
--model SPEC --weights random`` started with nothing else, its time to ready, and a
backlog's steady-state rate. Fixed-size models get the 224x224 corpus, the others
640x480. A row is written as each model finishes, so a run cut short keeps them.

A spec may end in ``@`` and a dtype and/or a quantization, joined by ``+``:
``timm:vit_base_patch16_224@float16+int8`` is that model with ``--dtype float16
--quantize int8``, in its ceiling (quantized, then compiled) and in its worker alike.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.gpu.config import Config, _median_forward_s
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import UtilizationSampler, _steady_state, sample_first
from bench.gpu.host import _await_results, _fleet, _start_host
from bench.gpu.load import _produce_parallel
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import until_all_ready
from schemas import DEFAULT_LIMITS
from workers.config.worker import WorkerSettings
from workers.handlers.base import ImageModel
from workers.model.loader import DTYPES, auto_dtype, load_handler
from workers.model.precision import auto_family, ceiling_dtype
from workers.model.quantize import QUANTIZE_MODES, quantize_handler

ZOO = (
    "timm:vit_base_patch16_224",
    "torchvision:convnext_tiny",
    "torchvision:efficientnet_b0",
    "embedding:resnet50",
    "torchvision:fasterrcnn_resnet50_fpn",
    "torchvision:deeplabv3_resnet50",
)
# Detectors and segmenters: the eager ceiling's batches of 640x480 images, the best taken:
# 8, and the worker's own largest (DeepLabV3's workers batched 24 on average, and the
# ceiling at 8 alone was 0.81 of what they served).
_VARIABLE_BATCHES = (8, WorkerSettings.model_fields["max_batch_size"].default)
# Each backlog lasts about this long at the model's forward ceiling (ViT-B/16 at 1,282 img/s,
# Faster R-CNN at a few hundred): the e2e count of a classifier took 24 s of a ViT's.
_BACKLOG_S = 8.0
_MIN_BACKLOG = 512


def stage_zoo(
    cfg: Config,
    corpora: Sequence[Corpus],
    args: argparse.Namespace,
    checkpoint: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    _pin_services(args)
    by_name = {corpus.name: corpus for corpus in corpora}
    out: dict[str, Any] = {}
    for spec in [s.strip() for s in args.zoo.split(",") if s.strip()]:
        print(f"  zoo {spec}", flush=True)
        try:
            row = _one(dataclasses.replace(cfg, model=spec), by_name, args)
        except Exception as exc:  # one model's failure is its row; the others still run
            row = {"error": f"{type(exc).__name__}: {exc}"}
        out[spec] = row
        print(f"  zoo {spec}: {json.dumps(row, default=str)}", flush=True)
        checkpoint(out)
    return out


@dataclasses.dataclass(frozen=True)
class Variant:
    """A zoo spec: the model, and the dtype and quantization it runs with."""

    model: str
    dtype: str = "auto"
    quantize: str = "none"

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``MODEL[@TOKEN[+TOKEN]]``, each token a dtype or a quantization (module doc)."""
        model, _, tail = spec.partition("@")
        variant = cls(model)
        for token in filter(None, tail.split("+")):
            if token in QUANTIZE_MODES:
                variant = dataclasses.replace(variant, quantize=token)
            elif token in DTYPES:
                variant = dataclasses.replace(variant, dtype=token)
            else:
                known = ", ".join([*DTYPES, *QUANTIZE_MODES])
                raise ValueError(f"zoo spec {spec!r}: {token!r} is not one of {known}")
        return variant

    def flags(self) -> str:
        """The worker's flags for this variant beyond the model (none: the defaults)."""
        flags = [] if self.dtype == "auto" else ["--dtype", self.dtype]
        return " ".join(flags + ([] if self.quantize == "none" else ["--quantize", self.quantize]))

    def name(self) -> str:
        """The model and its variant, for file names."""
        return f"{self.model}-{self.dtype}-{self.quantize}".replace(":", "-")


def ceiling_variant(variant: Variant, device: torch.device) -> Variant:
    """The variant a row's ceiling runs: its own dtype when it names one, else the
    fastest precision whose agreement with float32 meets the bar for the model's family
    (``workers.model.precision.ceiling_dtype``: its half precision where ``--dtype auto``
    runs one, float16 where the family is unmeasured), whatever the default runs, so that
    a float32 default cannot make its own ceiling look met."""
    if variant.dtype != "auto" or device.type != "cuda":
        return variant
    dtype = ceiling_dtype(auto_family(variant.model, device))
    return dataclasses.replace(variant, dtype=str(dtype).removeprefix("torch."))


def worker_dtype(variant: Variant, device: torch.device) -> str:
    """The dtype the row's worker runs: the variant's, else what ``--dtype auto`` picks."""
    if variant.dtype != "auto":
        return variant.dtype
    return str(auto_dtype(variant.model, device)).removeprefix("torch.")


def variant_args(args: argparse.Namespace, variant: Variant) -> argparse.Namespace:
    """``args`` with ``variant``'s flags after the user's ``--worker-options``: what the
    zoo row's worker is started with."""
    options = f"{args.worker_options} {variant.flags()}".strip()
    return argparse.Namespace(**{**vars(args), "worker_options": options})


def _one(cfg: Config, corpora: dict[str, Corpus], args: argparse.Namespace) -> dict[str, Any]:
    variant = Variant.parse(cfg.model)
    cfg = dataclasses.replace(cfg, model=variant.model)
    row = _ceiling(cfg, ceiling_variant(variant, cfg.device))
    row["worker_dtype"] = worker_dtype(variant, cfg.device)
    corpus = corpora["224x224" if row["fixed_size"] else "640x480"]
    row["corpus"] = corpus.name
    count = max(_MIN_BACKLOG, math.ceil(row["forward_ceiling_img_s"] * _BACKLOG_S))
    row |= asyncio.run(_served(cfg, corpus, args, count, variant))
    row["of_ceiling"] = row["img_s"] / row["forward_ceiling_img_s"]
    return row


def _ceiling(cfg: Config, variant: Variant | None = None) -> dict[str, Any]:
    """The model's forward alone on the card: compiled at the worker's batch size for a
    fixed-size model, eager on 640x480 images for the others (the best of
    ``_VARIABLE_BATCHES``); in ``variant``'s dtype, quantized as it says."""
    variant = variant or Variant(cfg.model)
    torch.manual_seed(0)
    handler = load_handler(
        cfg.model,
        device=str(cfg.device),
        weights="random",
        dtype=variant.dtype,
        channels_last=None,
        limits=DEFAULT_LIMITS,
        decode="cpu",
    )
    quantize_handler(handler, variant.quantize)
    fixed = isinstance(handler, ImageModel)
    started = time.monotonic()
    rates: dict[int, float] = {}
    if fixed:
        assert isinstance(handler, ImageModel)
        image = handler.image
        size = cfg.max_batch  # the worker's own on a GPU (GPU_IMAGE_BATCH): --max-batch-size
        shape = (size, image.channels, image.height, image.width)
        batch: Any = torch.randint(0, 256, shape, dtype=torch.uint8, device=cfg.device)
        forward = torch.compile(handler.forward)
        rates[size] = size / _median_forward_s(forward, batch, cfg.iterations, cfg.device)
    else:
        forward = handler.forward
        for size in _VARIABLE_BATCHES:
            batch = [
                torch.randint(0, 256, (3, 480, 640), dtype=torch.uint8, device=cfg.device)
                for _ in range(size)
            ]
            rates[size] = size / _median_forward_s(forward, batch, cfg.iterations, cfg.device)
    del handler, forward, batch
    torch.cuda.empty_cache()
    best = max(rates, key=rates.__getitem__)
    return {
        "fixed_size": fixed,
        "forward_ceiling_img_s": rates[best],
        "forward_ceiling": "compiled" if fixed else "eager",
        "ceiling_dtype": variant.dtype,
        "ceiling_batch": best,
        "ceiling_img_s_by_batch": rates,
        "ceiling_s": round(time.monotonic() - started, 1),
    }


async def _served(
    cfg: Config, corpus: Corpus, args: argparse.Namespace, count: int, variant: Variant
) -> dict[str, Any]:
    settings = ClientSettings(kafka_bootstrap=args.kafka_bootstrap)
    run = uuid.uuid4().hex[:8]
    model = f"gpuzoo{run}"
    partitions = 8
    await create_model_topics(settings, model, partitions)
    options = variant_args(args, variant)
    fleet = _fleet(cfg, model, options)
    try:
        started = time.monotonic()
        host = _start_host(fleet, cfg, options, None, 1)
        await until_all_ready([host], args.ready_timeout, settle_s=1.0)
        ready_s = time.monotonic() - started
        samplers: list[subprocess.Popen[bytes]] = []

        def sample() -> None:  # --profile-s: py-spy on a process as the backlog comes
            if args.profile_s:
                name = f"pyspy-zoo-{variant.name()}"
                samplers.append(sample_first(args, host, name))

        with UtilizationSampler(1) as gpu:
            await _produce_parallel(
                args, model, corpus, f"{run}-z", count, partitions, on_visible=sample
            )
            results = await _await_results(f"{run}-z", count, args, [host])
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
        steady = _steady_state(results, gpu)
        return {
            "ready_s": round(ready_s, 1),
            "processes": len(host.children()) or 1,
            "img_s": steady["img_s"],
            "gpu_util_pct": steady["gpu_util_pct"],
            "mean_batch": steady["mean_batch"],
            "command": " ".join(host.config.argv()[3:]),
        }
    finally:
        (args.out / f"zoo-{variant.name()}.log").write_text(fleet.logs())
        await fleet.aclose()
        await delete_model_topics(settings, model)
