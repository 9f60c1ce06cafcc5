"""Request parameters (``ce_params``) of the task handlers, parsed and checked.

Handlers parse them in ``preprocess``, so a bad parameter fails only its own request
with ``bad_request`` (the message names the parameter and the value seen), and again
in ``postprocess``, which costs microseconds. Names a task does not know are refused
too: a misspelt ``score_threshold`` would otherwise be ignored without a word.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas import ContractError, ErrorCode


def _bad(name: str, message: str, value: object) -> ContractError:
    return ContractError(ErrorCode.bad_request, f"ce_params.{name}", message, seen=value)


def check_names(params: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse a parameter this task does not take, listing the ones it does."""
    for name in params:
        if name not in known:
            raise _bad(
                name, f"unknown parameter; this model takes {', '.join(sorted(known))}", name
            )


def number(params: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A number from ``low`` to ``high`` (both included); ``default`` when absent."""
    value = params.get(name, default)
    # bool is an int subclass, but {"score_threshold": true} is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(name, f"must be a number from {low} to {high}", value)
    return float(value)


def integer(params: Mapping[str, Any], name: str, default: int, low: int = 1) -> int:
    """A whole number of at least ``low``; ``default`` when absent."""
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(name, f"must be an integer of at least {low}", value)
    return value


def boolean(params: Mapping[str, Any], name: str, default: bool) -> bool:
    """``true`` or ``false``; ``default`` when absent."""
    value = params.get(name, default)
    if not isinstance(value, bool):
        raise _bad(name, "must be true or false", value)
    return value


def choice(params: Mapping[str, Any], name: str, default: str, choices: Sequence[str]) -> str:
    """One of ``choices``; ``default`` when absent."""
    value = params.get(name, default)
    if value not in choices:
        raise _bad(name, f"must be one of {', '.join(choices)}", value)
    assert isinstance(value, str)
    return value


def classes(params: Mapping[str, Any], labels: Sequence[str]) -> frozenset[int] | None:
    """The ``classes`` to keep, as indices: a non-empty list of label names and/or
    indices into ``labels``. ``None`` (keep every class) when absent."""
    value = params.get("classes")
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise _bad("classes", "must be a non-empty list of class labels or indices", value)
    by_name: dict[str, int] = {}
    for index, label in enumerate(labels):
        by_name.setdefault(label, index)  # a name listed twice (e.g. "N/A") means its first
    kept = set()
    for item in value:
        if isinstance(item, str) and item in by_name:
            kept.add(by_name[item])
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < len(labels):
            kept.add(item)
        else:
            known = ", ".join(repr(label) for label in labels[:8])
            raise _bad(
                "classes",
                f"has an unknown class; give labels ({known}, ...) or indices 0 to "
                f"{len(labels) - 1}",
                item,
            )
    return frozenset(kept)


@dataclass(frozen=True, slots=True)
class DetectionParams:
    """What a detection request asks for (docs/models.md, "Request parameters")."""

    score_threshold: float  # keep detections scoring at least this
    max_detections: int  # then at most this many, best first
    classes: frozenset[int] | None  # only these class indices; None: all
    masks: bool  # instance segmentation: include each detection's mask
    mask_threshold: float  # a pixel belongs to the mask when its probability is at least this

    NAMES = ("score_threshold", "max_detections", "classes")
    MASK_NAMES = ("masks", "mask_threshold")

    @classmethod
    def parse(
        cls,
        params: Mapping[str, Any],
        labels: Sequence[str],
        *,
        default_threshold: float,
        max_detections: int,
        with_masks: bool,
    ) -> DetectionParams:
        """Raise ``ContractError(bad_request)`` naming the first bad parameter."""
        check_names(params, cls.NAMES + cls.MASK_NAMES if with_masks else cls.NAMES)
        return cls(
            score_threshold=number(params, "score_threshold", default_threshold, 0.0, 1.0),
            max_detections=min(integer(params, "max_detections", max_detections), max_detections),
            classes=classes(params, labels),
            masks=boolean(params, "masks", True),
            mask_threshold=number(params, "mask_threshold", 0.5, 0.0, 1.0),
        )


@dataclass(frozen=True, slots=True)
class SegmentationParams:
    """What a semantic segmentation request asks for."""

    format: str  # "png": the whole label map; "rle": one mask per class
    classes: frozenset[int] | None  # report only these classes; None: all present

    NAMES = ("format", "classes")
    FORMATS = ("png", "rle")

    @classmethod
    def parse(cls, params: Mapping[str, Any], labels: Sequence[str]) -> SegmentationParams:
        check_names(params, cls.NAMES)
        return cls(choice(params, "format", "png", cls.FORMATS), classes(params, labels))


@dataclass(frozen=True, slots=True)
class EmbeddingParams:
    """What an embedding request asks for."""

    normalize: bool  # scale to unit L2 norm
    dtype: str  # "float32" or "float16"

    NAMES = ("normalize", "dtype")
    DTYPES = ("float32", "float16")

    @classmethod
    def parse(cls, params: Mapping[str, Any], *, normalize: bool = True) -> EmbeddingParams:
        """``normalize``: the default when the request does not say."""
        check_names(params, cls.NAMES)
        return cls(
            boolean(params, "normalize", normalize),
            choice(params, "dtype", "float32", cls.DTYPES),
        )
