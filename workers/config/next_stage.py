"""What a worker's next stage takes from its answers: which boxes become child requests.

``conveyor worker --then MODEL`` (or ``then = "MODEL"`` in a host file's model table)
names the model that serves the crops; ``--then-options`` says which boxes it gets:

| option | default | meaning |
|---|---|---|
| ``min_score`` | 0.5 | boxes scoring below it are left out |
| ``classes`` | every class | labels (or class indices) whose boxes are kept |
| ``max_children`` | 16 | at most this many boxes per image, best score first |
| ``margin`` | 0.1 | each side of a box grows by this share of the box's width or height |
| ``params`` | none | the ``ce_params`` every child request carries (e.g. ``{"top_k": 1}``) |
| ``crop`` | ``boxes`` | ``image``: one child an answer (an object), the whole image |
| ``size`` | none | with ``crop = image``: the longest side the image is resized to (never up) |

Pure: the rule and its checks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from schemas import topics_for
from schemas.chain import MAX_CHILDREN

OPTIONS: dict[str, str] = {
    "min_score": "boxes scoring below it are left out (0 to 1; default 0.5)",
    "classes": "labels or class indices whose boxes are kept (default: every class)",
    "max_children": f"at most this many boxes per image, best first (1 to {MAX_CHILDREN}; 16)",
    "margin": "each side of a box grows by this share of its width or height (0 to 1; 0.1)",
    "params": "the ce_params object every child request carries (default none)",
    "crop": "boxes (a child a chosen box) or image (a child an answer: the whole image)",
    "size": "with crop image: the longest side the image is resized to, never up (default none)",
}

WHOLE_IMAGE = -1
"""The index ``select`` gives, alone, when the whole image is the one child."""


@dataclass(frozen=True, slots=True)
class NextStage:
    """The model a worker's answers feed, and which of their boxes it gets."""

    model: str
    topic: str  # the next model's request topic
    min_score: float = 0.5
    classes: frozenset[str] = frozenset()  # empty: every class
    max_children: int = 16
    margin: float = 0.1
    params: bytes | None = None  # ce_params of every child, encoded
    whole_image: bool = False  # crop = "image": one child an answer, the whole image
    size: int | None = None  # with whole_image: its longest side at most this

    @classmethod
    def parse(cls, model: str, options: Mapping[str, Any], prefix: str) -> NextStage:
        """The stage ``--then model --then-options options`` asks for; ``ValueError``
        naming the option and what it takes when one is wrong."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            known = "; ".join(f"{name}: {what}" for name, what in OPTIONS.items())
            raise ValueError(f"then_options has no {', '.join(unknown)}; it takes {known}")
        min_score = _number(options, "min_score", 0.5, 0.0, 1.0)
        margin = _number(options, "margin", 0.1, 0.0, 1.0)
        limit = options.get("max_children", 16)
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_CHILDREN:
            raise ValueError(f"then_options max_children is 1 to {MAX_CHILDREN}, not {limit!r}")
        classes = options.get("classes", [])
        if not isinstance(classes, list | tuple) or not all(
            isinstance(c, str | int) and not isinstance(c, bool) for c in classes
        ):
            raise ValueError(
                f"then_options classes is a list of labels or indices, not {classes!r}"
            )
        params = options.get("params")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"then_options params is an object, not {params!r}")
        crop = options.get("crop", "boxes")
        if crop not in ("boxes", "image"):
            raise ValueError(f"then_options crop is boxes or image, not {crop!r}")
        size = options.get("size")
        if size is not None and (
            crop != "image" or not isinstance(size, int) or isinstance(size, bool) or size < 1
        ):
            raise ValueError(
                f"then_options size is a number of pixels >= 1, with crop image; not {size!r}"
            )
        return cls(
            model=model,
            topic=topics_for(model, prefix).requests,
            min_score=min_score,
            classes=frozenset(str(c) for c in classes),
            max_children=limit,
            margin=margin,
            params=None if params is None else orjson.dumps(params),
            whole_image=crop == "image",
            size=size,
        )

    def takes(self, output: Any) -> bool:
        """Whether an answer can have children: an object (the whole image's answer goes
        in it) with ``crop = image``, else an object with ``detections``."""
        if not isinstance(output, dict):
            return False
        return self.whole_image or isinstance(output.get("detections"), list)

    def select(self, output: Any) -> list[int]:
        """The indices of the detections in ``output`` that become child requests, best
        first; none for an output without detections; ``[WHOLE_IMAGE]`` with ``crop =
        image``."""
        if self.whole_image:
            return [WHOLE_IMAGE] if isinstance(output, dict) else []
        detections = output.get("detections") if isinstance(output, dict) else None
        if not isinstance(detections, list):
            return []
        chosen = []
        for i, found in enumerate(detections):
            score = found.get("score") if isinstance(found, dict) else None
            if not isinstance(score, int | float) or score < self.min_score:
                continue
            if self.classes and not (
                found.get("label") in self.classes or str(found.get("index")) in self.classes
            ):
                continue
            chosen.append(i)
            if len(chosen) == self.max_children:
                break
        return chosen


def _number(
    options: Mapping[str, Any], name: str, default: float, low: float, high: float
) -> float:
    value = options.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"then_options {name} is a number from {low:g} to {high:g}, not {value!r}")
    return float(value)
