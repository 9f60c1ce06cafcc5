"""Model descriptions: what a model's workers say about it, for clients that ask.

Each worker writes its model's description to Redis when it starts serving and
refreshes it while it serves, with a TTL (``DESCRIPTION_TTL_S``): a description that
exists is a model that a worker served within that time. The HTTP gateway
(``producers.gateway``) answers the Open Inference Protocol's model metadata and
model readiness from it. The workers of one model write the same key; during a
rollout the last writer's version is the one described.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import orjson
from pydantic import BaseModel, Field, ValidationError

from schemas.errors import ContractError, ErrorCode
from schemas.headers import ContentType

DESCRIPTION_PREFIX = "conveyor:model:"
DESCRIPTION_TTL_S = 30
"""How long a description lives unless refreshed; workers refresh it every third of it."""


class Task(StrEnum):
    """What a model's ``outputs`` are (docs/models.md describes each shape)."""

    classification = "classification"
    """Classes of an image or a text: a list of ``{label, index, score}``, or a text
    classification document holding one (``labels``)."""
    token_classification = "token_classification"
    """Entities of a text (``entities/v1``)."""
    detection = "detection"
    segmentation = "segmentation"
    embedding = "embedding"
    text_generation = "text_generation"
    """A causal language model: prompts or chat messages in, generated text out
    (``{text, finish_reason, prompt_tokens, completion_tokens, ...}``), streamed."""
    custom = "custom"
    """A handler of a user's whose outputs have no shape the contract names."""


class ModelDescription(BaseModel, frozen=True):
    """One model as its workers serve it."""

    name: Annotated[str, Field(min_length=1)]
    """The served model name (topics ``<prefix>.<name>.*``)."""
    version: str
    """The ``model_version`` every result of it carries."""
    task: Task | str
    """A ``Task``; a task from a later contract version stays a plain string."""
    content_types: tuple[ContentType | str, ...]
    """Media types its requests may have."""
    labels: int | None = None
    """How many classes (or token tags) a classifier chooses among; null for other tasks."""
    worker: str
    """The worker that wrote this description last."""
    published_ms: int
    """When it wrote it, epoch milliseconds."""


def description_key(model: str) -> str:
    """The Redis key of a model's description: ``conveyor:model:<name>``."""
    return DESCRIPTION_PREFIX + model


def encode_description(description: ModelDescription) -> bytes:
    """The description as JSON bytes."""
    return orjson.dumps(description.model_dump(mode="json"))


def decode_description(data: bytes) -> ModelDescription:
    """Read a description; raises ``ContractError`` (``decode_failed``) on garbage.

    Unknown fields are ignored, so descriptions of later workers read fine.
    """
    try:
        return ModelDescription.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ContractError(
            ErrorCode.decode_failed, f"description.{where}".rstrip("."), first["msg"], seen=data
        ) from None
