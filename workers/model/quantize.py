"""Quantized layers on request (``--quantize``), through torchao (the ``quant`` extra).

``int8``: every linear layer of an image classifier or embedding model takes int8
weights (a scale per output channel) and its input quantized to int8 as it comes (a
scale per row), so the matrix products run on the card's int8 units; the other layers
(convolutions, norms, attention's softmax) stay in ``--dtype``. torchao's int8
configurations quantize linear layers only: a transformer (ViT) is mostly linear
layers, a convolutional network (ResNet, EfficientNet) mostly not, and gains little.

Accuracy is the user's to check on their own data; ``bench.precision`` measures top-1
agreement with float32 on real photographs (docs/benchmarks.md, "Reduced precision").
The default, ``none``, leaves the model as loaded.
"""

from __future__ import annotations

import logging
from typing import get_args

import torch

from common.install import install_hint
from workers.config.worker import WorkerSettings
from workers.handlers.base import Handler, ImageClassifier
from workers.handlers.tasks.embedding import ImageEmbedder
from workers.handlers.weights import ModelLoadError
from workers.model.packages import is_subclass_tensor

log = logging.getLogger(__name__)

QUANTIZE_MODES: tuple[str, ...] = get_args(WorkerSettings.model_fields["quantize"].annotation)
"""What ``--quantize`` takes, from the setting itself."""


def quantize_handler(handler: Handler, mode: str) -> None:
    """Quantize ``handler``'s model in place as ``mode`` says (``none``: leave it).

    Raises ``ModelLoadError`` for a mode it does not know, a model that is not an image
    classifier or embedding model, one without a linear layer, or torchao missing.
    """
    if mode == "none":
        return
    if mode not in QUANTIZE_MODES:
        raise ModelLoadError(f"quantize {mode!r} is not one of {', '.join(QUANTIZE_MODES)}")
    if not isinstance(handler, ImageClassifier | ImageEmbedder):
        raise ModelLoadError(
            f"{handler.name}: --quantize {mode} applies to image classifiers and embedding "
            "models (torchvision:, embedding:, timm:); leave it unset for this model"
        )
    quantized, linear = quantize_module(handler.module)
    if quantized == 0:
        raise ModelLoadError(
            f"{handler.name}: --quantize {mode} quantizes linear layers and this model has "
            "none; leave it unset"
        )
    log.info(
        "%s: %d of %d linear layers quantized to %s (torchao); %d other layers with "
        "weights stay in %s",
        handler.name,
        quantized,
        linear,
        mode,
        _other_layers(handler.module),
        handler.dtype,
    )


def quantize_module(module: torch.nn.Module) -> tuple[int, int]:
    """Quantize ``module``'s linear layers to int8 in place; returns (quantized, linear
    layers).

    Raises ``ModelLoadError`` when torchao is not installed.
    """
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError as exc:
        raise ModelLoadError(
            f"--quantize int8 needs torchao, which is not installed: {install_hint('quant')}"
        ) from exc
    quantize_(module, Int8DynamicActivationInt8WeightConfig())
    linear = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    return sum(1 for m in linear if is_subclass_tensor(m.weight)), len(linear)


def _other_layers(module: torch.nn.Module) -> int:
    return sum(
        1
        for m in module.modules()
        if not isinstance(m, torch.nn.Linear) and any(True for _ in m.parameters(recurse=False))
    )
