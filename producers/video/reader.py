"""Reading one stream's results in frame order from the model's results topic."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from common.security import kafka_options
from producers.bridge import LoopThread, SyncTwin
from producers.errors import InvalidInput, ResultTimeout, ServiceUnavailable, UnknownModel
from producers.settings import ClientSettings
from producers.video.ids import frame_request_id, parse_frame_request_id
from producers.video.reorder import DEFAULT_BUFFER, ReorderBuffer
from schemas import Result, decode_result, topics_for


@dataclass(frozen=True, slots=True)
class FrameResult:
    """The result of one frame of a stream, or the news that it is missing."""

    stream_id: str
    seq: int
    result: Result | None  # None: missing, later frames' results came and this one did not

    @property
    def request_id(self) -> str:
        """``<stream id>:<seq>``."""
        return frame_request_id(self.stream_id, self.seq)

    @property
    def missing(self) -> bool:
        """Whether the reader gave up on this frame's result."""
        return self.result is None


class AsyncStreamReader:
    """One stream's results in frame order, read from the model's results topic.

    Entering (``async with``) connects and fixes where reading starts: with
    ``since=None``, at the end of the topic as it is then, so enter **before**
    sending the frames, or results that arrive in between are missed; with
    ``since`` (a timezone-aware time before the first frame was sent), at the
    first result published at or after it, so the reader may start any time
    while those records are kept. ``results()`` yields ``FrameResult``s for
    seq ``start_seq``, ``start_seq + 1``, ... in order.

    When the next frame's result has not come within ``timeout`` seconds: if
    results of later frames are there, the missing frames are yielded with
    ``result=None`` and reading goes on; if none are, ``ResultTimeout`` is
    raised naming that frame's request id (for ``count=None``, this is how a
    stream that went quiet ends). At most ``max_buffer`` early results are
    held; when full, the gap before them is reported missing at once.
    Duplicates (a redelivered request) are dropped; the first result wins.
    """

    def __init__(
        self,
        settings: ClientSettings,
        model: str,
        stream_id: str,
        *,
        since: datetime | None = None,
        start_seq: int = 0,
        timeout: float = 30.0,
        max_buffer: int = DEFAULT_BUFFER,
    ) -> None:
        """Read ``stream_id``'s results from ``model``'s results topic (see the class doc)."""
        if since is not None and since.utcoffset() is None:
            raise InvalidInput("since must be a timezone-aware datetime")
        if timeout <= 0:
            raise InvalidInput(f"timeout must be > 0 seconds, not {timeout}")
        try:
            self.topic = topics_for(model, settings.topic_prefix).results
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        self.model = model
        self.stream_id = stream_id
        self._settings = settings
        self._since = since
        self._timeout = timeout
        self._buffer: ReorderBuffer[Result] = ReorderBuffer(start_seq, max_buffer)
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> Self:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._settings.kafka_bootstrap,
            group_id=None,  # a private reader: it must not take partitions from anyone
            enable_auto_commit=False,
            # Workers in exactly-once delivery write results in transactions: never read
            # an aborted one. Without transactions this reads exactly what is there.
            isolation_level="read_committed",
            **kafka_options(self._settings),
        )
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                await consumer.start()
                await self._position(consumer)
        except (KafkaError, OSError, TimeoutError) as exc:
            await consumer.stop()
            raise self._unavailable(str(exc) or "no answer in time") from None
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    async def results(self, count: int | None = None) -> AsyncGenerator[FrameResult, None]:
        """The next ``count`` frames' results in order (all that come, if None).

        Stop early by closing it (``contextlib.aclosing``) or by leaving the reader.
        """
        if self._consumer is None:
            raise RuntimeError("enter the reader (async with) before reading results")
        if count is not None and count < 0:
            raise InvalidInput(f"count must be >= 0, not {count}")
        buffer = self._buffer
        end = None if count is None else buffer.next_seq + count
        deadline = time.monotonic() + self._timeout
        while end is None or buffer.next_seq < end:
            ready: list[tuple[int, Result | None]] = list(buffer.pop_ready())
            if not ready and (buffer.full or time.monotonic() >= deadline):
                ready = [(seq, None) for seq in buffer.skip_gap()]
                if not ready:
                    missing = frame_request_id(self.stream_id, buffer.next_seq)
                    raise ResultTimeout([missing], self._timeout)
                ready.extend(buffer.pop_ready())
            if ready:
                for seq, result in ready:
                    yield FrameResult(self.stream_id, seq, result)
                # Set after the caller had the results: its own time does not count.
                deadline = time.monotonic() + self._timeout
            else:
                await self._fetch(self._consumer, deadline - time.monotonic(), end)

    async def _position(self, consumer: AIOKafkaConsumer) -> None:
        """Assign every partition of the results topic and fix each one's start offset."""
        # A fresh look, for a topic created since the consumer started. The consumer's
        # public topics() gives names only; this is the call behind it, with partitions.
        cluster = await consumer._client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(self.topic)
        if not partitions:
            raise UnknownModel(self.model, self.topic)
        assigned = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(assigned)
        starts: dict[TopicPartition, int] = await consumer.end_offsets(assigned)
        if self._since is not None:
            at = int(self._since.timestamp() * 1000)
            found = await consumer.offsets_for_times({tp: at for tp in assigned})
            # None: nothing published at or after ``since`` there yet; start at the end.
            starts.update({tp: o.offset for tp, o in found.items() if o is not None})
        for tp, offset in starts.items():
            consumer.seek(tp, offset)

    async def _fetch(self, consumer: AIOKafkaConsumer, wait_s: float, end: int | None) -> None:
        """Buffer this stream's results below ``end`` that arrive within ``wait_s`` seconds."""
        try:
            batches = await consumer.getmany(timeout_ms=max(math.ceil(wait_s * 1000), 0))
        except KafkaError as exc:
            raise self._unavailable(str(exc)) from exc
        for records in batches.values():
            for record in records:
                self._take(record, end)

    def _take(self, record: ConsumerRecord[bytes, bytes], end: int | None) -> None:
        # The key is the request id; other streams' results are skipped undecoded.
        parsed = (
            None if record.key is None else parse_frame_request_id(record.key.decode("latin-1"))
        )
        if parsed is None or parsed[0] != self.stream_id or record.value is None:
            return
        seq = parsed[1]
        if end is None or seq < end:
            self._buffer.add(seq, decode_result(record.value))

    def _unavailable(self, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            f"cannot read {self.topic} from Kafka at {self._settings.kafka_bootstrap} ({why}): "
            "is the broker running (`make up`)? Point the client at it with --kafka-bootstrap "
            "or CONVEYOR_KAFKA_BOOTSTRAP"
        )


class StreamReader(SyncTwin[AsyncStreamReader]):
    """The synchronous twin of ``AsyncStreamReader``: ``with`` it, then read ``results()``.

    Runs the reader on an event loop in a private thread (``producers.bridge``),
    from entering to leaving. Enter it before sending the frames (or pass ``since``).
    """

    def __init__(
        self,
        settings: ClientSettings,
        model: str,
        stream_id: str,
        *,
        since: datetime | None = None,
        start_seq: int = 0,
        timeout: float = 30.0,
        max_buffer: int = DEFAULT_BUFFER,
    ) -> None:
        """See ``AsyncStreamReader``."""
        self._twin = AsyncStreamReader(
            settings,
            model,
            stream_id,
            since=since,
            start_seq=start_seq,
            timeout=timeout,
            max_buffer=max_buffer,
        )
        self._entered = False

    def __enter__(self) -> Self:
        self._loop = LoopThread("conveyor-stream-reader")
        try:
            self._loop.call(self._twin.__aenter__())
        except BaseException:
            self._loop.close()
            raise
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._entered:
            self._entered = False
            self._loop.close(self._twin.__aexit__(exc_type, exc, tb))

    def results(self, count: int | None = None) -> Iterator[FrameResult]:
        """See ``AsyncStreamReader.results``; stopping early (``break``) is fine."""
        if not self._entered:
            raise RuntimeError("enter the reader (with) before reading results")
        yield from self._loop.iterate(self._twin.results(count))
