"""``hf:PATH_OR_ID``: a transformers text model with its fast tokenizer (the ``hf`` extra),
an object detector of a fixed input size (``workers.handlers.hf_detection``), or an image
classifier or CLIP/SigLIP dual encoder (``workers.handlers.hf_images``).

PATH is a local folder as ``save_pretrained`` (or a sentence-transformers ``save``)
writes it: it always loads, with no network. Anything else is a Hugging Face Hub
repository id (``owner/name``, ``@revision`` optional), read from the Hugging Face
cache (``$HF_HOME/hub``); it is downloaded only on request, ``weights="DEFAULT"``,
as timm's published weights are (``workers.handlers.published``: a progress bar on
stderr, each LFS file checked against the SHA-256 the Hub names it by, a clear
error offline). ``weights="random"`` builds the model from its config with random
weights (benchmarks: the version says so).

The task (``--task``, ``auto`` by default) is read from the folder: a
sentence-transformers folder (``modules.json``) is ``sentence-embedding``; otherwise
the config's ``architectures`` (``...ForSequenceClassification`` is
``text-classification``, ``...ForTokenClassification`` is ``token-classification``,
``...ForObjectDetection`` is ``object-detection``, ``...ForImageClassification`` is
``image-classification``, ``CLIPModel`` and ``SiglipModel`` are ``image-text-embedding``,
a bare encoder such as ``BertModel`` is ``sentence-embedding`` with mean pooling).
Result shapes: ``workers.handlers.tasks.text_tasks``, ``workers.handlers.tasks.dual_encoder``.

``max_length`` (``--max-length``) defaults to the model's: a sentence-transformers
folder's ``max_seq_length``, else the tokenizer's ``model_max_length``, at most the
config's ``max_position_embeddings`` (a dual encoder's ``text_config``'s). Longer texts
are cut there and say so (``truncated: true``), or, with ``refuse_long``
(``--truncation refuse``), refused ``text_too_long``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from common.install import install_hint
from workers.handlers.base import Handler
from workers.handlers.published import DEFAULT_WEIGHTS, check_blob
from workers.handlers.tasks.text_tasks import (
    POOLINGS,
    Pooling,
    SentenceEmbedder,
    TextClassifier,
    TokenClassifier,
)
from workers.handlers.torchvision_models import Serving
from workers.handlers.weights import RANDOM_WEIGHTS, ModelLoadError, sha256

Task = Literal[
    "auto",
    "text-classification",
    "token-classification",
    "sentence-embedding",
    "object-detection",
    "image-classification",
    "image-text-embedding",
]
TASKS: tuple[Task, ...] = (
    "auto",
    "text-classification",
    "token-classification",
    "sentence-embedding",
    "object-detection",
    "image-classification",
    "image-text-embedding",
)
_IMAGE_TASKS = ("object-detection", "image-classification")
"""Tasks of images alone: no tokenizer."""

_HEADS = {
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForObjectDetection": "object-detection",
    "ForImageClassification": "image-classification",
}
# Dual encoders by their whole-model class (a bare "...Model" is otherwise a text encoder).
_DUAL_ENCODERS = ("CLIPModel", "SiglipModel")
# modules.json names a module by its class's import path, which moved between versions
# of sentence-transformers (sentence_transformers.models.Pooling, then
# sentence_transformers.sentence_transformer.modules.pooling.Pooling): the class name says.
_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE = "Transformer", "Pooling", "Normalize"
# What an older Pooling config's pooling_mode_* keys are called here (newer ones say
# "pooling_mode": "mean").
_POOLING_KEYS: dict[str, Pooling] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
_NO_LIMIT = 100_000  # transformers' model_max_length for "no limit" is about 1e30
# Files a snapshot needs: config, tokenizer, weights, sentence-transformers' modules.
_SNAPSHOT_FILES = ("*.json", "*.txt", "*.model", "*.safetensors", "*/*.json")


@dataclass(frozen=True)
class TextServing:
    """The text settings of a worker (``WorkerSettings.task``, ``max_length``,
    ``truncation``)."""

    task: Task = "auto"
    max_length: int | None = None  # None: the model's
    refuse_long: bool = False  # refuse a text past max_length rather than cut it


@dataclass(frozen=True)
class _SentenceFolder:
    """What a sentence-transformers folder's modules say."""

    transformer: Path  # the folder of the transformers model
    pooling: Pooling
    normalize: bool
    max_length: int | None


def load_hf(
    name: str, *, weights: str | None, serving: Serving, text: TextServing, auto_dtype: bool = False
) -> Handler:
    """The handler for ``hf:NAME`` (see the module doc). ``auto_dtype``: the dtype was
    left to ``auto``, which runs a detector on CUDA under float16 autocast.

    Raises ``ModelLoadError`` naming the spec when transformers is not installed, for a
    folder or repository that is missing or not cached, a task that cannot be found or
    served, a slow tokenizer, a ``max_length`` past the model's positions, and weights
    that do not load.
    """
    spec = f"hf:{name}"
    transformers = _import_transformers(spec)
    folder, source = _folder(spec, name, weights)
    sentence = _sentence_folder(spec, folder)
    model_folder = sentence.transformer if sentence is not None else folder
    try:
        config = transformers.AutoConfig.from_pretrained(model_folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{spec}: cannot read the model's config: {exc}") from exc
    task = _task(spec, text.task, config, sentence)
    shown = Path(name).name if source is None else name.partition("@")[0]
    if weights == RANDOM_WEIGHTS:
        source = "random-weights"
    version = f"{shown}:{source or _weights_hash(model_folder)}"
    if task != "object-detection" and serving.options:
        raise ModelLoadError(
            f"{spec}: model options {dict(serving.options)} do not apply to this hf: model "
            "(an object detector takes score_threshold)"
        )
    if task in _IMAGE_TASKS:
        module = _module(spec, transformers, task, config, model_folder, weights)
        return _image_model(spec, task, module, model_folder, (shown, version), serving, auto_dtype)
    tokenizer = _tokenizer(spec, transformers, model_folder)
    # A dual encoder's config holds its text tower's (positions) in text_config.
    text_config = getattr(config, "text_config", None) if task == "image-text-embedding" else None
    max_length = _max_length(spec, text.max_length, text_config or config, tokenizer, sentence)
    module = _module(spec, transformers, task, config, model_folder, weights)
    if task == "image-text-embedding":
        from workers.handlers.hf_images import load_dual_encoder

        lengths = {"max_length": max_length, "refuse_long": text.refuse_long}
        return load_dual_encoder(
            spec, module, tokenizer, model_folder, (shown, version), lengths, serving
        )
    common: dict[str, Any] = {
        "name": shown,
        "version": version,
        "max_length": max_length,
        "refuse_long": text.refuse_long,
        "device": serving.device,
        "dtype": serving.dtype,
    }
    if task == "sentence-embedding":
        pooling = sentence.pooling if sentence is not None else "mean"
        normalize = sentence.normalize if sentence is not None else False
        return SentenceEmbedder(module, tokenizer, pooling=pooling, normalize=normalize, **common)
    labels = _labels(config)
    if task == "text-classification":
        return TextClassifier(module, tokenizer, labels=labels, **common)
    return TokenClassifier(module, tokenizer, labels=labels, **common)


def _image_model(
    spec: str,
    task: Task,
    module: Any,
    folder: Path,
    names: tuple[str, str],
    serving: Serving,
    auto_dtype: bool,
) -> Handler:
    """The handler of an image classifier or an object detector."""
    labels = _labels(module.config)
    if task == "image-classification":
        from workers.handlers.hf_images import load_image_classifier

        return load_image_classifier(spec, module, folder, names, labels, serving)
    from workers.handlers.hf_detection import load_detector

    half = auto_dtype and serving.device.type == "cuda"
    dtype = torch.float16 if half else serving.dtype
    return load_detector(spec, module, folder, names, labels, serving, dtype)


def _import_transformers(spec: str) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            f"{spec}: transformers is not installed; install the hf extra: {install_hint('hf')}"
        ) from exc
    logging: Any = transformers.logging  # untyped functions
    logging.set_verbosity_error()  # its advice on training is not for a server
    logging.disable_progress_bar()  # a bar per load of a local folder: noise
    return transformers


def _folder(spec: str, name: str, weights: str | None) -> tuple[Path, str | None]:
    """The model's folder, and what the version calls its weights (None: their hash)."""
    path = Path(name)
    if path.is_dir():
        if weights not in (None, RANDOM_WEIGHTS):
            raise ModelLoadError(
                f"{spec}: weights={weights!r} does not apply, the folder holds its weights; "
                "leave weights unset, or random for a benchmark"
            )
        return path, None
    if name.startswith(("/", ".", "~")) or path.suffix:
        raise ModelLoadError(f"{spec}: {path} is not a folder (save_pretrained writes one)")
    if weights not in (None, DEFAULT_WEIGHTS, RANDOM_WEIGHTS):
        raise ModelLoadError(
            f"{spec}: weights={weights!r} does not apply to a hub id: leave it unset (the "
            "cached snapshot), DEFAULT (downloaded unless cached) or random"
        )
    return _snapshot(spec, name, download=weights == DEFAULT_WEIGHTS)


def _snapshot(spec: str, repo: str, *, download: bool) -> tuple[Path, str]:
    """``repo``'s snapshot from the Hugging Face cache, downloaded first when asked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from tqdm import tqdm  # installed with huggingface_hub

    repo_id, _, revision = repo.partition("@")
    try:
        found = Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                allow_patterns=list(_SNAPSHOT_FILES),
                local_files_only=not download,
                tqdm_class=tqdm if download else None,
            )
        )
    except LocalEntryNotFoundError as exc:
        if not download:
            raise ModelLoadError(
                f"{spec}: {repo_id} is not in the Hugging Face cache, and nothing is "
                "downloaded unless asked. Pass weights='DEFAULT' (--weights DEFAULT) to "
                "download it, serve a local folder (hf:PATH), or weights='random' for a "
                "benchmark whose outputs mean nothing"
            ) from exc
        raise ModelLoadError(
            f"{spec}: cannot download {repo_id} ({exc}). Where this machine has no network, "
            "download it on one that has (save_pretrained) and serve the folder: hf:PATH"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{spec}: cannot read {repo_id} from the Hub: {exc}") from exc
    if download:
        for file in found.rglob("*.safetensors"):
            check_blob(spec, f"{repo_id}/{file.relative_to(found)}", file)
    return found, f"hub-{found.name[:12]}"


def _sentence_folder(spec: str, folder: Path) -> _SentenceFolder | None:
    """A sentence-transformers folder's modules, or None for a plain transformers one."""
    listing = folder / "modules.json"
    if not listing.is_file():
        return None
    modules = _json(spec, listing)
    transformer, pooling, normalize = None, None, False
    for module in modules if isinstance(modules, list) else []:
        kind, where = str(module.get("type")), folder / module.get("path", "")
        kind = kind.rpartition(".")[2]
        if kind == _ST_TRANSFORMER:
            transformer = where
        elif kind == _ST_POOLING:
            pooling = _pooling(spec, where / "config.json")
        elif kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise ModelLoadError(
                f"{spec}: modules.json lists {kind}, which is not served (a Transformer, a "
                "Pooling and a Normalize module are); serve it with a handler of your own"
            )
    if transformer is None or pooling is None:
        raise ModelLoadError(f"{spec}: modules.json needs a Transformer and a Pooling module")
    settings = transformer / "sentence_bert_config.json"
    if not settings.is_file():
        settings = folder / "sentence_bert_config.json"
    length = _json(spec, settings).get("max_seq_length") if settings.is_file() else None
    return _SentenceFolder(transformer, pooling, normalize, length)


def _pooling(spec: str, file: Path) -> Pooling:
    config = _json(spec, file)
    mode = config.get("pooling_mode")
    if mode is not None:  # sentence-transformers 6: a mode or a list of modes
        modes = [str(m) for m in (mode if isinstance(mode, list) else [mode])]
        served = [m for m in POOLINGS if m in modes]
    else:
        modes = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
        served = [_POOLING_KEYS[key] for key in modes if key in _POOLING_KEYS]
    if len(modes) != 1 or len(served) != 1:
        raise ModelLoadError(
            f"{spec}: {file} asks for pooling {', '.join(modes) or 'none'}; one of "
            f"{', '.join(POOLINGS)} is served"
        )
    return served[0]


def _json(spec: str, file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{spec}: cannot read {file}: {exc}") from exc


def _task(spec: str, asked: Task, config: Any, sentence: _SentenceFolder | None) -> Task:
    if asked not in TASKS:
        raise ModelLoadError(f"{spec}: task {asked!r} is not one of {', '.join(TASKS)}")
    if asked != "auto":
        return asked
    if sentence is not None:
        return "sentence-embedding"
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture in _DUAL_ENCODERS:
            return "image-text-embedding"
        for suffix, task in _HEADS.items():
            if architecture.endswith(suffix):
                return task  # type: ignore[return-value]  # a value of Task, from _HEADS
        if architecture.endswith("Model"):
            return "sentence-embedding"
    raise ModelLoadError(
        f"{spec}: cannot tell the task from the config's architectures "
        f"({', '.join(architectures) or 'none'}); pass --task, one of {', '.join(TASKS[1:])}"
    )


def _tokenizer(spec: str, transformers: Any, folder: Path) -> Any:
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{spec}: cannot load the tokenizer from {folder}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(
            f"{spec}: {type(tokenizer).__name__} is not a fast (Rust) tokenizer; only fast "
            "ones batch off the model thread. Save the model with its tokenizer.json"
        )
    return tokenizer


def _max_length(
    spec: str, asked: int | None, config: Any, tokenizer: Any, sentence: _SentenceFolder | None
) -> int:
    positions = getattr(config, "max_position_embeddings", None)
    own = tokenizer.model_max_length if tokenizer.model_max_length < _NO_LIMIT else None
    if sentence is not None and sentence.max_length:
        own = sentence.max_length
    limit = min(n for n in (positions, own) if n) if (positions or own) else None
    if asked is None:
        if limit is None:
            raise ModelLoadError(f"{spec}: the model states no maximum length; pass --max-length")
        return int(limit)
    if positions is not None and asked > positions:
        raise ModelLoadError(
            f"{spec}: --max-length {asked} is past the model's {positions} positions"
        )
    return asked


def _module(
    spec: str, transformers: Any, task: Task, config: Any, folder: Path, weights: str | None
) -> Any:
    auto = {
        "text-classification": transformers.AutoModelForSequenceClassification,
        "token-classification": transformers.AutoModelForTokenClassification,
        "sentence-embedding": transformers.AutoModel,
        "object-detection": transformers.AutoModelForObjectDetection,
        "image-classification": transformers.AutoModelForImageClassification,
        "image-text-embedding": transformers.AutoModel,
    }[task]
    try:
        if weights == RANDOM_WEIGHTS:
            return auto.from_config(config)
        return auto.from_pretrained(folder)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{spec}: cannot load the {task} model from {folder}: {exc}") from exc


def _weights_hash(folder: Path) -> str:
    """``sha256-`` and the first 12 hex digits of the folder's weights file."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return f"sha256-{sha256(folder / name)[:12]}"
    return "no-weights-file"


def _labels(config: Any) -> list[str]:
    id2label = getattr(config, "id2label", None) or {}
    count = int(getattr(config, "num_labels", len(id2label)))
    return [str(id2label.get(i, id2label.get(str(i), i))) for i in range(count)]
