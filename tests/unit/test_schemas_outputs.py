"""Task output documents (schemas.outputs): shapes, validation and round trips.

Every document a worker writes goes through ``encode_result`` to JSON and back
through ``decode_result`` and ``parse_outputs`` unchanged; malformed ones are
refused with ``decode_failed`` naming the field.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import ContractError, ErrorCode, decode_result, encode_result, ok_result
from schemas.outputs import (
    EMBEDDING_V1,
    ClassScore,
    DetectionOutput,
    EmbeddingOutput,
    InstanceSegmentationOutput,
    KeypointsOutput,
    Rle,
    SemanticSegmentationOutput,
    decode_rle_counts,
    encode_rle_counts,
    parse_outputs,
)

# Real numbers that survive JSON (orjson writes floats with repr's round trip).
coordinates = st.floats(min_value=0, max_value=10_000, allow_nan=False)
scores = st.floats(min_value=0, max_value=1, allow_nan=False)
labels = st.text(min_size=1, max_size=12)
indices = st.integers(min_value=0, max_value=1000)
counts = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@st.composite
def boxes(draw: st.DrawFn) -> list[float]:
    x1, x2 = sorted((draw(coordinates), draw(coordinates)))
    y1, y2 = sorted((draw(coordinates), draw(coordinates)))
    return [x1, y1, x2, y2]


@st.composite
def rles(draw: st.DrawFn, height: int, width: int) -> dict[str, Any]:
    """A valid RLE of a ``height`` x ``width`` mask: runs that add up to its area."""
    area = height * width
    cuts = sorted(draw(st.lists(st.integers(0, area), max_size=12)))
    runs = [b - a for a, b in zip([0, *cuts], [*cuts, area], strict=True)]
    return {"size": [height, width], "counts": encode_rle_counts(runs)}


def detection(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "box": draw(boxes()),
        "score": draw(scores),
        "index": draw(indices),
        "label": draw(labels),
    }


@st.composite
def detection_documents(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "type": "conveyor.detection.v1",
        "width": draw(st.integers(1, 4000)),
        "height": draw(st.integers(1, 4000)),
        "detections": [detection(draw) for _ in range(draw(st.integers(0, 5)))],
    }


@st.composite
def instance_documents(draw: st.DrawFn) -> dict[str, Any]:
    height, width = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    detections = []
    for _ in range(draw(st.integers(0, 4))):
        mask = draw(st.none() | rles(height, width))
        detections.append({**detection(draw), "mask": mask})
    return {
        "type": "conveyor.instance_segmentation.v1",
        "width": width,
        "height": height,
        "detections": detections,
    }


@st.composite
def keypoint_documents(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(labels, min_size=1, max_size=5))
    point = st.tuples(coordinates, coordinates, st.floats(-50, 50, allow_nan=False)).map(list)
    detections = [
        {
            **detection(draw),
            "keypoints": draw(st.lists(point, min_size=len(names), max_size=len(names))),
        }
        for _ in range(draw(st.integers(0, 3)))
    ]
    return {
        "type": "conveyor.keypoints.v1",
        "width": draw(st.integers(1, 4000)),
        "height": draw(st.integers(1, 4000)),
        "keypoint_names": names,
        "detections": detections,
    }


@st.composite
def segmentation_documents(draw: st.DrawFn) -> dict[str, Any]:
    height, width = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    rle = draw(st.booleans())
    classes = [
        {
            "index": draw(indices),
            "label": draw(labels),
            "pixels": draw(st.integers(1, height * width)),
            "mask": draw(rles(height, width)) if rle else None,
        }
        for _ in range(draw(st.integers(0, 4)))
    ]
    png = base64.b64encode(draw(st.binary(min_size=1, max_size=64))).decode()
    return {
        "type": "conveyor.semantic_segmentation.v1",
        "width": width,
        "height": height,
        "map": None if rle else {"encoding": "png", "data": png},
        "classes": classes,
    }


@st.composite
def embedding_documents(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(["float32", "float16"]))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    size = math.prod(shape) * (4 if dtype == "float32" else 2)
    data = draw(st.binary(min_size=size, max_size=size))
    document = {
        "type": EMBEDDING_V1,
        "dtype": dtype,
        "shape": shape,
        "normalized": draw(st.booleans()),
        "data": base64.b64encode(data).decode(),
        "truncated": draw(st.booleans()),  # text embedders say so; images: always false
    }
    modality = draw(st.sampled_from([None, "image", "text"]))  # dual encoders only
    return document if modality is None else {**document, "modality": modality}


documents = (
    detection_documents()
    | instance_documents()
    | keypoint_documents()
    | segmentation_documents()
    | embedding_documents()
)


# Generation speed depends on the machine's load; the property does not.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_every_task_document_round_trips_through_a_result(document: dict[str, Any]) -> None:
    result = ok_result("id-1", document, model="m", model_version="v", worker="w")

    back = decode_result(encode_result(result))

    assert back.outputs == document
    parsed = parse_outputs(back.outputs)
    # Fields a document leaves out (a dual encoder's modality) read as their defaults.
    dumped = parsed.model_dump(mode="json", exclude_unset=True)  # type: ignore[union-attr]
    assert dumped == orjson.loads(orjson.dumps(document))


@given(
    st.lists(
        st.builds(
            lambda name, i, s: {"label": name, "index": i, "score": s}, labels, indices, scores
        )
    )
)
def test_classification_keeps_its_list_shape(answer: list[dict[str, Any]]) -> None:
    parsed = parse_outputs(answer)

    assert parsed == [ClassScore(**entry) for entry in answer]


@given(counts)
def test_rle_counts_round_trip(runs: list[int]) -> None:
    assert decode_rle_counts(encode_rle_counts(runs)) == runs


def test_rle_counts_match_pycocotools_strings() -> None:
    # What pycocotools.mask.encode writes for a 4x4 mask with its middle 2x2 set (runs
    # 5, 2, 2, 2, 5 down the columns) and for a 3x2 mask with every pixel set.
    assert encode_rle_counts([5, 2, 2, 2, 5]) == "52203"
    assert encode_rle_counts([0, 6]) == "06"
    # From the fourth count on, the difference from the count two before is stored: the
    # runs 100, 3, 100, 3 are written as 100, 3, 100, 0.
    assert encode_rle_counts([100, 3, 100, 3]) == "T33T30"


def test_rle_decodes_to_a_row_major_mask() -> None:
    rle = Rle(size=(2, 3), counts=encode_rle_counts([1, 2, 3]))  # columns: [0,1] [1,0] [0,0]

    assert rle.to_bytes() == bytes([0, 1, 0, 1, 0, 0])
    assert rle.area == 2


@pytest.mark.parametrize(
    ("document", "field", "words"),
    [
        ({"type": "conveyor.detection.v1", "width": 4, "height": 4,
          "detections": [{"box": [3, 0, 1, 2], "score": 0.5, "index": 1, "label": "a"}]},
         "outputs.conveyor.detection.v1.detections.0", "x1 <= x2"),
        ({"type": "conveyor.detection.v1", "width": 4, "height": 4,
          "detections": [{"box": [0, 0, 1, 2], "score": 1.5, "index": 1, "label": "a"}]},
         "outputs.conveyor.detection.v1.detections.0.score", "less than or equal to 1"),
        ({"type": "conveyor.instance_segmentation.v1", "width": 2, "height": 2,
          "detections": [{"box": [0, 0, 1, 1], "score": 0.5, "index": 1, "label": "a",
                          "mask": {"size": [2, 2], "counts": "3"}}]},
         "outputs.conveyor.instance_segmentation.v1.detections.0.mask", "cover 3 pixels"),
        ({"type": "conveyor.keypoints.v1", "width": 2, "height": 2, "keypoint_names": ["a", "b"],
          "detections": [{"box": [0, 0, 1, 1], "score": 0.5, "index": 1, "label": "a",
                          "keypoints": [[0, 0, 1]]}]},
         "outputs.conveyor.keypoints.v1", "1 keypoints for 2 keypoint names"),
        ({"type": EMBEDDING_V1, "dtype": "float32", "shape": [3], "normalized": True,
          "data": base64.b64encode(bytes(8)).decode()},
         "outputs.conveyor.embedding.v1", "holds 8 bytes"),
        ({"type": "conveyor.tracking.v9", "width": 2, "height": 2},
         "outputs", "does not match any of the expected tags"),
        ("not a document", "outputs", "valid"),
    ],
)  # fmt: skip
def test_malformed_documents_are_refused_naming_the_field(
    document: Any, field: str, words: str
) -> None:
    with pytest.raises(ContractError) as caught:
        parse_outputs(document)
    assert caught.value.code is ErrorCode.decode_failed
    assert caught.value.field.startswith(field), caught.value.field
    assert words in str(caught.value)


def test_embedding_values_read_back_little_endian() -> None:
    values = [1.0, -2.5, 0.125]
    for dtype, fmt in (("float32", "<3f"), ("float16", "<3e")):
        data = base64.b64encode(struct.pack(fmt, *values)).decode()
        embedding = EmbeddingOutput(dtype=dtype, shape=[3], normalized=False, data=data)
        assert embedding.values() == values


def test_document_models_name_their_type() -> None:
    assert DetectionOutput(width=1, height=1, detections=[]).type == "conveyor.detection.v1"
    assert InstanceSegmentationOutput(width=1, height=1, detections=[]).type.endswith("v1")
    assert KeypointsOutput(width=1, height=1, keypoint_names=[], detections=[]).type.endswith("v1")
    assert SemanticSegmentationOutput(width=1, height=1, map=None, classes=[]).type.endswith("v1")
