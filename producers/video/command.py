"""``conveyor stream``: send a video's frames as one stream, optionally print the results.

The video is a file, played as fast as it decodes or in real time (``--realtime``),
or a live source (a URL or a V4L2 device), reconnected when it drops.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import aclosing, closing
from fractions import Fraction
from pathlib import Path
from typing import Any

import orjson

from producers.commands import EXIT_NOT_OK, EXIT_OK, runner
from producers.errors import InvalidInput
from producers.progress import ProgressBar
from producers.settings import ClientSettings
from producers.video.ids import check_stream_id
from producers.video.live import DEFAULT_RECONNECT_S, LiveSource, is_live
from producers.video.reader import AsyncStreamReader, FrameResult
from producers.video.send import SentFrame, stream_video
from producers.video.source import DEFAULT_QUALITY, FrameSource, VideoSource
from schemas import ErrorCode, Status


def add_stream_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    connection: argparse.ArgumentParser,
) -> None:
    """Add ``conveyor stream`` to ``commands``; ``connection`` holds the connection options."""
    stream = commands.add_parser(
        "stream",
        parents=[connection],
        help="send a video's frames (a file, a camera, a network stream) to a model as one "
        "ordered stream",
        description="Decode SOURCE, keep --fps frames per second of video time, encode each "
        "as JPEG and send it as a request with ce_stream=STREAM_ID and ce_seq=N (0, 1, 2, ...), "
        "request id STREAM_ID:N. SOURCE is a video file, a URL (rtsp://, http:// for MPEG-TS, "
        "MJPEG or an HLS .m3u8 playlist, rtmp://, srt://, udp://) or a V4L2 device "
        "(/dev/video0); a live source is read until --max-frames or Ctrl-C and reopened "
        "when it drops. Prints one JSON line per frame sent, or per result with "
        "--wait. Use a fresh stream id for each run: an id that already has a result in Redis "
        "keeps it.",
    )
    stream.add_argument(
        "source",
        metavar="SOURCE",
        help="a video file PyAV can read, a stream URL or a V4L2 device",
    )
    stream.add_argument("--model", required=True, help="model name (topic conveyor.MODEL.requests)")
    stream.add_argument("--stream-id", required=True, help="the stream's id (ce_stream)")
    stream.add_argument(
        "--fps", type=_fps, help="frames per second of video time to send (default: every frame)"
    )
    stream.add_argument("--max-frames", type=_at_least_one, help="stop after sending N frames")
    stream.add_argument(
        "--jpeg-quality",
        type=_quality,
        default=DEFAULT_QUALITY,
        help=f"1 (smallest) to 95 (best), default {DEFAULT_QUALITY}",
    )
    stream.add_argument("--size", type=_size, metavar="WxH", help="resize frames, e.g. 224x224")
    stream.add_argument(
        "--realtime",
        action="store_true",
        help="play a file in real time: each frame is sent at its presentation time and "
        "stamped with it (ce_capturetime); live sources come at their own pace",
    )
    stream.add_argument(
        "--reconnect-for",
        type=_seconds,
        metavar="S",
        help="live sources: how long to try reopening a source that dropped before giving "
        f"up (exit status 4); 0 ends at the first drop (default {DEFAULT_RECONNECT_S:g})",
    )
    stream.add_argument(
        "--input-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="live sources: an FFmpeg option for opening it, e.g. video_size=640x480, "
        "framerate=30, rtsp_transport=udp (repeatable)",
    )
    stream.add_argument(
        "--wait",
        action="store_true",
        help="then print the results in frame order (a live source needs --max-frames)",
    )
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
    stream.set_defaults(handler=runner(run_stream))


async def run_stream(args: argparse.Namespace, settings: ClientSettings) -> int:
    """``conveyor stream``: exit status 0 when sent (and with --wait every result ok), else 1."""
    check_stream_id(args.stream_id, settings)
    with closing(open_source(args)) as source:
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


def open_source(args: argparse.Namespace) -> FrameSource:
    """The file or live source ``args`` name, opened; ``InvalidInput`` for options that do not
    fit it, before anything connects."""
    if not is_live(args.source):
        if args.reconnect_for is not None or args.input_option:
            raise InvalidInput(
                f"--reconnect-for and --input-option are for live sources (a URL or a "
                f"/dev/video device), and {args.source} is a file"
            )
        return VideoSource(
            Path(args.source),
            fps=args.fps,
            max_frames=args.max_frames,
            size=args.size,
            jpeg_quality=args.jpeg_quality,
            realtime=args.realtime,
        )
    if args.realtime:
        raise InvalidInput(
            "--realtime plays a file at its frame times; a live source comes at its own pace"
        )
    if args.wait and args.max_frames is None:
        raise InvalidInput(
            "--wait prints the results once sending has ended, and a live source does not "
            "end by itself: give --max-frames N, or read the results with AsyncStreamReader "
            "while sending"
        )
    return LiveSource(
        args.source,
        fps=args.fps,
        max_frames=args.max_frames,
        size=args.size,
        jpeg_quality=args.jpeg_quality,
        reconnect_for=DEFAULT_RECONNECT_S if args.reconnect_for is None else args.reconnect_for,
        options=dict(args.input_option),
    )


async def _send(
    args: argparse.Namespace,
    settings: ClientSettings,
    source: FrameSource,
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
    gaps = ""
    if isinstance(source, LiveSource):
        seconds = sum(gap.seconds for gap in source.gaps)
        gaps = f" ({len(source.gaps)} reconnections, {seconds:.1f} s without frames)"
    print(
        f"conveyor stream: sent {sent} frames of {source.name} to model {args.model} as "
        f"stream {args.stream_id}{gaps}",
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
    document: dict[str, Any] = {"id": frame.request_id, "seq": frame.seq, "time_s": frame.time_s}
    if frame.captured is not None:
        document["captured"] = frame.captured.isoformat()
    _print_json(document)


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE like video_size=640x480, not {text!r}")
    return key, value
