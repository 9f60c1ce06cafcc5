"""The text tasks and their result shapes (docs/models.md, "Text models").

Each takes its input as ``workers.handlers.tasks.text.TextModel`` does, and answers
with one JSON object per text whose ``type`` names its shape (``schemas.outputs``),
all of them with ``truncated`` (the text was cut to ``max_length`` tokens):

- ``TextClassifier``: ``conveyor.text_classification.v1``, the ``top_k`` classes
  (request parameter, default 5, capped at the number of labels) as ``{label,
  index, score}``, best first, labels from the config's ``id2label``. Scores are the
  softmax, or the sigmoid for a model of one output (a cross-encoder, a reranker:
  send ``text`` and ``text_pair``) or of ``problem_type`` multi-label, as
  transformers' text-classification pipeline computes them.
- ``TokenClassifier``: ``conveyor.entities.v1``, the entities of the text as
  transformers' token-classification pipeline with ``aggregation_strategy="simple"``
  finds them: each token's best label; adjacent tokens of the same label joined
  unless a ``B-`` starts a new one; runs labelled ``O`` left out; the score is the
  mean of its tokens'; ``start`` and ``end`` are character offsets into the text as
  submitted. ``word`` is the tokens joined back by the tokenizer (the pipeline's word
  for tokens it knows; an unknown token shows as the tokenizer's unknown token, where
  the pipeline quotes the text: ``text[start:end]`` is always the span).
- ``SentenceEmbedder``: ``conveyor.embedding.v1`` (``workers.handlers.tasks.embedding``),
  the last hidden state pooled the way a sentence-transformers folder says
  (``mean``, ``cls``, ``max`` or ``lasttoken``); requests choose ``normalize``
  (default: whether the folder has a ``Normalize`` module) and ``dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from schemas.outputs import ENTITIES_V1, TEXT_CLASSIFICATION_V1
from workers.handlers.base import DEFAULT_TOP_K, to_host, top_k_param
from workers.handlers.tasks.embedding import embedding_document
from workers.handlers.tasks.params import EmbeddingParams, check_names
from workers.handlers.tasks.text import (
    END,
    FLAGS,
    IDS,
    MASK,
    SPECIAL,
    START,
    TextModel,
    TextOutputs,
)

Pooling = Literal["mean", "cls", "max", "lasttoken"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "max", "lasttoken")


class TextClassifier(TextModel):
    """Sequence classification: one text or a pair (see the module doc)."""

    def __init__(
        self, module: torch.nn.Module, tokenizer: Any, *, labels: Sequence[str], **kwargs: Any
    ) -> None:
        super().__init__(module, tokenizer, pairs=True, **kwargs)
        self.labels = tuple(labels)
        config = getattr(module, "config", None)
        multi = getattr(config, "problem_type", None) == "multi_label_classification"
        self.sigmoid = multi or len(self.labels) == 1

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_names(params, ("top_k",))
        top_k_param(params, DEFAULT_TOP_K)

    def run(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.module(**self.model_inputs(ids, types, mask)).logits
        return logits

    def postprocess(self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return self.postprocess_host(to_host(self.postprocess_device(outputs, params)), params)

    def postprocess_device(
        self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """Scores and top-k for the whole batch on the device: (scores, indices, flags)."""
        logits = outputs.values.float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        k = max((self._top_k(p) for p in params), default=1)
        best, indices = scores.topk(k, dim=-1)
        return best, indices, outputs.flags()

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The result documents from ``postprocess_device``'s host copies."""
        if not params:
            return []
        best, indices, flags = tensors
        labels = self.labels
        results: list[Any] = []
        for p, item_scores, item_indices, truncated in zip(
            params, best.tolist(), indices.tolist(), flags.tolist(), strict=True
        ):
            top = self._top_k(p)
            found = [
                {"label": labels[i], "index": i, "score": s}
                for s, i in zip(item_scores[:top], item_indices[:top], strict=True)
            ]
            results.append(
                {"type": TEXT_CLASSIFICATION_V1, "labels": found, "truncated": bool(truncated)}
            )
        return results

    def _top_k(self, params: Mapping[str, Any]) -> int:
        return min(top_k_param(params, DEFAULT_TOP_K), len(self.labels))


class TokenClassifier(TextModel):
    """Token classification as entities with character offsets (see the module doc)."""

    def __init__(
        self, module: torch.nn.Module, tokenizer: Any, *, labels: Sequence[str], **kwargs: Any
    ) -> None:
        super().__init__(module, tokenizer, pairs=False, **kwargs)
        self.labels = tuple(labels)

    def check_params(self, params: Mapping[str, Any]) -> None:
        check_names(params, ())

    def run(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.module(**self.model_inputs(ids, types, mask)).logits
        return logits

    def postprocess(self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return self.postprocess_host(to_host(self.postprocess_device(outputs, params)), params)

    def postprocess_device(
        self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """Each token's best label and its score, and the batch's rows: (labels,
        scores, rows), for one copy back per batch."""
        best, labels = outputs.values.float().softmax(dim=-1).max(dim=-1)
        return labels, best, outputs.rows

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The entities per text from ``postprocess_device``'s host copies (numpy per
        text, no torch op)."""
        if not params:
            return []
        labels, best, rows = (tensor.numpy() for tensor in tensors)
        results: list[Any] = []
        for n in range(len(params)):
            keep = (rows[n, MASK] == 1) & (rows[n, SPECIAL] == 0)
            tokens = _Tokens(
                ids=rows[n, IDS][keep].tolist(),
                labels=labels[n][keep].tolist(),
                scores=best[n][keep].tolist(),
                starts=rows[n, START][keep].tolist(),
                ends=rows[n, END][keep].tolist(),
            )
            entities = self._entities(tokens)
            truncated = bool(rows[n, FLAGS, 0])
            results.append({"type": ENTITIES_V1, "entities": entities, "truncated": truncated})
        return results

    def _entities(self, tokens: _Tokens) -> list[dict[str, Any]]:
        """Tokens grouped as the pipeline's ``group_entities`` does, ``O`` runs left out."""
        groups: list[list[int]] = []
        last_tag = None
        for position, label in enumerate(tokens.labels):
            bi, tag = _tag(self.labels[label])
            if groups and tag == last_tag and bi != "B":
                groups[-1].append(position)
            else:
                groups.append([position])
            last_tag = tag
        entities = []
        for group in groups:
            tag = _tag(self.labels[tokens.labels[group[0]]])[1]
            if tag == "O":
                continue
            words = self.tokenizer.convert_ids_to_tokens([tokens.ids[i] for i in group])
            entities.append(
                {
                    "entity_group": tag,
                    "score": float(np.mean([tokens.scores[i] for i in group])),
                    "word": self.tokenizer.convert_tokens_to_string(words),
                    "start": tokens.starts[group[0]],
                    "end": tokens.ends[group[-1]],
                }
            )
        return entities


class _Tokens:
    """One text's tokens (special and padding ones left out), column by column."""

    __slots__ = ("ends", "ids", "labels", "scores", "starts")

    def __init__(
        self,
        *,
        ids: list[int],
        labels: list[int],
        scores: list[float],
        starts: list[int],
        ends: list[int],
    ) -> None:
        self.ids = ids
        self.labels = labels
        self.scores = scores
        self.starts = starts
        self.ends = ends


def _tag(label: str) -> tuple[str, str]:
    """``B-PER`` → ``("B", "PER")``; a label without a prefix continues (``I``)."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


class SentenceEmbedder(TextModel):
    """Sentence embeddings: the last hidden state pooled (see the module doc)."""

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer: Any,
        *,
        pooling: Pooling = "mean",
        normalize: bool = False,
        **kwargs: Any,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        super().__init__(module, tokenizer, pairs=False, **kwargs)
        self.pooling = pooling
        self.normalize = normalize

    def check_params(self, params: Mapping[str, Any]) -> None:
        EmbeddingParams.parse(params, normalize=self.normalize)

    def run(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.module(**self.model_inputs(ids, types, mask)).last_hidden_state
        return pool(hidden, mask, self.pooling)

    def postprocess(self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return self.postprocess_host(to_host(self.postprocess_device(outputs, params)), params)

    def postprocess_device(
        self, outputs: TextOutputs, params: Sequence[Mapping[str, Any]]
    ) -> tuple[torch.Tensor, ...]:
        """The pooled vectors as float32 and the truncation flags: (vectors, flags)."""
        return outputs.values.float(), outputs.flags()

    def postprocess_host(
        self, tensors: tuple[torch.Tensor, ...], params: Sequence[Mapping[str, Any]]
    ) -> list[Any]:
        """The embedding documents from ``postprocess_device``'s host copies."""
        if not params:
            return []
        vectors, flags = (tensor.numpy() for tensor in tensors)
        shape = [int(vectors.shape[1])]
        results = []
        for vector, p, truncated in zip(vectors, params, flags.tolist(), strict=True):
            document = embedding_document(
                vector, shape, EmbeddingParams.parse(p, normalize=self.normalize)
            )
            document["truncated"] = bool(truncated)
            results.append(document)
        return results


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """(N, L, D) token states to (N, D) as sentence-transformers' ``Pooling`` does, for
    right-padded batches (``mask`` 1 on real tokens)."""
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "lasttoken":
        last = (mask.sum(dim=1) - 1).clamp(min=0)
        return hidden[torch.arange(len(hidden), device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    summed = (hidden * weights).sum(dim=1)
    # A row of padding alone (a runner's pad row) divides by a tiny count, not zero.
    return summed / weights.sum(dim=1).clamp(min=1e-9)
