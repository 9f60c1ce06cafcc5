"""Videos the tests write themselves with PyAV (nothing is fetched), the ``conveyor
stream`` command's parser, and a stream's results read back: what the video source's
unit tests and the video integration tests share.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from contextlib import aclosing
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from producers.video import AsyncStreamReader, FrameResult, add_stream_command

_MS = Fraction(1, 1000)


def write_video(
    path: Path, times_ms: Sequence[int], size: tuple[int, int] = (64, 64), codec: str = "mpeg4"
) -> Path:
    """A video whose frame ``i`` is shown at ``times_ms[i]`` and is grey level ``i % 256``."""
    width, height = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=25)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = _MS
        for i, ms in enumerate(times_ms):
            pixels = np.full((height, width, 3), i % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = ms, _MS
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def every_40_ms(seconds: int) -> list[int]:
    return list(range(0, seconds * 1000, 40))  # 25 fps


def stream_parser() -> argparse.ArgumentParser:
    """The ``conveyor`` command line with its ``stream`` command alone."""
    root = argparse.ArgumentParser(prog="conveyor")
    commands = root.add_subparsers(dest="command", required=True)
    add_stream_command(commands, argparse.ArgumentParser(add_help=False))
    return root


async def collect(reader: AsyncStreamReader, count: int) -> list[FrameResult]:
    """The stream's next ``count`` results, in frame order."""
    async with aclosing(reader.results(count)) as results:
        return [frame async for frame in results]
