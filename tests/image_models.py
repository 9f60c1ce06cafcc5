"""Tiny ``hf:`` image models for tests: built from configs, random weights, saved as
``save_pretrained`` writes them, each with its image processor config.

Nothing is downloaded. The classifier is a ViT of 2 layers of width 32 on 32x32
inputs (patches of 8), 4 classes (its head redrawn at a scale that spreads the
scores), its processor resizing to 32x32 bilinear (each side
by its own factor). The dual encoder is a CLIP of the same width with a projection
of 16, its image processor resizing the shortest edge to 40 and cropping 32x32 from
the centre (bicubic), and the WordPiece tokenizer of ``tests.text_models``: CLIP's
text tower pools at the config's ``eos_token_id``, which here is that tokenizer's
``[SEP]``, the token it ends every text with. A SigLIP of the same size takes the same
tokenizer and an image processor of a fixed 32x32 input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.served_direct import sharpen

CLASSES = ("cat", "dog", "bird", "fish")
SIDE = 32  # the models' input, square
PATCH = 8
CLIP_SHORTEST_EDGE = 40
PROJECTION = 16


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


def save_clip(folder: Path, seed: int = 0) -> Any:
    """A CLIP dual encoder, its ``CLIPImageProcessor`` and tokenizer, written to ``folder``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from tests import text_models

    tokenizer = text_models.tokenizer()
    text = _tower(
        vocab_size=text_models.VOCAB_SIZE,
        max_position_embeddings=text_models.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
    )
    config = CLIPConfig(
        text_config=text,
        vision_config=_tower(image_size=SIDE, patch_size=PATCH),
        projection_dim=PROJECTION,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": CLIP_SHORTEST_EDGE}, crop_size={"height": SIDE, "width": SIDE}
    ).save_pretrained(folder)
    return model


def save_siglip(folder: Path, seed: int = 0) -> Any:
    """A SigLIP dual encoder, its ``SiglipImageProcessor`` (32x32, bicubic) and the
    WordPiece tokenizer of ``tests.text_models`` (SigLIP's own is a SentencePiece one
    with no fast version), written to ``folder``."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    from tests import text_models

    tokenizer = text_models.tokenizer()
    text = _tower(
        vocab_size=text_models.VOCAB_SIZE,
        max_position_embeddings=text_models.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = SiglipConfig(text_config=text, vision_config=_tower(image_size=SIDE, patch_size=PATCH))
    torch.manual_seed(seed)
    model = SiglipModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    SiglipImageProcessor(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    return model
