"""Model specs to handlers: every spec form, and errors that name the spec and the fix."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from demo.models.digits import DIGITS_VERSION
from schemas import DEFAULT_LIMITS, ContentType, Limits
from workers.handlers.base import Handler, ImageClassifier
from workers.model.loader import ModelLoadError, load_handler
from workers.model.runner import ModelRunner

torchscript_is_deprecated = pytest.mark.filterwarnings(
    "ignore:`torch.jit.*` is deprecated:FutureWarning"
)


def load(spec: str, weights: str | None = None, **options: Any) -> Handler:
    settings: dict[str, Any] = {
        "device": "cpu",
        "weights": weights,
        "dtype": "float32",
        "channels_last": False,
        "limits": DEFAULT_LIMITS,
    }
    return load_handler(spec, **{**settings, **options})


class TinyNet(torch.nn.Module):
    """Any-size NCHW images to 3 class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.conv(x).mean(dim=(2, 3)))
        return out


class OptionsHandler:
    """A user handler that takes some of the loader's options by name."""

    name = "options"
    version = "options-v1"

    def __init__(self, device: torch.device, limits: Limits) -> None:
        self.device = device
        self.limits = limits

    def example_item(self) -> torch.Tensor:
        return torch.zeros(2)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return torch.zeros(2)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.sum(dim=1)

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return outputs.tolist()


class NotAHandler:
    name = "nope"


def test_digits_and_demo_load_the_demo_model() -> None:
    for spec in ("digits", "demo"):
        handler = load(spec)
        assert (handler.name, handler.version) == ("digits", DIGITS_VERSION)


def test_torchvision_random_weights_say_so_in_the_version() -> None:
    handler = load("torchvision:mobilenet_v3_small", weights="random")
    assert handler.version == "mobilenet_v3_small:random-weights"
    assert isinstance(handler, ImageClassifier)
    assert len(handler.labels) == 1000
    assert handler.labels[0] == "tench"  # ImageNet's names ship inside torchvision
    assert (handler.image.height, handler.image.width) == (224, 224)
    ModelRunner(handler, "cpu").warm_up([2])


def test_torchvision_without_cached_weights_explains_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty torchvision cache
    with pytest.raises(ModelLoadError) as caught:
        load("torchvision:resnet18")
    message = str(caught.value)
    assert "torchvision:resnet18" in message
    assert "nothing is downloaded unless asked" in message
    assert "weights='DEFAULT'" in message
    assert "resnet18-f37072fd.pth" in message  # the file to copy there by hand
    assert "weights=PATH" in message
    assert "weights='random'" in message


def test_torchvision_weights_from_a_file_with_its_own_labels(tmp_path: Path) -> None:
    import torchvision

    weights = tmp_path / "finetuned.pt"
    model = torchvision.models.get_model("mobilenet_v3_small", weights=None, num_classes=3)
    torch.save(model.state_dict(), weights)
    weights.with_name("finetuned.pt.labels.json").write_text(json.dumps(["a", "b", "c"]))

    handler = load("torchvision:mobilenet_v3_small", weights=str(weights))

    assert isinstance(handler, ImageClassifier)
    assert handler.labels == ("a", "b", "c")
    assert handler.version.startswith("mobilenet_v3_small:sha256-")
    first = next(handler.module.parameters())
    torch.testing.assert_close(first, next(model.parameters()))


def test_torchvision_weights_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    weights = tmp_path / "other.pt"
    torch.save(TinyNet().state_dict(), weights)
    with pytest.raises(ModelLoadError, match="cannot load weights from"):
        load("torchvision:mobilenet_v3_small", weights=str(weights))


def test_unknown_torchvision_architecture_is_named() -> None:
    with pytest.raises(ModelLoadError, match="no torchvision classification, detection or"):
        load("torchvision:resnet5000", weights="random")


@torchscript_is_deprecated
def test_torchscript_file_with_labels_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "tiny.pt"
    torch.jit.save(torch.jit.script(TinyNet()), str(path))
    path.with_name("tiny.pt.labels.json").write_text(json.dumps(["x", "y", "z"]))

    handler = load(f"torchscript:{path}")

    assert isinstance(handler, ImageClassifier)
    assert handler.labels == ("x", "y", "z")
    [result] = ModelRunner(handler, "cpu").run([handler.example_item()], [{"top_k": 2}])
    assert len(result) == 2


@torchscript_is_deprecated
@pytest.mark.parametrize(
    ("labels", "words"),
    [(["x", "y"], "lists 2 labels, but the model scores 3"), ({"x": 1}, "JSON list")],
)
def test_labels_sidecar_must_fit_the_model(tmp_path: Path, labels: object, words: str) -> None:
    path = tmp_path / "tiny.pt"
    torch.jit.save(torch.jit.script(TinyNet()), str(path))
    path.with_name("tiny.pt.labels.json").write_text(json.dumps(labels))
    with pytest.raises(ModelLoadError, match=words):
        load(f"torchscript:{path}")


def export(path: Path, height: int, *, dynamic_batch: bool = True) -> Path:
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        TinyNet().eval(),
        (torch.zeros(2, 3, height, height),),
        dynamic_shapes=({0: batch},) if dynamic_batch else None,
    )
    torch.export.save(program, path)
    return path


def test_export_archive_with_numeric_labels(tmp_path: Path) -> None:
    path = export(tmp_path / "tiny.pt2", 224)

    handler = load(f"export:{path}", allow_pickle=True)

    assert isinstance(handler, ImageClassifier)
    assert handler.labels == ("0", "1", "2")
    results = ModelRunner(handler, "cpu").run([handler.example_item()] * 3, [{}] * 3)
    assert [len(r) for r in results] == [3, 3, 3]


@pytest.mark.parametrize(("height", "dynamic_batch"), [(16, True), (224, False)])
def test_export_archive_that_cannot_take_the_batches_is_refused_at_load(
    tmp_path: Path, height: int, dynamic_batch: bool
) -> None:
    path = export(tmp_path / "fixed.pt2", height, dynamic_batch=dynamic_batch)
    with pytest.raises(ModelLoadError, match="must take a normalized float NCHW batch of any size"):
        load(f"export:{path}", allow_pickle=True)


def test_export_archive_needs_the_pickle_opt_in(tmp_path: Path) -> None:
    path = export(tmp_path / "tiny.pt2", 224)
    with pytest.raises(ModelLoadError, match="--allow-pickle-models"):
        load(f"export:{path}")


def test_user_class_gets_the_options_it_names() -> None:
    handler = load(f"{__name__}:OptionsHandler")
    assert isinstance(handler, OptionsHandler)
    assert handler.device == torch.device("cpu")
    assert handler.limits is DEFAULT_LIMITS


def test_user_class_that_is_not_a_handler_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="lacks version, example_item, preprocess"):
        load(f"{__name__}:NotAHandler")


@pytest.mark.parametrize(
    ("spec", "weights", "words"),
    [
        ("resnet50", None, "is not one of: digits, torchvision:ARCH, embedding:ARCH"),
        ("torchvision:", None, "is not one of"),
        ("torchscript:/no/such/model.pt", None, "does not exist"),
        ("export:/no/such/model.pt2", None, "--allow-pickle-models"),
        ("torchscript:/no/such/model.pt", "w.pt", "does not apply"),
        ("no_such_module_anywhere:Handler", None, "cannot import module"),
        (f"{__name__}:Missing", None, "has no class 'Missing'"),
        ("torchvision:resnet18", "/no/such/weights.pt", "does not exist"),
        ("digits", "random", "trains its own weights"),
    ],
)
def test_bad_specs_name_the_spec_and_the_fix(spec: str, weights: str | None, words: str) -> None:
    with pytest.raises(ModelLoadError, match=words):
        load(spec, weights=weights)


def test_unknown_dtype_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match="float32, fp32, float16"):
        load("digits", dtype="float64")


def test_half_precision_and_channels_last_reach_the_model() -> None:
    handler = load("digits", dtype="bfloat16", channels_last=True)
    assert isinstance(handler, ImageClassifier)
    assert next(handler.module.parameters()).dtype == torch.bfloat16
    assert len(ModelRunner(handler, "cpu").run([handler.example_item()], [{}])[0]) == 5


# -- detection, segmentation and embedding specs ---------------------------------------------

SMALL_DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"


@pytest.mark.parametrize(
    ("arch", "task", "labels"),
    [
        ("fasterrcnn_mobilenet_v3_large_320_fpn", "detection", 91),
        ("ssdlite320_mobilenet_v3_large", "detection", 91),
        ("maskrcnn_resnet50_fpn", "instance_segmentation", 91),
        ("keypointrcnn_resnet50_fpn", "keypoints", 2),
    ],
)
def test_detection_specs_pick_their_task_and_labels(arch: str, task: str, labels: int) -> None:
    from workers.handlers.tasks.detection import Detector

    handler = load(f"torchvision:{arch}", weights="random")

    assert isinstance(handler, Detector)
    assert (handler.task, len(handler.labels)) == (task, labels)
    assert handler.version == f"{arch}:random-weights"
    assert handler.labels[:2] == (
        ("__background__", "person") if labels == 91 else ("no person", "person")
    )
    assert len(handler.keypoint_names) == (17 if task == "keypoints" else 0)


def test_model_options_reach_the_builder_and_the_handler() -> None:
    from workers.handlers.tasks.detection import Detector

    handler = load(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn",
        weights="random",
        options={"min_size": 128, "box_detections_per_img": 7, "score_threshold": 0.25},
    )

    assert isinstance(handler, Detector)
    transform = handler.module.transform
    assert isinstance(transform, torch.nn.Module)
    assert transform.min_size == (128,)
    assert (handler.max_detections, handler.score_threshold) == (7, 0.25)


@pytest.mark.parametrize(
    ("spec", "options", "words"),
    [
        (f"torchvision:{SMALL_DETECTOR}", {"min_sise": 64}, "no model option min_sise"),
        ("torchvision:deeplabv3_mobilenet_v3_large", {"min_size": 64}, "no model option min_size"),
        ("torchvision:resnet18", {"depth": 3}, "refused the model options"),
        (f"torchvision:{SMALL_DETECTOR}", {"score_threshold": 2}, "from 0 to 1"),
        ("torchvision:lraspp_mobilenet_v3_large", {"resize_size": 0}, "positive integer"),
        ("digits", {"min_size": 64}, "apply to torchvision:, embedding:"),
    ],
)  # fmt: skip
def test_bad_model_options_are_refused_naming_them(
    spec: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ModelLoadError, match=words):
        load(spec, weights="random" if spec != "digits" else None, options=options)


def test_detectors_and_segmenters_refuse_the_fast_preprocessing() -> None:
    with pytest.raises(ModelLoadError, match="resizes images itself"):
        load("torchvision:lraspp_mobilenet_v3_large", weights="random", preprocess="fast")


def test_classifiers_take_the_reference_fit_unless_told_otherwise() -> None:
    auto = load("torchvision:mobilenet_v3_small", weights="random")
    fast = load("torchvision:mobilenet_v3_small", weights="random", preprocess="fast")
    assert isinstance(auto, ImageClassifier)
    assert isinstance(fast, ImageClassifier)
    assert (auto.image.fit, fast.image.fit) == ("reference", "fast")
    assert auto.image.resize_size == 256


def test_segmentation_spec_with_published_style_weights(tmp_path: Path) -> None:
    """Published DeepLabV3 weights carry an auxiliary classifier: it loads, then is dropped."""
    import torchvision

    from workers.handlers.tasks.segmentation import SemanticSegmenter

    weights = tmp_path / "deeplab.pt"
    model = torchvision.models.get_model(
        "deeplabv3_mobilenet_v3_large", weights=None, weights_backbone=None, aux_loss=True
    )
    torch.save(model.state_dict(), weights)

    handler = load("torchvision:deeplabv3_mobilenet_v3_large", weights=str(weights))

    assert isinstance(handler, SemanticSegmenter)
    assert handler.module.aux_classifier is None
    assert (len(handler.labels), handler.labels[15], handler.resize_size) == (21, "person", 520)


def test_embedding_spec_answers_with_the_backbones_features() -> None:
    from workers.handlers.tasks.embedding import ImageEmbedder

    handler = load("embedding:resnet18", weights="random")
    assert isinstance(handler, ImageEmbedder)
    assert handler.version == "resnet18-embedding:random-weights"
    (answer,) = ModelRunner(handler, "cpu").run([handler.example_item()], [{}])
    assert answer["shape"] == [512]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("embedding:squeezenet1_0", "no linear layer with 1000 outputs"),
        ("embedding:fasterrcnn_resnet50_fpn", "come from classification architectures"),
    ],
)
def test_embedding_specs_that_cannot_work_say_why(spec: str, words: str) -> None:
    with pytest.raises(ModelLoadError, match=words):
        load(spec, weights="random")
