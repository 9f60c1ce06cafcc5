"""``hf:PATH`` text models: served == direct for each task, input rules, length rules, and
the loader's errors. "Direct" is a transformers ``pipeline`` (sentence-transformers'
``encode`` for embeddings), one text at a time; "served" is the handler's batch path
(one tokenizer call, padded to a length bucket, one forward) through ``ModelRunner``."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from schemas import DEFAULT_LIMITS, ContentType, ContractError, ErrorCode
from schemas.outputs import EmbeddingOutput, parse_outputs
from workers.handlers.hf_models import TextServing
from workers.handlers.tasks.text import TextModel, bucket_of, length_buckets
from workers.model.loader import ModelLoadError, load_handler
from workers.model.runner import ModelRunner

# Lengths from a few tokens to past the tiny models' 48 and 64 positions.
TEXTS = [
    "Return a JSON string.",
    "paths",
    "The logging module defines functions and classes which implement a flexible "
    "event logging system for applications and libraries.",
    "Deserialize a str instance containing a JSON document to a Python object.",
]
PAIRS = [("Serialize obj to a JSON formatted str.", "json dumps"), ("paths", "files")]
LONG = " ".join(["the argument parser parses arguments"] * 20)


def load(folder: Path, **text: Any) -> TextModel:
    handler = load_handler(
        f"hf:{folder}",
        device="cpu",
        weights=None,
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        text=TextServing(**text),
    )
    assert isinstance(handler, TextModel)
    return handler


def serve(handler: TextModel, payloads: list[bytes], params: dict[str, Any] | None = None) -> Any:
    """Results of one batch: ``text/plain`` for bytes, JSON for a pair."""
    types = [ContentType.JSON if p.startswith(b"{") else ContentType.TEXT for p in payloads]
    items = handler.preprocess_batch(payloads, types, [params or {}] * len(payloads))
    assert all(isinstance(item, torch.Tensor) for item in items), items
    results = ModelRunner(handler, "cpu").run(items, [params or {}] * len(items))  # type: ignore[arg-type]
    for result in results:
        parse_outputs(result)  # every result fits its documented shape
    return results


def pipeline(task: str, folder: Path, **options: Any) -> Any:
    import transformers

    make: Any = transformers.pipeline  # its overloads want a literal task name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make(task, model=str(folder), device="cpu", **options)


def scores_of(answer: Any) -> list[dict[str, Any]]:
    """The pipeline's classes for one input: it nests them differently by input and top_k."""
    if isinstance(answer, dict):
        return [answer]
    return answer[0] if answer and isinstance(answer[0], list) else answer


def pair_json(text: str, pair: str) -> bytes:
    return json.dumps({"text": text, "text_pair": pair}).encode()


def test_text_classification_equals_the_pipeline(text_models: dict[str, Path]) -> None:
    folder = text_models["text-classification"]
    served = serve(load(folder), [t.encode() for t in TEXTS] + [pair_json(*p) for p in PAIRS])
    direct = pipeline("text-classification", folder, top_k=None)
    inputs: list[Any] = [*TEXTS, *({"text": a, "text_pair": b} for a, b in PAIRS)]
    for result, text in zip(served, inputs, strict=True):
        expected = scores_of(direct(text))
        assert [label["label"] for label in result["labels"]] == [e["label"] for e in expected]
        scores = [label["score"] for label in result["labels"]]
        assert scores == pytest.approx([e["score"] for e in expected], abs=1e-5)
        assert result["truncated"] is False


def test_a_cross_encoder_scores_pairs_with_the_sigmoid(text_models: dict[str, Path]) -> None:
    folder = text_models["cross-encoder"]
    served = serve(load(folder), [pair_json(*p) for p in PAIRS])
    direct = pipeline("text-classification", folder)
    for result, (text, pair) in zip(served, PAIRS, strict=True):
        expected = scores_of(direct({"text": text, "text_pair": pair}))
        assert len(result["labels"]) == 1
        assert result["labels"][0]["score"] == pytest.approx(expected[0]["score"], abs=1e-5)


def test_top_k_picks_the_best_classes(text_models: dict[str, Path]) -> None:
    (result,) = serve(load(text_models["text-classification"]), [b"paths"], {"top_k": 1})
    assert len(result["labels"]) == 1


def test_token_classification_equals_the_pipeline_simple_aggregation(
    text_models: dict[str, Path],
) -> None:
    folder = text_models["token-classification"]
    served = serve(load(folder), [t.encode() for t in TEXTS])
    direct = pipeline("token-classification", folder, aggregation_strategy="simple")
    found = 0
    for result, text in zip(served, TEXTS, strict=True):
        expected = direct(text)
        got = result["entities"]
        assert [(e["entity_group"], e["start"], e["end"], e["word"]) for e in got] == [
            (e["entity_group"], e["start"], e["end"], e["word"]) for e in expected
        ]
        assert [e["score"] for e in got] == pytest.approx(
            [float(e["score"]) for e in expected], abs=1e-5
        )
        for entity in got:  # offsets are characters of the text as submitted
            assert 0 <= entity["start"] < entity["end"] <= len(text)
        found += len(got)
    assert found > 0  # random weights still label some tokens other than O


def test_sentence_embeddings_equal_sentence_transformers_encode(
    text_models: dict[str, Path],
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = text_models["sentence-embedding"]
    handler = load(folder)
    assert handler.max_length == 48  # the folder's own limit
    served = serve(handler, [t.encode() for t in TEXTS])
    direct = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    for result, vector in zip(served, direct, strict=True):
        output = EmbeddingOutput.model_validate(result)
        assert output.normalized  # the folder has a Normalize module
        np.testing.assert_allclose(output.values(), vector, atol=1e-5)


def test_a_bare_encoder_is_mean_pooled_unnormalized(text_models: dict[str, Path]) -> None:
    handler = load(text_models["encoder"])
    (result,) = serve(handler, [b"paths and files"])
    assert result["normalized"] is False
    assert result["shape"] == [32]


def test_a_text_past_max_length_is_cut_and_says_so(text_models: dict[str, Path]) -> None:
    handler = load(text_models["text-classification"], max_length=16)
    short, long = serve(handler, [b"paths", LONG.encode()])
    assert (short["truncated"], long["truncated"]) == (False, True)


def test_a_text_past_max_length_is_refused_when_asked(text_models: dict[str, Path]) -> None:
    handler = load(text_models["text-classification"], max_length=16, refuse_long=True)
    items = handler.preprocess_batch([b"paths", LONG.encode()], [ContentType.TEXT] * 2, [{}, {}])
    assert isinstance(items[0], torch.Tensor)
    assert isinstance(items[1], ContractError)
    assert items[1].code == ErrorCode.text_too_long


@pytest.mark.parametrize(
    ("payload", "content_type", "code"),
    [
        (b"\xff\xfe not utf-8", ContentType.TEXT, ErrorCode.decode_failed),
        (b"", ContentType.TEXT, ErrorCode.bad_request),
        (b"  \n\t ", ContentType.TEXT, ErrorCode.bad_request),
        (b'{"txt": "no text key"}', ContentType.JSON, ErrorCode.bad_request),
        (b'{"text": 3}', ContentType.JSON, ErrorCode.bad_request),
        (b'{"text": ""}', ContentType.JSON, ErrorCode.bad_request),
        (b"[1, 2]", ContentType.JSON, ErrorCode.bad_request),
        (b"{not json", ContentType.JSON, ErrorCode.decode_failed),
        (b'{"text": "a", "text_pair": "b"}', ContentType.JSON, ErrorCode.bad_request),
        (b"\x89PNG", ContentType.PNG, ErrorCode.unsupported_media_type),
    ],
)
def test_bad_input_gets_its_code(
    text_models: dict[str, Path], payload: bytes, content_type: ContentType, code: ErrorCode
) -> None:
    handler = load(text_models["sentence-embedding"])  # takes one text: a pair is refused
    good, bad = handler.preprocess_batch(
        [b"paths", payload], [ContentType.TEXT, content_type], [{}, {}]
    )
    assert isinstance(good, torch.Tensor)  # a bad neighbour fails only itself
    assert isinstance(bad, ContractError)
    assert bad.code == code


def test_unknown_parameters_are_refused(text_models: dict[str, Path]) -> None:
    handler = load(text_models["token-classification"])
    with pytest.raises(ContractError) as caught:
        handler.preprocess(b"paths", ContentType.TEXT, {"top_k": 2})
    assert caught.value.code == ErrorCode.bad_request


def test_a_batch_is_padded_to_its_length_bucket(text_models: dict[str, Path]) -> None:
    handler = load(text_models["text-classification"])
    assert handler.buckets == (16, 32, 48, 64)
    items = [handler.preprocess(t.encode(), ContentType.TEXT, {}) for t in TEXTS]
    batch = handler.collate(items, torch.device("cpu"))
    longest = max(item.shape[-1] for item in items)
    assert batch.shape[-1] == bucket_of(longest, handler.buckets)
    assert [handler.cost(item) for item in items] == [
        bucket_of(item.shape[-1], handler.buckets) for item in items
    ]


def test_a_batch_never_takes_cudnns_attention(
    text_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN's kernel plans each new shape on the host: the forward runs without it, and
    the setting is back as it was afterwards."""
    cudnn_on: Any = torch.backends.cuda.cudnn_sdp_enabled  # untyped in torch
    handler = load(text_models["text-classification"])
    run, seen = handler.run, []

    def watched(*args: torch.Tensor) -> torch.Tensor:
        seen.append(cudnn_on())
        return run(*args)

    monkeypatch.setattr(handler, "run", watched)
    before = cudnn_on()
    items = [handler.preprocess(t.encode(), ContentType.TEXT, {}) for t in TEXTS]
    handler.forward(handler.collate(items, torch.device("cpu")))
    assert seen == [False]
    assert cudnn_on() == before


def test_compiled_the_forward_answers_as_eagerly_and_warm_up_meets_every_bucket(
    text_models: dict[str, Path],
) -> None:
    """A GPU compiles text models by default (dynamic shapes, no row buckets): the answers
    equal the eager forward's, and after ``warm_up`` a batch of any rows and length
    traces nothing new."""
    from torch._dynamo.utils import counters

    handler = load(text_models["text-classification"])
    assert handler.buckets == (16, 32, 48, 64)
    assert [item.shape[-1] for item in handler.warm_up_items()] == [32, 48, 64]
    torch._dynamo.reset()
    compiled = ModelRunner(handler, "cpu", compile="package")
    compiled.warm_up([1, 2, 8])
    traced = counters["stats"]["unique_graphs"]
    assert traced >= 1
    texts = [*TEXTS, LONG, "short"]
    items = [handler.preprocess(t.encode(), ContentType.TEXT, {}) for t in texts]
    assert {handler.cost(item) for item in items} >= {16, 64}
    eager = ModelRunner(handler, "cpu").run(items, [{}] * len(items))
    served = compiled.run(items, [{}] * len(items))
    assert counters["stats"]["unique_graphs"] == traced
    for got, want in zip(served, eager, strict=True):
        assert [label["label"] for label in got["labels"]] == [
            label["label"] for label in want["labels"]
        ]
        scores = [label["score"] for label in got["labels"]]
        assert scores == pytest.approx([label["score"] for label in want["labels"]], abs=1e-5)


def test_length_buckets() -> None:
    assert length_buckets(512) == (
        (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    )
    assert length_buckets(100) == (16, 32, 48, 64, 80, 96, 100)
    assert length_buckets(8192)[-3:] == (6144, 7168, 8192)
    assert length_buckets(8) == (8,)
    assert bucket_of(17, (16, 32)) == 32
    assert bucket_of(40, (16, 32)) == 32


def test_the_task_comes_from_the_config_or_the_setting(text_models: dict[str, Path]) -> None:
    classifier = load(text_models["text-classification"])
    assert type(classifier).__name__ == "TextClassifier"
    assert classifier.version.startswith("text-classification:sha256-")
    embedder = load(text_models["text-classification"], task="sentence-embedding")
    assert type(embedder).__name__ == "SentenceEmbedder"


def test_loader_errors_name_the_spec_and_the_fix(
    text_models: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*DEFAULT"):
        load_handler(
            "hf:nobody-here/not-a-model",
            device="cpu",
            weights=None,
            dtype="float32",
            channels_last=None,
            limits=DEFAULT_LIMITS,
        )
    with pytest.raises(ModelLoadError, match="past the model's 64 positions"):
        load(text_models["text-classification"], max_length=1000)
    odd = tmp_path / "odd"
    shutil.copytree(text_models["encoder"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pass --task"):
        load(odd)
    with pytest.raises(ModelLoadError, match="is not a folder"):
        load(tmp_path / "missing")
