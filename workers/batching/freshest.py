"""Freshest-frame mode: which waiting frames a newer frame of their stream has superseded.

Live video wants the answer to the newest frame, not to every frame: under load,
answering frames in turn makes results lag the input by as long as the backlog.
In freshest-frame mode (a request's ``ce_supersede: true``, or the worker's
``supersede_frames`` for frames that do not say), a frame that is still waiting in
the worker (being decoded, ready, or in the batcher; not yet on the model) when a
newer frame of the same ``ce_stream`` arrives is answered ``superseded`` instead of
being run. "Newer" means later in the stream's partition: a stream's frames share
one partition (the record key is the stream id), and the worker receives them in
that order.

`LatestFrames` is the pure bookkeeping: the caller reports frames as they arrive
and as they leave (to the model, or answered some other way), and asks which
waiting frames are superseded. What is answered keeps the stream's order: a frame
runs only if no newer frame had arrived by the time its batch closed, so the
answers that come from the model are in frame order, and every frame still ends
with exactly one answer (``ok`` or ``superseded``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["LatestFrames"]

T = TypeVar("T")


class _Stream:
    __slots__ = ("newest", "newest_waiting", "waiting")

    def __init__(self, newest: object) -> None:
        self.newest = newest  # the frame that arrived last
        self.newest_waiting = True  # whether that frame has not left yet
        self.waiting = 0  # frames of the stream that arrived and have not left


class LatestFrames(Generic[T]):
    """Per stream, its newest frame, and how many waiting frames are superseded.

    ``stream_of(frame)`` is the frame's stream (any hashable key), or None for a
    request outside freshest-frame mode, which this class then ignores. Frames are
    told apart by identity. Memory is per stream with frames waiting: a stream
    whose frames have all left is forgotten.
    """

    def __init__(self, stream_of: Callable[[T], Hashable | None]) -> None:
        self._stream_of = stream_of
        self._streams: dict[Hashable, _Stream] = {}
        self.superseded = 0
        """Waiting frames with a newer frame of their stream: when 0, nothing to answer."""

    def __len__(self) -> int:
        """Frames waiting (arrived, not left) in freshest-frame mode."""
        return sum(stream.waiting for stream in self._streams.values())

    def arrived(self, frames: Iterable[T]) -> None:
        """Frames in arrival order; the newest of its stream supersedes the waiting ones."""
        streams, stream_of = self._streams, self._stream_of
        for frame in frames:
            key = stream_of(frame)
            if key is None:
                continue
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = _Stream(frame)
            else:
                if stream.newest_waiting:
                    self.superseded += 1  # the previous newest, and it is still waiting
                stream.newest, stream.newest_waiting = frame, True
            stream.waiting += 1

    def is_superseded(self, frame: T) -> bool:
        """Whether ``frame`` (arrived, not left) has a newer frame of its stream."""
        key = self._stream_of(frame)
        if key is None:
            return False
        stream = self._streams.get(key)
        return stream is not None and stream.newest is not frame

    def left(self, frames: Iterable[T]) -> None:
        """Frames that will wait no more: gone to the model, answered, or dropped."""
        if not self._streams:
            return
        streams, stream_of = self._streams, self._stream_of
        for frame in frames:
            key = stream_of(frame)
            stream = None if key is None else streams.get(key)
            if stream is None:
                continue
            if stream.newest is frame:
                stream.newest_waiting = False
            else:
                self.superseded -= 1
            stream.waiting -= 1
            if stream.waiting == 0:
                del streams[key]
