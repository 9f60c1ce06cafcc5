"""The text demo's data and model: product reviews made by a rule, and a small BERT.

The generator (``reviews``), with a seeded ``random.Random``: a review is

- an opener, half the time, that says nothing of quality ("Bought this kettle for my
  sister.", "Arrived on Tuesday.");
- a clause "SUBJECT VERB [ADVERB] ADJECTIVE": the subject is the product, one of its
  parts or "it"; the adjective one of ``POSITIVE`` or ``NEGATIVE``; a negated verb ("is
  not", "was never", "does not feel"...; 30 % of clauses) flips its polarity, so "is
  not good" is negative and "was never flimsy" positive;
- 30 % of the time a second clause of the opposite polarity after "but", which
  decides; 20 % of the time one of the same polarity after "and";
- a closer of the review's polarity a quarter of the time ("Would buy again.", "Sent it
  back.").

The label is the polarity of the last clause, ``negative`` or ``positive`` (about half
each), and 4 % of labels are flipped at random: no model can pass about 96 % on it.
Short reviews repeat: about 2 % of the held-out reviews are also in the training set.

``python -m demo.models.reviews [FOLDER]`` builds the model (well under a minute on two
cores) into ``FOLDER`` (``.cache/reviews/reviews-bert`` by default), as
``save_pretrained`` writes it, with its tokenizer, so ``hf:FOLDER`` serves it: a
WordPiece tokenizer of about 400 tokens trained on the training reviews
(``demo.models.wordpiece``), and a 2-layer BERT of width 64
(``BertForSequenceClassification``, labels in its ``id2label``) trained with AdamW on
``TRAIN_REVIEWS`` reviews of seed 1. It prints the accuracy on ``HELD_OUT`` reviews of
seed 7, the model run directly through transformers.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from demo.models.wordpiece import train_wordpiece

LABELS = ("negative", "positive")
PRODUCTS = (
    "kettle", "blender", "backpack", "desk lamp", "phone case", "keyboard", "tent",
    "water bottle", "coffee grinder", "toaster", "umbrella", "office chair",
)  # fmt: skip
PARTS = ("handle", "lid", "strap", "cable", "finish", "button", "zip", "base", "switch")
POSITIVE = (
    "good", "great", "excellent", "sturdy", "reliable", "comfortable", "solid", "lovely",
    "quiet", "perfect",
)  # fmt: skip
NEGATIVE = (
    "bad", "poor", "flimsy", "noisy", "awful", "cheap", "useless", "disappointing",
    "fragile", "terrible",
)  # fmt: skip
_ADVERBS = ("", "", "really ", "very ", "quite ", "pretty ", "so ")
_VERBS = ("is", "was", "feels", "seems")
_NEGATED = ("is not", "was not", "is never", "was never", "does not feel", "does not seem")
_OPENERS = (
    "Bought this {product} for my {person}.", "Arrived on {day}.",
    "Used it for {weeks} weeks.", "Ordered the {product} online.", "Got it as a gift.",
)  # fmt: skip
_PEOPLE = ("sister", "dad", "flat", "office", "son", "partner")
_DAYS = ("Monday", "Tuesday", "Friday", "the weekend")
_CLOSERS = {
    "positive": ("Would buy again.", "Highly recommend.", "Five stars.", "Worth it."),
    "negative": ("Sent it back.", "Avoid.", "One star.", "Not worth it."),
}
_NOISE = 0.04

VOCAB_SIZE = 400
MAX_LENGTH = 64
TRAIN_REVIEWS = 4000
HELD_OUT = 1000
STEPS = 400
DEFAULT_FOLDER = Path(__file__).resolve().parents[2] / ".cache" / "reviews" / "reviews-bert"


@dataclass(frozen=True)
class Reviews:
    """Reviews and their labels (``LABELS``' names), in one order."""

    texts: list[str]
    labels: list[str]


def reviews(count: int, seed: int) -> Reviews:
    """``count`` reviews from the rule of the module doc."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(count):
        text, positive = _review(rng)
        if rng.random() < _NOISE:
            positive = not positive
        texts.append(text)
        labels.append(LABELS[positive])
    return Reviews(texts, labels)


def _review(rng: random.Random) -> tuple[str, bool]:
    product = rng.choice(PRODUCTS)
    sentences = []
    if rng.random() < 0.5:
        sentences.append(
            rng.choice(_OPENERS).format(
                product=product,
                person=rng.choice(_PEOPLE),
                day=rng.choice(_DAYS),
                weeks=rng.randint(2, 9),
            )
        )
    positive = rng.random() < 0.5
    first, joined = _clause(rng, product, positive), rng.random()
    if joined < 0.3:
        positive = not positive  # the clause after "but" decides
        first += " but " + _clause(rng, product, positive, subject_it=False)
    elif joined < 0.5:
        first += " and " + _clause(rng, product, positive, subject_it=False)
    sentences.append(first[0].upper() + first[1:] + ".")
    if rng.random() < 0.25:
        sentences.append(rng.choice(_CLOSERS[LABELS[positive]]))
    return " ".join(sentences), positive


def _clause(rng: random.Random, product: str, positive: bool, *, subject_it: bool = True) -> str:
    """A clause of the given polarity: the adjective's own, or its opposite negated."""
    subjects = [f"the {product}", f"the {rng.choice(PARTS)}"] + (["it"] if subject_it else [])
    negated = rng.random() < 0.3
    adjective = rng.choice(NEGATIVE if positive == negated else POSITIVE)
    verb = rng.choice(_NEGATED if negated else _VERBS)
    return f"{rng.choice(subjects)} {verb} {rng.choice(_ADVERBS)}{adjective}"


def train(data: Reviews, steps: int, seed: int = 0) -> tuple[Any, Any]:
    """The tokenizer trained on ``data``'s texts, and the classifier trained on both."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = train_wordpiece(data.texts, VOCAB_SIZE, MAX_LENGTH)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_LENGTH,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    model = BertForSequenceClassification(config)
    encoded = tokenizer(data.texts, padding=True, truncation=True, return_tensors="pt")
    targets = torch.tensor([LABELS.index(label) for label in data.labels])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    for step in range(steps):
        batch = torch.randint(len(targets), (32,), generator=torch.Generator().manual_seed(step))
        mask = encoded["attention_mask"][batch]
        width = int(mask.sum(dim=1).max())  # the batch's longest review, not the corpus's
        loss = model(
            input_ids=encoded["input_ids"][batch, :width],
            attention_mask=mask[:, :width],
            token_type_ids=encoded["token_type_ids"][batch, :width],
            labels=targets[batch],
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return tokenizer, model.eval()


def build(folder: Path = DEFAULT_FOLDER, max_steps: int | None = None) -> Path:
    """Train the tokenizer and the model and save both into ``folder``; returns it.
    ``max_steps`` cuts the training short (a model that loads, not one that is right)."""
    tokenizer, model = train(
        reviews(TRAIN_REVIEWS, seed=1), STEPS if max_steps is None else max_steps
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def predict(folder: Path, texts: Sequence[str]) -> list[tuple[str, float]]:
    """Each text's top label and its probability, from the saved model run directly
    through transformers (batches of 64 padded to their longest text)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    labels = model.config.id2label
    found: list[tuple[str, float]] = []
    with torch.inference_mode():
        for first in range(0, len(texts), 64):
            chunk = list(texts[first : first + 64])
            encoded = tokenizer(chunk, padding=True, truncation=True, return_tensors="pt")
            scores, indices = model(**encoded).logits.softmax(dim=-1).max(dim=-1)
            found += [
                (labels[i], s) for i, s in zip(indices.tolist(), scores.tolist(), strict=True)
            ]
    return found


def quiet_progress() -> None:
    """No progress bars from transformers (saving and loading this model takes
    milliseconds; the bars would only crowd a demo's output)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def accuracy(predicted: Sequence[str], truth: Sequence[str]) -> float:
    return sum(p == t for p, t in zip(predicted, truth, strict=True)) / max(len(truth), 1)


if __name__ == "__main__":
    quiet_progress()
    started = time.monotonic()
    built = build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER)
    spent = time.monotonic() - started
    heldout = reviews(HELD_OUT, seed=7)
    found = accuracy([label for label, _ in predict(built, heldout.texts)], heldout.labels)
    print(f"{built}: trained in {spent:.1f} s, held-out accuracy {found:.1%} ({HELD_OUT} reviews)")
