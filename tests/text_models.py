"""Tiny text models for tests: a tokenizer trained here, models from configs, random weights.

Nothing is downloaded. The tokenizer is a BERT-style WordPiece trained on the
docstrings of Python's standard library (text that ships with every Python), so the
vocabulary is real English words and subwords; the models are 2 layers of width 32.
``save_all(root)`` writes one folder per task, as ``save_pretrained`` (and
sentence-transformers' ``save``) do, for ``hf:PATH``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from demo.models.wordpiece import docstrings, train_wordpiece

VOCAB_SIZE = 600
HIDDEN = 32
MAX_POSITIONS = 64
CLASS_LABELS = ("negative", "neutral", "positive")
ENTITY_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
_CORPUS_MODULES = ("json", "pathlib", "collections", "argparse", "logging", "textwrap", "string")


def corpus() -> Iterator[str]:
    """Lines of the standard library's docstrings (the same on every run of one Python)."""
    return docstrings(_CORPUS_MODULES)


def tokenizer() -> Any:
    """A fast BERT tokenizer with a WordPiece vocabulary trained on ``corpus()``."""
    return train_wordpiece(corpus(), VOCAB_SIZE, MAX_POSITIONS)


def config(**more: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=MAX_POSITIONS,
        **more,
    )


def _labelled(labels: tuple[str, ...]) -> dict[str, Any]:
    return {
        "id2label": dict(enumerate(labels)),
        "label2id": {label: i for i, label in enumerate(labels)},
    }


def save_all(root: Path, seed: int = 0) -> dict[str, Path]:
    """Folders of a text classifier, a token classifier, a one-output cross-encoder and a
    sentence-transformers embedder (mean pooling, normalized), by task name."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import (
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
    )

    torch.manual_seed(seed)
    tok = tokenizer()
    folders = {
        "text-classification": BertForSequenceClassification(config(**_labelled(CLASS_LABELS))),
        "cross-encoder": BertForSequenceClassification(config(num_labels=1)),
        "token-classification": BertForTokenClassification(config(**_labelled(ENTITY_LABELS))),
        "encoder": BertModel(config(), add_pooling_layer=False),
    }
    paths: dict[str, Path] = {}
    for name, model in folders.items():
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    transformer = Transformer(str(paths["encoder"]), max_seq_length=48)
    pooling = Pooling(HIDDEN, pooling_mode="mean")
    embedder = SentenceTransformer(modules=[transformer, pooling, Normalize()])
    paths["sentence-embedding"] = root / "sentence-embedding"
    embedder.save(str(paths["sentence-embedding"]))
    return paths
