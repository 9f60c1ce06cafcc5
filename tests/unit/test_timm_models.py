"""``timm:NAME`` specs: timm's data config as the preprocessing, labels, weights files, and
errors that name the spec and the fix. Served == direct is in test_served_equals_direct.py,
the published weights' downloads in test_published_weights.py."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import timm
import timm.data
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from safetensors.torch import save_file

from schemas import DEFAULT_LIMITS, ContentType
from workers.decode.images import ImageSpec, decode
from workers.handlers.base import Handler, ImageClassifier
from workers.handlers.timm_models import image_spec
from workers.model.loader import ModelLoadError, load_handler
from workers.model.runner import ModelRunner

MAX_PIXELS = 10_000_000
# Data configs of every kind served: bicubic and bilinear, crop_pct 0.875 to 1.0, the
# centre crop and the squash (dm_nfnet_f0, tf_efficientnetv2_b3), 160 to 240 pixels.
CONFIGS = [
    "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "convnext_atto.d2_in1k",
    "resnet18.tv_in1k",
    "test_efficientnet.r160_in1k",
    "dm_nfnet_f0.dm_in1k",
    "tf_efficientnetv2_b3.in21k_ft_in1k",
    "deit_tiny_patch16_224.fb_in1k",
]


def load(spec: str, weights: str | None = "random", **settings: Any) -> Handler:
    torch.manual_seed(0)
    return load_handler(
        spec,
        **{
            "device": "cpu",
            "weights": weights,
            "dtype": "float32",
            "channels_last": None,
            "limits": DEFAULT_LIMITS,
            **settings,
        },
    )


def data_config(name: str) -> dict[str, Any]:
    """timm's resolved data config of a pretrained tag, without building the model."""
    config = timm.models.get_pretrained_cfg(name)
    assert config is not None
    resolved: dict[str, Any] = timm.data.resolve_data_config(pretrained_cfg=config.to_dict())
    return resolved


def photo(width: int, height: int, seed: int) -> bytes:
    """A PNG gradient with a bright block and noise: sharp edges and fine detail to resample."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([40 + 180 * x / width, 220 - 160 * y / height, 60 + 0 * x], axis=-1)
    base[height // 5 : height // 2, width // 4 : width // 2] = rng.uniform(0, 255, 3)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


# -- preprocessing: timm's evaluation transform -----------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    width=st.integers(1, 600),
    height=st.integers(1, 600),
    name=st.sampled_from(CONFIGS),
)
def test_reference_fit_equals_timms_eval_transform(width: int, height: int, name: str) -> None:
    """Within 1 grey level of ``timm.data.create_transform`` (in fact identical)."""
    config = data_config(name)
    spec = image_spec(f"timm:{name}", config, "reference")
    transform = timm.data.create_transform(**config, is_training=False)
    payload = photo(width, height, seed=width * 1000 + height)

    ours = decode(payload, ContentType.PNG, spec, max_pixels=MAX_PIXELS)
    theirs = transform(Image.open(io.BytesIO(payload)).convert("RGB"))
    mean = torch.tensor(config["mean"]).view(3, 1, 1)
    std = torch.tensor(config["std"]).view(3, 1, 1)
    levels = (theirs * std + mean) * 255  # undo the normalization: back to grey levels

    assert ours.shape == theirs.shape
    assert float((ours.float() - levels).abs().max()) <= 1.0


@pytest.mark.parametrize("name", ["dm_nfnet_f0.dm_in1k", "convnext_atto.d2_in1k"])
def test_the_fast_fit_cuts_the_same_region(name: str) -> None:
    """One resampling pass of the region the reference keeps: a few grey levels away on a
    smooth image, for the centre crop and the squash alike."""
    config = data_config(name)
    reference = image_spec(f"timm:{name}", config, "reference")
    fast = image_spec(f"timm:{name}", config, "fast")
    y, x = np.mgrid[0:300, 0:500].astype(np.float32)  # wide: the squash changes the aspect
    smooth = np.stack([x / 2, y / 1.2, (x + y) / 3.2], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(smooth).save(buffer, format="PNG")

    a = decode(buffer.getvalue(), ContentType.PNG, reference, max_pixels=MAX_PIXELS)
    b = decode(buffer.getvalue(), ContentType.PNG, fast, max_pixels=MAX_PIXELS)

    assert a.shape == b.shape
    assert float((a.float() - b.float()).abs().mean()) <= 1.0


def test_the_squash_is_the_one_the_config_names() -> None:
    assert image_spec("timm:x", data_config("dm_nfnet_f0.dm_in1k"), "reference").squash
    assert not image_spec("timm:x", data_config("convnext_atto.d2_in1k"), "reference").squash


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"crop_mode": "border"}, "crop_mode='border'"),
        ({"input_size": (3, 256, 320)}, "320x256 input"),
        ({"interpolation": "box-ish"}, "no Pillow equivalent"),
    ],
)
def test_preprocessing_that_cannot_be_served_is_refused(change: dict[str, Any], words: str) -> None:
    config = {**data_config("convnext_atto.d2_in1k"), **change}
    with pytest.raises(ModelLoadError, match=words):
        image_spec("timm:convnext_atto", config, "reference")


# -- specs, labels, weights ------------------------------------------------------------------


def test_random_weights_say_so_and_take_timms_data_config() -> None:
    handler = load("timm:convnext_atto.d2_in1k")

    assert isinstance(handler, ImageClassifier)
    assert (handler.name, handler.version) == ("convnext_atto", "convnext_atto:random-weights")
    assert handler.labels[281] == "tabby, tabby cat"  # timm's ImageNet descriptions
    assert len(handler.labels) == 1000
    assert handler.image == ImageSpec(
        height=224, width=224, mode="RGB", crop_ratio=224 / 256,
        resample=Image.Resampling.BICUBIC, fit="reference",
    )  # fmt: skip
    ModelRunner(handler, "cpu").warm_up([2])


def test_the_fast_preprocessing_is_chosen_by_the_setting() -> None:
    handler = load("timm:test_vit.r160_in1k", preprocess="fast")
    assert isinstance(handler, ImageClassifier)
    assert handler.image.fit == "fast"
    assert handler.image.crop_ratio == 160 / 168  # floor(160 / 0.95)


def test_classes_of_no_imagenet_set_are_labelled_by_index() -> None:
    handler = load("timm:vit_xsmall_patch16_clip_224.tinyclip_yfcc15m")  # 512 outputs

    assert isinstance(handler, ImageClassifier)
    assert handler.labels == tuple(str(i) for i in range(512))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_from_a_file_with_its_own_labels(tmp_path: Path, suffix: str) -> None:
    module = timm.create_model("test_convnext.r160_in1k", num_classes=3)
    file = tmp_path / f"finetuned{suffix}"
    if suffix == ".pt":
        torch.save(module.state_dict(), file)
    else:
        save_file(module.state_dict(), file)
    file.with_name(f"{file.name}.labels.json").write_text(json.dumps(["a", "b", "c"]))

    handler = load("timm:test_convnext.r160_in1k", str(file))

    assert isinstance(handler, ImageClassifier)
    assert handler.labels == ("a", "b", "c")
    assert handler.version.startswith("test_convnext:sha256-")
    for ours, theirs in zip(
        handler.module.state_dict().values(), module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_model_options_reach_timm() -> None:
    handler = load("timm:test_vit.r160_in1k", options={"img_size": 128})
    assert isinstance(handler, ImageClassifier)
    assert (handler.image.height, handler.image.width) == (128, 128)  # the config follows
    ModelRunner(handler, "cpu").warm_up([1])


@pytest.mark.parametrize(
    ("spec", "weights", "options", "words"),
    [
        ("timm:resnet5000", "random", {}, "timm has no model 'resnet5000'; similar names: "),
        ("timm:resnet18.nope", "random", {}, "no pretrained tag 'nope' for resnet18; its tags: "),
        ("timm:test_vit", "random", {"num_classes": 3}, "num_classes follows the labels"),
        ("timm:test_vit", "random", {"no_such_option": 1}, "timm refused the model options"),
        ("timm:test_vit", "/no/such.pt", {}, "does not exist or is not a file; the published"),
        ("timm:convnextv2_atto.fcmae", "random", {}, "has no classifier"),
        ("timm:deepseek_vit_412m.deepseek_v4_1_flash", "DEFAULT", {}, "crop_mode='border'"),
        ("timm:", None, {}, "is not one of: digits, torchvision:ARCH, embedding:ARCH, timm:NAME"),
    ],
)
def test_bad_timm_specs_name_the_spec_and_the_fix(
    spec: str, weights: str | None, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ModelLoadError, match=words) as caught:
        load(spec, weights, options=options)
    assert spec in str(caught.value)


@pytest.mark.parametrize(
    ("arch", "classes"), [("test_resnet.r160_in1k", 1000), ("test_vit.r160_in1k", 7)]
)
def test_weights_that_do_not_fit_are_refused(tmp_path: Path, arch: str, classes: int) -> None:
    """Another architecture's, or other classes without their labels."""
    file = tmp_path / "other.pt"
    torch.save(timm.create_model(arch, num_classes=classes).state_dict(), file)
    with pytest.raises(ModelLoadError, match=r"(?s)cannot load weights from .* PATH\.labels\.json"):
        load("timm:test_vit.r160_in1k", str(file))
