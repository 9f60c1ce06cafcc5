"""``--dtype auto``: the dtype each model family runs in (``workers.model.precision``'s
table), on CUDA and on the CPU. No GPU is needed: the choice reads the spec and the
device's type only."""

from __future__ import annotations

import pytest
import torch

from workers.model.loader import auto_dtype
from workers.model.precision import AUTO_FAMILIES, Family, auto_family, ceiling_dtype

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        # timm, by the module that registers the architecture: sizes and tags follow it.
        ("timm:vit_base_patch16_224", torch.float16),
        ("timm:vit_tiny_patch16_224.augreg_in21k", torch.float16),
        ("timm:convnext_tiny", torch.float16),
        ("timm:convnext_atto.d2_in1k", torch.float16),
        ("timm:efficientnet_b0", torch.float16),
        ("timm:tf_efficientnet_lite0", torch.float16),
        ("timm:resnet50", torch.float16),
        ("timm:swin_tiny_patch4_window7_224", torch.float32),  # not measured: float32
        ("timm:eva02_base_patch14_224.mim_in22k", torch.float32),
        # torchvision: classifiers, embedders, detectors, segmenters
        ("torchvision:resnet50", torch.float16),
        ("torchvision:vit_b_16", torch.float16),
        ("embedding:resnet50", torch.float16),
        ("torchvision:fasterrcnn_resnet50_fpn", torch.float16),  # autocast to it
        ("torchvision:deeplabv3_resnet50", torch.float16),
        # transformers' text models and detectors
        ("hf:./my-classifier", torch.float16),
        ("hf:owner/name@main", torch.float16),
        # files and classes of one's own
        ("torchscript:model.pt", torch.float32),
        ("export:model.pt2", torch.float32),
        ("tabular:fraud.joblib", torch.float32),
        ("digits", torch.float32),
        ("package.module:ClassName", torch.float32),
    ],
)
def test_auto_runs_each_family_in_its_dtype_on_cuda(spec: str, dtype: torch.dtype) -> None:
    assert auto_dtype(spec, CUDA) == dtype
    assert auto_family(spec, CUDA).reason  # every row says why


@pytest.mark.parametrize(
    "spec", ["timm:vit_base_patch16_224", "timm:convnext_tiny", "torchvision:resnet50", "hf:x"]
)
def test_on_the_cpu_every_family_runs_float32(spec: str) -> None:
    assert auto_dtype(spec, CPU) == torch.float32


def test_the_ceiling_is_the_fastest_precision_that_meets_the_bar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert ceiling_dtype(auto_family("timm:vit_base_patch16_224", CUDA)) == torch.float16
    # A family left in float32 for want of a measurement: the card's float16 is its ceiling.
    assert ceiling_dtype(auto_family("timm:swin_tiny_patch4_window7_224", CUDA)) == torch.float16
    assert ceiling_dtype(auto_family("hf:x", CUDA)) == torch.float16
    # One that only bfloat16 fits, and one measured below the bar in half precision.
    monkeypatch.setitem(AUTO_FAMILIES, "swin_transformer", Family("s", torch.bfloat16, "r"))
    assert ceiling_dtype(auto_family("timm:swin_tiny_patch4_window7_224", CUDA)) == torch.bfloat16
    monkeypatch.setitem(AUTO_FAMILIES, "swin_transformer", Family("s", torch.float32, "r", True))
    assert ceiling_dtype(auto_family("timm:swin_tiny_patch4_window7_224", CUDA)) == torch.float32
