"""A live video source for tests: an HTTP server that plays an endless MPEG-TS stream.

Each GET gets a stream of its own, encoded with PyAV as it is sent and paced in
real time (frame ``n`` leaves ``n / fps`` seconds after the first), as a camera
or a streaming server sends one. ``stop()`` ends every open stream and closes
the port, as a camera that drops off the network; ``start()`` serves again on
the same port.
"""

from __future__ import annotations

import contextlib
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Self

import av
import numpy as np


class LiveVideoServer:
    """Endless MPEG-TS over HTTP on 127.0.0.1:``port``, at ``fps`` frames of 64x64 a second."""

    def __init__(self, port: int, fps: int = 25) -> None:
        self.port = port
        self.fps = fps
        self.url = f"http://127.0.0.1:{port}/live.ts"
        self.connections = 0  # streams started, over every start()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Listen and serve (again, after ``stop()``) on the same port."""
        self._stopping.clear()
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        server.daemon_threads = False  # server_close() waits for the streams to end
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="live-video-server")
        self._thread.start()

    def stop(self) -> None:
        """End every open stream and stop listening; returns once they are closed."""
        if self._server is None or self._thread is None:
            return
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "video/mp2t")
                self.end_headers()
                server.connections += 1
                with contextlib.suppress(OSError, av.FFmpegError):  # the reader went away
                    server._play(self.wfile)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def _play(self, out: object) -> None:
        """Encode and send frames at ``fps`` until ``stop()``."""
        rate = Fraction(1, self.fps)
        with av.open(out, "w", format="mpegts") as container:
            stream = container.add_stream("mpeg4", rate=self.fps)
            assert isinstance(stream, av.VideoStream)
            stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
            stream.codec_context.time_base = rate
            started = time.monotonic()
            n = 0
            while not self._stopping.is_set():
                pixels = np.full((64, 64, 3), n % 256, dtype=np.uint8)
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts, frame.time_base = n, rate
                for packet in stream.encode(frame):
                    container.mux(packet)
                n += 1
                # Paced like a camera: the wait is the stream's frame interval.
                self._stopping.wait(max(0.0, started + n / self.fps - time.monotonic()))
