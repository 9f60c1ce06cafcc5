"""A BERT-style WordPiece tokenizer trained here, and the corpus the tests train it on.

``train_wordpiece(lines, vocab_size, model_max_length)`` is what BERT's own tokenizer
is, learnt from ``lines``: lower-casing, BERT's pre-tokenizer (whitespace and
punctuation), the specials ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0 to 4), and the
templates ``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` (B with token type 1). It is
the fast (Rust-backed) tokenizer that ``hf:`` serves; in transformers 5 that is
``BertTokenizer``. The same lines give the same tokens, but not always the same ids: the
trainer numbers tokens of equal frequency in its hash maps' order, which changes from
run to run, so a model is saved with the tokenizer it was trained with.

``docstrings(modules)``: the lines of the docstrings of standard-library modules, text
that ships with every Python (the same on every run of one Python), so a vocabulary
trained on it is real English words and subwords. The test models and ``bench.text``
train on it; the reviews demo trains on its own generated reviews.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def docstrings(modules: Iterable[str]) -> Iterator[str]:
    """The non-blank lines, stripped, of each module's docstring and its members'."""
    for name in modules:
        module = importlib.import_module(name)
        for value in [module, *vars(module).values()]:
            doc = getattr(value, "__doc__", None)
            if isinstance(doc, str):
                yield from (line.strip() for line in doc.splitlines() if line.strip())


def train_wordpiece(lines: Iterable[str], vocab_size: int, model_max_length: int) -> Any:
    """A fast BERT tokenizer with a WordPiece vocabulary of at most ``vocab_size`` learnt
    from ``lines``, for texts of up to ``model_max_length`` tokens (see the module doc)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from tokenizers.trainers import WordPieceTrainer
    from transformers import BertTokenizer

    tok = Tokenizer(WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(lines, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return BertTokenizer(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
