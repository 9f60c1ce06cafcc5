"""Reading a video file: decode with PyAV, keep frames by presentation time, encode JPEGs.

The pieces a live source (``producers.video.live``) shares are here too: the
``Frame`` sent, the ``FrameSource`` protocol ``stream_video`` reads, the
``FrameSampler``, the ``Pacer`` that plays a file in real time and the JPEG
encoding of a decoded frame.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self

from common.install import install_hint
from producers.errors import InvalidInput

if TYPE_CHECKING:
    import av.container
    import av.video.frame
    import av.video.stream

DEFAULT_QUALITY = 85
"""JPEG quality of the frames sent, unless told otherwise."""
_INSTALL_HINT = install_hint("video")


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


class Pacer:
    """Holds each frame until its presentation time comes round on the clock: real-time play.

    The first frame goes at once and fixes the schedule; a frame shown ``t``
    seconds after it goes ``t`` seconds after it did. A frame already late
    (decoding and encoding slower than real time) goes at once, and the
    schedule is kept, not shifted, so one slow frame does not delay the rest.
    ``due`` returns the frame's time on the wall clock: what a camera playing
    the file would have stamped it with.
    """

    def __init__(
        self,
        *,
        wait: Callable[[float], object] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """``wait(seconds)`` sleeps (an ``Event.wait`` makes the sleep interruptible)."""
        self._wait = wait
        self._monotonic = monotonic
        self._wall = wall
        self._start: tuple[Fraction, float, datetime] | None = None

    def due(self, time_s: Fraction) -> datetime:
        """Wait until the frame shown at ``time_s`` is due; its wall-clock time."""
        if self._start is None:
            self._start = (time_s, self._monotonic(), self._wall())
        first, started, started_wall = self._start
        offset = float(time_s - first)
        delay = started + offset - self._monotonic()
        if delay > 0:
            self._wait(delay)
        return started_wall + timedelta(seconds=offset)


@dataclass(frozen=True, slots=True)
class Frame:
    """One sampled frame, encoded and numbered, ready to send."""

    seq: int  # 0, 1, 2, ... in the order frames are kept, across reconnections too
    time_s: float  # a file's presentation time; a live source's time since its first frame
    jpeg: bytes
    captured: datetime | None = None  # sent as ce_capturetime; None for a file sent unpaced


class FrameSource(Protocol):
    """What ``stream_video`` reads: a file (``VideoSource``) or a live source (``LiveSource``)."""

    @property
    def name(self) -> str:
        """The file or the source, as messages name it (no password)."""
        ...

    @property
    def expected_frames(self) -> int | None:
        """About how many frames ``frames()`` will yield (for progress), None if unknown."""
        ...

    def frames(self) -> Generator[Frame, None, None]:
        """The frames to send, in order; may block (run it in a thread)."""
        ...

    def stop(self) -> None:
        """Make ``frames()`` end soon, from any thread (within a read timeout for live ones)."""
        ...

    def close(self) -> None:
        """Release the file or the connection, once ``frames()`` has ended."""
        ...


class JpegEncoder:
    """Resizes a decoded frame (``size``: width, height; None keeps it) and encodes a JPEG."""

    def __init__(self, size: tuple[int, int] | None, quality: int) -> None:
        if not 1 <= quality <= 95:
            raise InvalidInput(f"jpeg_quality must be 1–95, not {quality}")
        if size is not None and min(size) < 1:
            raise InvalidInput(f"size must be at least 1x1, not {size[0]}x{size[1]}")
        self._size = size
        self._quality = quality

    def encode(self, frame: av.video.frame.VideoFrame) -> bytes:
        width, height = self._size if self._size is not None else (frame.width, frame.height)
        try:
            image = frame.to_image(width=width, height=height)  # type: ignore[no-untyped-call]
        except ImportError as exc:
            raise InvalidInput(f"encoding frames as JPEG needs Pillow: {_INSTALL_HINT}") from exc
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=self._quality)
        return out.getvalue()


def check_max_frames(max_frames: int | None) -> None:
    if max_frames is not None and max_frames < 1:
        raise InvalidInput(f"max_frames must be >= 1, not {max_frames}")


def ffmpeg_reason(error: Exception) -> str:
    """Why FFmpeg failed, without the URL it puts in its errors (a URL may hold a password)."""
    strerror = getattr(error, "strerror", None)
    return strerror if isinstance(strerror, str) and strerror else str(error)


class OpenFailed(Exception):
    """FFmpeg could not open a source; ``reason`` says why without naming it."""

    def __init__(self, error: Exception) -> None:
        self.reason = ffmpeg_reason(error)
        super().__init__(str(error))


def open_container(
    target: str,
    *,
    format: str | None = None,
    options: Mapping[str, str] | None = None,
    timeout: tuple[float, float] | None = None,
) -> av.container.InputContainer:
    """``av.open`` for reading; ``InvalidInput`` without PyAV, ``OpenFailed`` if FFmpeg fails."""
    try:
        import av
    except ImportError as exc:
        # Imported here, not at the top: the rest of the SDK works without it.
        raise InvalidInput(f"reading video needs PyAV: {_INSTALL_HINT} ({exc})") from None
    try:
        return av.open(target, "r", format=format, options=dict(options or {}), timeout=timeout)
    except (av.FFmpegError, OSError) as exc:
        raise OpenFailed(exc) from None


def video_stream(container: av.container.InputContainer, name: str) -> av.video.stream.VideoStream:
    """The first video stream, set to decode on all cores; ``InvalidInput`` if there is none."""
    if not container.streams.video:
        container.close()
        raise InvalidInput(f"{name} has no video stream (only audio, subtitles or data)")
    stream: av.video.stream.VideoStream = container.streams.video[0]
    stream.thread_type = "AUTO"  # decode on all cores; frames still come in order
    return stream


def frame_time(
    frame: av.video.frame.VideoFrame,
    index: int,
    stream: av.video.stream.VideoStream,
    sampled: bool,
    name: str,
) -> Fraction:
    """Presentation time in seconds; from the frame rate when a frame has no timestamp."""
    if frame.pts is not None and frame.time_base is not None:
        return frame.pts * frame.time_base
    rate = stream.average_rate or stream.guessed_rate
    if rate:
        return index / rate
    if not sampled:
        return Fraction(index)  # every frame is kept; the time is only reported
    raise InvalidInput(
        f"{name}: frame {index} has no timestamp and the stream no frame rate, "
        "so frames cannot be sampled by time; leave out the fps to send every frame"
    )


class VideoSource:
    """A video file opened for sampling: ``frames()`` yields ``Frame``s to send.

    Opening reads the container header, so an unreadable file or one without a
    video stream fails here, with ``InvalidInput``, before anything connects.
    With ``realtime``, frames come at their presentation times (``Pacer``) and
    carry that time on the wall clock as their capture time; without it they
    come as fast as they decode and carry none. Close it (or use ``with``) to
    release the file.
    """

    def __init__(
        self,
        path: Path,
        *,
        fps: Fraction | None = None,
        max_frames: int | None = None,
        size: tuple[int, int] | None = None,
        jpeg_quality: int = DEFAULT_QUALITY,
        realtime: bool = False,
    ) -> None:
        """Open ``path``; keep ``fps`` frames per second (None: all), at most ``max_frames``.

        ``size``: ``(width, height)`` to resize each frame to; None keeps the
        source size. ``jpeg_quality``: 1 (smallest) to 95 (best).
        """
        check_max_frames(max_frames)
        self._encoder = JpegEncoder(size, jpeg_quality)
        self.path = path
        self._fps = fps
        self._max_frames = max_frames
        self._stopping = threading.Event()
        self._pacer = Pacer(wait=self._stopping.wait) if realtime else None
        try:
            self._container = open_container(str(path))
        except OpenFailed as exc:
            raise InvalidInput(f"cannot read video file {path}: {exc}") from None
        self._stream = video_stream(self._container, str(path))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def name(self) -> str:
        return str(self.path)

    def stop(self) -> None:
        self._stopping.set()

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
                time_s = frame_time(frame, index, self._stream, self._fps is not None, self.name)
                if not sampler.keep(time_s):
                    continue
                captured = None if self._pacer is None else self._pacer.due(time_s)
                if self._stopping.is_set():
                    return
                yield Frame(seq, float(time_s), self._encoder.encode(frame), captured)
                seq += 1
                if seq == self._max_frames:
                    return
        except av.FFmpegError as exc:
            raise InvalidInput(f"cannot decode {self.path} after {seq} frames: {exc}") from None

    def _duration_s(self) -> Fraction | None:
        stream = self._stream
        if stream.duration is not None and stream.time_base is not None:
            return stream.duration * stream.time_base
        if self._container.duration is not None:
            return Fraction(self._container.duration, 1_000_000)  # in AV_TIME_BASE units
        return None
