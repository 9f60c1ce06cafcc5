"""What ``--dtype auto`` runs a model in: a table of model families, each with its dtype
and the reason (docs/models.md, "Precision", shows the same table).

Half precision doubles what a tensor-core GPU computes a second, and costs accuracy where a
model's numbers do not fit it. The bar a family must meet before ``auto`` runs it in half
precision on CUDA: top-1 agreement with float32 of at least 99% on real photographs
(``bench.precision``; PERF.md's goals). Between float16 and bfloat16, float16 is chosen
where both fit: its 10-bit mantissa keeps more of float32's answer than bfloat16's 7 bits
(EfficientNet-Lite0 on real weights: 99.6% against 94.1%), and bfloat16's wider range is
needed only by models whose activations overflow float16. On the CPU every model runs in
float32: half precision there is emulated or slower, and not what is served on a card.

timm models are told apart by the timm module that registers their architecture
(``vision_transformer`` for every ``vit_*``, ``convnext``, ``efficientnet`` for the
EfficientNets and their Lite and TF ports, ``resnet``), so a new size or tag of a
family follows its family. A family the table does not name runs in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AUTO_FAMILIES", "Family", "auto_family", "ceiling_dtype"]


@dataclass(frozen=True)
class Family:
    """One row of the table: the models it covers, their dtype under ``auto``, and why."""

    label: str  # what docs/models.md's table calls the family
    dtype: torch.dtype  # on CUDA; on the CPU, float32 for every family
    reason: str
    # Half precision was measured below the bar: float32 is the fastest that meets it.
    half_fails: bool = False


_TORCHVISION = Family(
    "torchvision: and embedding: models (classifiers, embedders, detectors, segmenters)",
    torch.float16,
    "float16 since the first GPU runs: ResNet-50's float16 forward 2x float32's on an H200; "
    "detectors and segmenters autocast so that box arithmetic stays in float32",
)
_TIMM_OTHER = Family(
    "other timm families",
    torch.float32,
    "not measured against float32 yet: pass --dtype float16 after checking with bench.precision",
)
_HF = Family(
    "hf: models (text classifiers, token classifiers, sentence embedders, image classifiers, "
    "dual encoders, RT-DETR)",
    torch.float16,
    "a BERT-base-sized classifier trained on lines of Python's docstrings (bench."
    "text_agreement, one H200): float16 100% top-1 agreement with float32 on the held-out "
    "lines, the embedders' cosine >= 0.99999; their work is matrix products, at twice "
    "float32's rate on tensor cores; image classifiers and towers are ViTs as timm's, which "
    "run float16; RT-DETR autocasts, so that box arithmetic stays in float32",
)
_OTHER = Family(
    "TorchScript, torch.export, tabular and your own classes",
    torch.float32,
    "a file's own dtype is the one it was saved in; a tabular model's rows are a few floats; "
    "your class receives the dtype and decides",
)
_CPU = Family(
    "every model on the CPU",
    torch.float32,
    "half precision on a CPU is emulated or slower than float32, and not what a card serves",
)

AUTO_FAMILIES: dict[str, Family] = {
    "vision_transformer": Family(
        "timm ViTs (vit_*)",
        torch.float16,
        "the work is matrix products (2x float32's rate on tensor cores; ViT-B/16 served 979 "
        "img/s in float32 on an H200 against a float16 compiled forward of 10,734); LayerNorm "
        "and softmax accumulate in float32 inside their float16 kernels; bfloat16 keeps fewer "
        "mantissa bits for the same speed",
    ),
    "convnext": Family(
        "timm ConvNeXts (convnext_*)",
        torch.float16,
        "convolutions and MLPs on tensor cores; as torchvision's convnext_tiny, which auto runs "
        "in float16; bfloat16 keeps fewer mantissa bits for the same speed",
    ),
    "efficientnet": Family(
        "timm EfficientNets (efficientnet_*, tf_efficientnet_*, *_lite*)",
        torch.float16,
        "EfficientNet-Lite0's published ImageNet weights on 1,000 crops of real photographs: "
        "float16 99.6% top-1 agreement with float32, bfloat16 94.1% (below the bar), on an H200",
    ),
    "resnet": Family(
        "timm ResNets (resnet*, resnext*, seresnet*)",
        torch.float16,
        "the architecture of torchvision's ResNets, which auto runs in float16",
    ),
}
"""timm families by the timm module that registers their architecture."""


def auto_family(spec: str, device: torch.device) -> Family:
    """The row of the table that ``spec`` (a ``--model`` spec) falls in on ``device``."""
    if device.type != "cuda":
        return _CPU
    kind, _, rest = spec.partition(":")
    if kind in ("torchvision", "embedding") and rest:
        return _TORCHVISION
    if kind == "timm" and rest:
        return _timm_family(rest)
    if kind == "hf" and rest:
        return _HF
    return _OTHER


def ceiling_dtype(family: Family) -> torch.dtype:
    """The fastest precision of ``family`` that meets the bar, as far as measured: its own
    when it runs in half precision or failed the bar in it, else float16 (unmeasured: what
    the card does, so that a float32 default does not meet its own ceiling)."""
    if family.dtype != torch.float32 or family.half_fails:
        return family.dtype
    return torch.float16


def _timm_family(name: str) -> Family:
    try:
        from timm.models import get_arch_name, is_model_in_modules
    except ImportError:  # the loader says how to install timm
        return _TIMM_OTHER
    architecture = get_arch_name(name)
    for module, row in AUTO_FAMILIES.items():
        if is_model_in_modules(architecture, [module]):
            return row
    return _TIMM_OTHER
