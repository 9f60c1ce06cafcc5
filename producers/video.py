"""Video and frame pipelines: send a video's frames as one ordered stream, read results in order.

Sending (``conveyor stream``, ``stream_video``): ``VideoSource`` decodes a file
with PyAV, keeps frames by presentation time (``FrameSampler``), optionally
resizes them and encodes each as JPEG. Every kept frame becomes one request
with ``ce_stream=<stream id>``, ``ce_seq=<n>`` (0, 1, 2, ... in the order sent)
and the request id ``<stream id>:<n>``, sent through the SDK's ``RequestSender``.
The record key is the stream id, so one stream's frames stay in one partition,
in order.

Reading (``AsyncStreamReader``, ``StreamReader``): a reader of its own (no
consumer group) on the model's results topic keeps the results of one stream,
recognised by their request ids, and hands them out in frame order. Results
are keyed by request id, so one stream's results spread over the topic's
partitions and may arrive out of order; ``ReorderBuffer`` puts them back.

PyAV (``av``) and Pillow are needed only to send: ``pip install 'conveyor-serve[video]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import math
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import orjson
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from common.install import install_hint
from common.security import kafka_options
from producers.commands import EXIT_NOT_OK, EXIT_OK, _runner
from producers.errors import InvalidInput, ResultTimeout, ServiceUnavailable, UnknownModel
from producers.progress import ProgressBar
from producers.sender import RequestSender
from producers.settings import ClientSettings
from schemas import (
    ContentType,
    ErrorCode,
    OutgoingRecord,
    Result,
    Status,
    decode_result,
    encode_request,
    is_valid_request_id,
    topics_for,
)

if TYPE_CHECKING:
    import av.container
    import av.video.frame
    import av.video.stream

T = TypeVar("T")

_SEQ_DIGITS = 19  # the longest ce_seq: 2**63 - 1
_SEND_CHUNK = 64  # frames decoded, then sent, at a time: one acknowledgement wait per chunk
_DEFAULT_QUALITY = 85
_DEFAULT_BUFFER = 1024
_INSTALL_HINT = install_hint("video")


# -- request ids ---------------------------------------------------------------------------


def frame_request_id(stream_id: str, seq: int) -> str:
    """The request id of frame ``seq`` of ``stream_id``: ``<stream id>:<seq>``."""
    return f"{stream_id}:{seq}"


def parse_frame_request_id(request_id: str) -> tuple[str, int] | None:
    """``(stream id, seq)`` of an id made by ``frame_request_id``, else None.

    The seq is what follows the last ``:``, so stream ids may contain ``:`` too.
    """
    stream_id, sep, seq = request_id.rpartition(":")
    if not sep or not stream_id or not seq.isascii() or not seq.isdigit():
        return None
    return stream_id, int(seq)


def check_stream_id(stream_id: str, settings: ClientSettings) -> None:
    """Raise ``InvalidInput`` unless every ``<stream_id>:<seq>`` is a valid request id."""
    longest = settings.limits.max_id_length - 1 - _SEQ_DIGITS
    if not is_valid_request_id(stream_id) or len(stream_id) > longest:
        raise InvalidInput(
            f"stream id {stream_id!r} must be 1–{longest} characters of [A-Za-z0-9._:-]: "
            f"frame request ids are <stream id>:<seq> and may be at most "
            f"{settings.limits.max_id_length} characters"
        )


# -- reading a video -----------------------------------------------------------------------


class FrameSampler:
    """Keeps at most ``fps`` frames per second of presentation time.

    Time from the first frame is cut into slots of ``1/fps`` seconds; the first
    frame in each slot is kept and the others are dropped. Sampling by
    timestamp rather than by frame index keeps the output rate right for
    variable frame rate sources and for any ratio of rates (25 to 10 fps keeps
    frames 0, 3, 5, 8, 10, ...). A source slower than ``fps`` keeps every frame.
    Times are ``Fraction``s, so slot boundaries are exact.
    """

    def __init__(self, fps: Fraction | None) -> None:
        """``fps``: frames per second to keep, > 0; None keeps every frame."""
        if fps is not None and fps <= 0:
            raise ValueError(f"fps must be > 0, not {fps}")
        self._fps = fps
        self._start: Fraction | None = None
        self._last_slot = -1

    def keep(self, time_s: Fraction) -> bool:
        """Whether the frame shown at ``time_s`` seconds is kept; call in presentation order."""
        if self._start is None:
            self._start = time_s
        if self._fps is None:
            return True
        slot = math.floor((time_s - self._start) * self._fps)
        if slot <= self._last_slot:
            return False
        self._last_slot = slot
        return True


@dataclass(frozen=True, slots=True)
class Frame:
    """One sampled frame, encoded and numbered, ready to send."""

    seq: int  # 0, 1, 2, ... in the order frames are kept
    time_s: float  # presentation time in the source, in seconds
    jpeg: bytes


class VideoSource:
    """A video file opened for sampling: ``frames()`` yields ``Frame``s to send.

    Opening reads the container header, so an unreadable file or one without a
    video stream fails here, with ``InvalidInput``, before anything connects.
    Close it (or use ``with``) to release the file.
    """

    def __init__(
        self,
        path: Path,
        *,
        fps: Fraction | None = None,
        max_frames: int | None = None,
        size: tuple[int, int] | None = None,
        jpeg_quality: int = _DEFAULT_QUALITY,
    ) -> None:
        """Open ``path``; keep ``fps`` frames per second (None: all), at most ``max_frames``.

        ``size``: ``(width, height)`` to resize each frame to; None keeps the
        source size. ``jpeg_quality``: 1 (smallest) to 95 (best).
        """
        if max_frames is not None and max_frames < 1:
            raise InvalidInput(f"max_frames must be >= 1, not {max_frames}")
        if not 1 <= jpeg_quality <= 95:
            raise InvalidInput(f"jpeg_quality must be 1–95, not {jpeg_quality}")
        if size is not None and min(size) < 1:
            raise InvalidInput(f"size must be at least 1x1, not {size[0]}x{size[1]}")
        self.path = path
        self._fps = fps
        self._max_frames = max_frames
        self._size = size
        self._quality = jpeg_quality
        self._container = self._open()
        if not self._container.streams.video:
            self._container.close()
            raise InvalidInput(f"{path} has no video stream (only audio, subtitles or data)")
        self._stream: av.video.stream.VideoStream = self._container.streams.video[0]
        self._stream.thread_type = "AUTO"  # decode on all cores; frames still come in order

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the file."""
        self._container.close()

    @property
    def expected_frames(self) -> int | None:
        """About how many frames ``frames()`` will yield (for progress), None if unknown."""
        duration = self._duration_s()
        if self._fps is not None:
            expected = None if duration is None else math.ceil(duration * self._fps)
        elif self._stream.frames > 0:
            expected = self._stream.frames
        else:
            rate = self._stream.average_rate
            expected = None if duration is None or rate is None else math.ceil(duration * rate)
        if expected is None or self._max_frames is None:
            return expected
        return min(expected, self._max_frames)

    def frames(self) -> Generator[Frame, None, None]:
        """Decode, sample, resize and JPEG-encode; raises ``InvalidInput`` on a broken file."""
        import av  # present: the constructor opened the file with it

        sampler = FrameSampler(self._fps)
        seq = 0
        try:
            for index, frame in enumerate(self._container.decode(self._stream)):
                time_s = self._frame_time(frame, index)
                if not sampler.keep(time_s):
                    continue
                yield Frame(seq, float(time_s), self._jpeg(frame))
                seq += 1
                if seq == self._max_frames:
                    return
        except av.FFmpegError as exc:
            raise InvalidInput(f"cannot decode {self.path} after {seq} frames: {exc}") from None

    def _open(self) -> av.container.InputContainer:
        try:
            import av
        except ImportError as exc:
            # Imported here, not at the top: the rest of the SDK works without it.
            raise InvalidInput(f"reading video needs PyAV: {_INSTALL_HINT} ({exc})") from None
        try:
            return av.open(str(self.path), "r")
        except (av.FFmpegError, OSError) as exc:
            raise InvalidInput(f"cannot read video file {self.path}: {exc}") from None

    def _duration_s(self) -> Fraction | None:
        stream = self._stream
        if stream.duration is not None and stream.time_base is not None:
            return stream.duration * stream.time_base
        if self._container.duration is not None:
            return Fraction(self._container.duration, 1_000_000)  # in AV_TIME_BASE units
        return None

    def _frame_time(self, frame: av.video.frame.VideoFrame, index: int) -> Fraction:
        """Presentation time in seconds; from the frame rate when a frame has no timestamp."""
        if frame.pts is not None and frame.time_base is not None:
            return frame.pts * frame.time_base
        rate = self._stream.average_rate or self._stream.guessed_rate
        if rate:
            return index / rate
        if self._fps is None:
            return Fraction(index)  # every frame is kept; the time is only reported
        raise InvalidInput(
            f"{self.path}: frame {index} has no timestamp and the stream no frame rate, "
            "so frames cannot be sampled by time; leave out the fps to send every frame"
        )

    def _jpeg(self, frame: av.video.frame.VideoFrame) -> bytes:
        width, height = self._size if self._size is not None else (frame.width, frame.height)
        try:
            image = frame.to_image(width=width, height=height)  # type: ignore[no-untyped-call]
        except ImportError as exc:
            raise InvalidInput(f"encoding frames as JPEG needs Pillow: {_INSTALL_HINT}") from exc
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=self._quality)
        return out.getvalue()


# -- sending a stream ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SentFrame:
    """A frame the broker has acknowledged."""

    request_id: str  # <stream id>:<seq>
    seq: int
    time_s: float  # presentation time in the source, in seconds


async def stream_video(
    settings: ClientSettings,
    source: VideoSource,
    *,
    model: str,
    stream_id: str,
    on_sent: Callable[[SentFrame], None] | None = None,
    freshest: bool | None = None,
) -> int:
    """Send ``source``'s frames to ``model`` as stream ``stream_id``; returns how many were sent.

    Frames are sent in order, a chunk at a time; ``on_sent`` is called for
    each frame once the broker has it. Decoding runs in a thread, so the event
    loop stays free. Use a stream id of its own for each run: a request id
    ``<stream id>:<seq>`` that already has a result in Redis keeps that result.
    ``freshest`` sets ``ce_supersede`` on every frame: True lets a worker answer a
    frame ``superseded`` (status ``expired``) when a newer one is already waiting,
    so results keep up with live video under load; False asks for every frame;
    None leaves it to the worker's ``supersede_frames`` setting.
    Raises ``InvalidInput`` for a bad stream id or a broken file,
    ``UnknownModel`` and ``ServiceUnavailable`` as ``AsyncClient.submit`` does.
    """
    check_stream_id(stream_id, settings)
    try:
        topic = topics_for(model, settings.topic_prefix).requests
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    frames = source.frames()
    sender = RequestSender(settings)
    sent = 0
    try:
        while chunk := await _next_chunk(frames):
            records = [_frame_record(settings, stream_id, frame, freshest) for frame in chunk]
            await sender.send(model, topic, records)
            sent += len(chunk)
            if on_sent is not None:
                for frame in chunk:
                    on_sent(
                        SentFrame(frame_request_id(stream_id, frame.seq), frame.seq, frame.time_s)
                    )
    finally:
        frames.close()
        await sender.close()
    return sent


async def _next_chunk(frames: Iterator[Frame]) -> list[Frame]:
    """The next frames, decoded in a thread so that the event loop stays free.

    A caller cancelled meanwhile (Ctrl-C) waits for the thread to finish its
    chunk before it goes on: closing the generator or the file under a running
    decode would fail.
    """
    decoding = asyncio.ensure_future(
        asyncio.to_thread(lambda: list(itertools.islice(frames, _SEND_CHUNK)))
    )
    try:
        return await asyncio.shield(decoding)
    except asyncio.CancelledError:
        await asyncio.wait([decoding])
        raise


def _frame_record(
    settings: ClientSettings, stream_id: str, frame: Frame, freshest: bool | None
) -> OutgoingRecord:
    return encode_request(
        frame.jpeg,
        request_id=frame_request_id(stream_id, frame.seq),
        content_type=ContentType.JPEG,
        source=settings.source,
        stream=stream_id,
        seq=frame.seq,
        supersede=freshest,
        time=datetime.now(UTC),
        limits=settings.limits,
    )


# -- reading results in order --------------------------------------------------------------


class ReorderBuffer(Generic[T]):
    """Hands out items numbered 0, 1, 2, ... in order, whatever order they are added in.

    A pure core with no clock and no I/O: the reader decides when a gap has
    lasted long enough to give up on it (``skip_gap``). Items below the next
    number (late or duplicate) are ignored, and so is a second item with a
    number already held: the first one wins, as for results in Redis.
    """

    def __init__(self, start_seq: int = 0, capacity: int = _DEFAULT_BUFFER) -> None:
        """``start_seq``: the first number handed out; ``capacity``: most items held at once."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.next_seq = start_seq
        """The number handed out next."""
        self.capacity = capacity
        self._held: dict[int, T] = {}

    @property
    def held(self) -> int:
        """How many items wait for an earlier one."""
        return len(self._held)

    @property
    def full(self) -> bool:
        """Whether ``capacity`` items are held: the gap before them should be skipped."""
        return len(self._held) >= self.capacity

    def add(self, seq: int, item: T) -> bool:
        """Hold ``item`` until its turn; False when it is ignored (late or a duplicate)."""
        if seq < self.next_seq or seq in self._held:
            return False
        self._held[seq] = item
        return True

    def pop_ready(self) -> list[tuple[int, T]]:
        """The items that are next in order, removed from the buffer."""
        ready = []
        while self.next_seq in self._held:
            ready.append((self.next_seq, self._held.pop(self.next_seq)))
            self.next_seq += 1
        return ready

    def skip_gap(self) -> range:
        """Give up on the numbers missing before the lowest held item; returns them.

        Empty when nothing is held: with no later item there is no gap yet.
        """
        if not self._held:
            return range(0)
        missing = range(self.next_seq, min(self._held))
        self.next_seq = missing.stop
        return missing


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
        max_buffer: int = _DEFAULT_BUFFER,
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


class StreamReader:
    """The synchronous twin of ``AsyncStreamReader``: ``with`` it, then read ``results()``.

    Runs the reader on a private event loop in the calling thread, so use it
    from one thread. Enter it before sending the frames (or pass ``since``).
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
        max_buffer: int = _DEFAULT_BUFFER,
    ) -> None:
        """See ``AsyncStreamReader``."""
        self._reader = AsyncStreamReader(
            settings,
            model,
            stream_id,
            since=since,
            start_seq=start_seq,
            timeout=timeout,
            max_buffer=max_buffer,
        )
        self._runner: asyncio.Runner | None = None

    def __enter__(self) -> Self:
        runner = asyncio.Runner()
        try:
            runner.run(self._reader.__aenter__())
        except BaseException:
            runner.close()
            raise
        self._runner = runner
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            try:
                runner.run(self._reader.__aexit__(exc_type, exc, tb))
            finally:
                runner.close()

    def results(self, count: int | None = None) -> Iterator[FrameResult]:
        """See ``AsyncStreamReader.results``; stopping early (``break``) is fine."""
        if self._runner is None:
            raise RuntimeError("enter the reader (with) before reading results")
        runner = self._runner
        results = self._reader.results(count)
        try:
            while True:
                try:
                    yield runner.run(_next(results))
                except StopAsyncIteration:
                    return
        finally:
            if self._runner is not None:  # not left already: end the wait on its loop
                runner.run(results.aclose())


async def _next(results: AsyncIterator[T]) -> T:
    return await anext(results)


# -- the conveyor stream command -----------------------------------------------------------


def add_stream_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add ``conveyor stream`` to ``commands``; ``connection`` holds the connection options."""
    stream = commands.add_parser(
        "stream",
        parents=[connection],
        help="send a video file's frames to a model as one ordered stream",
        description="Decode SOURCE, keep --fps frames per second of video time, encode each "
        "as JPEG and send it as a request with ce_stream=STREAM_ID and ce_seq=N (0, 1, 2, ...), "
        "request id STREAM_ID:N. Prints one JSON line per frame sent, or per result with "
        "--wait. Use a fresh stream id for each run: an id that already has a result in Redis "
        "keeps it.",
    )
    stream.add_argument("source", type=Path, metavar="SOURCE", help="a video file PyAV can read")
    stream.add_argument("--model", required=True, help="model name (topic conveyor.MODEL.requests)")
    stream.add_argument("--stream-id", required=True, help="the stream's id (ce_stream)")
    stream.add_argument(
        "--fps", type=_fps, help="frames per second of video time to send (default: every frame)"
    )
    stream.add_argument("--max-frames", type=_at_least_one, help="stop after sending N frames")
    stream.add_argument(
        "--jpeg-quality",
        type=_quality,
        default=_DEFAULT_QUALITY,
        help=f"1 (smallest) to 95 (best), default {_DEFAULT_QUALITY}",
    )
    stream.add_argument("--size", type=_size, metavar="WxH", help="resize frames, e.g. 224x224")
    stream.add_argument("--wait", action="store_true", help="then print the results in frame order")
    stream.add_argument(
        "--freshest",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="freshest-frame mode (ce_supersede): a frame still waiting when a newer one "
        "arrives is answered 'superseded' instead of run; --no-freshest asks for every frame "
        "(default: the worker's setting)",
    )
    stream.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds --wait waits for each next result (default 30)",
    )
    stream.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr while sending (default: on a terminal)",
    )
    stream.set_defaults(handler=_runner(run_stream))


async def run_stream(args: argparse.Namespace, settings: ClientSettings) -> int:
    """``conveyor stream``: exit status 0 when sent (and with --wait every result ok), else 1."""
    check_stream_id(args.stream_id, settings)
    with VideoSource(
        args.source,
        fps=args.fps,
        max_frames=args.max_frames,
        size=args.size,
        jpeg_quality=args.jpeg_quality,
    ) as source:
        if not args.wait:
            await _send(args, settings, source, _print_sent)
            return EXIT_OK
        # Entered before sending, so no result can come before the reader looks.
        async with AsyncStreamReader(
            settings, args.model, args.stream_id, timeout=args.timeout
        ) as reader:
            sent = await _send(args, settings, source, None)
            status = EXIT_OK
            async with aclosing(reader.results(sent)) as results:
                async for frame in results:
                    _print_json(_frame_document(frame))
                    if not _answered(frame, args.freshest):
                        status = EXIT_NOT_OK
            return status


async def _send(
    args: argparse.Namespace,
    settings: ClientSettings,
    source: VideoSource,
    on_sent: Callable[[SentFrame], None] | None,
) -> int:
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    expected = source.expected_frames
    progress = ProgressBar(expected, "frames sent", sys.stderr) if show and expected else None

    def sent_one(frame: SentFrame) -> None:
        if on_sent is not None:
            on_sent(frame)
        if progress is not None:
            progress.advance()

    try:
        sent = await stream_video(
            settings,
            source,
            model=args.model,
            stream_id=args.stream_id,
            on_sent=sent_one,
            freshest=args.freshest,
        )
    finally:
        if progress is not None:
            progress.close()
    print(
        f"conveyor stream: sent {sent} frames of {source.path} to model {args.model} as "
        f"stream {args.stream_id}",
        file=sys.stderr,
    )
    return sent


def _answered(frame: FrameResult, freshest: bool | None) -> bool:
    """Whether the frame got the answer asked for: ok, or superseded when asked for that."""
    result = frame.result
    if result is None:
        return False
    if result.status is Status.ok:
        return True
    code = result.error.code if result.error is not None else None
    return freshest is not False and code == ErrorCode.superseded


def _print_sent(frame: SentFrame) -> None:
    _print_json({"id": frame.request_id, "seq": frame.seq, "time_s": frame.time_s})


def _frame_document(frame: FrameResult) -> dict[str, Any]:
    if frame.result is None:
        return {"id": frame.request_id, "seq": frame.seq, "status": "missing"}
    document: dict[str, Any] = frame.result.model_dump(mode="json")
    return {"seq": frame.seq, **document}


def _print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(document).decode() + "\n")
    sys.stdout.flush()


def _fps(text: str) -> Fraction:
    try:
        fps = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(
            f"not a number: {text!r} (e.g. 10, 29.97, 30000/1001)"
        ) from None
    if fps <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return fps


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def _quality(text: str) -> int:
    value = _at_least_one(text)
    if value > 95:
        raise argparse.ArgumentTypeError(f"must be 1–95, not {value}")
    return value


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or min(int(width), int(height)) < 1:
        raise argparse.ArgumentTypeError(f"must be WIDTHxHEIGHT like 224x224, not {text!r}")
    return int(width), int(height)
