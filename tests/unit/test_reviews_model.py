"""The text demo's reviews and model: the generator follows its stated rule, the same
seed gives the same reviews, and a built folder loads as an ``hf:`` classifier."""

from __future__ import annotations

import re
from pathlib import Path

from demo.models.reviews import LABELS, NEGATIVE, POSITIVE, build, predict, reviews
from schemas import DEFAULT_LIMITS
from workers.handlers.hf_models import TextServing
from workers.handlers.tasks.text_tasks import TextClassifier
from workers.model.loader import load_handler


def by_rule(text: str) -> str:
    """The label the module doc's rule gives: the polarity of the last adjective, flipped
    when a negation comes before it in its clause."""
    label, negated = None, False
    for word in re.findall(r"[a-z]+|[.]", text.lower()):
        if word in ("not", "never"):
            negated = True
        elif word in POSITIVE or word in NEGATIVE:
            label, negated = (word in POSITIVE) != negated, False
        elif word in (".", "but", "and"):
            negated = False
    assert label is not None, text
    return LABELS[label]


def test_the_labels_follow_the_rule_but_for_the_noise() -> None:
    data = reviews(2000, seed=3)
    agree = sum(by_rule(t) == label for t, label in zip(data.texts, data.labels, strict=True))
    assert 0.93 <= agree / 2000 <= 0.99  # 4 % of labels flipped
    assert 0.4 <= data.labels.count("positive") / 2000 <= 0.6
    assert any(" not " in t or " never " in t for t in data.texts)
    assert any(" but " in t for t in data.texts)


def test_the_same_seed_gives_the_same_reviews() -> None:
    assert reviews(200, seed=7) == reviews(200, seed=7)
    assert reviews(200, seed=7).texts != reviews(200, seed=1).texts


def test_a_built_folder_loads_as_a_text_classifier(tmp_path: Path) -> None:
    folder = build(tmp_path / "reviews", max_steps=5)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        path.name for path in folder.iterdir()
    }
    handler = load_handler(
        f"hf:{folder}",
        device="cpu",
        weights=None,
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        text=TextServing(),
    )
    assert isinstance(handler, TextClassifier)
    assert handler.labels == LABELS
    found = predict(folder, reviews(3, seed=7).texts)
    assert [label in LABELS and 0.5 <= score <= 1 for label, score in found] == [True] * 3
