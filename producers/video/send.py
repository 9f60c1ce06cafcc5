"""Sending a stream: a source's frames, in order, as requests of one stream (``stream_video``)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from producers.errors import InvalidInput
from producers.sender import RequestSender
from producers.settings import ClientSettings
from producers.video.ids import check_stream_id, frame_request_id
from producers.video.source import Frame, FrameSource
from schemas import ContentType, OutgoingRecord, encode_request, topics_for

_SEND_CHUNK = 64  # frames sent at most at a time: one acknowledgement wait per chunk
_PUT_POLL_S = 0.1  # how often a decoder waiting for room looks whether it was stopped


@dataclass(frozen=True, slots=True)
class SentFrame:
    """A frame the broker has acknowledged."""

    request_id: str  # <stream id>:<seq>
    seq: int
    time_s: float  # a file's presentation time; a live source's time since its first frame
    captured: datetime | None = None  # its ce_capturetime, if it had one


async def stream_video(
    settings: ClientSettings,
    source: FrameSource,
    *,
    model: str,
    stream_id: str,
    on_sent: Callable[[SentFrame], None] | None = None,
    freshest: bool | None = None,
) -> int:
    """Send ``source``'s frames to ``model`` as stream ``stream_id``; returns how many were sent.

    ``source`` is a file (``VideoSource``) or a live source (``LiveSource``).
    Frames are decoded on a thread of their own and sent in order as they come:
    whatever is ready (up to 64 frames) goes in one send, so a file read as fast
    as it decodes goes in large sends and a live or real-time source frame by
    frame, without waiting for a chunk to fill. ``on_sent`` is called for each
    frame once the broker has it. Use a stream id of its own for each run: a
    request id ``<stream id>:<seq>`` that already has a result in Redis keeps
    that result. ``freshest`` sets ``ce_supersede`` on every frame: True lets a
    worker answer a frame ``superseded`` (status ``expired``) when a newer one is
    already waiting, so results keep up with live video under load; False asks
    for every frame; None leaves it to the worker's ``supersede_frames`` setting.
    Raises ``InvalidInput`` for a bad stream id or a broken file, ``SourceLost``
    when a live source could not be reopened, ``UnknownModel`` and
    ``ServiceUnavailable`` as ``AsyncClient.submit`` does.
    """
    check_stream_id(stream_id, settings)
    try:
        topic = topics_for(model, settings.topic_prefix).requests
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    sender = RequestSender(settings)
    feed = FrameFeed(source)
    sent = 0
    try:
        while chunk := await feed.next_chunk():
            records = [_frame_record(settings, stream_id, frame, freshest) for frame in chunk]
            await sender.send(model, topic, records)
            sent += len(chunk)
            if on_sent is not None:
                for frame in chunk:
                    request_id = frame_request_id(stream_id, frame.seq)
                    on_sent(SentFrame(request_id, frame.seq, frame.time_s, frame.captured))
    finally:
        await feed.stop()
        await sender.close()
    return sent


class FrameFeed:
    """A source's ``frames()`` run on a thread of its own, handed to the event loop.

    At most ``capacity`` decoded frames wait to be sent; the decoder waits for
    room beyond that, so a file is never decoded far ahead of the sends.
    ``stop()`` asks the source to end and waits for the thread, so the source
    can be closed afterwards (closing it under a running decode would fail).
    """

    def __init__(self, source: FrameSource, capacity: int = 2 * _SEND_CHUNK) -> None:
        self._source = source
        self._frames: queue.Queue[Frame] = queue.Queue(capacity)
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()  # set when frames were queued or the thread ended
        self._ended = False
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-stream-decode")
        self._thread.start()

    async def next_chunk(self) -> list[Frame]:
        """The frames ready now (at least one, at most 64); [] once the source ended.

        Re-raises what the source raised (a broken file, a lost source).
        """
        while True:
            chunk: list[Frame] = []
            while len(chunk) < _SEND_CHUNK:
                try:
                    chunk.append(self._frames.get_nowait())
                except queue.Empty:
                    break
            if chunk:
                return chunk
            if self._ended:
                if self._error is not None:
                    raise self._error
                return []
            self._ready.clear()
            if self._frames.empty():  # nothing was queued between the look and the clear
                await self._ready.wait()

    async def stop(self) -> None:
        """End the source's frames and wait for the thread; cancelling waits for it too."""
        self._stopping.set()
        self._source.stop()
        joining = asyncio.ensure_future(asyncio.to_thread(self._thread.join))
        try:
            await asyncio.shield(joining)
        except asyncio.CancelledError:
            await asyncio.wait([joining])
            raise

    def _run(self) -> None:
        frames = self._source.frames()
        try:
            for frame in frames:
                if not self._put(frame):
                    return
        except BaseException as exc:  # handed to the event loop, raised by next_chunk
            self._error = exc
        finally:
            frames.close()
            self._loop.call_soon_threadsafe(self._end)

    def _put(self, frame: Frame) -> bool:
        """Queue ``frame`` once there is room; False if stopped meanwhile."""
        while not self._stopping.is_set():
            try:
                self._frames.put(frame, timeout=_PUT_POLL_S)
            except queue.Full:
                continue
            self._loop.call_soon_threadsafe(self._ready.set)
            return True
        return False

    def _end(self) -> None:
        self._ended = True
        self._ready.set()


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
        capture_time=frame.captured,
        limits=settings.limits,
    )
