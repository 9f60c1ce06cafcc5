"""ImageClassifier: parameters, normalization, top-k results and labels."""

from __future__ import annotations

import copy
import io
import math
from typing import Any

import pytest
import torch
from PIL import Image

from schemas import ContentType, ContractError, ErrorCode, Limits
from workers.decode.images import ImageSpec
from workers.handlers.base import DEFAULT_TOP_K, Handler, ImageClassifier, top_k_param

LABELS = ["cat", "dog", "fish", "bird", "frog", "newt", "crab"]


class FixedLogits(torch.nn.Module):
    """Returns row ``i`` of ``logits`` for an item whose pixels all equal ``i``."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[:, 0, 0, 0].round().long()
        return self.logits[rows]


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def classifier(module: torch.nn.Module, **options: Any) -> ImageClassifier:
    defaults: dict[str, Any] = {
        "name": "test",
        "version": "test-v1",
        "labels": LABELS,
        "image": ImageSpec(4, 4, "RGB"),
        # mean 0, std 1/255: normalized input == the raw pixel value, so FixedLogits
        # can read an item's row number straight from its pixels.
        "mean": (0.0, 0.0, 0.0),
        "std": (1 / 255, 1 / 255, 1 / 255),
    }
    return ImageClassifier(module, **{**defaults, **options})


def png(size: tuple[int, int] = (4, 4)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("params", "expected"), [({}, DEFAULT_TOP_K), ({"top_k": 1}, 1)])
def test_top_k_param_defaults_and_accepts_positive_integers(
    params: dict[str, Any], expected: int
) -> None:
    assert top_k_param(params) == expected


@pytest.mark.parametrize("value", [0, -1, "3", 2.5, True, None, [1]])
def test_top_k_param_rejects_anything_but_a_positive_integer(value: object) -> None:
    with pytest.raises(ContractError) as caught:
        top_k_param({"top_k": value})
    assert caught.value.code == ErrorCode.bad_request
    assert caught.value.field == "ce_params.top_k"


def test_image_classifier_is_a_handler() -> None:
    assert isinstance(classifier(Identity()), Handler)


def test_preprocess_rejects_bad_params_before_the_item_joins_a_batch() -> None:
    handler = classifier(Identity())
    with pytest.raises(ContractError) as caught:
        handler.preprocess(png(), ContentType.PNG, {"top_k": 0})
    assert caught.value.code == ErrorCode.bad_request


def test_preprocess_decodes_to_the_model_input_shape_and_applies_limits() -> None:
    handler = classifier(Identity(), limits=Limits(max_pixels=100))
    assert handler.preprocess(png(), ContentType.PNG, {}).shape == (3, 4, 4)
    assert handler.example_item().shape == (3, 4, 4)
    with pytest.raises(ContractError) as caught:
        handler.preprocess(png((20, 20)), ContentType.PNG, {})
    assert caught.value.code == ErrorCode.image_too_large
    with pytest.raises(ContractError) as caught:
        handler.preprocess(b"hello", ContentType.TEXT, {})
    assert caught.value.code == ErrorCode.unsupported_media_type


def test_forward_normalizes_pixels_with_mean_and_std() -> None:
    handler = classifier(Identity(), labels=["a"], mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    batch = torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 1, 2).expand(1, 3, 1, 2)

    out = handler.forward(batch)

    expected = torch.tensor([[[-1.0, 1.0]], [[-1.0, 3.0]], [[0.0, 1.0]]])
    torch.testing.assert_close(out[0], expected)


def test_forward_leaves_a_float_input_batch_unchanged() -> None:
    handler = classifier(Identity())
    batch = torch.ones((1, 3, 4, 4))
    handler.forward(batch)
    assert bool((batch == 1).all())


def test_postprocess_returns_top_k_labels_best_first_with_softmax_scores() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, -2.0, -3.0]])
    handler = classifier(FixedLogits(logits))

    [result] = handler.postprocess(handler.forward(torch.zeros((1, 3, 4, 4))), [{"top_k": 3}])

    assert [(r["label"], r["index"]) for r in result] == [("dog", 1), ("bird", 3), ("fish", 2)]
    probs = logits.softmax(dim=-1)[0]
    assert [r["score"] for r in result] == pytest.approx([float(probs[i]) for i in (1, 3, 2)])


def test_postprocess_honours_each_items_own_top_k_and_default() -> None:
    logits = torch.randn((3, len(LABELS)), generator=torch.Generator().manual_seed(0))
    handler = classifier(FixedLogits(logits))
    batch = torch.arange(3, dtype=torch.uint8).view(3, 1, 1, 1).expand(3, 3, 4, 4)

    results = handler.postprocess(handler.forward(batch), [{"top_k": 1}, {}, {"top_k": 2}])

    assert [len(r) for r in results] == [1, DEFAULT_TOP_K, 2]
    for row, result in enumerate(results):
        assert result[0]["index"] == int(logits[row].argmax())


def test_top_k_larger_than_the_label_count_returns_every_label() -> None:
    handler = classifier(FixedLogits(torch.zeros((1, len(LABELS)))))
    [result] = handler.postprocess(handler.forward(torch.zeros((1, 3, 4, 4))), [{"top_k": 100}])
    assert sorted(r["label"] for r in result) == sorted(LABELS)
    assert sum(r["score"] for r in result) == pytest.approx(1.0)


def test_outputs_that_do_not_match_the_labels_are_a_model_error() -> None:
    handler = classifier(FixedLogits(torch.zeros((1, 3))))
    with pytest.raises(RuntimeError, match=r"expected \(batch, 7\)"):
        handler.postprocess(handler.forward(torch.zeros((1, 3, 4, 4))), [{}])


def test_results_are_plain_json_types() -> None:
    handler = classifier(FixedLogits(torch.zeros((1, len(LABELS)))))
    [result] = handler.postprocess(handler.forward(torch.zeros((1, 3, 4, 4))), [{}])
    entry = result[0]
    assert (type(entry["label"]), type(entry["index"]), type(entry["score"])) == (str, int, float)
    assert math.isfinite(entry["score"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gives_the_same_ranking(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, len(LABELS)),
    )  # fmt: skip
    batch = torch.randint(0, 256, (4, 3, 4, 4), dtype=torch.uint8)
    full = classifier(conv, mean=(0.5,) * 3, std=(0.25,) * 3)
    reference = full.postprocess(full.forward(batch), [{"top_k": 1}] * 4)
    half = classifier(copy.deepcopy(conv), mean=(0.5,) * 3, std=(0.25,) * 3, dtype=dtype)
    assert next(half.module.parameters()).dtype == dtype
    results = half.postprocess(half.forward(batch), [{"top_k": 1}] * 4)
    assert [r[0]["score"] for r in results] == pytest.approx(
        [r[0]["score"] for r in reference], abs=0.05
    )


def test_channels_last_gives_the_same_outputs() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, len(LABELS)),
    )  # fmt: skip
    batch = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    expected = classifier(conv).forward(batch)
    handler = classifier(copy.deepcopy(conv), channels_last=True)
    weight = next(handler.module.parameters())
    assert weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(handler.forward(batch), expected)


def test_mean_and_std_must_match_the_channels() -> None:
    with pytest.raises(ValueError, match="need 1 values for L input"):
        classifier(Identity(), image=ImageSpec(4, 4, "L"))
