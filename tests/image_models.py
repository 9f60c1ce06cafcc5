"""A tiny ``hf:`` image model for tests: built from configs, random weights, saved as
``save_pretrained`` writes them, each with its image processor config.

Nothing is downloaded. The classifier is a ViT of 2 layers of width 32 on 32x32
inputs (patches of 8), 4 classes (its head redrawn at a scale that spreads the
scores), its processor resizing to 32x32 bilinear (each side
by its own factor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.served_direct import sharpen

CLASSES = ("cat", "dog", "bird", "fish")
SIDE = 32  # the models' input, square
PATCH = 8


def _tower(**more: Any) -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        **more,
    }


def save_vit(folder: Path, seed: int = 0) -> Any:
    """A ViT image classifier and its ``ViTImageProcessor``, written to ``folder``."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    config = ViTConfig(
        **_tower(image_size=SIDE, patch_size=PATCH),
        num_labels=len(CLASSES),
        id2label=dict(enumerate(CLASSES)),
        label2id={label: n for n, label in enumerate(CLASSES)},
    )
    torch.manual_seed(seed)
    model = ViTForImageClassification(config).eval()
    # transformers' initializer gives near-uniform scores, under which a difference
    # between served and direct would hide: the head at a trained model's scale.
    sharpen(model.classifier, 0.5)
    model.save_pretrained(folder)
    ViTImageProcessor(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    return model
