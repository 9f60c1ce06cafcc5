"""Reading video files and live sources into frames to send, and the ``conveyor stream``
arguments.

Videos are written by the tests themselves with PyAV, so nothing is fetched; the
live source is ``tests.live_video.LiveVideoServer``, an HTTP server on loopback.
"""

from __future__ import annotations

import io
import re
import sys
import threading
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from producers.errors import InvalidInput
from producers.testing import free_port
from producers.video import (
    LiveSource,
    Pacer,
    SourceLost,
    VideoSource,
    is_live,
)
from producers.video.command import open_source
from producers.video.live import without_password
from tests.fakes import FakeClock
from tests.live_video import LiveVideoServer
from tests.videos import every_40_ms, stream_parser, write_video


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


def test_stream_command_reads_its_options() -> None:
    argv = "stream v.mp4 --model digits --stream-id cam1 --fps 30000/1001 --max-frames 5"
    args = stream_parser().parse_args(
        [*argv.split(), "--jpeg-quality=70", "--size=224x160", "--wait"]
    )

    assert (args.source, args.model, args.stream_id) == ("v.mp4", "digits", "cam1")
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
        stream_parser().parse_args(["stream", "v.mp4", "--model", "m", "--stream-id", "s", option])

    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err


def test_stream_command_reads_the_live_options() -> None:
    argv = "stream rtsp://cam/1 --model m --stream-id s --reconnect-for 2.5"
    args = stream_parser().parse_args(
        [*argv.split(), "--input-option", "video_size=640x480", "--input-option=framerate=30"]
    )

    assert (args.source, args.reconnect_for, args.realtime) == ("rtsp://cam/1", 2.5, False)
    assert args.input_option == [("video_size", "640x480"), ("framerate", "30")]
    assert (
        stream_parser()
        .parse_args(["stream", "v.mp4", "--model", "m", "--stream-id", "s", "--realtime"])
        .realtime
    )


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("--reconnect-for=-1", "must be a finite number >= 0"),
        ("--reconnect-for=soon", "not a number of seconds"),
        ("--input-option=video_size", "must be KEY=VALUE"),
        ("--input-option==30", "must be KEY=VALUE"),
    ],
)
def test_stream_command_refuses_bad_live_options(
    option: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        stream_parser().parse_args(
            ["stream", "rtsp://cam", "--model", "m", "--stream-id", "s", option]
        )

    assert why in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        ("rtsp://cam/1 --realtime", "a live source comes at its own pace"),
        ("/dev/video0 --wait", "give --max-frames N"),
        ("v.mp4 --reconnect-for 5", "v.mp4 is a file"),
        ("v.mp4 --input-option framerate=30", "v.mp4 is a file"),
    ],
)
def test_options_that_do_not_fit_the_source_are_refused_before_opening(argv: str, why: str) -> None:
    args = stream_parser().parse_args(["stream", *argv.split(), "--model", "m", "--stream-id", "s"])

    with pytest.raises(InvalidInput, match=re.escape(why)):
        open_source(args)


@pytest.mark.parametrize(
    ("source", "live"),
    [
        ("rtsp://10.0.0.5:554/stream1", True),
        ("RTSPS://cam/1", True),
        ("http://cam.local/video.mjpg", True),
        ("https://example.com/live/index.m3u8", True),
        ("srt://relay:9000", True),
        ("udp://239.0.0.1:1234", True),
        ("/dev/video0", True),
        ("clip.mp4", False),
        ("/videos/rtsp-capture.ts", False),
        ("C:/videos/clip.mp4", False),
    ],
)
def test_live_sources_are_urls_and_v4l2_devices(source: str, live: bool) -> None:
    assert is_live(source) is live


def test_passwords_in_source_urls_are_hidden() -> None:
    assert (
        without_password("rtsp://admin:s3cret@10.0.0.5:554/s1")
        == "rtsp://admin:***@10.0.0.5:554/s1"
    )
    assert without_password("rtsp://10.0.0.5/s1") == "rtsp://10.0.0.5/s1"


def test_pacer_holds_each_frame_until_its_presentation_time() -> None:
    clock = FakeClock(100.0)
    start = datetime(2025, 1, 31, 12, tzinfo=UTC)
    pacer = Pacer(wait=clock.wait, monotonic=clock, wall=lambda: start)

    due = [pacer.due(Fraction(ms, 1000)) for ms in (500, 540, 580)]
    clock.now += 0.1  # encoding frame 3 took 100 ms: it is late
    due.append(pacer.due(Fraction(620, 1000)))
    due.append(pacer.due(Fraction(800, 1000)))

    # The first frame fixes the schedule; a late one goes at once and the rest keep to it.
    assert clock.waits == [0.04, 0.04, 0.12]
    assert [(d - start).total_seconds() for d in due] == pytest.approx([0, 0.04, 0.08, 0.12, 0.3])


def test_a_paced_file_stamps_frames_with_their_times_and_an_unpaced_one_does_not(
    tmp_path: Path,
) -> None:
    path = write_video(tmp_path / "v.mp4", [0, 40, 80, 200])

    with VideoSource(path, realtime=True) as source:
        paced = list(source.frames())
    with VideoSource(path) as source:
        unpaced = list(source.frames())

    assert all(f.captured is None for f in unpaced)
    captured = [f.captured for f in paced]
    assert None not in captured
    offsets = [(c - captured[0]).total_seconds() for c in captured if c and captured[0]]
    assert offsets == pytest.approx([0, 0.04, 0.08, 0.2], abs=1e-6)


def test_an_unreachable_live_source_is_refused_at_once_without_its_password() -> None:
    url = f"http://viewer:hunter2@127.0.0.1:{free_port()}/live.ts"

    with pytest.raises(InvalidInput) as refused:
        LiveSource(url)

    assert "cannot open live source http://viewer:***@127.0.0.1" in str(refused.value)
    assert "Connection refused" in str(refused.value)
    assert "hunter2" not in str(refused.value)


@pytest.mark.timeout(30)
def test_a_live_source_that_stays_away_ends_with_source_lost() -> None:
    server = LiveVideoServer(free_port())
    server.start()
    source = LiveSource(server.url, reconnect_for=1.0)
    frames = source.frames()
    try:
        assert [next(frames).seq for _ in range(5)] == [0, 1, 2, 3, 4]
        server.stop()
        with pytest.raises(SourceLost) as lost:
            list(frames)
    finally:
        frames.close()
        source.close()
        server.stop()

    assert lost.value.after_seq >= 4
    assert f"dropped after frame {lost.value.after_seq}" in str(lost.value)
    assert "could not be reopened within 1 s" in str(lost.value)
    assert source.gaps == []


@pytest.mark.timeout(30)
def test_a_live_source_stops_when_asked_while_it_waits_to_reconnect() -> None:
    with LiveVideoServer(free_port()) as server:
        source = LiveSource(server.url, reconnect_for=60)
    # The server is gone: the source waits to reopen it until stopped.
    frames = source.frames()
    timer = threading.Timer(0.5, source.stop)
    timer.start()
    try:
        seqs = [frame.seq for frame in frames]
    finally:
        timer.join()
        source.close()

    assert seqs == list(range(len(seqs)))  # ended by stop(): no SourceLost, no reconnection
    assert source.gaps == []
