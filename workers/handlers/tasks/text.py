"""Text models: payloads to token ids in the decode threads, padded batches by length.

``TextModel`` is the input side shared by the text tasks (``workers.handlers.tasks.text_tasks``):

- **Input.** ``text/plain`` is the text as UTF-8; ``application/json`` is
  ``{"text": ..., "text_pair": ...}`` (``text_pair`` optional, for models that take
  two texts: cross-encoders, rerankers). Invalid UTF-8 and malformed JSON are
  ``decode_failed``; an empty or blank text, a JSON document without a string
  ``text``, or a pair for a model that takes one text are ``bad_request``; other
  media types are ``unsupported_media_type``.
- **Tokenizing** is one call of the fast (Rust) tokenizer for a whole chunk of
  records (``preprocess_batch``), in the decode threads, never a Python loop over
  requests in the model thread. The tokenizer is a private copy of the model's,
  truncating at ``max_length`` tokens (special tokens included): a text cut there
  answers ``truncated: true``, or, with ``refuse_long``, is refused
  ``text_too_long``.
- **An item** is an int64 ``(ROWS, length)`` tensor: its token ids, token type ids,
  attention mask, special-token mask, each token's character offsets into the
  submitted text, and a flags row (``[truncated, 0, ...]``).
- **A batch** (``collate``) is padded to the next length bucket (``length_buckets``:
  powers of two up to ``max_length``), so that a compiled forward sees a few shapes,
  and its ``cost`` per item is that bucket: the batcher closes a batch at a token
  budget of rows × padded length (``workers.batching.batcher``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from schemas import ContentType, ContractError, ErrorCode

IDS, TYPES, MASK, SPECIAL, START, END, FLAGS = range(7)
ROWS = 7
"""Rows of an item tensor (see the module doc)."""

SHAPE_FREE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a text batch may take: all but cuDNN's, which builds a plan on the
host for each new shape, and text batches come in many (rows x padded length). On one
H200 a MiniLM-sized encoder's batch of 16-256 rows took 73.6 ms with cuDNN's against 12.8
with the memory-efficient kernel (9.5 and 13.5 ms when every batch had one shape);
BERT-base's 76.7 against 38.9 (docs/bench-log, 2026-12-03)."""

SMALLEST_BUCKET = 16
"""Shorter texts are padded up to this: below it a forward costs about the same."""


def length_buckets(max_length: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Padded lengths: from ``smallest``, steps of a quarter of the current power of two
    (at least ``smallest``) below ``max_length``, then ``max_length``: 16, 32, 48, 64,
    80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512 for 512.

    Powers of two alone padded a long-tailed mix by about half (a 65-token text
    computed 128); quarter steps pad at most a fifth of a bucket past 64, keep every
    length a multiple of 16 (tensor-core friendly) and stay 16 shapes for 512.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    sizes = {max_length}
    size = smallest
    while size < max_length:
        sizes.add(size)
        octave = 1 << (size.bit_length() - 1)  # the power of two at or below size
        size += max(octave // 4, smallest)
    return tuple(sorted(sizes))


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length`` tokens (the largest when none does)."""
    for size in buckets:
        if length <= size:
            return size
    return buckets[-1]


def read_text(payload: bytes, content_type: ContentType, *, pairs: bool) -> tuple[str, str | None]:
    """The text (and its pair) of one payload; ``ContractError`` for bad input (module doc)."""
    if content_type == ContentType.TEXT:
        text: object = _utf8(payload)
        pair: object = None
    elif content_type == ContentType.JSON:
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise ContractError(
                ErrorCode.decode_failed, "value", f"not a JSON document: {exc}"
            ) from None
        if not isinstance(document, dict) or "text" not in document:
            raise ContractError(
                ErrorCode.bad_request,
                "value.text",
                'a JSON text request is {"text": ..., "text_pair": ...}; text is missing',
            )
        text, pair = document["text"], document.get("text_pair")
    else:
        raise ContractError(
            ErrorCode.unsupported_media_type,
            "content-type",
            "a text model takes text/plain (UTF-8) or application/json",
            seen=str(content_type),
        )
    _check_text("text", text)
    if pair is not None:
        if not pairs:
            raise ContractError(
                ErrorCode.bad_request,
                "value.text_pair",
                "this model takes one text per request, not a pair",
            )
        _check_text("text_pair", pair)
    assert isinstance(text, str)
    return text, pair if isinstance(pair, str) else None


def _utf8(payload: bytes) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(
            ErrorCode.decode_failed,
            "value",
            f"text/plain must be UTF-8: byte {exc.start} does not decode",
        ) from None


def _check_text(field: str, text: object) -> None:
    if not isinstance(text, str):
        raise ContractError(
            ErrorCode.bad_request, f"value.{field}", "must be a string", seen=type(text).__name__
        )
    if not text.strip():
        raise ContractError(ErrorCode.bad_request, f"value.{field}", "the text is empty")


class TextModel:
    """A transformers model behind a fast tokenizer, minus the task's ``postprocess``.

    ``tokenizer`` is a transformers fast tokenizer (its ``backend_tokenizer`` is copied,
    so a caller's settings never change it); ``pairs``: whether a request may carry a
    ``text_pair``. Subclasses run the module (``run``) and build results.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer: Any,
        *,
        name: str,
        version: str,
        max_length: int,
        refuse_long: bool = False,
        pairs: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from tokenizers import Tokenizer

        # The fast tokenizer's batch call spreads over a thread per core unless told not
        # to; the worker already tokenizes in its decode threads, in each process of a
        # host, so those threads would only contend for the same cores. A value the user
        # set is kept.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.name = name
        self.version = version
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_length = max_length
        self.refuse_long = refuse_long
        self.pairs = pairs
        self.tokenizer = tokenizer
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_padding()
        backend.enable_truncation(max_length)
        self._backend = backend
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.buckets = length_buckets(max_length)
        self.module = module.to(device=self.device, dtype=dtype).eval()
        # DistilBERT's forward takes no token type ids; BERT's does, and pairs need them.
        self._takes_types = "token_type_ids" in inspect.signature(module.forward).parameters

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Raise ``ContractError(bad_request)`` for request parameters this model refuses."""

    def example_item(self) -> torch.Tensor:
        return self._example_text()

    def _example_text(self) -> torch.Tensor:
        item = self.preprocess_batch([b"warm up"], [ContentType.TEXT], [{}])[0]
        assert isinstance(item, torch.Tensor)
        return item

    def warm_up_items(self) -> list[torch.Tensor]:
        """An item of each length bucket past the smallest (``WarmUpShapes``): a compiled
        forward traces and tunes them at start. Token ids are the padding id's, which
        every vocabulary holds."""
        item = self._example_text()
        items = []
        for length in self.buckets[1:]:
            long = torch.zeros((ROWS, length), dtype=torch.int64)
            long[IDS] = self.pad_id
            long[:, : item.shape[-1]] = item
            long[MASK] = 1
            items.append(long)
        return items

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        item = self.preprocess_batch([payload], [content_type], [params])[0]
        if isinstance(item, ContractError):
            raise item
        return item

    def preprocess_batch(
        self,
        payloads: Sequence[bytes],
        content_types: Sequence[ContentType],
        params: Sequence[Mapping[str, Any]],
    ) -> list[torch.Tensor | ContractError]:
        """One item tensor per payload, or the ``ContractError`` that refuses it; the
        good ones tokenized in one call."""
        out: list[torch.Tensor | ContractError] = []
        inputs: list[str | tuple[str, str]] = []
        where: list[int] = []
        for payload, content_type, p in zip(payloads, content_types, params, strict=True):
            try:
                self.check_params(p)
                text, pair = read_text(payload, content_type, pairs=self.pairs)
            except ContractError as exc:
                out.append(exc)
                continue
            where.append(len(out))
            out.append(exc_placeholder)
            inputs.append(text if pair is None else (text, pair))
        if inputs:
            encodings = self._backend.encode_batch(inputs, add_special_tokens=True)
            for index, encoding in zip(where, encodings, strict=True):
                out[index] = self._item(encoding)
        return out

    def _item(self, encoding: Any) -> torch.Tensor | ContractError:
        truncated = bool(encoding.overflowing)
        if truncated and self.refuse_long:
            return ContractError(
                ErrorCode.text_too_long,
                "value",
                "the text has more tokens than the model takes (--truncation refuse)",
                limit=self.max_length,
            )
        # Filled in numpy, whose row assignment converts a list in C: a torch.tensor per
        # row cost 68 of the 160 us a text took in the decode threads (bench.text's mix).
        item = np.zeros((ROWS, len(encoding.ids)), dtype=np.int64)
        item[IDS] = encoding.ids
        item[TYPES] = encoding.type_ids
        item[MASK] = 1
        item[SPECIAL] = encoding.special_tokens_mask
        item[START : END + 1] = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2).T
        item[FLAGS, 0] = int(truncated)
        return torch.from_numpy(item)

    def cost(self, item: torch.Tensor) -> int:
        """What ``item`` adds to a batch per row: its padded length (``workers.batching``)."""
        return bucket_of(int(item.shape[-1]), self.buckets)

    def collate(self, items: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The items padded to the batch's length bucket: (N, ROWS, bucket) on ``device``.

        One host array per batch, filled through numpy (a slice copy per item, no torch
        op per item), pinned on CUDA and copied with one non-blocking upload: the copy
        runs on the caller's stream while the host goes on.
        """
        length = bucket_of(max(item.shape[-1] for item in items), self.buckets)
        shape = (len(items), ROWS, length)
        pinned = device.type == "cuda"
        if pinned:
            batch = torch.empty(shape, dtype=torch.int64, pin_memory=True)
            array = batch.numpy()
            array.fill(0)
        else:
            # numpy's zeros, not torch's: no intra-op threads woken for a small fill.
            array = np.zeros(shape, dtype=np.int64)
            batch = torch.from_numpy(array)
        array[:, IDS] = self.pad_id
        for row, item in enumerate(items):
            array[row, :, : item.shape[-1]] = item.numpy()
        return batch.to(device, non_blocking=pinned)

    def forward(self, batch: torch.Tensor) -> TextOutputs:
        batch = batch.to(self.device)
        with sdpa_kernel(SHAPE_FREE_ATTENTION):
            values = self.run(batch[:, IDS], batch[:, TYPES], batch[:, MASK])
        return TextOutputs(values, batch)

    def run(
        self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:  # pragma: no cover - every task overrides it
        """The module's output for a padded batch."""
        raise NotImplementedError

    def postprocess(
        self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:  # pragma: no cover - every task overrides it
        """One result document per text (the task's shape)."""
        raise NotImplementedError

    def model_inputs(
        self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Keyword arguments of the module: ``token_type_ids`` only where it takes them."""
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self._takes_types:
            inputs["token_type_ids"] = types
        return inputs


exc_placeholder = ContractError(ErrorCode.internal, "value", "not tokenized")
"""Holds a place in ``preprocess_batch``'s output until the batch call fills it."""


class TextOutputs:
    """A batch's outputs with its rows (flags, offsets, ids), sliceable by item."""

    __slots__ = ("rows", "values")

    def __init__(self, values: torch.Tensor, rows: torch.Tensor) -> None:
        self.values = values
        self.rows = rows

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: slice) -> TextOutputs:
        return TextOutputs(self.values[index], self.rows[index])

    def truncated(self) -> list[bool]:
        """Per item: whether its text was cut to ``max_length``."""
        return [bool(flag) for flag in self.flags().tolist()]

    def flags(self) -> torch.Tensor:
        """Per item, 1 where its text was cut to ``max_length`` (on the device)."""
        return self.rows[:, FLAGS, 0]
