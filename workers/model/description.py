"""The worker's description of its model in Redis (``schemas.description``), kept fresh.

``describe`` reads what the handler knows: its task from its type, the media types it
decodes (images and npy arrays, or text and JSON), its version, and a classifier's label
count. ``Describer`` writes that
document when the worker starts serving and again every third of its TTL, so the key
expires within ``DESCRIPTION_TTL_S`` of the last worker stopping. A Redis that refuses
the write (an ACL without ``+set`` on ``~conveyor:model:*``) or cannot be reached costs
only the description: the worker logs it and serves on. On a Redis Cluster nothing is
written (the gateway that reads descriptions runs against a standalone Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.security import redis_options
from schemas import ContentType
from schemas.description import (
    DESCRIPTION_TTL_S,
    ModelDescription,
    Task,
    description_key,
    encode_description,
)
from workers.config.worker import WorkerSettings
from workers.decode.images import IMAGE_TYPES
from workers.handlers.base import Handler, ImageClassifier, ImageModel
from workers.handlers.tasks.detection import Detector
from workers.handlers.tasks.detr import DetrDetector
from workers.handlers.tasks.dual_encoder import DualEncoder
from workers.handlers.tasks.embedding import ImageEmbedder
from workers.handlers.tasks.full_size import FullSizeImageTask
from workers.handlers.tasks.segmentation import SemanticSegmenter
from workers.handlers.tasks.text import TextModel
from workers.handlers.tasks.text_tasks import SentenceEmbedder, TextClassifier, TokenClassifier

log = logging.getLogger(__name__)

_TASKS: tuple[tuple[type[Any], Task], ...] = (
    (ImageClassifier, Task.classification),
    (Detector, Task.detection),
    (DetrDetector, Task.detection),
    (SemanticSegmenter, Task.segmentation),
    (ImageEmbedder, Task.embedding),
    (TextClassifier, Task.classification),
    (TokenClassifier, Task.token_classification),
    (SentenceEmbedder, Task.embedding),
    (DualEncoder, Task.embedding),
)
_IMAGES = (*IMAGE_TYPES, ContentType.NPY)  # what ImageModel and FullSizeImageTask decode
_TEXT = (ContentType.TEXT, ContentType.JSON)  # what TextModel reads (text, or text and pair)


def describe(handler: Handler, served_name: str, worker: str) -> ModelDescription:
    """The description of ``handler`` served as ``served_name`` by ``worker``.

    A handler may say its task with a ``task`` attribute (a ``Task``), and what it
    takes with a ``content_types`` attribute (media type strings); built-in image
    handlers take images and npy arrays, and a handler of another kind is described as
    taking any of the contract's media types.
    """
    declared_task = getattr(handler, "task", None)
    if isinstance(declared_task, Task):  # e.g. a generation model's (workers.generation)
        task = declared_task
    else:
        task = next((t for kind, t in _TASKS if isinstance(handler, kind)), Task.custom)
    declared: Iterable[str] | None = getattr(handler, "content_types", None)
    if declared is not None:
        content_types: tuple[str, ...] = tuple(declared)
    elif isinstance(handler, ImageModel | FullSizeImageTask):
        content_types = _IMAGES
    elif isinstance(handler, TextModel):
        content_types = _TEXT
    else:
        content_types = tuple(ContentType)
    labels = None
    if isinstance(handler, ImageClassifier | TextClassifier | TokenClassifier):
        labels = len(handler.labels)
    return ModelDescription(
        name=served_name,
        version=handler.version,
        task=task,
        content_types=content_types,
        labels=labels,
        worker=worker,
        published_ms=int(time.time() * 1000),
    )


class Describer:
    """Keeps the model's description in Redis while the worker serves (``async with``)."""

    def __init__(
        self,
        settings: WorkerSettings,
        description: ModelDescription,
        ttl_s: int = DESCRIPTION_TTL_S,
    ) -> None:
        self._settings = settings
        self._description = description
        self._ttl_s = ttl_s
        self._task: asyncio.Task[None] | None = None
        # Set on exit: redis-py can turn a cancellation inside a command into its own
        # error, which _write forgives, so the loop also ends on this.
        self._stopped = asyncio.Event()
        self._failing = False  # logged once per outage, not every refresh

    async def __aenter__(self) -> Self:
        if not self._settings.redis_cluster:
            self._task = asyncio.create_task(self._refresh(), name="describe-model")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _refresh(self) -> None:
        settings = self._settings
        redis = aioredis.Redis.from_url(
            settings.redis_url.get_secret_value(),
            socket_timeout=5,
            socket_connect_timeout=5,
            **redis_options(settings),
        )
        key = description_key(self._description.name)
        try:
            while not self._stopped.is_set():
                await self._write(redis, key)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), self._ttl_s / 3)
        finally:
            await redis.aclose()

    async def _write(self, redis: aioredis.Redis, key: str) -> None:
        document = self._description.model_copy(update={"published_ms": int(time.time() * 1000)})
        try:
            await redis.set(key, encode_description(document), ex=self._ttl_s)
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning(
                    "cannot write the model's description to Redis key %s (%s): the HTTP "
                    "gateway will not describe it; grant +set on ~conveyor:model:* to serve "
                    "its metadata",
                    key,
                    exc,
                )
            self._failing = True
        else:
            self._failing = False
