"""Video and frame pipelines: send a video's frames as one ordered stream, read results in order.

Sending (``conveyor stream``, ``stream_video``): ``VideoSource`` decodes a file
with PyAV, keeps frames by presentation time (``FrameSampler``), optionally
plays it in real time (``Pacer``), resizes frames and encodes each as JPEG.
``LiveSource`` does the same for a live source (an RTSP, HTTP or HLS URL, a
V4L2 camera) and reopens it when it drops (``Gap``, ``SourceLost``). Frames of
live and real-time sources carry their capture time (``ce_capturetime``).
Every kept frame becomes one request
with ``ce_stream=<stream id>``, ``ce_seq=<n>`` (0, 1, 2, ... in the order sent)
and the request id ``<stream id>:<n>``, sent through the SDK's ``RequestSender``.
The record key is the stream id, so one stream's frames stay in one partition,
in order.

Reading (``AsyncStreamReader``, ``StreamReader``): a reader of its own (no
consumer group) on the model's results topic keeps the results of one stream,
recognised by their request ids, and hands them out in frame order. Results
are keyed by request id, so one stream's results spread over the topic's
partitions and may arrive out of order; ``ReorderBuffer`` puts them back.

PyAV (``av``) and Pillow are needed only to send: ``pip install 'conveyor-serve[video]'``.

Modules, by concern: ``ids`` (frame request ids), ``source`` (decoding and
sampling a file, and what live sources share with it), ``live`` (live sources),
``send`` (``stream_video``), ``reorder`` (the pure reorder buffer), ``reader``
(the readers) and ``command`` (``conveyor stream``).
"""

from producers.errors import SourceLost
from producers.video.command import add_stream_command, run_stream
from producers.video.ids import check_stream_id, frame_request_id, parse_frame_request_id
from producers.video.live import Gap, LiveSource, is_live
from producers.video.reader import AsyncStreamReader, FrameResult, StreamReader
from producers.video.reorder import ReorderBuffer
from producers.video.send import SentFrame, stream_video
from producers.video.source import Frame, FrameSampler, FrameSource, Pacer, VideoSource

__all__ = [
    "AsyncStreamReader",
    "Frame",
    "FrameResult",
    "FrameSampler",
    "FrameSource",
    "Gap",
    "LiveSource",
    "Pacer",
    "ReorderBuffer",
    "SentFrame",
    "SourceLost",
    "StreamReader",
    "VideoSource",
    "add_stream_command",
    "check_stream_id",
    "frame_request_id",
    "is_live",
    "parse_frame_request_id",
    "run_stream",
    "stream_video",
]
