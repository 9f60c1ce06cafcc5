"""Reading video files into frames to send, and the ``conveyor stream`` arguments.

Videos are written by the tests themselves with PyAV, so nothing is fetched.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from producers.errors import InvalidInput
from producers.video import VideoSource, add_stream_command

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


def test_frames_are_sampled_by_time_and_numbered_from_zero(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", every_40_ms(2))

    with VideoSource(path, fps=Fraction(10)) as source:
        expected = source.expected_frames
        frames = list(source.frames())

    assert [f.seq for f in frames] == list(range(20))
    assert [round(f.time_s, 3) for f in frames[:5]] == [0.0, 0.12, 0.2, 0.32, 0.4]
    assert expected == 20


def test_variable_frame_rate_is_sampled_by_presentation_time(tmp_path: Path) -> None:
    path = write_video(tmp_path / "vfr.mp4", [0, 10, 20, 30, 40, 500, 1000, 1010, 1500])

    with VideoSource(path, fps=Fraction(4)) as source:
        times = [f.time_s for f in source.frames()]

    assert times == [0.0, 0.5, 1.0, 1.5]


def test_frames_are_jpegs_of_the_requested_size(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", every_40_ms(1), size=(64, 48))

    with VideoSource(path, size=(32, 16), jpeg_quality=50) as source:
        frames = list(source.frames())

    assert len(frames) == 25  # no fps: every frame
    image = Image.open(io.BytesIO(frames[0].jpeg))
    assert (image.format, image.size) == ("JPEG", (32, 16))


def test_without_a_size_frames_keep_the_source_size(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", every_40_ms(1), size=(64, 48))

    with VideoSource(path, max_frames=1) as source:
        (frame,) = source.frames()

    assert Image.open(io.BytesIO(frame.jpeg)).size == (64, 48)


def test_max_frames_stops_early(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", every_40_ms(2))

    with VideoSource(path, fps=Fraction(10), max_frames=7) as source:
        assert source.expected_frames == 7
        assert [f.seq for f in source.frames()] == list(range(7))


def test_a_missing_file_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"cannot read video file .*nope\.mp4"):
        VideoSource(tmp_path / "nope.mp4")


def test_a_file_that_is_not_a_video_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.mp4"
    path.write_text("not a video at all\n" * 100)

    with pytest.raises(InvalidInput, match=r"cannot read video file .*notes\.mp4"):
        VideoSource(path)


def test_a_file_without_a_video_stream_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sound.wav"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        samples = av.AudioFrame.from_ndarray(
            np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono"
        )
        samples.sample_rate = 8000
        for packet in [*stream.encode(samples), *stream.encode()]:
            container.mux(packet)

    with pytest.raises(InvalidInput, match=r"sound\.wav has no video stream"):
        VideoSource(path)


def test_without_pyav_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # makes `import av` raise ImportError

    with pytest.raises(InvalidInput, match=r"pip install 'conveyor-serve\[video\]'"):
        VideoSource(tmp_path / "v.mp4")


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ({"max_frames": 0}, "max_frames must be >= 1"),
        ({"jpeg_quality": 96}, "jpeg_quality must be 1–95"),
        ({"size": (0, 10)}, "size must be at least 1x1"),
    ],
)
def test_bad_options_are_refused_before_opening(
    tmp_path: Path, option: dict[str, object], why: str
) -> None:
    with pytest.raises(InvalidInput, match=why):
        VideoSource(tmp_path / "v.mp4", **option)  # type: ignore[arg-type]


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="conveyor")
    commands = root.add_subparsers(dest="command", required=True)
    add_stream_command(commands, argparse.ArgumentParser(add_help=False))
    return root


def test_stream_command_reads_its_options() -> None:
    argv = "stream v.mp4 --model digits --stream-id cam1 --fps 30000/1001 --max-frames 5"
    args = parser().parse_args([*argv.split(), "--jpeg-quality=70", "--size=224x160", "--wait"])

    assert (args.source, args.model, args.stream_id) == (Path("v.mp4"), "digits", "cam1")
    assert args.fps == Fraction(30000, 1001)
    assert (args.max_frames, args.jpeg_quality, args.size, args.wait) == (5, 70, (224, 160), True)


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("--size=224", "WIDTHxHEIGHT"),
        ("--size=0x10", "WIDTHxHEIGHT"),
        ("--fps=0", "must be > 0"),
        ("--fps=fast", "not a number"),
        ("--jpeg-quality=100", "must be 1–95"),
        ("--max-frames=0", "must be >= 1"),
    ],
)
def test_stream_command_refuses_bad_options(
    option: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["stream", "v.mp4", "--model", "m", "--stream-id", "s", option])

    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err
