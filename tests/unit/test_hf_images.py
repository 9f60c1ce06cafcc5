"""``hf:PATH`` image models: a ViT classifier and a CLIP dual encoder, served == direct.

The models (``tests.image_models``: random weights, each with its image processor
config) load through the real spec and are served through the real handler path
(``preprocess_batch``/``preprocess``, the runner's ``collate``, ``forward``,
``postprocess``). "Direct" is transformers itself: the ``image-classification``
pipeline, and CLIP's ``get_image_features`` on what its processor makes and
``get_text_features`` on what its tokenizer makes.

Tolerances, measured: the handler fits images with Pillow, transformers' processors
with torchvision on tensors; the two resizes are within one grey level of each other
(``test_the_fitted_pixels_are_within_a_grey_level_of_the_processors``). On these
32x32 inputs, where a grey level of one pixel weighs more than on a 224x224 one, that
moved the classifier's probabilities (its head scaled so that they spread, top-1 0.77
on average) by a median 1.6e-5, a 99th percentile 4.5e-4 and at most 1.4e-3 over 200
images, top-1 equal on all (IMAGE_SCORE_TOLERANCE 2e-3); the normalized image vectors
by at most 2.5e-4 a component for CLIP and 1.5e-3 for SigLIP (its 32x32 bicubic resize
of the whole image) over 100 images (IMAGE_VECTOR_TOLERANCE 2e-3), an image-text cosine
by at most 1.2e-4 and 7.2e-4 (COSINE_TOLERANCE 1e-3). On the same
pixels the served and direct scores agree to float32 rounding (1e-5), and texts,
tokenized alike, to 1e-5.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from PIL import Image

from schemas import DEFAULT_LIMITS, ContentType, ContractError, ErrorCode
from schemas.description import Task
from schemas.outputs import EmbeddingOutput, parse_outputs
from tests.image_models import CLASSES, PROJECTION, SIDE, save_clip, save_siglip, save_vit
from tests.served_direct import photo_like, pil
from workers.handlers.base import ImageClassifier
from workers.handlers.hf_models import TextServing
from workers.handlers.tasks.dual_encoder import DualEncoder
from workers.handlers.tasks.text import bucket_of
from workers.handlers.weights import ModelLoadError
from workers.model.description import describe
from workers.model.loader import load_handler
from workers.model.runner import ModelRunner

pytest.importorskip("transformers")

IMAGE_SCORE_TOLERANCE = 2e-3
IMAGE_VECTOR_TOLERANCE = 2e-3
COSINE_TOLERANCE = 1e-3
SAME_PIXELS_TOLERANCE = 1e-5
TEXT_TOLERANCE = 1e-5
IMAGES = [photo_like(seed) for seed in range(24)]
TEXTS = [
    "a photo of a cat",
    "Return a JSON string.",
    "paths",
    "The logging module defines functions and classes which implement a flexible "
    "event logging system for applications and libraries.",
]


@pytest.fixture(scope="module")
def vit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("vit")
    return path, save_vit(path)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("clip")
    return path, save_clip(path)


@pytest.fixture(scope="module")
def siglip(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("siglip")
    return path, save_siglip(path)


def load(folder: Path, **text: Any) -> Any:
    return load_handler(
        f"hf:{folder}",
        device="cpu",
        weights=None,
        dtype="float32",
        channels_last=None,
        limits=DEFAULT_LIMITS,
        text=TextServing(**text),
    )


def serve(handler: Any, payloads: list[bytes], types: list[ContentType], **params: Any) -> Any:
    items = [handler.preprocess(p, t, params) for p, t in zip(payloads, types, strict=True)]
    results = ModelRunner(handler, "cpu").run(items, [params] * len(items))
    for result in results:
        parse_outputs(result)  # every result fits its documented shape
    return results


def jpeg(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    pil(payload).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def unit(vectors: torch.Tensor) -> np.ndarray[Any, Any]:
    return torch.nn.functional.normalize(vectors.float(), dim=-1).numpy()


def vector(result: dict[str, Any]) -> np.ndarray[Any, Any]:
    return np.array(EmbeddingOutput.model_validate(result).values())


# -- the image classifier -----------------------------------------------------------------


def test_the_spec_reads_task_labels_and_input_from_the_folder(vit: tuple[Path, Any]) -> None:
    handler = load(vit[0])
    assert isinstance(handler, ImageClassifier)
    assert handler.labels == CLASSES
    assert (handler.image.height, handler.image.width, handler.image.squash) == (SIDE, SIDE, True)
    assert handler.image.resample == Image.Resampling.BILINEAR
    assert handler.version.startswith(f"{vit[0].name}:sha256-")


def test_image_classification_equals_the_pipeline(vit: tuple[Path, Any]) -> None:
    import transformers

    folder, _ = vit
    payloads = IMAGES[:12] + [jpeg(p) for p in IMAGES[12:]]
    types = [ContentType.PNG] * 12 + [ContentType.JPEG] * 12
    served = serve(load(folder), payloads, types, top_k=len(CLASSES))
    make: Any = transformers.pipeline  # its overloads want a literal task name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        direct = make("image-classification", model=str(folder), device="cpu", top_k=None)
    worst = 0.0
    for result, payload in zip(served, payloads, strict=True):
        expected = {e["label"]: e["score"] for e in direct(pil(payload))}
        assert result[0]["label"] == max(expected, key=lambda label: expected[label])
        assert [e["label"] for e in result] == sorted(expected, key=lambda k: -expected[k])
        worst = max(worst, *(abs(e["score"] - expected[e["label"]]) for e in result))
    assert worst <= IMAGE_SCORE_TOLERANCE
    assert max(result[0]["score"] for result in served) > 0.6  # the scores are spread


def test_on_the_same_pixels_the_scores_equal_the_models(vit: tuple[Path, Any]) -> None:
    folder, model = vit
    handler = load(folder)
    items = [handler.preprocess(p, ContentType.PNG, {}) for p in IMAGES]
    served = ModelRunner(handler, "cpu").run(items, [{"top_k": 1}] * len(items))
    with torch.inference_mode():
        pixels = (torch.stack(items).float() / 255 - 0.5) / 0.5  # the processor's mean, std
        scores = model(pixel_values=pixels).logits.softmax(dim=-1)
    for result, row in zip(served, scores, strict=True):
        (best,) = result
        assert best["index"] == int(row.argmax())
        assert best["score"] == pytest.approx(float(row.max()), abs=SAME_PIXELS_TOLERANCE)


@pytest.mark.parametrize("model", ["vit", "clip"])
def test_the_fitted_pixels_are_within_a_grey_level_of_the_processors(
    model: str, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoImageProcessor

    folder, _ = request.getfixturevalue(model)
    handler = load(folder)
    image_model = handler.images if isinstance(handler, DualEncoder) else handler
    processor = AutoImageProcessor.from_pretrained(folder)
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    for payload in IMAGES:  # sizes whose centre crops start at a half pixel among them
        ours = image_model.preprocess(payload, ContentType.PNG, {}).float()
        theirs = processor(images=pil(payload), return_tensors="pt")["pixel_values"][0]
        grey = (theirs * std + mean) * 255
        assert float((grey - ours).abs().max()) <= 1.0 + 1e-3


def test_loading_refuses_a_folder_without_a_processor_config(
    vit: tuple[Path, Any], tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(vit[0], bare)
    (bare / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no preprocessor_config\.json.*save_pretrained"):
        load(bare)
    processor = json.loads((vit[0] / "preprocessor_config.json").read_text())
    processor["size"] = {"longest_edge": 64}
    (bare / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelLoadError, match="served are"):
        load(bare)


# -- the dual encoder ---------------------------------------------------------------------


def mixed(count: int = 6) -> tuple[list[bytes], list[ContentType]]:
    """Images and texts taking turns, the texts as text/plain and as JSON."""
    payloads: list[bytes] = []
    types: list[ContentType] = []
    for n in range(count):
        payloads.append(IMAGES[n])
        types.append(ContentType.PNG)
        if n < len(TEXTS):
            text = TEXTS[n]
            as_json = n % 2 == 1
            payloads.append(json.dumps({"text": text}).encode() if as_json else text.encode())
            types.append(ContentType.JSON if as_json else ContentType.TEXT)
    return payloads, types


def test_the_spec_serves_clip_as_an_image_text_dual_encoder(clip: tuple[Path, Any]) -> None:
    handler = load(clip[0])
    assert isinstance(handler, DualEncoder)
    image = handler.images.image
    assert (image.height, image.width, image.resize_size) == (SIDE, SIDE, 40)
    assert image.resample == Image.Resampling.BICUBIC
    assert handler.image_cost == (SIDE // 8) ** 2 + 1  # patches and the class token
    assert handler.buckets == (16, 32, 48, 64)  # CLIP pools at EOS: texts pad to buckets
    described = describe(handler, "clip", "w")
    assert described.task == Task.embedding
    assert {ContentType.PNG, ContentType.TEXT} <= set(described.content_types)


def test_one_batch_of_images_and_texts_equals_both_towers_run_directly(
    clip: tuple[Path, Any],
) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder, model = clip
    handler = load(folder)
    payloads, types = mixed()
    items = handler.preprocess_batch(payloads, types, [{}] * len(payloads))
    assert all(isinstance(item, torch.Tensor) for item in items), items
    served = ModelRunner(handler, "cpu").run(cast(list[torch.Tensor], items), [{}] * len(items))
    processor = AutoImageProcessor.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    images = [pil(p) for p, t in zip(payloads, types, strict=True) if t == ContentType.PNG]
    with torch.inference_mode():
        pixels = processor(images=images, return_tensors="pt")
        image_vectors = unit(model.get_image_features(**pixels).pooler_output)
        # CLIP's forward takes no token type ids, which a BERT tokenizer makes.
        tokens = tokenizer(TEXTS, padding=True, return_tensors="pt", return_token_type_ids=False)
        text_vectors = unit(model.get_text_features(**tokens).pooler_output)
    modalities = ["image" if t == ContentType.PNG else "text" for t in types]
    assert [r["modality"] for r in served] == modalities  # in the batch's order
    found = iter(image_vectors), iter(text_vectors)
    for result in served:
        assert EmbeddingOutput.model_validate(result).modality == result["modality"]
        assert result["normalized"] is True
        assert result["shape"] == [PROJECTION]
        expected = next(found[0] if result["modality"] == "image" else found[1])
        tolerance = IMAGE_VECTOR_TOLERANCE if result["modality"] == "image" else TEXT_TOLERANCE
        np.testing.assert_allclose(vector(result), expected, atol=tolerance)
        assert result["truncated"] is False


def test_an_image_and_a_text_score_the_direct_cosine(clip: tuple[Path, Any]) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder, model = clip
    image, text = serve(
        load(folder), [IMAGES[0], TEXTS[0].encode()], [ContentType.PNG, ContentType.TEXT]
    )
    processor = AutoImageProcessor.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.inference_mode():
        pixels = processor(images=pil(IMAGES[0]), return_tensors="pt")
        image_direct = model.get_image_features(**pixels).pooler_output[0]
        tokens = tokenizer(TEXTS[0], return_tensors="pt", return_token_type_ids=False)
        text_direct = model.get_text_features(**tokens).pooler_output[0]
    cosine = float(torch.nn.functional.cosine_similarity(image_direct, text_direct, dim=0))
    assert float(vector(image) @ vector(text)) == pytest.approx(cosine, abs=COSINE_TOLERANCE)


def test_costs_and_a_mixed_batch(clip: tuple[Path, Any]) -> None:
    handler = load(clip[0])
    text = handler.preprocess(b"paths", ContentType.TEXT, {})
    image = handler.preprocess(IMAGES[0], ContentType.PNG, {})
    assert handler.cost(text) == bucket_of(text.shape[-1], handler.buckets) == 16
    assert handler.cost(image) == handler.image_cost
    batch = handler.collate([image, text], torch.device("cpu"))
    pixels, tokens, image_rows, text_rows = batch
    assert (pixels.shape[0], tokens.shape[0]) == (1, 1)
    assert (image_rows.tolist(), text_rows.tolist()) == ([0], [1])
    assert tokens.shape[-1] == 16


@pytest.mark.parametrize(
    ("payload", "content_type", "code"),
    [
        (b'{"text": "a", "text_pair": "b"}', ContentType.JSON, ErrorCode.bad_request),
        (b"", ContentType.TEXT, ErrorCode.bad_request),
        (b"\xff\xfe", ContentType.TEXT, ErrorCode.decode_failed),
        (b"\x89PNG not really", ContentType.PNG, ErrorCode.decode_failed),
        (b"RIFF....WAVE", cast(ContentType, "audio/wav"), ErrorCode.unsupported_media_type),
    ],
)
def test_bad_input_gets_its_code(
    clip: tuple[Path, Any], payload: bytes, content_type: ContentType, code: ErrorCode
) -> None:
    handler = load(clip[0])
    good, bad, image = handler.preprocess_batch(
        [b"paths", payload, IMAGES[0]],
        [ContentType.TEXT, content_type, ContentType.PNG],
        [{}, {}, {}],
    )
    assert isinstance(good, torch.Tensor)  # a bad neighbour fails only itself
    assert isinstance(image, torch.Tensor)
    assert isinstance(bad, ContractError)
    assert bad.code == code


def test_unknown_parameters_are_refused_for_images_and_texts(clip: tuple[Path, Any]) -> None:
    handler = load(clip[0])
    for payload, content_type in ((IMAGES[0], ContentType.PNG), (b"paths", ContentType.TEXT)):
        with pytest.raises(ContractError) as caught:
            handler.preprocess(payload, content_type, {"top_k": 2})
        assert caught.value.code == ErrorCode.bad_request


def test_loading_refuses_a_tokenizer_that_does_not_end_at_eos(
    clip: tuple[Path, Any], tmp_path: Path
) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(clip[0], odd)
    config = json.loads((odd / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 1  # [UNK], not the [SEP] every text ends with
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pools at eos_token_id 1"):
        load(odd)


def test_siglip_pads_every_text_to_max_length_as_its_processor_does(
    siglip: tuple[Path, Any],
) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder, model = siglip
    handler = load(folder)
    assert isinstance(handler, DualEncoder)
    assert handler.buckets == (64,)  # the last position is pooled: padding changes it
    assert handler.image_cost == (SIDE // 8) ** 2  # no class token
    items = [handler.preprocess(t.encode(), ContentType.TEXT, {}) for t in TEXTS]
    assert {handler.cost(item) for item in items} == {64}
    payloads = [t.encode() for t in TEXTS] + IMAGES[:4]
    types = [ContentType.TEXT] * len(TEXTS) + [ContentType.PNG] * 4
    served = serve(handler, payloads, types)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    with torch.inference_mode():
        full = tokenizer(TEXTS, padding="max_length", max_length=64, return_tensors="pt")
        text_vectors = unit(
            model.get_text_features(full["input_ids"], full["attention_mask"]).pooler_output
        )
        short = tokenizer(TEXTS, padding=True, return_tensors="pt")
        bucketed = unit(
            model.get_text_features(short["input_ids"], short["attention_mask"]).pooler_output
        )
        pixels = processor(images=[pil(p) for p in IMAGES[:4]], return_tensors="pt")
        image_vectors = unit(model.get_image_features(**pixels).pooler_output)
    for result, expected, other in zip(served[: len(TEXTS)], text_vectors, bucketed, strict=True):
        assert result["modality"] == "text"
        np.testing.assert_allclose(vector(result), expected, atol=TEXT_TOLERANCE)
        assert np.abs(vector(result) - other).max() > 1e-3  # a bucket would not do
    for result, expected in zip(served[len(TEXTS) :], image_vectors, strict=True):
        assert result["modality"] == "image"
        np.testing.assert_allclose(vector(result), expected, atol=IMAGE_VECTOR_TOLERANCE)


async def test_the_pipeline_batches_images_and_texts_together(clip: tuple[Path, Any]) -> None:
    """Through the worker's pipeline (fake source and sink): chunks preprocessed in one
    call, batches formed by cost, each answer the in-process runner's."""
    import orjson

    from schemas import encode_request
    from tests.fakes import TOPIC, FakeRecord, FakeSource
    from tests.unit.pipeline.harness import make, run_until

    handler = load(clip[0])
    payloads, types = mixed()
    records = []
    for n, (payload, content_type) in enumerate(zip(payloads * 3, types * 3, strict=True)):
        record = encode_request(payload, request_id=f"r{n}", content_type=content_type, source="t")
        records.append(FakeRecord(TOPIC, 0, n, 0, record.key, record.value, record.headers))
    batches: list[set[bool]] = []  # per batch, whether its items are texts
    collate = handler.collate

    def recorded(items: Any, device: torch.device) -> list[torch.Tensor]:
        batches.append({item.dtype == torch.int64 for item in items})
        batch: list[torch.Tensor] = collate(items, device)
        return batch

    handler.collate = recorded
    pipeline, sink = make(FakeSource({0: records}), handler, max_batch_size=16)
    await run_until(pipeline, lambda: len(sink.stored) == len(records), timeout=60)
    items = handler.preprocess_batch(payloads, types, [{}] * len(payloads))
    direct = ModelRunner(load(clip[0]), "cpu").run(
        cast(list[torch.Tensor], items), [{}] * len(items)
    )
    sizes = []
    for n in range(len(records)):
        document = orjson.loads(sink.stored[f"r{n}"])
        outputs = document["outputs"]
        assert outputs["modality"] == direct[n % len(payloads)]["modality"]
        np.testing.assert_allclose(
            vector(outputs), vector(direct[n % len(payloads)]), atol=SAME_PIXELS_TOLERANCE
        )
        sizes.append(document["timings"]["batch_size"])
    assert max(sizes) > 1
    assert all(batches)  # every batch the pipeline formed went through the handler
    # Which batches form depends on what has arrived when one closes; given both kinds at
    # once, as a backlog is, the batcher puts images and texts of close cost together.
    from workers.batching.batcher import Batcher

    batcher: Batcher[torch.Tensor] = Batcher(16, 0.0, cost_of=handler.cost, max_cost=16_384)
    batcher.add_many(cast(list[torch.Tensor], items), 0.0)
    kinds = [{item.dtype == torch.int64 for item in batch.items} for batch in batcher.drain(0.0)]
    assert {True, False} in kinds  # a batch of images and texts
