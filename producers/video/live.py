"""Live sources: network streams (RTSP, HTTP, HLS, ...) and V4L2 cameras, reopened when they drop.

A live source has no end of its own: ``frames()`` goes on until ``max_frames``
or ``stop()``. When the source drops (a read error, a read that times out, or
the stream ending), it is reopened, first at once and then every few seconds,
for up to ``reconnect_for`` seconds; each drop that ended in a reconnection is
logged twice (when it drops, when frames come back) and kept in ``gaps``.
Frames keep counting across a reconnection: ``seq`` is the number of frames
sent before, so request ids ``<stream id>:<seq>`` stay unique and a reader sees
no missing frame; the gap shows in the frames' capture times instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from types import TracebackType
from typing import TYPE_CHECKING, Self
from urllib.parse import urlsplit, urlunsplit

from producers.errors import InvalidInput, SourceLost
from producers.video.source import (
    DEFAULT_QUALITY,
    Frame,
    FrameSampler,
    JpegEncoder,
    OpenFailed,
    check_max_frames,
    ffmpeg_reason,
    frame_time,
    open_container,
    video_stream,
)

if TYPE_CHECKING:
    import av.container
    import av.video.frame

log = logging.getLogger(__name__)

NETWORK_SCHEMES = frozenset(
    {"rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "srt", "udp", "tcp"}
)
"""URL schemes read as live network sources (an ``.m3u8`` URL over HTTP is HLS)."""
V4L2_PREFIX = "/dev/video"
DEFAULT_RECONNECT_S = 60.0
_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)  # waits between attempts to reopen; the last one repeats


def is_live(source: str) -> bool:
    """Whether ``source`` names a live source (a URL or a V4L2 device) rather than a file."""
    return source.startswith(V4L2_PREFIX) or urlsplit(source).scheme.lower() in NETWORK_SCHEMES


def without_password(url: str) -> str:
    """``url`` with the password of its user info, if any, written ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


@dataclass(frozen=True, slots=True)
class Gap:
    """A drop of a live source that ended in a reconnection."""

    after_seq: int  # the last frame kept before the drop (-1: none yet)
    seconds: float  # from that frame to the first one kept after the reconnection
    reason: str  # why the source dropped


class LiveSource:
    """A live video source opened for sampling: ``frames()`` yields ``Frame``s until stopped.

    ``url`` is a URL PyAV (FFmpeg) reads (``rtsp://``, ``http://`` for MPEG-TS,
    MJPEG or an HLS ``.m3u8`` playlist, ``rtmp://``, ``srt://``, ``udp://``) or a
    V4L2 device (``/dev/video0``). ``options`` are FFmpeg's options for it (e.g.
    ``{"video_size": "640x480", "framerate": "30"}`` for a camera); RTSP is
    read over TCP unless ``rtsp_transport`` says otherwise. Opening connects
    and reads the stream's header, so a source that cannot be reached fails
    here, with ``InvalidInput``; only a source that dropped later is reopened.
    Each frame's capture time is when it came out of the decoder (the earliest
    time this host knows of it) and ``time_s`` counts from the first frame.
    ``SourceLost`` ends ``frames()`` when a reopening did not succeed within
    ``reconnect_for`` seconds (0: the first drop ends it).
    """

    def __init__(
        self,
        url: str,
        *,
        fps: Fraction | None = None,
        max_frames: int | None = None,
        size: tuple[int, int] | None = None,
        jpeg_quality: int = DEFAULT_QUALITY,
        reconnect_for: float = DEFAULT_RECONNECT_S,
        options: Mapping[str, str] | None = None,
        open_timeout_s: float = 10.0,
        read_timeout_s: float = 5.0,
    ) -> None:
        """Connect to ``url`` (see the class doc); sampling and encoding as ``VideoSource``."""
        check_max_frames(max_frames)
        if reconnect_for < 0:
            raise InvalidInput(f"reconnect_for must be >= 0 seconds, not {reconnect_for}")
        self._encoder = JpegEncoder(size, jpeg_quality)
        self.url = url
        self._fps = fps
        self._max_frames = max_frames
        self._reconnect_for = reconnect_for
        self._format = "v4l2" if url.startswith(V4L2_PREFIX) else None
        self._options = dict(options or {})
        if urlsplit(url).scheme.lower() in ("rtsp", "rtsps"):
            self._options.setdefault("rtsp_transport", "tcp")
        self._timeouts = (open_timeout_s, read_timeout_s)
        self._stopping = threading.Event()
        self.gaps: list[Gap] = []
        """Each drop that ended in a reconnection, in order."""
        self._drop_reason = ""  # why the current connection's frames ended
        try:
            self._container = self._open(open_timeout_s)
        except OpenFailed as exc:
            raise InvalidInput(f"cannot open live source {self.name}: {exc.reason}") from None
        self._stream = video_stream(self._container, self.name)

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
        return without_password(self.url)

    @property
    def expected_frames(self) -> int | None:
        return self._max_frames

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        """Release the connection."""
        self._container.close()

    def frames(self) -> Generator[Frame, None, None]:
        """Decode, sample, resize and encode; reconnect after a drop (see the class doc)."""
        seq = 0
        started: float | None = None  # monotonic time of the first frame kept
        last: float | None = None  # ... and of the latest one
        dropped: str | None = None  # why the source last dropped, until frames come back
        while not self._stopping.is_set():
            sampler = FrameSampler(self._fps)  # timestamps restart with each connection
            sampled = self._fps is not None
            for index, frame in self._decoded():
                now, captured = time.monotonic(), datetime.now(UTC)
                if not sampler.keep(frame_time(frame, index, self._stream, sampled, self.name)):
                    continue
                if started is None:
                    started = now
                if dropped is not None:
                    self._resumed(seq - 1, now - (last if last is not None else now), dropped)
                    dropped = None
                last = now
                yield Frame(seq, now - started, self._encoder.encode(frame), captured)
                seq += 1
                if seq == self._max_frames or self._stopping.is_set():
                    return
            dropped = self._drop_reason
            log.warning(
                "conveyor stream: %s dropped after frame %d (%s); reconnecting for up to %g s",
                self.name,
                seq - 1,
                dropped,
                self._reconnect_for,
            )
            if not self._reconnect(seq - 1, dropped):
                return

    def _decoded(self) -> Generator[tuple[int, av.video.frame.VideoFrame], None, None]:
        """The current connection's frames with their index; sets ``_drop_reason`` at the end."""
        import av  # present: the constructor opened the source with it

        decoding = self._container.decode(self._stream)
        index = 0
        while True:
            try:
                frame = next(decoding)
            except StopIteration:
                self._drop_reason = "the stream ended"
                return
            except (av.FFmpegError, OSError) as exc:  # a read failed or timed out
                self._drop_reason = ffmpeg_reason(exc)
                return
            yield index, frame
            index += 1

    def _reconnect(self, after_seq: int, reason: str) -> bool:
        """Reopen the source; False when stopped meanwhile. Raises ``SourceLost``."""
        self._container.close()
        give_up = time.monotonic() + self._reconnect_for
        attempt = 0
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise SourceLost(self.name, after_seq, reason, self._reconnect_for)
            try:
                container = self._open(min(self._timeouts[0], max(left, 0.5)))
                stream = video_stream(container, self.name)
            except OpenFailed as exc:
                reason = exc.reason
            except InvalidInput as exc:  # it came back without a video stream
                reason = str(exc)
            else:
                self._container, self._stream = container, stream
                return True
            wait = _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]
            attempt += 1
            if self._stopping.wait(min(wait, max(give_up - time.monotonic(), 0))):
                return False

    def _resumed(self, after_seq: int, seconds: float, reason: str) -> None:
        self.gaps.append(Gap(after_seq, seconds, reason))
        log.warning(
            "conveyor stream: %s is back after %.1f s without frames (%s); next frame %d, "
            "reconnection %d",
            self.name,
            seconds,
            reason,
            after_seq + 1,
            len(self.gaps),
        )

    def _open(self, open_timeout_s: float) -> av.container.InputContainer:
        return open_container(
            self.url,
            format=self._format,
            options=self._options,
            timeout=(open_timeout_s, self._timeouts[1]),
        )
