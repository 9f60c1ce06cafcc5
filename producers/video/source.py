"""Reading a video: decode a file with PyAV, keep frames by presentation time, encode JPEGs."""

from __future__ import annotations

import io
import math
from collections.abc import Generator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

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
        jpeg_quality: int = DEFAULT_QUALITY,
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
