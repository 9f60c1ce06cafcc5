"""The ``zoo`` stage: the one command with its defaults on other models than ResNet-50.

For each spec of ``--zoo`` (random weights: throughput only), on one card: the
model's own forward ceiling in this process (compiled with ``torch.compile`` at the
batch size the worker uses, for models that take a fixed-size batch; eager for
detectors and segmenters, whose images keep their sizes), then ``conveyor worker
--model SPEC --weights random`` started with nothing else, its time to ready, and a
backlog's steady-state rate. Fixed-size models get the 224x224 corpus, the others
640x480. A row is written as each model finishes, so a run cut short keeps them.

A real-time detector runs as the others do: ``hf:PATH`` where PATH's last part names a
config of ``BUILT`` (``hf:.run/rtdetr-r50vd``: RT-DETR R50-vd, the transformers
default config with COCO's 80 classes, at 640x640) writes that config folder first
if PATH does not exist (no weights: the row runs ``--weights random``). Its ceiling
is the compiled forward with its batched post-processing at the worker's batch (the
detector's own, 64, unless ``--max-batch-size`` is lower) and its backlog is 640x480
JPEGs.

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
from pathlib import Path
from typing import Any

import torch

from bench.gpu.config import Config, _median_forward_s
from bench.gpu.cores import _pin_services
from bench.gpu.corpus import Corpus
from bench.gpu.e2e import Load, sample_first, timed_backlog
from bench.gpu.host import _fleet, _start_host
from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import until_all_ready
from schemas import DEFAULT_LIMITS
from workers.config.worker import WorkerSettings
from workers.handlers.base import ImageModel
from workers.handlers.tasks.detr import DetrDetector
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
    return with_worker_options(args, variant.flags())


def with_worker_options(args: argparse.Namespace, flags: str) -> argparse.Namespace:
    """``args`` with ``flags`` after the user's ``--worker-options``."""
    options = f"{args.worker_options} {flags}".strip()
    return argparse.Namespace(**{**vars(args), "worker_options": options})


def built_config(spec: str) -> Path | None:
    """The folder of an ``hf:`` spec whose name is one of ``BUILT``, written when missing
    (a config and an image processor config: no weights); ``None`` for other specs."""
    kind, _, rest = spec.partition(":")
    folder = Path(rest)
    if kind != "hf" or folder.name not in BUILT:
        return None
    if not folder.exists():
        BUILT[folder.name](folder)
    return folder


def _rtdetr(folder: Path, **sizes: Any) -> None:
    from transformers import RTDetrConfig, RTDetrImageProcessor

    labels = dict(enumerate(f"class{n}" for n in range(80)))
    config = RTDetrConfig(num_labels=80, id2label=labels, **sizes)
    config.architectures = ["RTDetrForObjectDetection"]
    config.save_pretrained(folder)
    RTDetrImageProcessor().save_pretrained(folder)


def _rtdetr_tiny(folder: Path) -> None:
    """A small RT-DETR of the same shape of input, for --quick runs on the CPU."""
    from transformers import RTDetrResNetConfig

    backbone = RTDetrResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"],
    )
    _rtdetr(
        folder,
        backbone_config=backbone,
        encoder_in_channels=[32, 64, 128],
        encoder_hidden_dim=32,
        encoder_ffn_dim=64,
        encoder_attention_heads=2,
        d_model=32,
        decoder_in_channels=[32, 32, 32],
        decoder_ffn_dim=64,
        decoder_attention_heads=2,
        decoder_layers=1,
        num_queries=20,
    )


BUILT: dict[str, Callable[[Path], None]] = {"rtdetr-r50vd": _rtdetr, "rtdetr-tiny": _rtdetr_tiny}
"""Configs an ``hf:`` zoo spec may name by its folder's last part (module doc)."""


def _one(cfg: Config, corpora: dict[str, Corpus], args: argparse.Namespace) -> dict[str, Any]:
    variant = Variant.parse(cfg.model)
    built_config(variant.model)
    cfg = dataclasses.replace(cfg, model=variant.model)
    row = _ceiling(cfg, ceiling_variant(variant, cfg.device))
    row["worker_dtype"] = worker_dtype(variant, cfg.device)
    corpus = corpora["224x224" if row["fixed_size"] and not row["detector"] else "640x480"]
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
    detector = isinstance(handler, DetrDetector)
    started = time.monotonic()
    rates: dict[int, float] = {}
    batch: Any
    compiled = False
    if isinstance(handler, DetrDetector):
        # The worker's batch (its own unless --max-batch-size is lower), and the batch as
        # its collate builds it: the fitted images with their size rows.
        size = min(cfg.max_batch, handler.gpu_batch)
        batch = handler.collate([handler.example_item()] * size, cfg.device)
        # Compiled on a GPU, as its worker is; eager on the CPU (a --quick smoke run),
        # where Inductor takes minutes for it.
        compiled = cfg.device.type == "cuda"
        forward = torch.compile(handler.forward) if compiled else handler.forward
        rates[size] = size / _median_forward_s(forward, batch, cfg.iterations, cfg.device)
    elif fixed:
        assert isinstance(handler, ImageModel)
        image = handler.image
        size = cfg.max_batch  # the worker's own on a GPU (GPU_IMAGE_BATCH): --max-batch-size
        shape = (size, image.channels, image.height, image.width)
        batch = torch.randint(0, 256, shape, dtype=torch.uint8, device=cfg.device)
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
        "detector": detector,
        "forward_ceiling_img_s": rates[best],
        "forward_ceiling": "compiled" if fixed and (compiled or not detector) else "eager",
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

        load = Load(model, run, partitions, host, None, 1)
        steady = await timed_backlog(args, load, corpus, f"{run}-z", count, sample)
        for sampler in samplers:
            sampler.wait(timeout=args.profile_s + 30)
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
