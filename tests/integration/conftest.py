"""Integration fixtures: a model served for a whole module, topics dropped after a test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from producers.admin import create_model_topics, delete_model_topics
from producers.settings import ClientSettings
from producers.testing import Fleet, WorkerConfig
from tests.harness import TEST_WORKER_OPTIONS


@pytest.fixture(scope="module")
async def served_model(
    kafka_bootstrap: str,
    redis_url: str,
    digits: list[tuple[bytes, int]],  # the model is built before the worker loads it
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[str]:
    """A model name with its topics (3 partitions) and one digits worker serving it, for the
    whole module; the topics are deleted afterwards. The digits model takes any image and
    scales it to 8x8 grey, so any picture is valid input."""
    model = f"served{uuid.uuid4().hex[:10]}"
    settings = ClientSettings(kafka_bootstrap=kafka_bootstrap)
    await create_model_topics(settings, model, partitions=3)
    base = WorkerConfig(model, kafka_bootstrap, redis_url, options=TEST_WORKER_OPTIONS)
    try:
        async with Fleet(base, tmp_path_factory.mktemp("served")) as fleet:
            fleet.start()
            yield model
    finally:
        await delete_model_topics(settings, model)


@pytest.fixture
async def drop_topics(client_settings: ClientSettings) -> AsyncIterator[list[str]]:
    """Models whose topics the test creates (or has created): deleted after it."""
    models: list[str] = []
    yield models
    for model in models:
        await delete_model_topics(client_settings, model)
