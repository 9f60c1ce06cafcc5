"""``hf:PATH`` for causal language models: a local folder to a running ``Generator``.

A folder with a ``config.json`` whose ``architectures`` name a ``*ForCausalLM`` (task
``text-generation``) and a tokenizer (``tokenizer.json`` or what ``AutoTokenizer``
reads) loads here: ``AutoModelForCausalLM`` in the worker's dtype on its device, the
tokenizer, and the engine (``workers.generation.engine``). Nothing is downloaded.

Model options (``--model-options``), all optional: ``max_new_tokens`` (the most a
request may ask, default 256), ``default_new_tokens`` (when it does not say, 64),
``max_prompt_tokens`` (default: what the model's positions and the KV cache hold,
less one new token), ``max_sequences``, ``max_batch_tokens``, ``page_size``,
``kv_memory_fraction`` (GPU), ``kv_cache_mb`` (CPU), ``stream_maxlen`` and
``stream_ttl_s`` (``workers.publish.streams``), ``cancel_poll_ms``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from schemas import ContentType
from schemas.description import Task
from workers.generation.engine import Engine, EngineOptions
from workers.generation.folder import causal_lm_architecture
from workers.generation.requests import Limits, Prompt, parse_prompt, token_list
from workers.handlers.weights import ModelLoadError

log = logging.getLogger(__name__)

TASK = "text-generation"


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """How each request's chunks are kept in its Redis Stream."""

    stream_maxlen: int = 10_000
    stream_ttl_s: int = 3_600
    cancel_poll_ms: int = 20


class Generator:
    """A causal LM, its tokenizer and its engine: the handler of a generation model.

    It satisfies ``workers.handlers.base.Handler`` for the intake (``preprocess`` turns
    a payload into a ``Prompt``); the batch methods are never called: the pipeline
    hands its requests to ``workers.generation.stage.Generating``, which feeds the
    engine."""

    task = Task.text_generation
    """What the worker's description of the model says (``workers.model.description``)."""
    content_types = (ContentType.TEXT, ContentType.JSON)
    """The media types ``preprocess`` takes: a prompt, or ``{"prompt"}``/``{"messages"}``."""

    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        engine: Engine,
        limits: Limits,
        streams: StreamOptions,
    ) -> None:
        self.name = name
        self.version = f"{name}:{type(model).__name__}:{model.dtype}".replace("torch.", "")
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine
        self.limits = limits
        self.streams = streams
        self.device = model.device
        self._chat = self._apply_chat if getattr(tokenizer, "chat_template", None) else None

    def example_item(self) -> torch.Tensor:
        """Unused (nothing is stacked): a one-token prompt."""
        return torch.zeros(1, dtype=torch.long)

    def preprocess(
        self, payload: bytes, content_type: ContentType, params: Mapping[str, Any]
    ) -> Any:
        """The request as a ``Prompt`` (thread-safe: the tokenizer is Rust's)."""
        return parse_prompt(payload, content_type, params, self.limits, self.encode, self._chat)

    def encode(self, text: str) -> list[int]:
        return token_list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _apply_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return token_list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def forward(self, batch: Any) -> Any:
        raise TypeError("a generation model runs in its engine, not batch by batch")

    def postprocess(self, outputs: Any, params: Sequence[Mapping[str, Any]]) -> list[Any]:
        raise TypeError("a generation model runs in its engine, not batch by batch")


def load_generator(
    path: str, *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]
) -> Generator:
    """The ``Generator`` of the local folder ``path``; ``ModelLoadError`` says what is missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if causal_lm_architecture(path) is None:
        raise ModelLoadError(f"hf:{path}: no config.json naming a *ForCausalLM architecture")
    engine_options, limit_options, stream_options = _split_options(path, options)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"hf:{path}: cannot load the model or its tokenizer: {exc}") from exc
    eos = _eos_ids(model, tokenizer)
    engine = Engine(model, eos, EngineOptions(**engine_options))
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    most = min(engine.max_tokens, positions or engine.max_tokens)
    max_new = int(limit_options.get("max_new_tokens", 256))
    limits = Limits(
        max_prompt_tokens=int(limit_options.get("max_prompt_tokens", most - 1)),
        max_new_tokens=max_new,
        default_new_tokens=min(max_new, int(limit_options.get("default_new_tokens", 64))),
        max_total_tokens=most,
    )
    if limits.max_prompt_tokens >= most:
        raise ModelLoadError(
            f"hf:{path}: max_prompt_tokens {limits.max_prompt_tokens} leaves no room for a new "
            f"token in the {most} tokens a sequence may have"
        )
    name = folder.resolve().name
    log.info("%s (%s): %s", name, TASK, engine.plan.describe())
    return Generator(name, model, tokenizer, engine, limits, StreamOptions(**stream_options))


_LIMIT_OPTIONS = ("max_new_tokens", "default_new_tokens", "max_prompt_tokens")


def _split_options(
    path: str, options: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    engine_names = {f.name for f in fields(EngineOptions)}
    stream_names = {f.name for f in fields(StreamOptions)}
    unknown = set(options) - engine_names - stream_names - set(_LIMIT_OPTIONS)
    if unknown:
        known = sorted(engine_names | stream_names | set(_LIMIT_OPTIONS))
        raise ModelLoadError(
            f"hf:{path}: unknown model options {sorted(unknown)}; a generation model takes {known}"
        )
    for name, value in options.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"hf:{path}: model option {name} must be a positive number")

    def pick(names: set[str]) -> dict[str, Any]:
        return {k: v for k, v in options.items() if k in names}

    return pick(engine_names), pick(set(_LIMIT_OPTIONS)), pick(stream_names)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the generation config, the model config or the
    tokenizer names."""
    found: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i >= 0 and i not in found:
                found.append(i)
    return found


def prompt_of(item_tensor: Any) -> Prompt:
    """An item's preprocessed request (``Generator.preprocess``)."""
    assert isinstance(item_tensor, Prompt)
    return item_tensor
