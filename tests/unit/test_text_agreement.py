"""bench.text_agreement and the text stage's parts that need no card: real lines with
their modules, a held-out fifth fixed by each line, agreement measured as it says, and
the text corpus the producers rebuild by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.gpu.corpus import TEXT_CORPUS, _records, corpus_named
from bench.gpu.text import write_folder
from bench.text_agreement import agreement, held_out, labelled_lines
from schemas import ContentType


def test_the_lines_are_distinct_labelled_and_a_fifth_held_out() -> None:
    lines, labels = labelled_lines()
    assert len(lines) == len(set(lines)) == len(labels) > 1000
    assert set(labels) == set(range(8))
    share = sum(map(held_out, lines)) / len(lines)
    assert 0.15 < share < 0.25
    assert [held_out(line) for line in lines] == [held_out(line) for line in lines]


def test_agreement_counts_top1_and_cosines() -> None:
    reference = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5]])
    other = torch.tensor([[0.8, 0.2], [0.7, 0.3], [0.5, 0.5]])
    found = agreement(reference, other, classifier=True)
    assert abs(found["top1_agreement"] - 2 / 3) < 1e-6
    assert abs(found["largest_probability_difference"] - 0.3) < 1e-6
    same = agreement(reference, reference.clone(), classifier=False)
    assert same["cosine_min"] > 1 - 1e-12
    flipped = agreement(reference, -reference, classifier=False)
    assert flipped["cosine_mean"] < -1 + 1e-12


def test_the_text_corpus_is_rebuilt_by_name_as_text_requests() -> None:
    corpus = corpus_named(TEXT_CORPUS)
    assert corpus.content_type == ContentType.TEXT
    assert corpus.payloads == corpus_named(TEXT_CORPUS).payloads  # every producer alike
    (record,) = _records(corpus, ["t-0"])
    assert record.value == corpus.payloads[0]
    assert corpus_named("32x24").content_type == ContentType.JPEG


def test_the_stage_writes_a_folder_hf_reads_without_weights(tmp_path: Path) -> None:
    folder = write_folder("tiny", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert (folder / "tokenizer.json").exists()
    assert not list(folder.glob("*.safetensors"))
