"""A tiny RT-DETR for tests: built from a config, random weights, saved as ``save_pretrained``.

Nothing is downloaded. The backbone is a ResNet of one block a stage and 16 to 128
channels, one encoder and one decoder layer of width 32, 20 queries, 5 classes, and
an image processor config of a 128x96 input (so a test proves the processor's size
is read, not assumed). Every layer has torch's default initialization, so that
queries, scores and boxes differ from one another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LABELS = ("person", "bicycle", "car", "dog", "cat")
INPUT = {"height": 96, "width": 128}
QUERIES = 20


def tiny_rtdetr(seed: int = 0) -> Any:
    """The model, in eval mode."""
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"],
    )
    config = RTDetrConfig(
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
        num_queries=QUERIES,
        num_denoising=0,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: n for n, label in enumerate(LABELS)},
    )
    torch.manual_seed(seed)
    model = RTDetrForObjectDetection(config).eval()
    # transformers' initializer zeroes the last box layers and leaves queries alike at
    # random; torch's own initialization of every layer makes them differ.
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear | torch.nn.Conv2d):
                layer.reset_parameters()
    return model


def save_tiny_rtdetr(folder: Path, seed: int = 0) -> Any:
    """Write the model and its image processor config to ``folder``; return the model."""
    from transformers import RTDetrImageProcessor

    model = tiny_rtdetr(seed)
    model.save_pretrained(folder)
    RTDetrImageProcessor(size=dict(INPUT)).save_pretrained(folder)
    return model
