"""OpenAI's completion and chat bodies as generation requests: no I/O here.

``/v1/completions`` and ``/v1/chat/completions`` become one generation request each
(``parse_completion``, ``parse_chat``): a JSON payload, ``{"prompt": ...}`` or
``{"messages": [...]}`` (the worker renders messages with its tokenizer's chat
template), and the generation parameters as ``ce_params`` (docs/contract.md,
Generation streams). Their answers are ``producers.gateway.openai_answers``.

What a generation model cannot do is refused by name rather than ignored: ``n`` above
1, ``logprobs``, ``echo``, penalties, tools and token-array prompts. ``seed`` is passed
on: the engine draws a seeded request's tokens from its own seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

MAX_STOPS = 4
"""OpenAI's limit on ``stop`` strings (the worker takes up to 8)."""


class Kind(StrEnum):
    """Which of the two generation routes a call came by."""

    completion = "text_completion"
    chat = "chat.completion"


class BadRequest(ValueError):
    """A body refused with 400, naming the parameter at fault (OpenAI's ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Generation:
    """One OpenAI call as a generation request."""

    kind: Kind
    model: str
    payload: bytes
    """The request's ``application/json`` payload: ``{"prompt"}`` or ``{"messages"}``."""
    params: dict[str, Any]
    """Its ``ce_params``: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``."""
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: a last chunk carries the usage."""


# Parameters a caller may send at their no-op value (clients such as LangChain send
# them always); any other value is refused by name.
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
}
_WHY_NOT = {
    "n": "one choice per call: send n calls for n choices",
    "best_of": "one choice per call",
    "echo": "the answer is the new text only",
    "logprobs": "token log-probabilities are not returned",
    "top_logprobs": "token log-probabilities are not returned",
    "presence_penalty": "the engine applies no penalties",
    "frequency_penalty": "the engine applies no penalties",
    "logit_bias": "the engine applies no logit bias",
    "suffix": "no insertion after the text",
    "tools": "no tool calls",
    "functions": "no function calls",
    "tool_choice": "no tool calls",
    "function_call": "no function calls",
    "response_format": "only text is returned",
}
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
"""Accepted and without effect: they say who asks or how OpenAI keeps a call."""
_COMMON = frozenset(
    {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "stop", "seed"}
)
_COMPLETION = _COMMON | {"prompt", "max_tokens"}
_CHAT = _COMMON | {"messages", "max_tokens", "max_completion_tokens"}
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def parse_body(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ``BadRequest`` otherwise."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(None, f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise BadRequest(None, "the body must be a JSON object")
    return document


def parse_completion(document: Mapping[str, Any]) -> Generation:
    """A ``/v1/completions`` body as a generation request."""
    _known(document, _COMPLETION)
    prompt = document.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(
            "prompt",
            "prompt must be a string (a list of several prompts, or of token ids, is not "
            "taken: send one call per prompt)",
        )
    if not prompt:
        raise BadRequest("prompt", "prompt is empty")
    params = _params(document, _int(document, "max_tokens"))
    return _generation(Kind.completion, document, {"prompt": prompt}, params)


def parse_chat(document: Mapping[str, Any]) -> Generation:
    """A ``/v1/chat/completions`` body as a generation request."""
    _known(document, _CHAT)
    messages = document.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list of messages")
    rendered = [_message(n, m) for n, m in enumerate(messages)]
    most = _int(document, "max_completion_tokens")
    if most is None:
        most = _int(document, "max_tokens")
    return _generation(Kind.chat, document, {"messages": rendered}, _params(document, most))


def _generation(
    kind: Kind, document: Mapping[str, Any], payload: dict[str, Any], params: dict[str, Any]
) -> Generation:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model", "model must name a model (GET /v1/models lists them)")
    stream = document.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream", "stream must be true or false")
    options = document.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise BadRequest("stream_options", "stream_options is an object, with stream: true")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadRequest("stream_options.include_usage", "must be true or false")
    return Generation(kind, model, orjson.dumps(payload), params, stream, include_usage)


def _known(document: Mapping[str, Any], taken: frozenset[str]) -> None:
    for name, value in document.items():
        if name in taken or name in _IGNORED or value is None:
            continue
        if name in _NO_OPS:
            # By type too: n=True is not n=1, logprobs=0 is a completion's "none".
            if not any(type(value) is type(v) and value == v for v in _NO_OPS[name]):
                raise BadRequest(name, f"{name}={value!r} is not supported: {_WHY_NOT[name]}")
            continue
        raise BadRequest(name, f"{name} is not a parameter this route takes")


def _message(n: int, message: Any) -> dict[str, str]:
    where = f"messages[{n}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise BadRequest(
            f"{where}.role", f"{where} needs a role: one of {', '.join(sorted(_ROLES))}"
        )
    if message.get("tool_calls"):
        raise BadRequest(f"{where}.tool_calls", "tool calls are not supported")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(f"{where}.content[{i}]", p) for i, p in enumerate(content))
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content", f"{where}.content must be a string or text parts")
    return {"role": str(message["role"]), "content": content}


def _text_part(where: str, part: Any) -> str:
    if (
        not isinstance(part, dict)
        or part.get("type") != "text"
        or not isinstance(part.get("text"), str)
    ):
        raise BadRequest(where, f"{where}: only text parts are taken ({{type: text, text}})")
    return str(part["text"])


def _params(document: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """The generation's ``ce_params``. OpenAI's default temperature is 1 (sampled);
    0 is greedy, as the worker's."""
    temperature = _number(document, "temperature", 1.0, 0.0, 2.0)
    params: dict[str, Any] = {"temperature": temperature}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    top_p = _number(document, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p", "top_p must be above 0")
    if top_p < 1.0:
        params["top_p"] = top_p
    top_k = document.get("top_k")  # not OpenAI's, but vLLM's and the worker's
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise BadRequest("top_k", "top_k must be a whole number, 0 (no cut) or more")
        params["top_k"] = top_k
    stop = _stop(document.get("stop"))
    if stop:
        params["stop"] = stop
    seed = document.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise BadRequest("seed", "seed must be a whole number, 0 or more")
        params["seed"] = seed
    return params


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise BadRequest("stop", f"stop must be a string or a list of up to {MAX_STOPS} strings")
    return list(stops)


def _int(document: Mapping[str, Any], name: str) -> int | None:
    value = document.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(name, f"{name} must be a whole number, 1 or more")
    return value


def _number(
    document: Mapping[str, Any], name: str, default: float, least: float, most: float
) -> float:
    value = document.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not least <= value <= most
    ):
        raise BadRequest(name, f"{name} must be a number from {least:g} to {most:g}")
    return float(value)
