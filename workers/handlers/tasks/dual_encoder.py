"""Dual encoders (CLIP, SigLIP): images and texts embedded into one space.

``DualEncoder`` answers an image request with the image tower's embedding
(``get_image_features``) and a text request with the text tower's
(``get_text_features``), as ``conveyor.embedding.v1`` documents whose ``modality``
says which tower answered (``image`` or ``text``). Both are L2-normalized unless a
request asks ``normalize: false``, so the dot product of an image's and a text's
vectors is their cosine similarity (CLIP's and SigLIP's logits before their scale).

- **Input.** Images as every fixed-size image model takes them (``image/jpeg``,
  ``image/png``, ``image/webp``, ``application/x-npy``; ``workers.handlers.base.ImageModel``
  fits and normalizes them), texts as ``workers.handlers.tasks.text.TextModel`` reads
  them (``text/plain``, ``application/json`` ``{"text": ...}``; a ``text_pair`` is
  ``bad_request``). Other media types are ``unsupported_media_type``.
- **Items** tell their kind by dtype: a text is an int64 ``(ROWS, length)`` tensor, an
  image a uint8 one (its pixels, or its JPEG bytes for the device decoder).
- **A batch** may hold both: ``collate`` builds the image batch and the padded text
  batch apart, with each item's row, and ``forward`` runs each tower on its part and
  puts the vectors back in the batch's order.
- **Cost** (``workers.batching``): a text costs its length bucket, as in every text
  model (SigLIP's text tower pools the last position, so its texts are always padded
  to ``max_length``, and cost that); an image costs the image tower's sequence length
  (its patches, plus CLIP's class token), the tokens a forward of it runs through.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from schemas import ContentType, ContractError, ErrorCode
from workers.decode.images import IMAGE_TYPES
from workers.handlers.base import ImageModel, to_host
from workers.handlers.tasks.embedding import embedding_document
from workers.handlers.tasks.params import EmbeddingParams
from workers.handlers.tasks.text import (
    FLAGS,
    IDS,
    MASK,
    SHAPE_FREE_ATTENTION,
    TextModel,
    exc_placeholder,
)

MODALITIES = ("image", "text")
"""What ``modality`` says, by an item's kind (0: image, 1: text)."""
_TEXT_TYPES = (ContentType.TEXT, ContentType.JSON)
_IMAGE_TYPES = (*IMAGE_TYPES, ContentType.NPY)


class DualEncoder(TextModel):
    """A CLIP or SigLIP model serving both of its towers (see the module doc).

    ``module`` is the whole model (``get_text_features`` runs here); ``images`` is its
    image side (an ``ImageModel`` whose module runs ``get_image_features``).
    ``full_length``: pad every text to ``max_length`` (SigLIP). ``image_cost``: what an
    image costs a batch per row.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer: Any,
        *,
        images: ImageModel,
        full_length: bool = False,
        image_cost: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(module, tokenizer, pairs=False, **kwargs)
        self.content_types: tuple[str, ...] = (*_IMAGE_TYPES, *_TEXT_TYPES)
        """What it takes (``workers.model.description``): images and texts."""
        self.images = images
        self.full_length = full_length
        if full_length:
            self.buckets = (self.max_length,)
        self.image_cost = max(1, image_cost)
        names = getattr(tokenizer, "model_input_names", ["attention_mask"])
        # Run the text tower with what its tokenizer makes: a processor that makes no
        # attention mask has the padding attended to, as it was trained.
        self._takes_mask = "attention_mask" in names

    def check_params(self, params: Mapping[str, Any]) -> None:
        EmbeddingParams.parse(params)

    def example_item(self) -> torch.Tensor:
        return self.images.example_item()

    def preprocess_batch(
        self,
        payloads: Sequence[bytes],
        content_types: Sequence[ContentType],
        params: Sequence[Mapping[str, Any]],
    ) -> list[torch.Tensor | ContractError]:
        """Images decoded one by one, texts tokenized in one call (``TextModel``)."""
        out: list[torch.Tensor | ContractError] = [exc_placeholder] * len(payloads)
        texts: list[int] = []
        for n, (payload, content_type, p) in enumerate(
            zip(payloads, content_types, params, strict=True)
        ):
            if content_type in _TEXT_TYPES:
                texts.append(n)
                continue
            try:
                out[n] = self._image(payload, content_type, p)
            except ContractError as exc:
                out[n] = exc
        if texts:
            done = super().preprocess_batch(
                [payloads[n] for n in texts],
                [content_types[n] for n in texts],
                [params[n] for n in texts],
            )
            for n, item in zip(texts, done, strict=True):
                out[n] = item
        return out

    def _image(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> torch.Tensor:
        if content_type not in _IMAGE_TYPES:
            accepted = ", ".join([*_IMAGE_TYPES, *_TEXT_TYPES])
            raise ContractError(
                ErrorCode.unsupported_media_type,
                "content-type",
                f"this model takes images or texts; send one of {accepted}",
                seen=str(content_type),
            )
        self.check_params(params)
        return self.images.preprocess(payload, content_type, params)

    def cost(self, item: torch.Tensor) -> int:
        """A text's padded length, or ``image_cost`` for an image (module doc)."""
        return super().cost(item) if _is_text(item) else self.image_cost

    def collate(  # type: ignore[override]  # a list: the image and the text batch
        self, items: Sequence[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """``[pixels, tokens, image rows, text rows]`` on ``device``: the images' batch
        (uint8 (I, C, H, W)), the texts' (int64 (T, ROWS, bucket)), and where in the
        batch each of their items sits (int64, I and T long)."""
        is_text = [_is_text(item) for item in items]
        text_items = [item for item, text in zip(items, is_text, strict=True) if text]
        image_items = [item for item, text in zip(items, is_text, strict=True) if not text]
        rows = torch.arange(len(items))
        kinds = torch.tensor(is_text, dtype=torch.bool)
        pixels = self._pixels(image_items, device)
        if text_items:
            tokens = super().collate(text_items, device)
        else:
            tokens = torch.zeros((0, FLAGS + 1, 1), dtype=torch.int64, device=device)
        return [pixels, tokens, _upload(rows[~kinds], device), _upload(rows[kinds], device)]

    def _pixels(self, items: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        spec = self.images.image
        if not items:
            shape = (0, spec.channels, spec.height, spec.width)
            return torch.zeros(shape, dtype=torch.uint8, device=device)
        decoded = self.images.collate(items, device)  # the device decoder's, if any
        return decoded if decoded is not None else _upload(torch.stack(items), device)

    def forward(self, batch: list[torch.Tensor]) -> DualOutputs:  # type: ignore[override]
        pixels, tokens, image_rows, text_rows = batch
        size = len(image_rows) + len(text_rows)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if len(image_rows):
            parts.append((image_rows, self.images.forward(pixels)))
        flags = torch.zeros(size, dtype=torch.int64, device=self.device)
        kinds = torch.zeros(size, dtype=torch.int64, device=self.device)
        if len(text_rows):
            tokens = tokens.to(self.device)
            mask = tokens[:, MASK] if self._takes_mask else None
            get: Any = self.module.get_text_features  # transformers' decorators are untyped
            with sdpa_kernel(SHAPE_FREE_ATTENTION):  # text batches come in many shapes
                found = get(input_ids=tokens[:, IDS], attention_mask=mask)
            parts.append((text_rows, features(found)))
            flags.index_copy_(0, text_rows, tokens[:, FLAGS, 0])
            kinds.index_fill_(0, text_rows, 1)
        width = parts[0][1].shape[-1]
        vectors = parts[0][1].new_empty((size, width))
        for rows, values in parts:
            vectors.index_copy_(0, rows, values.to(vectors.dtype))
        return DualOutputs(vectors, kinds, flags)

    def postprocess(  # type: ignore[override]
        self, outputs: DualOutputs, params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        return self.postprocess_host(to_host(self.postprocess_device(outputs, params)), params)

    def postprocess_device(
        self, outputs: DualOutputs, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """The vectors as float32, each item's kind and truncation flag."""
        return outputs.vectors.float(), outputs.kinds, outputs.flags

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The embedding documents, in the batch's order, each saying its ``modality``."""
        if not params:
            return []
        vectors, kinds, flags = (tensor.numpy() for tensor in tensors)
        shape = [int(vectors.shape[1])]
        results = []
        for vector, p, kind, truncated in zip(
            vectors, params, kinds.tolist(), flags.tolist(), strict=True
        ):
            document = embedding_document(vector, shape, EmbeddingParams.parse(p))
            document["modality"] = MODALITIES[kind]
            document["truncated"] = bool(truncated)
            results.append(document)
        return results


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: to CUDA through pinned memory, without waiting."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _is_text(item: torch.Tensor) -> bool:
    return item.dtype == torch.int64


def features(output: Any) -> torch.Tensor:
    """The projected embeddings of ``get_*_features``: the pooler output of what it
    returns in transformers 5, the tensor itself before."""
    if isinstance(output, torch.Tensor):
        return output
    pooled: torch.Tensor = output.pooler_output
    return pooled


class DualOutputs:
    """A batch's vectors in its order, with each item's kind (1: text) and truncation
    flag; sliceable by item."""

    __slots__ = ("flags", "kinds", "vectors")

    def __init__(self, vectors: torch.Tensor, kinds: torch.Tensor, flags: torch.Tensor) -> None:
        self.vectors = vectors
        self.kinds = kinds
        self.flags = flags

    def __len__(self) -> int:
        return len(self.vectors)

    def __getitem__(self, index: slice) -> DualOutputs:
        return DualOutputs(self.vectors[index], self.kinds[index], self.flags[index])
