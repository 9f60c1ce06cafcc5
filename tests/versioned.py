"""A model whose version is a setting: what the version tests roll, shadow and canary.

Served as ``--model tests.versioned:VersionedModel`` with ``--model-options`` (or
``model_options`` in a config file) ``{"version": "v2", "drift": 1}``. It is the
identity model of ``bench.identity`` with a classifier's answer: each payload's
first 16 bytes add up to a sum ``s``; the answer is one class,
``(s + drift * (s % 2)) % 10``, with the score ``0.5 + drift / 100``. So versions of
different drift agree on the top class of even sums only, and their scores tell
them apart on every request: a result shows which version computed it.
``answer(payload, drift)`` is the same computation outside a worker: a direct run.
``slow_ms`` makes every batch take that long (a model that keeps requests in flight).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import orjson
import torch

from producers.testing import read_topic, requests
from schemas import ContentType, OutgoingRecord, Result
from schemas.canary import is_marker, marker_share, request_bucket

SPEC = "tests.versioned:VersionedModel"
ITEM_BYTES = 16


def answer(payload: bytes, drift: int) -> list[dict[str, Any]]:
    """What a version with ``drift`` answers for ``payload``."""
    total = sum(payload[:ITEM_BYTES])
    index = (total + drift * (total % 2)) % 10
    return [{"label": str(index), "index": index, "score": 0.5 + drift / 100}]


class VersionedModel:
    """The handler (``workers.handlers.Handler``); its options are its version's."""

    name = "versioned"

    def __init__(self, model_options: Mapping[str, Any]) -> None:
        self.version = str(model_options.get("version", "v1"))
        self._drift = int(model_options.get("drift", 0))
        self._slow_s = float(model_options.get("slow_ms", 0)) / 1000.0

    def example_item(self) -> torch.Tensor:
        return torch.zeros(ITEM_BYTES, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        head = payload[:ITEM_BYTES].ljust(ITEM_BYTES, b"\0")
        return torch.frombuffer(bytearray(head), dtype=torch.uint8)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self._slow_s:
            time.sleep(self._slow_s)
        return batch

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [answer(bytes(row), self._drift) for row in outputs.to(torch.uint8).tolist()]


# -- what the version tests share ------------------------------------------------------------


def versioned_requests(count: int, prefix: str) -> tuple[list[OutgoingRecord], list[str]]:
    """``count`` text requests, ids ``<prefix>-<n>``, whose payloads sum to all sorts of
    values (so versions disagree on about half of the top classes)."""
    payloads = [f"{n * 7919}".encode() for n in range(count)]
    return requests(payloads, count, prefix, ContentType.TEXT)


def computed_by(result: Result, payload: bytes, drifts: Mapping[str, int]) -> bool:
    """Whether ``result`` is what the version it names answers for ``payload``."""
    drift = drifts.get(result.model_version)
    return drift is not None and result.outputs == answer(payload, drift)


class RequestLog:
    """Where each request sits in its request topic, and the canary markers among them."""

    def __init__(self) -> None:
        self.position: dict[str, tuple[int, int]] = {}  # id -> (partition, offset)
        self.markers: dict[int, list[tuple[int, int]]] = defaultdict(list)  # (offset, share)

    @classmethod
    async def read(cls, bootstrap: str, topic: str, expect: int) -> RequestLog:
        found = cls()
        for record in await read_topic(bootstrap, topic, expect, 60):
            if is_marker(record.key, record.headers):
                share = marker_share(record.value)
                assert share is not None
                found.markers[record.partition].append((record.offset, share))
            else:
                found.position[record.key.decode()] = (record.partition, record.offset)
        return found

    def share(self, request_id: str) -> int:
        """The canary share (basis points) in effect for the request: its partition's last
        marker before it (0 before the first)."""
        partition, offset = self.position[request_id]
        before = [share for at, share in self.markers[partition] if at < offset]
        return before[-1] if before else 0

    def canary_answers(self, request_id: str) -> bool:
        return request_bucket(request_id) < self.share(request_id)

    def in_offset_order(self, versions: Mapping[str, str]) -> dict[int, list[str]]:
        """Per partition, the versions of the results of the requests, in offset order."""
        rows: dict[int, list[tuple[int, str]]] = defaultdict(list)
        for request_id, version in versions.items():
            partition, offset = self.position[request_id]
            rows[partition].append((offset, version))
        return {p: [v for _, v in sorted(row)] for p, row in rows.items()}


def switches(sequence: Sequence[str]) -> int:
    """How many times ``sequence`` changes value."""
    return sum(1 for a, b in pairwise(sequence) if a != b)


async def conveyor(*argv: str) -> tuple[int, str, str]:
    """``conveyor ARGV`` in a child process (its main() runs an event loop of its own): the
    exit status, stdout and stderr."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "producers.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def json_lines(text: str) -> list[Any]:
    return [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]
