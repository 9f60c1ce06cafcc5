"""The task handlers' own logic: request parameters, result documents, same-shape groups.

The models here are small fakes with torchvision's interfaces (a detector that finds
what it is told to, a segmenter that labels pixels by brightness), so every branch is
checked exactly and fast; tests/unit/test_served_equals_direct.py runs the real
torchvision models.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from schemas import ContentType, ContractError, ErrorCode
from schemas.outputs import (
    DetectionOutput,
    EmbeddingOutput,
    InstanceSegmentationOutput,
    KeypointsOutput,
    Rle,
    SemanticSegmentationOutput,
    parse_outputs,
)
from workers.handlers.base import Handler, SplitPostprocess
from workers.handlers.tasks.detection import Detector
from workers.handlers.tasks.embedding import ImageEmbedder, remove_head
from workers.handlers.tasks.groups import ShapeKey, group_indices
from workers.handlers.tasks.segmentation import SemanticSegmenter
from workers.model.loader import IMAGENET_IMAGE
from workers.model.runner import ModelRunner

LABELS = ["background", "cat", "dog", "bird"]


def png(width: int, height: int, value: int = 128) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, value)).save(buffer, format="PNG")
    return buffer.getvalue()


class Told(torch.nn.Module):
    """A detector that reports, for every image, the detections it was given, with a
    mask filling the left half of each box and keypoints at its corners; it records the
    image sizes of each call (a batch)."""

    def __init__(self, detections: list[tuple[list[float], int, float]]) -> None:
        super().__init__()
        self.detections = detections
        self.calls: list[list[tuple[int, int]]] = []
        self.detections_per_img = 3

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        self.calls.append([tuple(image.shape[-2:]) for image in images])  # type: ignore[misc]
        out = []
        for image in images:
            height, width = image.shape[-2:]
            boxes = torch.tensor([box for box, _, _ in self.detections])
            masks = torch.zeros(len(boxes), 1, height, width)
            for n, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
                masks[n, 0, y1:y2, x1 : (x1 + x2) // 2] = 0.9
            corners = torch.stack([boxes[:, :2], boxes[:, 2:]], dim=1)
            out.append(
                {
                    "boxes": boxes,
                    "labels": torch.tensor([label for _, label, _ in self.detections]),
                    "scores": torch.tensor([score for _, _, score in self.detections]),
                    "masks": masks,
                    "keypoints": torch.cat([corners, torch.ones(len(boxes), 2, 1)], dim=2),
                    "keypoints_scores": torch.full((len(boxes), 2), 3.5),
                }
            )
        return out


DETECTIONS = [
    ([2.0, 2.0, 10.0, 8.0], 1, 0.9),
    ([0.0, 0.0, 4.0, 4.0], 2, 0.6),
    ([5, 5, 6, 6], 3, 0.2),
]


def detector(task: Any = "detection") -> tuple[Detector, Told]:
    module = Told(DETECTIONS)  # type: ignore[arg-type]
    handler = Detector(
        module, name="told", version="told-v1", labels=LABELS, task=task,
        keypoint_names=["top-left", "bottom-right"], decode="cpu",
    )  # fmt: skip
    return handler, module


def serve(handler: Handler, payloads: list[bytes], params: list[dict[str, Any]]) -> list[Any]:
    items = [
        handler.preprocess(p, ContentType.PNG, q) for p, q in zip(payloads, params, strict=True)
    ]
    return ModelRunner(handler, "cpu").run(items, params)


def test_detections_are_filtered_and_ordered_as_the_request_asks() -> None:
    handler, _ = detector()
    params: list[dict[str, Any]] = [
        {},  # default threshold 0.5
        {"score_threshold": 0.1},
        {"score_threshold": 0.1, "max_detections": 1},
        {"score_threshold": 0.1, "classes": ["dog", 3]},
    ]
    answers = serve(handler, [png(12, 10)] * 4, params)

    found = [[d["label"] for d in a["detections"]] for a in answers]
    assert found == [["cat", "dog"], ["cat", "dog", "bird"], ["cat"], ["dog", "bird"]]
    first = DetectionOutput.model_validate(answers[0])
    assert (first.width, first.height) == (12, 10)
    assert first.detections[0].box == (2.0, 2.0, 10.0, 8.0)
    assert first.detections[0].score == pytest.approx(0.9)
    assert first.detections[0].index == 1


def test_an_index_past_the_labels_is_named_by_its_number() -> None:
    module = Told([([0.0, 0.0, 1.0, 1.0], 7, 0.9)])
    handler = Detector(module, name="t", version="v", labels=LABELS, decode="cpu")
    (answer,) = serve(handler, [png(4, 4)], [{}])
    assert answer["detections"][0]["label"] == "7"


def test_instance_masks_are_rle_of_the_thresholded_probabilities() -> None:
    handler, _ = detector("instance_segmentation")
    params: list[dict[str, Any]] = [{}, {"masks": False}, {"mask_threshold": 0.95}]
    answers = serve(handler, [png(12, 10)] * 3, params)

    document = InstanceSegmentationOutput.model_validate(answers[0])
    mask = document.detections[0].mask
    assert mask is not None
    pixels = np.frombuffer(mask.to_bytes(), np.uint8).reshape(10, 12)
    expected = np.zeros((10, 12), np.uint8)
    expected[2:8, 2:6] = 1  # the left half of the box [2, 2, 10, 8]
    assert (pixels == expected).all()
    assert all(d["mask"] is None for d in answers[1]["detections"])
    empty = Rle.model_validate(answers[2]["detections"][0]["mask"])
    assert empty.area == 0


def test_keypoints_come_with_their_names() -> None:
    handler, _ = detector("keypoints")
    (answer,) = serve(handler, [png(12, 10)], [{}])

    document = KeypointsOutput.model_validate(answer)
    assert document.keypoint_names == ["top-left", "bottom-right"]
    assert document.detections[0].keypoints == [(2.0, 2.0, 3.5), (10.0, 8.0, 3.5)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"score_threshold": 1.5}, "ce_params.score_threshold"),
        ({"score_threshold": True}, "ce_params.score_threshold"),
        ({"max_detections": 0}, "ce_params.max_detections"),
        ({"classes": []}, "ce_params.classes"),
        ({"classes": ["unicorn"]}, "ce_params.classes"),
        ({"classes": [4]}, "ce_params.classes"),
        ({"mask_threshold": 0.5}, "ce_params.mask_threshold"),  # not a mask model
        ({"score_treshold": 0.3}, "ce_params.score_treshold"),  # misspelt
    ],
)
def test_bad_detection_params_fail_their_request_in_preprocess(
    params: dict[str, Any], field: str
) -> None:
    handler, _ = detector()
    with pytest.raises(ContractError) as caught:
        handler.preprocess(png(4, 4), ContentType.PNG, params)
    assert (caught.value.code, caught.value.field) == (ErrorCode.bad_request, field)


def test_a_detector_runs_each_group_of_equal_padded_shape_as_one_batch() -> None:
    handler, module = detector()
    sizes = [(40, 30), (30, 40), (40, 30), (41, 30), (80, 60)]  # (width, height)
    serve(handler, [png(w, h) for w, h in sizes], [{}] * len(sizes))
    # Told has no resize transform: only images of exactly the same shape share a batch.
    assert sorted(module.calls) == sorted(
        [[(30, 40), (30, 40)], [(40, 30)], [(30, 41)], [(60, 80)]]
    )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(8, 700), st.integers(8, 700), st.sampled_from([(64, 96), (320, 640), (800, 1333)])
)
def test_shape_key_is_the_padded_shape_the_transform_gives(
    height: int, width: int, sizes: tuple[int, int]
) -> None:
    transform = GeneralizedRCNNTransform(sizes[0], sizes[1], [0.5] * 3, [0.2] * 3).eval()
    holder = torch.nn.Module()
    holder.transform = transform
    image = torch.zeros(3, height, width)

    batch, _ = transform([image])

    assert ShapeKey(holder)(image) == tuple(batch.tensors.shape[1:])


def test_a_fixed_size_transform_puts_every_image_in_one_group() -> None:
    holder = torch.nn.Module()
    holder.transform = GeneralizedRCNNTransform(  # as SSD and SSDlite build theirs
        320, 320, [0.5] * 3, [0.2] * 3, size_divisible=1, fixed_size=(320, 320)
    ).eval()
    key = ShapeKey(holder)
    assert {key(torch.zeros(3, h, w)) for h, w in ((10, 700), (480, 640), (33, 33))} == {
        (3, 320, 320)
    }


def test_group_indices_keeps_item_order() -> None:
    assert group_indices(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert group_indices([]) == []


class Bright(torch.nn.Module):
    """Segments pixels by brightness: class 2 where the first channel is above 0,
    else class 0 (class 1 never wins)."""

    def forward(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        on = (batch[:, :1] > 0).float()
        return {"out": torch.cat([1 - on, torch.zeros_like(on) - 1, on], dim=1)}


def segmenter() -> SemanticSegmenter:
    return SemanticSegmenter(
        Bright(), name="bright", version="v1", labels=["dark", "never", "light"],
        mean=[0.5] * 3, std=[0.25] * 3, resize_size=16, decode="cpu",
    )  # fmt: skip


def half_lit(width: int, height: int) -> bytes:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, width // 2 :] = 255
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_label_maps_come_back_at_the_submitted_size_as_png_or_rle() -> None:
    handler = segmenter()
    params: list[dict[str, Any]] = [{}, {"format": "rle"}, {"classes": ["light"]}]
    answers = serve(handler, [half_lit(40, 20)] * 3, params)

    as_png = SemanticSegmentationOutput.model_validate(answers[0])
    assert as_png.map is not None
    label_map = np.asarray(Image.open(io.BytesIO(base64.b64decode(as_png.map.data))))
    assert label_map.shape == (20, 40)
    assert set(np.unique(label_map[:, :18])) == {0}
    assert set(np.unique(label_map[:, 22:])) == {2}
    assert [(c.label, c.pixels) for c in as_png.classes] == [
        (name, int((label_map == index).sum())) for index, name in ((0, "dark"), (2, "light"))
    ]  # most pixels first, counted at the submitted size

    as_rle = SemanticSegmentationOutput.model_validate(answers[1])
    assert as_rle.map is None
    for segment in as_rle.classes:
        assert segment.mask is not None
        pixels = np.frombuffer(segment.mask.to_bytes(), np.uint8).reshape(20, 40)
        assert (pixels == (label_map == segment.index)).all()
    assert [c.label for c in parse_outputs(answers[2]).classes] == ["light"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "params", [{"format": "svg"}, {"classes": ["sky"]}, {"score_threshold": 0.5}]
)
def test_bad_segmentation_params_fail_their_request(params: dict[str, Any]) -> None:
    with pytest.raises(ContractError) as caught:
        segmenter().preprocess(png(4, 4), ContentType.PNG, params)
    assert caught.value.code is ErrorCode.bad_request


def embedder() -> ImageEmbedder:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, stride=4), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(4, 6), torch.nn.Linear(6, 10),
    )  # fmt: skip
    remove_head(module, 10)
    return ImageEmbedder(
        module, name="e", version="e-v1", image=IMAGENET_IMAGE,
        mean=[0.5] * 3, std=[0.25] * 3, decode="cpu",
    )  # fmt: skip


def test_embeddings_are_normalized_and_cast_as_asked() -> None:
    handler = embedder()
    params: list[dict[str, Any]] = [{}, {"normalize": False}, {"dtype": "float16"}]
    answers = serve(handler, [half_lit(50, 40)] * 3, params)

    unit, raw, half = (EmbeddingOutput.model_validate(a) for a in answers)
    assert unit.shape == [6]
    assert unit.normalized
    assert not raw.normalized
    assert np.linalg.norm(unit.values()) == pytest.approx(1.0, abs=1e-6)
    direct = np.asarray(raw.values()) / np.linalg.norm(raw.values())
    assert np.allclose(unit.values(), direct, atol=1e-6)
    assert half.dtype == "float16"
    assert np.allclose(half.values(), unit.values(), atol=1e-3)


def test_the_embedder_leaves_the_device_half_of_its_postprocess_on_the_device() -> None:
    """Its documents come from a host half that runs once the copy has arrived, so the
    device goes on with the next batch meanwhile (a ``.cpu()`` inside ``postprocess``
    waited for the device in the middle of every batch)."""
    handler = embedder()
    assert isinstance(handler, SplitPostprocess)
    outputs = torch.randn(3, 2, 3)
    params: list[dict[str, Any]] = [{}, {"normalize": False}, {"dtype": "float16"}]
    (device,) = handler.postprocess_device(outputs, params)
    assert device.dtype == torch.float32
    assert device.shape == (3, 2, 3)
    documents = handler.postprocess_host((device.clone(),), params)
    assert documents == handler.postprocess(outputs, params)
    raw = EmbeddingOutput.model_validate(documents[1])
    assert raw.shape == [2, 3]
    assert np.allclose(raw.values(), outputs[1].flatten().numpy())


@pytest.mark.parametrize("params", [{"normalize": 1}, {"dtype": "float64"}, {"top_k": 3}])
def test_bad_embedding_params_fail_their_request(params: Mapping[str, Any]) -> None:
    with pytest.raises(ContractError) as caught:
        embedder().preprocess(png(4, 4), ContentType.PNG, params)
    assert caught.value.code is ErrorCode.bad_request


def test_remove_head_takes_the_last_linear_layer_with_that_many_outputs() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))
    remove_head(module, 10)
    assert isinstance(module[2], torch.nn.Identity)
    assert isinstance(module[0], torch.nn.Linear)
    with pytest.raises(ValueError, match="no linear layer with 5 outputs"):
        remove_head(torch.nn.Sequential(torch.nn.Conv2d(3, 5, 1)), 5)
