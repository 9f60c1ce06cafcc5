"""The pure parts of pipelines: child headers, the next stage's rule, cutting crops."""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
import pytest
import torch
from PIL import Image
from redis.crc import key_slot

from schemas import result_key
from schemas.chain import (
    COUNT_H,
    INDEX_H,
    PARENT_H,
    Child,
    child_id,
    child_of,
    hash_slot,
    join_key,
)
from schemas.headers import ContentType
from workers.chain.crops import Crop, cut, cut_from, cut_pixels, pixel_box
from workers.config.next_stage import NextStage
from workers.config.worker import WorkerSettings


def _headers(
    parent: bytes | None, index: bytes | None, count: bytes | None
) -> list[tuple[str, bytes | None]]:
    headers: list[tuple[str, bytes | None]] = [("ce_id", b"x"), ("ce_source", b"s")]
    for name, value in ((PARENT_H, parent), (INDEX_H, index), (COUNT_H, count)):
        if value is not None:
            headers.append((name, value))
    return headers


def test_a_child_names_its_parent_place_and_count() -> None:
    assert child_of(_headers(b"frame-7", b"2", b"3")) == Child("frame-7", 2, 3)


@pytest.mark.parametrize(
    ("parent", "index", "count"),
    [
        (None, b"0", b"1"),  # no parent: a plain request
        (b"p", None, b"1"),
        (b"p", b"0", None),
        (b"p", b"1", b"1"),  # index past the count
        (b"p", b"-1", b"2"),
        (b"p", b"0", b"0"),
        (b"p", b"0", b"99999"),  # more children than a parent may have
        (b"p", b"0x1", b"2"),
        (b"bad id!", b"0", b"1"),
        (b"\xff", b"0", b"1"),
    ],
)
def test_headers_that_do_not_name_a_child_make_a_plain_request(
    parent: bytes | None, index: bytes | None, count: bytes | None
) -> None:
    assert child_of(_headers(parent, index, count)) is None


def test_child_ids_stay_valid_request_ids() -> None:
    assert child_id("cam-1:42", 3) == "cam-1:42:3"
    long = "a" * 128
    made = child_id(long, 1000)
    assert len(made) <= 128
    assert made.endswith(":1000")
    assert made != child_id("b" * 128, 1000)
    assert join_key("p-1") == "conveyor:join:p-1"


@pytest.mark.parametrize("parent", ["p-1", "cam-1:42", "a" * 128, "7"])
def test_a_cluster_join_shares_its_result_keys_hash_slot(parent: str) -> None:
    joined = join_key(parent, cluster=True)
    assert joined.startswith("conveyor:join:{")
    assert joined.endswith("}" + parent)
    slot = key_slot(result_key(parent).encode())  # redis-py's own, as the witness
    assert hash_slot(result_key(parent)) == slot
    assert hash_slot(joined) == key_slot(joined.encode()) == slot


def test_a_pipeline_on_a_redis_cluster_is_accepted() -> None:
    settings = WorkerSettings(model="digits", then="reader", redis_cluster=True)
    assert settings.next_stage is not None


def _detections(*scored: tuple[float, str, int]) -> dict[str, object]:
    found = [
        {"box": [0, 0, 4, 4], "score": s, "label": label, "index": i} for s, label, i in scored
    ]
    return {"type": "conveyor.detection.v1", "width": 8, "height": 8, "detections": found}


def test_the_next_stage_takes_boxes_by_score_class_and_count() -> None:
    stage = NextStage.parse("digits", {"min_score": 0.5, "max_children": 2}, "conveyor")
    assert stage.topic == "conveyor.digits.requests"
    output = _detections((0.9, "3", 3), (0.6, "1", 1), (0.55, "7", 7), (0.2, "2", 2))
    assert stage.select(output) == [0, 1]
    by_class = NextStage.parse("d", {"classes": ["7", 1], "min_score": 0}, "conveyor")
    assert by_class.select(output) == [1, 2]
    assert stage.select([{"label": "cat", "score": 1.0}]) == []  # a classifier's answer


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"min_score": 2}, "min_score"),
        ({"margin": -0.1}, "margin"),
        ({"max_children": 0}, "max_children"),
        ({"max_children": True}, "max_children"),
        ({"classes": "cat"}, "classes"),
        ({"params": [1]}, "params"),
        ({"top": 3}, "top"),
    ],
)
def test_a_bad_option_is_named(options: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        NextStage.parse("digits", options, "conveyor")


def test_boxes_grow_by_their_margin_and_stay_in_the_image() -> None:
    assert pixel_box((10.2, 20.5, 19.8, 30.0), 0.0, 100, 100) == (10, 20, 20, 30)
    assert pixel_box((10, 20, 20, 30), 0.1, 100, 100) == (9, 19, 21, 31)
    assert pixel_box((-5, -5, 200, 50), 0.5, 100, 60) == (0, 0, 100, 60)
    assert pixel_box((99.5, 59.9, 99.5, 59.9), 0.0, 100, 60) == (99, 59, 100, 60)


def _pixels(crop: Crop) -> npt.NDArray[np.uint8]:
    if crop.content_type == ContentType.NPY:
        pixels: npt.NDArray[np.uint8] = np.load(io.BytesIO(crop.data), allow_pickle=False)
        return pixels
    assert crop.content_type == ContentType.PNG
    return np.asarray(Image.open(io.BytesIO(crop.data)))


def test_crops_are_the_pixels_of_their_boxes() -> None:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    crops = cut(
        buffer.getvalue(),
        ContentType.PNG,
        [(1, 2, 11, 7), (30.5, 20, 40, 30)],
        0.0,
        max_pixels=10_000,
        limit=10_000,
    )
    assert [c.content_type for c in crops] == [ContentType.NPY, ContentType.NPY]
    first, second = (_pixels(c) for c in crops)
    assert np.array_equal(first, pixels[2:7, 1:11])
    assert np.array_equal(second, pixels[20:30, 30:40])


def test_a_crop_too_large_as_npy_goes_as_png_of_the_same_pixels() -> None:
    pixels = np.zeros((30, 40, 3), dtype=np.uint8)
    pixels[10:20, 5:35] = (200, 30, 90)  # flat areas: PNG is far smaller than the raw array
    raw = 30 * 40 * 3
    (small,) = cut_pixels(pixels, [(0, 0, 40, 30)], 0.0, limit=raw + 128)
    (large,) = cut_pixels(pixels, [(0, 0, 40, 30)], 0.0, limit=raw)
    assert small.content_type == ContentType.NPY
    assert large.content_type == ContentType.PNG
    assert len(large.data) < raw
    assert np.array_equal(_pixels(small), pixels)
    assert np.array_equal(_pixels(large), pixels)


def test_crops_come_from_the_image_the_model_decoded_or_its_bytes() -> None:
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    png = buffer.getvalue()
    boxes = [(3, 4, 20, 25)]
    want = cut(png, ContentType.PNG, boxes, 0.1, max_pixels=10_000, limit=10_000)

    def crops(preprocessed: torch.Tensor, payload: bytes, margin: float) -> list[Crop]:
        shape = (40, 30)  # width, height: as the answer gives them
        return cut_from(
            preprocessed, payload, ContentType.PNG, boxes, margin, max_pixels=10_000,
            limit=10_000, shape=shape,
        )  # fmt: skip

    held = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()  # as decode_full makes it
    assert crops(held, b"", 0.1) == want
    kept = torch.frombuffer(bytearray(png), dtype=torch.uint8)  # kept for the card's decoder
    assert crops(kept, b"", 0.1) == want
    resized = held[:, :20, :20].contiguous()  # a handler's own resize: not the boxes' pixels
    assert crops(resized, png, 0.1) == want
    grey = torch.from_numpy(pixels[:, :, :1]).permute(2, 0, 1).contiguous()
    (crop,) = crops(grey, b"", 0.0)
    assert np.array_equal(_pixels(crop), pixels[4:25, 3:20, 0])


def test_the_whole_image_is_one_child_of_any_answer_that_is_an_object() -> None:
    stage = NextStage.parse("scene", {"crop": "image", "size": 16}, "conveyor")
    assert stage.select({"type": "conveyor.embedding.v1"}) == [-1]
    assert stage.takes({"type": "conveyor.embedding.v1"})
    assert not stage.takes([{"label": "cat", "score": 1.0}])  # nothing to put its answer in
    with pytest.raises(ValueError, match="size"):
        NextStage.parse("scene", {"size": 16}, "conveyor")  # size is for crop image
    with pytest.raises(ValueError, match="crop"):
        NextStage.parse("scene", {"crop": "tiles"}, "conveyor")


def test_a_resized_crop_keeps_its_shape_and_is_never_enlarged() -> None:
    pixels = np.zeros((30, 40, 3), dtype=np.uint8)
    (small,) = cut_pixels(pixels, [(0, 0, 40, 30)], 0.0, limit=10_000, size=20)
    (same,) = cut_pixels(pixels, [(0, 0, 40, 30)], 0.0, limit=10_000, size=100)
    assert _pixels(small).shape == (15, 20, 3)
    assert _pixels(same).shape == (30, 40, 3)
