"""Sending a stream: a video's frames, in order, as requests of one stream (``stream_video``)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from producers.errors import InvalidInput
from producers.sender import RequestSender
from producers.settings import ClientSettings
from producers.video.ids import check_stream_id, frame_request_id
from producers.video.source import Frame, VideoSource
from schemas import ContentType, OutgoingRecord, encode_request, topics_for

_SEND_CHUNK = 64  # frames decoded, then sent, at a time: one acknowledgement wait per chunk


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
