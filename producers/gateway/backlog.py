"""How far behind a model's workers are: its consumer group's lag, read from Kafka, cached.

The lag is what KEDA's Kafka scaler reads too: over the request topic's partitions,
the end offset minus the group's committed offset (the log start where nothing is
committed yet). It counts records sent and not yet answered and committed, so it
grows without bound when requests come faster than the workers answer, or when no
worker runs. A model's lag is read at most once every ``cache_s`` however many
requests ask, and concurrent askers share one read.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupCoordinatorNotAvailableError, KafkaError

from common.security import kafka_options
from producers.errors import ServiceUnavailable
from producers.settings import ClientSettings
from schemas import consumer_group, topics_for


class Backlog:
    """The lag of each model's primary consumer group on its plain request topic."""

    def __init__(self, settings: ClientSettings, cache_s: float) -> None:
        self._settings = settings
        self._cache_s = cache_s
        options: dict[str, Any] = {
            "bootstrap_servers": settings.kafka_bootstrap,
            "request_timeout_ms": int(settings.connect_timeout_s * 1000),
            **kafka_options(settings),
        }
        self._admin = AIOKafkaAdminClient(**options)
        self._ends = AIOKafkaConsumer(enable_auto_commit=False, **options)
        self._read: dict[str, tuple[float, int]] = {}  # model -> (monotonic time, lag)
        self._reading: dict[str, asyncio.Task[int]] = {}
        self._started = False

    async def start(self) -> None:
        """Connect; raises ``ServiceUnavailable`` when Kafka cannot be reached."""
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                await self._admin.start()
                await self._ends.start()
        except (KafkaError, OSError, TimeoutError) as exc:
            await self.stop()
            raise ServiceUnavailable(
                f"cannot reach Kafka at {self._settings.kafka_bootstrap} to read lags: {exc!r}"
            ) from None
        self._started = True

    async def stop(self) -> None:
        """Disconnect."""
        await self._ends.stop()
        await self._admin.close()

    async def lag(self, model: str) -> int:
        """Records of ``model``'s request topic its workers have not committed yet."""
        now = time.monotonic()
        cached = self._read.get(model)
        if cached is not None and now - cached[0] < self._cache_s:
            return cached[1]
        reading = self._reading.get(model)
        if reading is None:
            reading = self._reading[model] = asyncio.ensure_future(self._fetch(model))
            reading.add_done_callback(lambda _: self._reading.pop(model, None))
        # Shielded: one caller that gives up does not cancel the others' read.
        lag: int = await asyncio.shield(reading)
        return lag

    async def reachable(self) -> bool:
        """Whether Kafka answers a metadata request now."""
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                await self._admin.describe_cluster()
        except (KafkaError, OSError, TimeoutError):
            return False
        return True

    async def _fetch(self, model: str) -> int:
        prefix = self._settings.topic_prefix
        topic = topics_for(model, prefix).requests
        group = consumer_group(model, prefix)
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                partitions = await self._partitions(topic)
                ends = await self._ends.end_offsets(partitions)
                starts = await self._ends.beginning_offsets(partitions)
                try:
                    offsets = await self._admin.list_consumer_group_offsets(
                        group, partitions=partitions
                    )
                except GroupCoordinatorNotAvailableError:  # no member ever joined
                    offsets = {}
        except (KafkaError, OSError, TimeoutError) as exc:
            raise ServiceUnavailable(
                f"cannot read the lag of {group} on {topic}: {exc!r}"
            ) from None
        committed = {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
        lag: int = sum(ends[tp] - committed.get(tp, starts[tp]) for tp in partitions)
        self._read[model] = (time.monotonic(), lag)
        return lag

    async def _partitions(self, topic: str) -> list[TopicPartition]:
        # All topics, never this one by name: a broker that creates topics on demand
        # would create a topic asked for by name.
        described = await self._admin.describe_topics()
        found = [t for t in described if t.get("topic") == topic and not t.get("error_code")]
        if not found:
            return []
        return [TopicPartition(topic, p["partition"]) for p in found[0]["partitions"]]
