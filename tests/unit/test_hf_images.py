"""``hf:PATH`` image classifiers: a ViT served == the image-classification pipeline.

The model (``tests.image_models``: random weights, its image processor config) loads
through the real spec and is served through the real handler path (``preprocess``,
the runner's stacking, ``forward``, ``postprocess``). "Direct" is transformers' own
``image-classification`` pipeline.

Tolerances, measured: the handler fits images with Pillow, transformers' processors
with torchvision on tensors; the two resizes are within one grey level of each other
(``test_the_fitted_pixels_are_within_a_grey_level_of_the_processors``). On these
32x32 inputs, where a grey level of one pixel weighs more than on a 224x224 one, that
moved the classifier's probabilities (its head scaled so that they spread, top-1 0.77
on average) by a median 1.6e-5, a 99th percentile 4.5e-4 and at most 1.4e-3 over 200
images, top-1 equal on all (IMAGE_SCORE_TOLERANCE 2e-3). On the same pixels the
served and direct scores agree to float32 rounding (1e-5).
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from schemas import DEFAULT_LIMITS, ContentType
from schemas.outputs import parse_outputs
from tests.image_models import CLASSES, SIDE, save_vit
from tests.served_direct import photo_like, pil
from workers.handlers.base import ImageClassifier
from workers.handlers.hf_models import TextServing
from workers.handlers.weights import ModelLoadError
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

pytest.importorskip("transformers")

IMAGE_SCORE_TOLERANCE = 2e-3
SAME_PIXELS_TOLERANCE = 1e-5
IMAGES = [photo_like(seed) for seed in range(24)]


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("vit")
    return path, save_vit(path)


def load(folder: Path, **text: Any) -> Any:
    return load_handler(
        f"hf:{folder}",
        device="cpu",
        weights=None,
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        text=TextServing(**text),
    )


def serve(handler: Any, payloads: list[bytes], types: list[ContentType], **params: Any) -> Any:
    items = [handler.preprocess(p, t, params) for p, t in zip(payloads, types, strict=True)]
    results = ModelRunner(handler, "cpu").run(items, [params] * len(items))
    for result in results:
        parse_outputs(result)  # every result fits its documented shape
    return results


def jpeg(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    pil(payload).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


# -- the image classifier -----------------------------------------------------------------


def test_the_spec_reads_task_labels_and_input_from_the_folder(vit: tuple[Path, Any]) -> None:
    handler = load(vit[0])
    assert isinstance(handler, ImageClassifier)
    assert handler.labels == CLASSES
    assert (handler.image.height, handler.image.width, handler.image.squash) == (SIDE, SIDE, True)
    assert handler.image.resample == Image.Resampling.BILINEAR
    assert handler.version.startswith(f"{vit[0].name}:sha256-")


def test_image_classification_equals_the_pipeline(vit: tuple[Path, Any]) -> None:
    import transformers

    folder, _ = vit
    payloads = IMAGES[:12] + [jpeg(p) for p in IMAGES[12:]]
    types = [ContentType.PNG] * 12 + [ContentType.JPEG] * 12
    served = serve(load(folder), payloads, types, top_k=len(CLASSES))
    make: Any = transformers.pipeline  # its overloads want a literal task name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = make("image-classification", model=str(folder), device="cpu", top_k=None)
    worst = 0.0
    for result, payload in zip(served, payloads, strict=True):
        expected = {e["label"]: e["score"] for e in direct(pil(payload))}
        assert result[0]["label"] == max(expected, key=lambda label: expected[label])
        assert [e["label"] for e in result] == sorted(expected, key=lambda k: -expected[k])
        worst = max(worst, *(abs(e["score"] - expected[e["label"]]) for e in result))
    assert worst <= IMAGE_SCORE_TOLERANCE
    assert max(result[0]["score"] for result in served) > 0.6  # the scores are spread


def test_on_the_same_pixels_the_scores_equal_the_models(vit: tuple[Path, Any]) -> None:
    folder, model = vit
    handler = load(folder)
    items = [handler.preprocess(p, ContentType.PNG, {}) for p in IMAGES]
    served = ModelRunner(handler, "cpu").run(items, [{"top_k": 1}] * len(items))
    with torch.inference_mode():
        pixels = (torch.stack(items).float() / 255 - 0.5) / 0.5  # the processor's mean, std
        scores = model(pixel_values=pixels).logits.softmax(dim=-1)
    for result, row in zip(served, scores, strict=True):
        (best,) = result
        assert best["index"] == int(row.argmax())
        assert best["score"] == pytest.approx(float(row.max()), abs=SAME_PIXELS_TOLERANCE)


def test_the_fitted_pixels_are_within_a_grey_level_of_the_processors(
    vit: tuple[Path, Any],
) -> None:
    from transformers import AutoImageProcessor

    folder, _ = vit
    image_model = load(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    for payload in IMAGES:
        ours = image_model.preprocess(payload, ContentType.PNG, {}).float()
        theirs = processor(images=pil(payload), return_tensors="pt")["pixel_values"][0]
        grey = (theirs * std + mean) * 255
        assert float((grey - ours).abs().max()) <= 1.0 + 1e-3


def test_loading_refuses_a_folder_without_a_processor_config(
    vit: tuple[Path, Any], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(vit[0], bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no preprocessor_config\.json.*save_pretrained"):
        load(bare)
    processor = json.loads((vit[0] / "preprocessor_config.json").read_text())
    processor["size"] = {"longest_edge": 64}
    (bare / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelLoadError, match="served are"):
        load(bare)
