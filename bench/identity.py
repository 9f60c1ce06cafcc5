"""A model that does nothing, so that a benchmark measures the worker around it.

Serve it with ``conveyor worker --model bench.identity:IdentityHandler``. Each
payload becomes a fixed-size byte vector (its first ``ITEM_BYTES`` bytes,
zero-padded), ``forward`` returns the batch unchanged and each result is that
vector as a list of ints: every stage of the worker runs, the model costs nothing.

``--model-options '{"result_bytes": N}'`` makes each result a document of ``N``
base64 characters instead, as large as an embedding model's (2,048 float32 values:
10,924), for the cost of large results alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from schemas import ContentType

ITEM_BYTES = 16
"""Bytes of each payload the model sees and echoes; the rest is ignored."""


class IdentityHandler:
    """The identity function on ``ITEM_BYTES``-byte vectors, as a ``workers.handlers.Handler``."""

    name = "identity"
    version = "identity-v1"

    def __init__(self, model_options: Mapping[str, Any] | None = None) -> None:
        size = int((model_options or {}).get("result_bytes", 0))
        # Base64 characters, as an embedding's data field holds them.
        self._filler = "A" * size if size > 0 else None

    def example_item(self) -> torch.Tensor:
        return torch.zeros(ITEM_BYTES, dtype=torch.uint8)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        head = payload[:ITEM_BYTES].ljust(ITEM_BYTES, b"\0")
        # bytearray: torch.frombuffer wants a writable buffer it may share.
        return torch.frombuffer(bytearray(head), dtype=torch.uint8)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def postprocess(self, outputs: torch.Tensor, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        rows: list[Any] = outputs.tolist()
        if self._filler is not None:
            return [{"head": row, "data": self._filler} for row in rows]
        return rows
