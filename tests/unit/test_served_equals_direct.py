"""Served == direct: every task's answers through the worker's batching path equal the
model run directly on one image at a time.

"Served" is the handler's ``preprocess`` of the encoded image, then ``ModelRunner.run``
on batches of 32 images of mixed sizes (so detectors and segmenters split each batch
into same-shape groups). "Direct" is the torchvision model called the way its
documentation shows, one image at a time, on the image Pillow decodes (through the
weights' reference transform for classifiers and segmenters; for timm classifiers,
timm's own evaluation transform from the model's data config). The tolerances are
the ones docs/models.md states and explains: the same classes and float32 rounding
for classification and embeddings; for detectors the same detections (class, and
score within 1e-3), all but a few in a thousand also with boxes within 0.01 pixel
(the rest: a near-tie between two overlapping region proposals let the other one
through), and for those IoU >= 0.99 for masks and 99% of keypoints within 0.01 pixel;
for segmentation all but a few pixels at near-tied class boundaries.

Models have random weights (nothing can be downloaded), made to behave like trained
ones where it matters here: their batch-norm statistics are measured on the test
images (a random network's activations otherwise fade to constants, and every
detection ties with the others) and their class scores are drawn at a larger scale,
so scores spread out instead of tying at 1/classes. The serving path is the same
whatever the weights. Mask and Keypoint R-CNN are built with torchvision's classes
on its MobileNetV3 FPN backbone with slim heads, for time; ``torchvision:maskrcnn_*``
and ``keypointrcnn_*`` differ only in backbone and head widths.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.models.detection import KeypointRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import mobilenet_backbone
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.transforms.functional import pil_to_tensor, to_tensor

from schemas import DEFAULT_LIMITS, ContentType
from schemas.outputs import Rle, parse_outputs
from tests.served_direct import Agreement, calibrate, calibrate_detector, photo_like, pil, sharpen
from workers.handlers.base import Handler
from workers.handlers.tasks.detection import Detector
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

# One test process runs the module under pytest -n, early (--dist loadgroup hands out the
# largest groups first): its minute and a half of torch work does not come at the run's end.
pytestmark = pytest.mark.xdist_group("served-direct")

IMAGES = 200
BATCH = 32
MASK_MIN_IOU = 0.99
KEYPOINT_TOLERANCE_PX = 0.01
MIN_KEYPOINT_SHARE = 0.99
MIN_PIXEL_AGREEMENT = 0.9999
CLASS_SCORE_TOLERANCE = 1e-5
EMBEDDING_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [photo_like(seed) for seed in range(IMAGES)]


def load(spec: str, **options: Any) -> Handler:
    torch.manual_seed(0)
    return load_handler(
        spec,
        device="cpu",
        weights="random",
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        options=options,
    )


def served(
    handler: Handler, payloads: Sequence[bytes], params: Mapping[str, Any] | None = None
) -> list[Any]:
    """Answers through preprocess and the runner, ``BATCH`` requests at a time."""
    runner = ModelRunner(handler, "cpu")
    items = [handler.preprocess(p, ContentType.PNG, params or {}) for p in payloads]
    answers: list[Any] = []
    for start in range(0, len(items), BATCH):
        chunk = items[start : start + BATCH]
        answers += runner.run(chunk, [params or {}] * len(chunk))
    for answer in answers:
        parse_outputs(answer)  # every answer is a valid document of its task
    return answers


# -- detection, instance segmentation, keypoints ---------------------------------------------


def compare_detections(handler: Detector, payloads: Sequence[bytes], floor: float) -> Agreement:
    answers = served(handler, payloads)
    agreement = Agreement()
    with torch.inference_mode():
        for payload, answer in zip(payloads, answers, strict=True):
            image = pil(payload)
            assert (answer["width"], answer["height"]) == image.size
            agreement.add(answer, handler.module([to_tensor(image)])[0], floor)
    return agreement


def slim_rcnn(kind: type[MaskRCNN] | type[KeypointRCNN], **heads: Any) -> Any:
    """An R-CNN on torchvision's MobileNetV3 FPN backbone (random weights, seeded
    before the caller built ``heads``)."""
    backbone = mobilenet_backbone(
        backbone_name="mobilenet_v3_large", weights=None, fpn=True,
        norm_layer=torch.nn.BatchNorm2d, trainable_layers=6,
    )  # fmt: skip
    return kind(
        backbone,
        min_size=64,
        max_size=96,
        rpn_anchor_generator=AnchorGenerator(((32, 64, 128, 256, 512),) * 3, ((0.5, 1, 2),) * 3),
        rpn_post_nms_top_n_test=30,
        box_score_thresh=0.5,
        box_detections_per_img=1000,  # every candidate: no cut among near-equal scores
        **heads,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_detection_served_equals_direct(images: list[bytes]) -> None:
    handler = load(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn",
        min_size=64,
        max_size=96,
        num_classes=5,
        rpn_post_nms_top_n_test=30,
        box_detections_per_img=1000,  # every candidate: no cut among near-equal scores
        box_score_thresh=0.3,
        score_threshold=0.0,
    )
    assert isinstance(handler, Detector)
    calibrate_detector(handler.module, images[:16])

    compare_detections(handler, images, floor=0.3).check(at_least=2 * IMAGES)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_instance_segmentation_served_equals_direct(images: list[bytes]) -> None:
    torch.manual_seed(0)
    module = slim_rcnn(
        MaskRCNN,
        box_predictor=FastRCNNPredictor(1024, 5),  # the box head's width; 5 classes
        mask_head=MaskRCNNHeads(256, (32, 32), 1),
        mask_predictor=MaskRCNNPredictor(32, 32, 5),
    )
    calibrate_detector(module, images[:16])
    sharpen(module.roi_heads.mask_predictor.mask_fcn_logits, 0.5)
    labels = [f"class-{n}" for n in range(5)]
    handler = Detector(
        module, name="masks", version="v", labels=labels, task="instance_segmentation",
        decode="cpu", score_threshold=0.0,
    )  # fmt: skip

    agreement = compare_detections(handler, images, floor=0.5)

    agreement.check(at_least=2 * IMAGES)
    ious = []
    for detection, j, direct in agreement.strict:
        mask = Rle.model_validate(detection["mask"])
        served_mask = np.frombuffer(mask.to_bytes(), np.uint8).reshape(mask.size).astype(bool)
        direct_mask: npt.NDArray[np.bool_] = (direct["masks"][j, 0] > 0.5).numpy()
        ious.append(mask_iou(served_mask, direct_mask))
    assert min(ious) >= MASK_MIN_IOU, min(ious)


def mask_iou(a: npt.NDArray[np.bool_], b: npt.NDArray[np.bool_]) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_keypoints_served_equal_direct(images: list[bytes]) -> None:
    weights = torchvision.models.get_model_weights("keypointrcnn_resnet50_fpn").DEFAULT
    names = list(weights.meta["keypoint_names"])
    torch.manual_seed(0)
    module = slim_rcnn(
        KeypointRCNN,
        num_classes=2,
        keypoint_head=KeypointRCNNHeads(256, (32, 32)),
        keypoint_predictor=KeypointRCNNPredictor(32, len(names)),
    )
    calibrate_detector(module, images[:16])
    # Keypoint R-CNN turns each detection's heatmaps into points one detection at a
    # time: fewer, surer detections keep the test quick.
    module.roi_heads.score_thresh = 0.7
    handler = Detector(
        module, name="poses", version="v", labels=["no person", "person"], task="keypoints",
        keypoint_names=names, decode="cpu", score_threshold=0.0,
    )  # fmt: skip

    agreement = compare_detections(handler, images, floor=0.7)

    agreement.check(at_least=IMAGES)
    close = total = 0
    for detection, j, direct in agreement.strict:
        points = np.array(detection["keypoints"])
        expected = np.concatenate(
            [direct["keypoints"][j, :, :2].numpy(), direct["keypoints_scores"][j, :, None].numpy()],
            axis=1,
        )
        gaps = np.abs(points - expected)
        close += int((gaps[:, :2].max(axis=1) <= KEYPOINT_TOLERANCE_PX).sum())
        total += len(points)
    assert close / total >= MIN_KEYPOINT_SHARE, (close, total)


# -- semantic segmentation --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_semantic_segmentation_served_equals_direct(images: list[bytes]) -> None:
    handler = load("torchvision:lraspp_mobilenet_v3_large", resize_size=64)
    module = handler.module  # type: ignore[attr-defined]
    weights = torchvision.models.get_model_weights("lraspp_mobilenet_v3_large").DEFAULT
    reference = weights.transforms(resize_size=64)
    # Calibration needs one batch: the first images, prepared and brought to one size.
    prepared = [reference(pil_to_tensor(pil(p)))[None] for p in images[:16]]
    batch = torch.cat([torch.nn.functional.interpolate(x, size=(64, 64)) for x in prepared])
    calibrate(module, lambda: module(batch))

    answers = served(handler, images)

    agree = total = 0
    with torch.inference_mode():
        for payload, answer in zip(images, answers, strict=True):
            image = pil_to_tensor(pil(payload))
            scores = module(reference(image)[None])["out"]
            full = torch.nn.functional.interpolate(
                scores, size=image.shape[-2:], mode="bilinear", align_corners=False
            )
            direct = full[0].argmax(dim=0).numpy()
            label_map = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["map"]["data"]))))
            agree += int((label_map == direct).sum())
            total += direct.size
    assert agree / total >= MIN_PIXEL_AGREEMENT, (agree, total)


# -- classification and embeddings ------------------------------------------------------------


def classifier_inputs(payloads: Sequence[bytes], arch: str) -> torch.Tensor:
    transform = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    return torch.stack([transform(pil(p)) for p in payloads])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_classification_served_equals_direct(images: list[bytes]) -> None:
    handler = load("torchvision:mobilenet_v3_small")
    module = handler.module  # type: ignore[attr-defined]
    calibrate(module, lambda: module(classifier_inputs(images[:32], "mobilenet_v3_small")))
    sharpen(module.classifier[-1], 0.5)

    answers = served(handler, images)

    with torch.inference_mode():
        for payload, answer in zip(images, answers, strict=True):
            logits = module(classifier_inputs([payload], "mobilenet_v3_small"))
            scores, indices = logits.softmax(dim=1).topk(5)
            assert [a["index"] for a in answer] == indices[0].tolist()
            assert np.allclose(
                [a["score"] for a in answer], scores[0].numpy(), atol=CLASS_SCORE_TOLERANCE, rtol=0
            )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embeddings_served_equal_direct(images: list[bytes]) -> None:
    handler = load("embedding:mobilenet_v3_small")
    module = handler.module  # type: ignore[attr-defined]
    calibrate(module, lambda: module(classifier_inputs(images[:32], "mobilenet_v3_small")))

    answers = served(handler, images)

    with torch.inference_mode():
        for payload, answer in zip(images, answers, strict=True):
            vector = module(classifier_inputs([payload], "mobilenet_v3_small"))[0]
            direct = (vector / vector.norm()).numpy()
            values = np.frombuffer(base64.b64decode(answer["data"]), "<f4")
            assert np.abs(values - direct).max() <= EMBEDDING_TOLERANCE


# -- timm classifiers ------------------------------------------------------------------------

# Three families in the tiny variants timm builds for its own tests (the same classes,
# a few hundred thousand weights, 160 pixels, crop 0.95, bicubic): a ViT, a ConvNeXt (layer
# norms) and an EfficientNet (batch norms). test_timm_models.py checks the preprocessing
# of the full-size models' data configs against timm's transform.
TIMM_MODELS = ("test_vit.r160_in1k", "test_convnext.r160_in1k", "test_efficientnet.r160_in1k")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_classification_served_equals_direct(images: list[bytes], name: str) -> None:
    """Direct is timm's own evaluation transform (``resolve_model_data_config``,
    ``create_transform``) on the Pillow image, then the model on one image at a time."""
    import timm.data

    handler = load(f"timm:{name}")
    module = handler.module  # type: ignore[attr-defined]
    config = timm.data.resolve_model_data_config(module)
    transform = timm.data.create_transform(**config, is_training=False)

    def direct(payloads: Sequence[bytes]) -> torch.Tensor:
        return torch.stack([transform(pil(p)) for p in payloads])

    calibrate(module, lambda: module(direct(images[:32])))
    sharpen(module.get_classifier(), 0.5)

    answers = served(handler, images)

    with torch.inference_mode():
        for payload, answer in zip(images, answers, strict=True):
            scores, indices = module(direct([payload])).softmax(dim=1).topk(5)
            assert [a["index"] for a in answer] == indices[0].tolist()
            assert np.allclose(
                [a["score"] for a in answer], scores[0].numpy(), atol=CLASS_SCORE_TOLERANCE, rtol=0
            )


# -- the negative control -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_padding_mixed_sizes_together_would_break_the_tolerance(images: list[bytes]) -> None:
    """What the same-shape groups prevent: torchvision's own batching of mixed sizes
    (one batch padded to the largest image) moves boxes far past the tolerance."""
    handler = load(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", min_size=64, max_size=96,
        num_classes=5, rpn_post_nms_top_n_test=30, box_detections_per_img=1000,
        box_score_thresh=0.3,
    )  # fmt: skip
    assert isinstance(handler, Detector)
    module = handler.module
    calibrate_detector(module, images[:16])
    mixed = images[:BATCH]
    with torch.inference_mode():
        padded = module([to_tensor(pil(p)) for p in mixed])
        alone = [module([to_tensor(pil(p))])[0] for p in mixed]
    moved = 0
    for together, single in zip(padded, alone, strict=True):
        if len(together["boxes"]) != len(single["boxes"]):
            moved += 1
        elif len(single["boxes"]):
            moved += (together["boxes"] - single["boxes"]).abs().max().item() > 1.0
    assert moved >= BATCH // 4, moved
