"""A generation request: the payload and ``ce_params`` checked into a ``Prompt``.

Pure: no model, no engine. The payload is ``text/plain`` (the prompt itself) or
``application/json`` with ``prompt`` (a string) or ``messages`` (a list of
``{"role", "content"}``, put through the tokenizer's chat template). Parameters:
``max_new_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k``, ``stop`` (a
string or a list of strings), ``seed``. Each bad value is refused with the field it
came from; a prompt longer than the model takes is refused with both numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas import ContentType, ContractError, ErrorCode

MAX_STOPS = 8
MAX_STOP_CHARS = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask of the engine."""

    max_prompt_tokens: int
    """Prompt tokens at most: a longer prompt can never fit and is refused."""
    max_new_tokens: int
    """New tokens at most; a request asking for more is refused."""
    default_new_tokens: int
    """New tokens when the request does not say."""
    max_total_tokens: int
    """Prompt and new tokens of one sequence at most (the model's positions, the cache)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Prompt:
    """A checked request: the prompt's token ids and how to continue it."""

    token_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...] = ()
    return_token_ids: bool = False  # the result also lists the new tokens' ids


Encode = Callable[[str], list[int]]
ChatTemplate = Callable[[list[dict[str, str]]], list[int]]


def parse_prompt(
    payload: bytes,
    content_type: ContentType,
    params: Mapping[str, Any],
    limits: Limits,
    encode: Encode,
    chat: ChatTemplate | None,
) -> Prompt:
    """The request as a ``Prompt``; raises ``ContractError`` naming what is wrong."""
    if content_type == ContentType.TEXT:
        token_ids = encode(_text(payload, "payload"))
    elif content_type == ContentType.JSON:
        token_ids = _json_prompt(payload, encode, chat)
    else:
        raise ContractError(
            ErrorCode.unsupported_media_type,
            "content-type",
            "a generation model takes text/plain (the prompt) or application/json "
            '({"prompt": ...} or {"messages": [...]})',
            seen=str(content_type),
        )
    if not token_ids:
        raise ContractError(ErrorCode.bad_request, "prompt", "the prompt is empty")
    max_new = _int(params, "max_new_tokens", limits.default_new_tokens, 1)
    if max_new > limits.max_new_tokens:
        raise ContractError(
            ErrorCode.bad_request,
            "params.max_new_tokens",
            f"asks for {max_new} new tokens; this model makes at most {limits.max_new_tokens}",
            limit=limits.max_new_tokens,
            seen=max_new,
        )
    if len(token_ids) > limits.max_prompt_tokens:
        raise ContractError(
            ErrorCode.prompt_too_long,
            "prompt",
            f"the prompt is {len(token_ids)} tokens; this model takes at most "
            f"{limits.max_prompt_tokens} prompt tokens",
            limit=limits.max_prompt_tokens,
            seen=len(token_ids),
        )
    if len(token_ids) + max_new > limits.max_total_tokens:
        raise ContractError(
            ErrorCode.prompt_too_long,
            "params.max_new_tokens",
            f"the prompt's {len(token_ids)} tokens and {max_new} new tokens make "
            f"{len(token_ids) + max_new}; this model holds at most {limits.max_total_tokens} "
            "tokens a sequence: ask for fewer new tokens or shorten the prompt",
            limit=limits.max_total_tokens,
            seen=len(token_ids) + max_new,
        )
    token_ids_wanted = params.get("token_ids", False)
    if not isinstance(token_ids_wanted, bool):
        raise ContractError(ErrorCode.bad_request, "params.token_ids", "must be true or false")
    return Prompt(token_ids, max_new, parse_sampling(params), parse_stop(params), token_ids_wanted)


def parse_sampling(params: Mapping[str, Any]) -> Sampling:
    """The sampling parameters of ``params`` (each absent one at its default)."""
    temperature = _float(params, "temperature", 0.0, 0.0, 100.0)
    top_p = _float(params, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ContractError(
            ErrorCode.bad_request, "params.top_p", "top_p must be above 0", seen=top_p
        )
    top_k = _int(params, "top_k", 0, 0)
    seed = params.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ContractError(
            ErrorCode.bad_request, "params.seed", "seed must be a whole number, 0 or more"
        )
    return Sampling(temperature, top_p, top_k, seed)


def parse_stop(params: Mapping[str, Any]) -> tuple[str, ...]:
    """``stop``: a string or a list of strings, each cut from the text where it appears."""
    stop = params.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ContractError(
            ErrorCode.bad_request,
            "params.stop",
            f"stop must be a string or a list of at most {MAX_STOPS} strings, each of 1 to "
            f"{MAX_STOP_CHARS} characters",
        )
    return tuple(stops)


def _json_prompt(payload: bytes, encode: Encode, chat: ChatTemplate | None) -> list[int]:
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractError(ErrorCode.decode_failed, "payload", f"not JSON: {exc}") from None
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise ContractError(
            ErrorCode.bad_request,
            "payload",
            'a JSON request is an object with either "prompt" (a string) or "messages" '
            '(a list of {"role": ..., "content": ...})',
        )
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ContractError(ErrorCode.bad_request, "payload.prompt", "must be a string")
        return encode(prompt)
    return _chat(body["messages"], chat)


def _chat(messages: object, chat: ChatTemplate | None) -> list[int]:
    if chat is None:
        raise ContractError(
            ErrorCode.bad_request,
            "payload.messages",
            "this model's tokenizer has no chat template: send a prompt instead",
        )
    if not isinstance(messages, list) or not messages:
        raise ContractError(
            ErrorCode.bad_request, "payload.messages", "must be a non-empty list of messages"
        )
    checked = []
    for n, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ContractError(
                ErrorCode.bad_request,
                f"payload.messages[{n}]",
                'each message is {"role": "...", "content": "..."} with string values',
            )
        checked.append({"role": message["role"], "content": message["content"]})
    return chat(checked)


def _text(payload: bytes, field: str) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(ErrorCode.decode_failed, field, f"not UTF-8: {exc}") from None


def _int(params: Mapping[str, Any], name: str, default: int, least: int) -> int:
    value = params.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ContractError(
            ErrorCode.bad_request,
            f"params.{name}",
            f"{name} must be a whole number, {least} or more",
            seen=value,
        )
    return value


def _float(
    params: Mapping[str, Any], name: str, default: float, least: float, most: float
) -> float:
    value = params.get(name, default)
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not least <= value <= most
    ):
        raise ContractError(
            ErrorCode.bad_request,
            f"params.{name}",
            f"{name} must be a number from {least:g} to {most:g}",
            seen=value,
        )
    return float(value)


def token_list(ids: Any) -> list[int]:
    """A tokenizer's output as a plain list of ints (a ``BatchEncoding`` or a list)."""
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
