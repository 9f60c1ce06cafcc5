"""A local server of published weights for tests, in torch hub's and the Hugging Face Hub's forms.

The download tests cannot reach download.pytorch.org or huggingface.co, so they point
the download at this server, which serves real weights files the test saved:

- ``add(name, data)``: a file at ``/NAME``, which torch hub fetches with a plain GET;
- ``add_hf(repo, filename, data)``: a file of a Hugging Face repository at
  ``/REPO/resolve/main/FILENAME``. The ``huggingface_hub`` client (``HF_ENDPOINT`` set
  to ``url``) first sends a HEAD, answered with the headers the Hub sends: the commit,
  the ETag (the file's SHA-256, as the Hub's for a Git LFS file, unless ``etag`` says
  otherwise) and the size; then it GETs the file. A file the repository does not hold
  is a 404 with the Hub's ``EntryNotFound`` code.

``requests`` lists every (method, path) asked; ``stop()`` closes the port: a server
that is down, or a machine without a network.

torchvision hard-codes its weights' URLs, so a worker process is pointed at this server
by a handler class of the tests' own: ``--model tests.weights_server:MobileNetPublishedHere``
is ``torchvision:mobilenet_v3_small`` with its ``IMAGENET1K_V1`` weights at the URL in
``CONVEYOR_TEST_WEIGHTS_URL``; that URL is all it changes.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

import torch
import torchvision

from schemas import ContentType, Limits
from workers.model.loader import load_handler

COMMIT = "0123456789abcdef0123456789abcdef01234567"
URL_VARIABLE = "CONVEYOR_TEST_WEIGHTS_URL"


class WeightsServer:
    """Weights files over HTTP on 127.0.0.1, at any free port (``url``)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[bytes, str | None]] = {}  # path: data, ETag
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="weights")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop listening: from now on a connection to ``url`` is refused."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def add(self, name: str, data: bytes) -> str:
        """Serve ``data`` at ``/name``; returns its URL."""
        self._files[f"/{name}"] = (data, None)
        return f"{self.url}/{name}"

    def add_hf(self, repo: str, filename: str, data: bytes, etag: str | None = None) -> str:
        """Serve ``data`` as ``filename`` of Hugging Face repository ``repo``; returns its URL."""
        path = f"/{repo}/resolve/main/{filename}"
        self._files[path] = (data, etag or hashlib.sha256(data).hexdigest())
        return f"{self.url}{path}"

    def downloads(self) -> list[str]:
        """The paths of the files sent (GETs answered with a file)."""
        return [path for method, path in self.requests if method == "GET" and path in self._files]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                server.requests.append((self.command, self.path))
                found = server._files.get(self.path)
                if found is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data, etag = found
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                if etag is not None:
                    self.send_header("ETag", f'"{etag}"')
                    self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


class MobileNetPublishedHere:
    """``torchvision:mobilenet_v3_small`` with ``IMAGENET1K_V1`` published at the URL in
    ``CONVEYOR_TEST_WEIGHTS_URL``, loaded by the worker's own loader, weights and all, and
    served through the handler it builds."""

    def __init__(self, weights: str | None, device: torch.device, limits: Limits) -> None:
        entry = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
        entry.value.url = os.environ[URL_VARIABLE]
        self.handler = load_handler(
            "torchvision:mobilenet_v3_small",
            device=str(device),
            weights=weights,
            dtype="float32",
            channels_last=None,
            limits=limits,
        )
        self.name = self.handler.name
        self.version = self.handler.version

    def example_item(self) -> torch.Tensor:
        return self.handler.example_item()

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        return self.handler.preprocess(payload, content_type, params)

    def forward(self, batch: Any) -> Any:
        return self.handler.forward(batch)

    def postprocess(self, outputs: Any, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return self.handler.postprocess(outputs, params)
