"""Task outputs: what ``Result.outputs`` holds for each kind of model (docs/models.md).

Classification keeps the shape it always had: a list of ``{label, index, score}``,
best first. Every other task answers with one JSON object whose ``type`` names the
task and the version of its shape (``conveyor.detection.v1``, ...): a later,
incompatible shape gets a new type, so a reader can dispatch on it, and fields may
be added to a shape without a new type (readers ignore fields they do not know).

Geometry is in the pixels of the image as submitted (before any resizing the model
does): x to the right, y down, ``(0, 0)`` the top-left corner of the top-left pixel,
so a box around the whole ``width`` x ``height`` image is ``[0, 0, width, height]``.
EXIF orientation is not applied: the pixel grid is the one stored in the file.

Masks are COCO run-length encoding (``Rle``): the format pycocotools, Detectron2,
MMDetection and the COCO evaluation tools read directly, about 20-100 times smaller
than the bitmap for object-like shapes, and cheap to write on the worker. Label
maps of semantic segmentation are PNG (one byte per pixel compresses to a few KB
and any image library reads it) or, on request, one ``Rle`` per class. Embeddings
are raw little-endian floats in base64, with their dtype and shape.

The models here validate and read documents (``parse_outputs``); workers write the
same shapes as plain dicts, and tests check every one against these models.
"""

from __future__ import annotations

import array
import base64
import binascii
import math
import struct
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, model_validator

from schemas.errors import ContractError, ErrorCode

DETECTION_V1: Final = "conveyor.detection.v1"
INSTANCE_SEGMENTATION_V1: Final = "conveyor.instance_segmentation.v1"
KEYPOINTS_V1: Final = "conveyor.keypoints.v1"
SEMANTIC_SEGMENTATION_V1: Final = "conveyor.semantic_segmentation.v1"
EMBEDDING_V1: Final = "conveyor.embedding.v1"
TEXT_CLASSIFICATION_V1: Final = "conveyor.text_classification.v1"
ENTITIES_V1: Final = "conveyor.entities.v1"

EMBEDDING_DTYPES: dict[str, int] = {"float32": 4, "float16": 2}
"""Embedding element types and their sizes in bytes (always little-endian)."""

_RLE_BASE = 48  # COCO's compressed counts: 6-bit groups written as characters from "0"
_COUNT_MAX = 2**32 - 1  # COCO stores counts as uint32

NonNegative = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Score = Annotated[float, Field(ge=0.0, le=1.0)]


# -- run-length encoding ------------------------------------------------------------------


def encode_rle_counts(counts: Sequence[int]) -> str:
    """COCO's compressed string for run lengths (pycocotools ``rleToString``).

    Each count from the fourth on is stored as its difference from the count two
    before it, then written 5 bits at a time, low bits first, one character
    (48 + 6 bits) per group with bit 5 meaning "more groups follow".
    """
    out = bytearray()
    for i, count in enumerate(counts):
        if not 0 <= count <= _COUNT_MAX:
            raise ValueError(f"run lengths are 0 to 2**32 - 1, got {count}")
        x = count - counts[i - 2] if i > 2 else count
        more = True
        while more:
            c = x & 0x1F
            x >>= 5  # arithmetic shift: a negative difference ends in -1
            more = x != -1 if c & 0x10 else x != 0
            out.append((c | 0x20 if more else c) + _RLE_BASE)
    return out.decode("ascii")


def decode_rle_counts(text: str) -> list[int]:
    """Run lengths from COCO's compressed string (pycocotools ``rleFrString``).

    Raises ``ValueError`` for characters outside the alphabet, a string that ends
    inside a number, or a count outside 0 to 2**32 - 1.
    """
    counts: list[int] = []
    x = shift = 0
    for char in text:
        c = ord(char) - _RLE_BASE
        if not 0 <= c < 64:
            raise ValueError(f"{char!r} is not a character of COCO's compressed counts")
        x |= (c & 0x1F) << shift
        shift += 5
        if c & 0x20:
            continue
        if c & 0x10:
            x -= 1 << shift  # sign-extend the last group
        if len(counts) > 2:
            x += counts[-2]
        if not 0 <= x <= _COUNT_MAX:
            raise ValueError(f"run length {x} is outside 0 to 2**32 - 1")
        counts.append(x)
        x = shift = 0
    if shift:
        raise ValueError("the compressed counts end inside a number")
    return counts


class Rle(BaseModel, frozen=True):
    """A binary mask in COCO run-length encoding: the pixels in column-major order
    (down the first column, then the next), as alternating runs of 0s and 1s,
    starting with 0s (a first count of 0 when the first pixel is set)."""

    size: tuple[Positive, Positive]
    """``[height, width]`` of the mask: the submitted image's."""
    counts: str
    """The run lengths in COCO's compressed string form (``decode_rle_counts``)."""

    @model_validator(mode="after")
    def _counts_cover_the_mask(self) -> Self:
        counts = decode_rle_counts(self.counts)
        height, width = self.size
        if sum(counts) != height * width:
            raise ValueError(
                f"the runs cover {sum(counts)} pixels, the {height}x{width} mask has "
                f"{height * width}"
            )
        return self

    def run_lengths(self) -> list[int]:
        """The counts as numbers: 0s, 1s, 0s, ... in column-major order."""
        return decode_rle_counts(self.counts)

    def to_bytes(self) -> bytes:
        """The mask as ``height * width`` bytes of 0 or 1, row by row (row-major), e.g.
        ``numpy.frombuffer(rle.to_bytes(), numpy.uint8).reshape(rle.size)``."""
        height = self.size[0]
        columns = b"".join(
            (b"\x01" if n % 2 else b"\x00") * count for n, count in enumerate(self.run_lengths())
        )
        return b"".join(columns[row::height] for row in range(height))

    @property
    def area(self) -> int:
        """How many pixels are set."""
        return sum(self.run_lengths()[1::2])


# -- classification -----------------------------------------------------------------------


class ClassScore(BaseModel, frozen=True):
    """One class of a classification answer."""

    label: str
    index: NonNegative
    """Position of the class in the model's output."""
    score: Score
    """Softmax probability."""


CLASSIFICATION = TypeAdapter(list[ClassScore])
"""Validates a classification answer: a list of ``ClassScore``, best first."""


# -- detection, instance segmentation, keypoints -----------------------------------------


class Detection(BaseModel, frozen=True):
    """One detected object."""

    box: tuple[float, float, float, float]
    """``[x1, y1, x2, y2]``: left, top, right, bottom edges, in image pixels."""
    score: Score
    index: NonNegative
    """Class index in the model's output (for torchvision's COCO models, 0 is background)."""
    label: str
    """The class name from the weights or a labels file, else the index as text."""

    @model_validator(mode="after")
    def _ordered_box(self) -> Self:
        x1, y1, x2, y2 = self.box
        if not (x1 <= x2 and y1 <= y2) or not all(map(math.isfinite, self.box)):
            raise ValueError(
                f"a box is [x1, y1, x2, y2] with x1 <= x2 and y1 <= y2, not {self.box}"
            )
        return self


class _Image(BaseModel, frozen=True):
    width: Positive
    """Width of the submitted image, in pixels."""
    height: Positive
    """Height of the submitted image, in pixels."""


class DetectionOutput(_Image, frozen=True):
    """``conveyor.detection.v1``: boxes, best score first."""

    type: Literal["conveyor.detection.v1"] = DETECTION_V1
    detections: list[Detection]


class MaskedDetection(Detection, frozen=True):
    mask: Rle | None
    """The object's pixels; null when the request asked for no masks."""


class InstanceSegmentationOutput(_Image, frozen=True):
    """``conveyor.instance_segmentation.v1``: boxes with one mask each, best score first."""

    type: Literal["conveyor.instance_segmentation.v1"] = INSTANCE_SEGMENTATION_V1
    detections: list[MaskedDetection]

    @model_validator(mode="after")
    def _masks_fit_the_image(self) -> Self:
        for detection in self.detections:
            if detection.mask is not None and detection.mask.size != (self.height, self.width):
                raise ValueError(
                    f"a mask of size {list(detection.mask.size)} in a "
                    f"{self.height}x{self.width} image (size is [height, width])"
                )
        return self


class KeypointDetection(Detection, frozen=True):
    keypoints: list[tuple[float, float, float]]
    """``[x, y, score]`` per keypoint, in ``keypoint_names`` order; the score is the
    model's raw confidence (a logit, not a probability)."""


class KeypointsOutput(_Image, frozen=True):
    """``conveyor.keypoints.v1``: boxes with named keypoints, best score first."""

    type: Literal["conveyor.keypoints.v1"] = KEYPOINTS_V1
    keypoint_names: list[str]
    detections: list[KeypointDetection]

    @model_validator(mode="after")
    def _one_point_per_name(self) -> Self:
        for detection in self.detections:
            if len(detection.keypoints) != len(self.keypoint_names):
                raise ValueError(
                    f"{len(detection.keypoints)} keypoints for "
                    f"{len(self.keypoint_names)} keypoint names"
                )
        return self


# -- semantic segmentation ----------------------------------------------------------------


class LabelMap(BaseModel, frozen=True):
    """Every pixel's class index as an image."""

    encoding: Literal["png"]
    """A grayscale PNG of the image's size: 8-bit when the model has at most 256
    classes, else 16-bit; pixel value = class index."""
    data: str
    """The PNG file, base64 (standard alphabet, padded)."""


class Segment(BaseModel, frozen=True):
    """One class present in a semantic segmentation."""

    index: NonNegative
    label: str
    pixels: Positive
    """How many pixels have this class."""
    mask: Rle | None = None
    """Its pixels, when the request asked for ``"format": "rle"``."""


class SemanticSegmentationOutput(_Image, frozen=True):
    """``conveyor.semantic_segmentation.v1``: a class per pixel."""

    type: Literal["conveyor.semantic_segmentation.v1"] = SEMANTIC_SEGMENTATION_V1
    map: LabelMap | None
    """The whole label map (``"format": "png"``, the default); null with ``"rle"``."""
    classes: list[Segment]
    """The classes present (those the request kept), most pixels first."""


# -- embeddings -----------------------------------------------------------------------------


class EmbeddingOutput(BaseModel, frozen=True):
    """``conveyor.embedding.v1``: one vector per image."""

    type: Literal["conveyor.embedding.v1"] = EMBEDDING_V1
    dtype: Literal["float32", "float16"]
    shape: list[Positive]
    """The vector's shape, e.g. ``[2048]``."""
    normalized: bool
    """Whether the vector was scaled to unit L2 norm (before the cast to ``dtype``)."""
    data: str
    """The values as little-endian ``dtype``, row-major, base64 (standard, padded)."""
    truncated: bool = False
    """Text models: the text was cut to the model's ``max_length`` tokens before it ran."""
    modality: Literal["image", "text"] | None = None
    """Dual encoders (CLIP, SigLIP): the tower that answered, ``image`` for an image
    request, ``text`` for a text one (their vectors share one space); absent elsewhere."""

    @model_validator(mode="after")
    def _data_fits_the_shape(self) -> Self:
        expected = math.prod(self.shape) * EMBEDDING_DTYPES[self.dtype]
        try:
            size = len(base64.b64decode(self.data, validate=True))
        except binascii.Error as exc:
            raise ValueError(f"data is not base64: {exc}") from None
        if size != expected:
            raise ValueError(f"data holds {size} bytes; {self.shape} {self.dtype} is {expected}")
        return self

    def values(self) -> list[float]:
        """The vector's values, flattened, as Python floats."""
        raw = base64.b64decode(self.data)
        if self.dtype == "float16":
            return list(struct.unpack(f"<{len(raw) // 2}e", raw))
        values = array.array("f", raw)
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()


# -- text ---------------------------------------------------------------------------------


class TextClassificationOutput(BaseModel, frozen=True):
    """``conveyor.text_classification.v1``: the classes of one text (or pair of texts)."""

    type: Literal["conveyor.text_classification.v1"] = TEXT_CLASSIFICATION_V1
    labels: list[ClassScore]
    """The ``top_k`` classes, best first (a one-output model, a reranker: its sigmoid)."""
    truncated: bool
    """The text was cut to the model's ``max_length`` tokens before it ran."""


class Entity(BaseModel, frozen=True):
    """A run of tokens given one entity (transformers' ``aggregation_strategy="simple"``)."""

    entity_group: str
    """The label without its ``B-``/``I-`` prefix."""
    score: Score
    """The mean of its tokens' softmax scores."""
    word: str
    """Its tokens joined back by the tokenizer (``convert_tokens_to_string``)."""
    start: NonNegative
    """Offset of its first character in the submitted text (Python ``str`` indices)."""
    end: NonNegative
    """Offset just past its last character: ``text[start:end]`` is the span."""


class EntitiesOutput(BaseModel, frozen=True):
    """``conveyor.entities.v1``: the entities of one text (token classification)."""

    type: Literal["conveyor.entities.v1"] = ENTITIES_V1
    entities: list[Entity]
    """In text order; runs labelled ``O`` are left out."""
    truncated: bool
    """The text was cut to the model's ``max_length`` tokens before it ran."""


# -- reading any of them --------------------------------------------------------------------

TaskOutput = Annotated[
    DetectionOutput
    | InstanceSegmentationOutput
    | KeypointsOutput
    | SemanticSegmentationOutput
    | EmbeddingOutput
    | TextClassificationOutput
    | EntitiesOutput,
    Field(discriminator="type"),
]
_TASK_OUTPUT: TypeAdapter[TaskOutput] = TypeAdapter(TaskOutput)


def parse_outputs(outputs: Any) -> list[ClassScore] | TaskOutput:
    """Validate the ``outputs`` of an ``ok`` result and read it as its task's model.

    A list is a classification answer; an object is read by its ``type``. Raises
    ``ContractError`` (``decode_failed``) naming the first field that does not fit,
    including for an object whose ``type`` this version does not know.
    """
    try:
        if isinstance(outputs, list):
            return CLASSIFICATION.validate_python(outputs)
        return _TASK_OUTPUT.validate_python(outputs)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ContractError(
            ErrorCode.decode_failed,
            f"outputs.{where}" if where else "outputs",
            first["msg"],
        ) from None
